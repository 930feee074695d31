"""Load a trained model (exported file or DeepSpeed checkpoint) and run it on images, batched."""
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ..cli.options import memory_gib
from ..data.device import Normalize, decode_dataset
from ..data.folders import build_transform, check_preprocessing, val_sizes, with_val_sizes
from ..data.recipe import check_val_size_flags
from ..engine.finetune import head_module
from ..models.build import check_saved_model, load_weights, model_for_weights
from ..models.names import MODEL_NAME
from ..utils.failures import UsageError
from ..utils.files import fingerprint, parse_json
from ..utils.loading import load_checked, tensors_by_name, unloadable_tensor
from ..utils.text import digits, error_line
from .export import consolidated_state_dict, sidecar_path


def _a_file_name(name):
    """Whether `name` could be a class folder's: no NUL, and text a file system gives (a lone surrogate such as
    \\ud800, which no name decodes to, failed to print); not empty."""
    try:
        name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return bool(name) and "\0" not in name


def load_model(path, device):
    """(model in eval mode on `device`, metadata with class_names and image_size) from an exported
    .pt/.safetensors file (with its .json sidecar) or a checkpoint folder."""
    path = Path(path)
    if path.is_dir():
        state_dict, metadata = consolidated_state_dict(path)
    elif path.is_file():
        metadata = _metadata(path)
        if metadata.get("format", "state_dict") != "state_dict":
            raise UsageError(f"--model {path} is exported as {metadata['format']}, which runs outside PyTorch's "
                             "modules: give the state_dict export (.pt, .safetensors) or the checkpoint folder")
        state_dict = _weights(path)
        if "model_file" in metadata and metadata["model_file"] != fingerprint(path):  # sidecars since it was added
            raise UsageError(f"--model {path} is not the file {sidecar_path(path)} was written with (an export "
                             "stopped between its two renames, or the files of two exports): export the model again")
    else:
        raise UsageError(f"--model {path}: no such file or checkpoint folder")
    classes = len(metadata["class_names"])
    name = metadata.get("model", MODEL_NAME)
    try:
        model = model_for_weights(name, classes, metadata["image_size"])
    except (ValueError, AssertionError) as err:  # ViT and MaxViT check the size as they are built: a traceback
        raise UsageError(f"--model {path}: its metadata names {name} at {metadata['image_size']} px, which that model "
                         f"cannot take ({error_line(err)}): its .json sidecar belongs to another export") from None
    head = head_module(model, classes)
    saved = state_dict.get(next(f"{name}.weight" for name, module in model.named_modules() if module is head))
    if torch.is_tensor(saved) and saved.ndim and saved.shape[0] != classes:
        raise UsageError(f"--model {path} has {saved.shape[0]} outputs but its class names list {classes}: its "
                         ".json sidecar belongs to another export")
    load_weights(model, state_dict, f"--model {path}")
    return model.to(device).eval(), metadata


