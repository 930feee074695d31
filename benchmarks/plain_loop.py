"""The reference the trainer is measured against: a plain PyTorch training script over an image folder.

What a careful hand-written loop does: torchvision's ResNet18, AdamW, the trainer's own transforms
(RandomResizedCrop + flip for training, resize + centre crop for validation) in DataLoader workers,
torch.autocast (+ GradScaler for fp16) and channels_last on a GPU, a validation pass and a checkpoint of
model and optimizer (torch.save to a temporary file, then a rename) after every epoch. Run it as a
process of its own: it counts its startup from its own start, imports included, to the end of the first
optimizer step, and prints one JSON object: startup_s, total_s and per epoch train_s, validation_s,
checkpoint_s, wall_s, images_per_s, val_acc.

    python benchmarks/plain_loop.py --data bench_data --epochs 6 --batch_size 256 --precision bf16

--recipe adds torchvision's "new recipe" augmentation as its reference script applies it: TrivialAugmentWide and
random erasing in the workers' transform, mixup or cutmix on each batch in the DataLoader's collate_fn, and
label smoothing in the loss.
"""
import time

PROCESS_STARTED = time.time()  # before the imports below, as the trainer counts its startup

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torchvision.transforms import v2  # noqa: E402

from deepspeed_image_trainer.data.folders import build_transform  # noqa: E402
from deepspeed_image_trainer.data.recipe import RECIPE_DEFAULTS  # noqa: E402

# torchvision's references/classification ResNet50 v2 recipe, less its schedule, EMA and optimizer
RECIPE = {**RECIPE_DEFAULTS, "auto_augment": "ta_wide", "random_erase": 0.1}
MIXUP_ALPHA, CUTMIX_ALPHA, LABEL_SMOOTHING = 0.2, 1.0, 0.1

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="folder holding train/ and val/")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--precision", choices=list(DTYPES), default="fp32")
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--model", default="resnet18", help="a torchvision classifier")
    parser.add_argument("--recipe", action="store_true", help="torchvision's new-recipe augmentation (above)")
    return parser


class MixedBatches:
    """The reference script's collate_fn: the default collation, then mixup or cutmix on the batch."""

    def __init__(self, num_classes):
        self.mix = v2.RandomChoice([v2.MixUp(alpha=MIXUP_ALPHA, num_classes=num_classes),
                                    v2.CutMix(alpha=CUTMIX_ALPHA, num_classes=num_classes)])

    def __call__(self, batch):
        return self.mix(*torch.utils.data.default_collate(batch))


def main():
    args = get_args_parser().parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = True
    dtype = DTYPES[args.precision]
    memory_format = torch.channels_last if cuda else torch.contiguous_format
    recipe = RECIPE if args.recipe else None
    train_set = torchvision.datasets.ImageFolder(args.data / "train", build_transform(args.image_size, train=True,
                                                                                      recipe=recipe))
    val_set = torchvision.datasets.ImageFolder(args.data / "val", build_transform(args.image_size, train=False))
    loader_args = {"batch_size": args.batch_size, "num_workers": args.num_workers, "pin_memory": cuda,
                   "persistent_workers": args.num_workers > 0}
    train_loader = torch.utils.data.DataLoader(train_set, shuffle=True, drop_last=True, **loader_args,
                                               collate_fn=MixedBatches(len(train_set.classes)) if recipe else None)
    val_loader = torch.utils.data.DataLoader(val_set, **loader_args)
    model = torchvision.models.get_model(args.model, num_classes=len(train_set.classes)).to(
        device, memory_format=memory_format)
    label_smoothing = LABEL_SMOOTHING if recipe else 0.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.05)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    checkpoint = Path(tempfile.mkdtemp()) / "checkpoint.pt"

    startup_s, epochs = None, []
    for epoch in range(args.epochs):
        epoch_started = time.perf_counter()
        model.train()
        seen = 0
        for images, labels in train_loader:
            images = images.to(device, non_blocking=True, memory_format=memory_format)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(images), labels, label_smoothing=label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            seen += len(labels)
            if startup_s is None:
                synchronize(device)
                startup_s = time.time() - PROCESS_STARTED
        synchronize(device)
        train_s = time.perf_counter() - epoch_started

        started = time.perf_counter()
        model.eval()
        correct = total = 0
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            for images, labels in val_loader:
                images = images.to(device, non_blocking=True, memory_format=memory_format)
                correct += (model(images).argmax(1).cpu() == labels).sum().item()
                total += labels.numel()
        validation_s = time.perf_counter() - started

        started = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                   checkpoint.with_suffix(".tmp"))
        os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
        checkpoint_s = time.perf_counter() - started
        epochs.append({"epoch": epoch + 1, "train_s": train_s, "validation_s": validation_s,
                       "checkpoint_s": checkpoint_s, "wall_s": time.perf_counter() - epoch_started,
                       "images_per_s": seen / train_s, "val_acc": correct / total})
    print(json.dumps({"startup_s": startup_s, "total_s": time.time() - PROCESS_STARTED, "epochs": epochs}))


if __name__ == "__main__":
    main()
