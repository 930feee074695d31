"""Image-folder datasets, transforms and the per-rank data loaders."""
import signal
import sys

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import transforms
from torchvision.transforms import v2

from ..utils.failures import UsageError
from ..utils.text import listed
from .check import check_data, labelled_samples
from .recipe import MAX_VAL_SIZE

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# How images become model input: the mean and std to normalise with, the validation resize as a multiple of
# the crop (224 from 256) and the interpolation. Pretrained weights bring their own (model.preprocessing).
DEFAULT_PREPROCESSING = {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "resize_ratio": 256 / 224,
                         "interpolation": "bilinear"}
INTERPOLATIONS = ("bilinear", "bicubic")


def val_sizes(image_size, preprocessing=None):
    """(resize, crop) of validation images: --val_crop_size (default the training crop, --image_size) and
    --val_resize_size (default the crop / 0.875, or by the weights' own ratio), kept in the preprocessing."""
    pre = preprocessing or DEFAULT_PREPROCESSING
    crop = pre.get("val_crop_size") or image_size
    return pre.get("val_resize_size") or round(crop * pre["resize_ratio"]), crop


def with_val_sizes(preprocessing, val_resize_size=None, val_crop_size=None):
    """`preprocessing` with the validation sizes given (None: the defaults of val_sizes, left out)."""
    given = {"val_resize_size": val_resize_size, "val_crop_size": val_crop_size}
    return {**preprocessing, **{key: value for key, value in given.items() if value is not None}}


def check_preprocessing(preprocessing, source):
    """`preprocessing` as read from `source` (an export's sidecar, a checkpoint) is one this trainer writes."""
    if preprocessing is None:
        return DEFAULT_PREPROCESSING

    def number(value):  # as JSON writes one: "1.1" and true passed float() and failed later, in a traceback
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(value)
        return float(value)

    def size(key):  # the validation sizes: pixels, when given
        value = preprocessing.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 1 <= value <= MAX_VAL_SIZE):
            raise TypeError(value)
        return value

    try:
        triples = [list(map(number, preprocessing[key])) for key in ("mean", "std")]
        ratio = number(preprocessing["resize_ratio"])
        sizes = {key: size(key) for key in ("val_resize_size", "val_crop_size")}
        # std at least 1e-6: below it (1e-320) the division made every image "not readable"; pixels are 0-1, so
        # a mean far outside that (1e308) made every logit NaN
        usable = (all(len(t) == 3 and all(np.isfinite(t)) for t in triples) and all(-1 <= m <= 2 for m in triples[0])
                  and all(1e-6 <= s <= 10 for s in triples[1])
                  and 1 <= ratio <= 2 and preprocessing["interpolation"] in INTERPOLATIONS)
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError):  # OverflowError: 400 digits
        usable = False
    if not usable:
        raise UsageError(f"{source}: its preprocessing is not one this trainer writes (mean -1 to 2 and std "
                         f"1e-6 to 10 for 3 channels, resize_ratio 1-2, interpolation {' or '.join(INTERPOLATIONS)}, "
                         f"validation sizes 1-{MAX_VAL_SIZE} px): export again")
    return {**preprocessing, "mean": triples[0], "std": triples[1], "resize_ratio": ratio,
            **{key: value for key, value in sizes.items() if value is not None}}


def auto_augment_policy(recipe, interpolation):
    """torchvision's transforms.v2 class for the recipe's --auto_augment (cli/options.py's recipe_of), as its
    reference scripts build it."""
    policy = recipe["auto_augment"]
    if policy == "ra":
        return v2.RandAugment(num_ops=recipe["ra_num_ops"], magnitude=recipe["ra_magnitude"],
                              interpolation=interpolation)
    if policy == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if policy == "augmix":
        return v2.AugMix(severity=recipe["augmix_severity"], interpolation=interpolation)
    return v2.AutoAugment(v2.AutoAugmentPolicy(policy), interpolation=interpolation)