def _weights(path):
    """The state_dict in an exported .pt/.pth/.safetensors file, checked to be tensors by name."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state_dict = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as err:
            raise UsageError(f"--model {path} is damaged or not a safetensors file ({err})") from None
    else:
        state_dict = load_checked(path, deepspeed_classes=False)
    if not tensors_by_name(state_dict):
        raise UsageError(f"--model {path} is not a state_dict (tensors by name): export one with export_model.py")
    odd = unloadable_tensor(state_dict)
    if odd is not None:
        raise UsageError(f"--model {path}: {odd}")
    return state_dict


def _metadata(path):
    """The sidecar's (or a .safetensors file's own) class names and image size, checked."""
    sidecar = sidecar_path(path)
    metadata, source = None, sidecar
    if sidecar.is_file():
        try:
            metadata = parse_json(sidecar.read_bytes())
        except (OSError, ValueError) as err:
            raise UsageError(f"{sidecar} is unreadable ({str(err).splitlines()[0]}): export the model again") from None
    elif path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        source = path
        try:
            with safe_open(str(path), "pt") as f:
                stored = f.metadata() or {}
            if "class_names" in stored:
                metadata = {k: parse_json(v) for k, v in stored.items()}
        except (SafetensorError, OSError, ValueError) as err:
            raise UsageError(f"--model {path} is damaged or not a safetensors file ({err})") from None
    if metadata is None:
        raise UsageError(f"--model {path}: class names not found (expected {sidecar} from export_model.py)")
    names = metadata.get("class_names") if isinstance(metadata, dict) else None
    size = metadata.get("image_size") if isinstance(metadata, dict) else None
    if (not isinstance(names, list) or not names or not all(isinstance(n, str) and _a_file_name(n) for n in names)
            or not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise UsageError(f"{source}: expected class_names (a list of names) and image_size (pixels), as "
                         "export_model.py writes them; export the model again")
    if len(set(names)) < len(names):  # two outputs of one name: ambiguous predictions, a misleading data check
        raise UsageError(f"{source}: class_names names a class twice; export the model again")
    memory, image_bytes = memory_gib(), 3 * size ** 2 * 4  # one input image, fp32 (a worker was OOM-killed)
    if memory is not None and image_bytes > memory * 2**30:
        shown = f"{size}" if size < 10**12 else f"a whole number of {digits(size)} digits"
        raise UsageError(f"{source}: image_size {shown}: one input image alone is more than this machine's "
                         f"{memory:,.0f} GiB of memory; export the model again")
    check_saved_model(metadata.get("model", MODEL_NAME), source)
    check_preprocessing(metadata.get("preprocessing"), source)
    return metadata


def add_inference_args(parser):
    """The validation sizes and test-time augmentation evaluate and predict take."""
    parser.add_argument("--val_resize_size", type=int, default=None, metavar="PX",
                        help="resize the shorter side to this (default: the model's, as its run validated)")
    parser.add_argument("--val_crop_size", type=int, default=None, metavar="PX",
                        help="the centre crop the model sees (default: the model's, as its run validated)")
    parser.add_argument("--tta", choices=("flip",), default=None,
                        help="test-time augmentation: flip averages the logits of each image and its mirror image")


def applied_inference_args(args, metadata):
    """`metadata` with --val_resize_size and --val_crop_size in its preprocessing, checked as training checks them
    (a ViT built for its image size takes no other crop)."""
    from ..models.build import check_val_crop

    check_val_size_flags(args)
    given = {"val_resize_size": args.val_resize_size, "val_crop_size": args.val_crop_size}
    preprocessing = with_val_sizes(check_preprocessing(metadata.get("preprocessing"), args.model), **given)
    resize, crop = val_sizes(metadata["image_size"], preprocessing)
    if resize < crop:
        raise UsageError(f"--val_resize_size {resize} is smaller than the crop {crop}: the crop would pad the image; "
                         "resize to at least the crop")
    check_val_crop(metadata.get("model", MODEL_NAME), len(metadata["class_names"]), metadata["image_size"],
                   preprocessing.get("val_crop_size"))
    return {**metadata, "preprocessing": preprocessing}


class FlipAveraged(torch.nn.Module):
    """`model` with its logits averaged over each image and its horizontal mirror (--tta flip); the plain logits
    of each batch are kept in `plain`, for the gain the averaging brings."""

    def __init__(self, model):
        super().__init__()
        self.model, self.plain = model, []

    def forward(self, images):
        logits = self.model(images)
        self.plain.append(logits.float().cpu())
        return (logits + self.model(torch.flip(images, dims=[3]))) / 2


def default_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def predict_log_probabilities(model, dataset, num_classes, device, batch_size=64, num_workers=2):
    """Log-softmax of the logits for every item of `dataset` (items are (image tensor, anything)): exact for
    the loss where probabilities round to 0 or 1."""
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=device.type == "cuda")
    batches = [torch.log_softmax(model(images.to(device, non_blocking=True)).float(), dim=1).cpu()
               for images, _ in loader]
    return torch.cat(batches) if batches else torch.empty(0, num_classes)


# How validation images became the model's input: PIL's resize (torchvision's transforms, the DataLoader tier's
# validation) or torchvision's on decoded tensors (the device and cache tiers'). The pixels differ a little, so
# a report is the trained run's logged figure only when it decodes as that run validated.
DECODES = ("pil", "torchvision")


def trained_decode(metadata):
    """The decode the model's run validated with (a checkpoint's or export's data_tier; pil when unknown)."""
    return "torchvision" if metadata.get("data_tier") in ("device", "cache") else "pil"


@torch.no_grad()
def decoded_log_probabilities(model, dataset, metadata, device, batch_size=64):
    """predict_log_probabilities over `dataset`'s files decoded and resized as the device and cache tiers
    validate (data/device.py), in fp32."""
    size, preprocessing = int(metadata["image_size"]), metadata.get("preprocessing")
    paths = [path for path, _ in dataset.samples]
    images, unreadable = decode_dataset(paths, *val_sizes(size, preprocessing), device)
    if unreadable:
        raise UsageError(f"{len(unreadable)} image(s) do not decode with torchvision (" + ", ".join(
            f"{paths[index]}: {why}" for index, why in list(unreadable.items())[:3]) + "): use --decode pil")
    normalize = Normalize(device, torch.float32, preprocessing)
    batches = [torch.log_softmax(model(normalize(images[start:start + batch_size])).float(), dim=1).cpu()
               for start in range(0, len(images), batch_size)]
    return torch.cat(batches) if batches else torch.empty(0, len(metadata["class_names"]))


def eval_transform(metadata):
    return build_transform(int(metadata["image_size"]), train=False, preprocessing=metadata.get("preprocessing"))
