"""Image-folder datasets, transforms and the per-rank data loaders."""
import signal
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


def epoch_seed(seed, rank, epoch):
    """The seed of one rank's augmentation randomness in one epoch: the same in a resumed run."""
    return hash((seed, rank, epoch)) % 2**63


def batch_memory_format(device):
    """channels_last on a GPU (faster convolutions with cuDNN), the default layout elsewhere."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def ignore_stop_signals(worker_id):
    """DataLoader workers leave SIGINT/SIGTERM to the training process, which stops after its step
    and saves; a worker killed by them would abort that step instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class EpochSampler(DistributedSampler):
    """DistributedSampler whose epoch can start part-way through, for a run resumed mid-epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self):
        return self.num_samples - self.start


class TrainLoader:
    """The training DataLoader of one rank. `epoch(e, start_batch)` fixes the shuffle and the
    augmentation randomness from (seed, rank, epoch) alone, so a resumed run sees what an
    uninterrupted one would have seen."""

    def __init__(self, dataset, micro_batch_size, num_workers, rank, world_size, seed, pin_memory):
        self.sampler = EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                    seed=seed, drop_last=True)
        self.generator = torch.Generator()
        self.seed, self.rank, self.micro_batch_size = seed, rank, micro_batch_size
        # Workers restart every epoch: each epoch's worker seeds come from the generator reseeded below.
        self.loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler, drop_last=True,
                                 num_workers=num_workers, pin_memory=pin_memory, generator=self.generator,
                                 worker_init_fn=ignore_stop_signals)
        self.batches_per_epoch = self.sampler.num_samples // micro_batch_size

    def epoch(self, epoch, start_batch=0):
        self.sampler.set_epoch(epoch)
        self.sampler.start = start_batch * self.micro_batch_size
        self.generator.manual_seed(epoch_seed(self.seed, self.rank, epoch))
        return self.loader


def build_loaders(train_set, val_set, micro_batch_size, num_workers, rank, world_size, seed, pin_memory):
    """Training loader (see TrainLoader) and validation loader.

    Validation shards are disjoint and unpadded (rank r takes images r, r + world_size, ...), so
    metrics summed over ranks count every image exactly once.
    """
    train_loader = TrainLoader(train_set, micro_batch_size, num_workers, rank, world_size, seed, pin_memory)
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=micro_batch_size, shuffle=False, num_workers=num_workers,
                            pin_memory=pin_memory, persistent_workers=num_workers > 0,
                            worker_init_fn=ignore_stop_signals)
    return train_loader, val_loader