def build_transform(image_size, train, preprocessing=None, recipe=None):
    """The DataLoader tier's transform; `recipe` (recipe_of): training augmentation in torchvision's reference
    order, the policy on the cropped image, random erasing on the normalised tensor."""
    pre = preprocessing or DEFAULT_PREPROCESSING
    interpolation = transforms.InterpolationMode(pre["interpolation"])
    if train:
        steps = [transforms.RandomResizedCrop(image_size, interpolation=interpolation, antialias=True),
                 transforms.RandomHorizontalFlip()]
        if recipe and recipe["auto_augment"]:
            steps.append(auto_augment_policy(recipe, interpolation))
    else:
        resize, crop = val_sizes(image_size, pre)
        steps = [transforms.Resize(resize, interpolation=interpolation, antialias=True), transforms.CenterCrop(crop)]
    steps += [transforms.ToTensor(), transforms.Normalize(pre["mean"], pre["std"])]
    if train and recipe and recipe["random_erase"]:
        steps.append(v2.RandomErasing(p=recipe["random_erase"]))
    return transforms.Compose(steps)


def to_rgb(image):
    """A PIL image of any mode as RGB: 16-bit grey scaled to 8 bits (PIL would clip it to white),
    transparency composited onto white (PIL would drop alpha and show what lies under it)."""
    if image.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N"):
        image = Image.fromarray((np.asarray(image) >> 8).clip(0, 255).astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info:
        image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA"))
    return image.convert("RGB")


def load_rgb(path):
    """The image file as an upright RGB PIL image: EXIF orientation applied, then to_rgb."""
    with Image.open(path) as image:
        return to_rgb(ImageOps.exif_transpose(image))


class ImageFiles(Dataset):
    """torchvision ImageFolder's interface (samples, targets, classes, class_to_idx) over checked files."""

    def __init__(self, samples, classes, transform=None, root=None):
        self.samples, self.classes, self.transform, self.root = samples, list(classes), transform, root
        self.targets = [label for _, label in samples]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        # A file checked before the run can change during it (rewritten, truncated, deleted): use the next
        # readable sample in its place rather than lose the run, and say so.
        for offset in range(len(self.samples)):
            path, label = self.samples[(index + offset) % len(self.samples)]
            try:
                image = load_rgb(path)
            except Exception as err:  # noqa: BLE001 - corrupt data raises OSError, SyntaxError, ValueError, ...
                print(f"warning: {path} can no longer be read ({err}); the next image is used in its place",
                      file=sys.stderr, flush=True)
                continue
            return (self.transform(image) if self.transform else image), label
        raise OSError("none of the dataset's images can be read any more")


def image_folder(root, transform=None, classes=None):
    """(dataset, DataCheck) of one image folder, unreadable files left out; labels follow `classes`
    (default: the folder's own) by name, and a class folder outside `classes` is a UsageError."""
    check = check_data(root, None)
    classes = check.classes if classes is None else list(classes)
    unknown = [name for name in check.classes if name not in classes]
    if unknown:
        raise UsageError(f"{root} has images of classes the model does not know: {listed(unknown)}")
    return ImageFiles(labelled_samples(check.train, classes), classes, transform), check


def load_datasets(train_dir, val_dir, image_size, preprocessing=None, decode=True, recipe=None):
    """(train set, val set, DataCheck): the checked images (`decode`: see check.inspect_image), validation
    labelled by the training classes' names; `recipe`: the training set's augmentation (build_transform)."""
    check = check_data(train_dir, val_dir, decode)

    def dataset(scan, train):
        return ImageFiles(labelled_samples(scan, check.classes), check.classes,
                          build_transform(image_size, train, preprocessing, recipe), root=scan.root)

    return dataset(check.train, train=True), dataset(check.val, train=False), check


def epoch_seed(seed, rank, epoch, *stream):
    """The seed of one rank's augmentation randomness in one epoch: the same in a resumed run; `stream` keys
    another draw of the same epoch apart (the GPU tiers' erasing and policy beside their crops)."""
    return hash((seed, rank, epoch, *stream)) % 2**63


def batch_memory_format(device):
    """channels_last on a GPU (faster convolutions with cuDNN), the default layout elsewhere."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def ignore_stop_signals(worker_id):
    """DataLoader workers leave SIGINT/SIGTERM to the training process, which stops after its step
    and saves; a worker killed by them would abort that step instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class EpochSampler(DistributedSampler):
    """DistributedSampler whose epoch can start part-way through, for a run resumed mid-epoch.

    With `repetitions` N > 1, repeated augmentation (DeiT's and torchvision's RASampler): the epoch's shuffled
    images each N times in a row, dealt over the ranks so that an image's repeats go to different ranks, cut to
    the epoch's usual length (so it sees 1/N of the images); the keys are then (image, repeat) pairs, for each
    repeat to draw its own augmentation."""

    def __init__(self, *args, repetitions=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.start, self.repetitions = 0, repetitions

    def __iter__(self):
        return iter(self.keys()[self.start:])

    def keys(self):
        """This rank's keys of the whole epoch: image indices, or (image, repeat) pairs."""
        if self.repetitions == 1:
            return list(super().__iter__())
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        repeated = [(index, repeat) for index in order.tolist() for repeat in range(self.repetitions)]
        return repeated[:self.num_samples * self.num_replicas][self.rank::self.num_replicas]

    def images(self):
        """The image index of each of this rank's keys from `start` on."""
        return [key[0] if isinstance(key, tuple) else key for key in self]

    def __len__(self):
        return self.num_samples - self.start


class KeyedAugmentation(Dataset):
    """A training set whose every sample is augmented with torch's random numbers seeded from (seed, epoch,
    index) alone, not from a worker's stream: the same crops and flips whatever the number of DataLoader
    workers or ranks, and from any batch a resumed run starts at."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        """`key`: an image index, or an (index, repeat) pair of repeated augmentation (EpochSampler)."""
        key = key if isinstance(key, tuple) else (key,)
        with torch.random.fork_rng(devices=[]):  # the process's own stream (num_workers 0) goes on untouched
            torch.manual_seed(hash((self.seed, self.epoch, *key)) % 2**63)
            return self.dataset[key[0]]


class TrainLoader:
    """The training DataLoader of one rank. `epoch(e, start_batch)` fixes the shuffle from (seed, epoch) and
    each image's augmentation from (seed, epoch, image), so a resumed run sees what an uninterrupted one
    would have seen."""

    def __init__(self, dataset, micro_batch_size, num_workers, rank, world_size, seed, pin_memory, repetitions=1):
        self.sampler = EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                    seed=seed, drop_last=True, repetitions=repetitions)
        self.dataset = KeyedAugmentation(dataset, seed)
        self.micro_batch_size = micro_batch_size
        # Workers restart every epoch, each with the dataset as it is then: its epoch set below. The loader's
        # own generator (the workers' base seed) keeps it from drawing on the training process's stream.
        self.loader = DataLoader(self.dataset, batch_size=micro_batch_size, sampler=self.sampler, drop_last=True,
                                 num_workers=num_workers, pin_memory=pin_memory, generator=torch.Generator(),
                                 worker_init_fn=ignore_stop_signals)
        self.batches_per_epoch = self.sampler.num_samples // micro_batch_size

    def epoch(self, epoch, start_batch=0):
        self.sampler.set_epoch(epoch)
        self.sampler.start = start_batch * self.micro_batch_size
        self.dataset.epoch = epoch
        return self.loader


def build_loaders(train_set, val_set, micro_batch_size, num_workers, rank, world_size, seed, pin_memory,
                  repetitions=1):
    """Training loader (see TrainLoader; `repetitions`: EpochSampler's) and validation loader.

    Validation shards are disjoint and unpadded (rank r takes images r, r + world_size, ...), so
    metrics summed over ranks count every image exactly once.
    """
    train_loader = TrainLoader(train_set, micro_batch_size, num_workers, rank, world_size, seed, pin_memory,
                               repetitions)
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=micro_batch_size, shuffle=False, num_workers=num_workers,
                            pin_memory=pin_memory, persistent_workers=num_workers > 0,
                            worker_init_fn=ignore_stop_signals)
    return train_loader, val_loader
