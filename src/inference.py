"""Load a trained model (exported file or DeepSpeed checkpoint) and run it on images, batched."""
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from data import build_transform
from export_model import consolidated_state_dict, sidecar_path
from failures import UsageError
from model import ResNet18Animals90


def load_model(path, device):
    """(model in eval mode on `device`, metadata with class_names and image_size) from an exported
    .pt/.safetensors file (with its .json sidecar) or a checkpoint folder."""
    path = Path(path)
    if path.is_dir():
        state_dict, metadata = consolidated_state_dict(path)
    elif path.is_file():
        metadata = _metadata(path)
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state_dict = load_file(str(path))
        else:
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise UsageError(f"--model {path}: no such file or checkpoint folder")
    model = ResNet18Animals90(num_classes=len(metadata["class_names"]))
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as err:
        raise UsageError(f"--model {path}: not a {metadata.get('model', 'ResNet18Animals90')} state_dict "
                         f"({str(err).splitlines()[0]})") from None
    return model.to(device).eval(), metadata


def _metadata(path):
    sidecar = sidecar_path(path)
    if sidecar.is_file():
        return json.loads(sidecar.read_text())
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            stored = f.metadata() or {}
        if "class_names" in stored:
            return {k: json.loads(v) for k, v in stored.items()}
    raise UsageError(f"--model {path}: class names not found (expected {sidecar} from export_model.py)")


def default_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def predict_probabilities(model, dataset, device, batch_size=64, num_workers=2):
    """Softmax probabilities for every item of `dataset` (items are (image tensor, anything))."""
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=device.type == "cuda")
    batches = [torch.softmax(model(images.to(device, non_blocking=True)).float(), dim=1).cpu()
               for images, _ in loader]
    return torch.cat(batches) if batches else torch.empty(0, len(model.fc.weight))


def eval_transform(metadata):
    return build_transform(int(metadata["image_size"]), train=False)
