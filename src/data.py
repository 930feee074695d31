"""Image-folder datasets, transforms and the per-rank data loaders."""
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

from options import UsageError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def build_transform(image_size, train):
    if train:
        steps = [transforms.RandomResizedCrop(image_size, antialias=True), transforms.RandomHorizontalFlip()]
    else:
        # The usual 0.875 centre-crop ratio (224 from 256).
        steps = [transforms.Resize(round(image_size / 0.875), antialias=True), transforms.CenterCrop(image_size)]
    return transforms.Compose(steps + [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def image_folder(root, transform=None):
    """torchvision's ImageFolder, with a one-line UsageError for a missing or empty folder."""
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"image folder not found: {root}")
    try:
        return datasets.ImageFolder(root, transform=transform)
    except (FileNotFoundError, RuntimeError) as err:
        raise UsageError(f"{root}: {err}") from None


def load_datasets(train_dir, val_dir, image_size):
    train_set = image_folder(train_dir, build_transform(image_size, train=True))
    val_set = image_folder(val_dir, build_transform(image_size, train=False))
    if val_set.classes != train_set.classes:
        missing = sorted(set(train_set.classes) ^ set(val_set.classes))
        raise UsageError(f"{train_dir} and {val_dir} have different class folders (e.g. {missing[:3]})")
    return train_set, val_set


def build_loaders(train_set, val_set, micro_batch_size, num_workers, rank, world_size, seed, pin_memory):
    """Training loader (DistributedSampler: call set_epoch every epoch) and validation loader.

    Validation shards are disjoint and unpadded (rank r takes images r, r + world_size, ...), so
    metrics summed over ranks count every image exactly once.
    """
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=seed, drop_last=True)
    common = dict(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=num_workers > 0)
    train_loader = DataLoader(train_set, batch_size=micro_batch_size, sampler=train_sampler, drop_last=True,
                              generator=torch.Generator().manual_seed(seed + rank), **common)
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=micro_batch_size, shuffle=False, **common)
    return train_loader, val_loader, train_sampler
