"""The dataset decoded once and kept on the training device as uint8; augmentation per batch there.

The DataLoader path (folders.py) decodes and augments every image in worker processes every epoch.
Here every image is decoded once at start (nvJPEG in batches on a GPU, torchvision/PIL on the CPU),
and each batch is cut out of the resident tensors with a few tensor ops, the way airbench does:

- training images are stored as squares of `--device_train_size` pixels, by default
  `round(image_size / 0.875)` (resized so that the shorter side has that length, then centre-cropped);
  torchvision's RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) and RandomHorizontalFlip are drawn per
  image from that square and applied to the whole batch as two batched matrix products (ResizedCrops):
  torchvision's antialiased bilinear resize is separable, so each crop is rows @ square @ columns^T with
  per-image weight matrices, and gives torchvision's pixels for the same box. Unlike the DataLoader path,
  crops never reach the parts of a non-square image's longer side that lie outside its central square.
- validation images are stored exactly as the DataLoader path feeds them (Resize + CenterCrop).

Shuffling and sharding come from the same EpochSampler as the DataLoader path, and each epoch's crops
and flips from (seed, rank, epoch) alone, so a run resumed mid-epoch continues with the very batches an
uninterrupted run would have used.
"""
import collections
import io
import itertools
import math
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import InterpolationMode, functional as TF

from ..utils.text import error_line
from . import cache as image_cache
from .check import EXIF_ORIENTATION
from .folders import (DEFAULT_PREPROCESSING, EpochSampler, auto_augment_policy, batch_memory_format, epoch_seed,
                      load_rgb, val_sizes)

DECODE_CHUNK = 256  # images decoded per nvJPEG call: bounds the memory the decode needs
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10  # as torchvision's RandomResizedCrop
ERASE_SCALE, ERASE_RATIO, ERASE_TRIES = (0.02, 0.33), (0.3, 3.3), 10  # torchvision's RandomErasing's defaults
# keys the erasing's and the policy's generators apart from the crops' (same seed, rank and epoch)
ERASE_STREAM, POLICY_STREAM = 1, 2
FREE_MEMORY_SHARE = 0.25  # auto mode uses the GPU for data when it needs at most this share of free memory
# The reading thread takes the GIL between its ops, which a Python-heavy step (ZeRO-2's gradient hooks) holds
# for up to sys.getswitchinterval() at a time, so reads start this many batches ahead (pinned and device memory:
# this many batches more). ResNet18, ZeRO-2, H100: 5% of the epoch waiting for data (one ahead, before the copies
# had a stream of their own: 16%).
HOST_BATCHES_AHEAD = 3
# The policy (--auto_augment) runs on the batches of a chunk of about this many images at once, at most
# POLICY_CHUNK_BATCHES batches: its launches from the host take about as long for four batches of 256 as for one,
# and a ResNet18 step leaves the host little room (recipe_augmentation.py's "a batch at a time" rows).
POLICY_CHUNK_IMAGES = 1024
POLICY_CHUNK_BATCHES = 8
# torch threads of the thread that gathers host batches: a batch's rows gathered on every core of a 16-core host
# came slower than on a few, beside the training step and alone (benchmarks/host_batches.py)
GATHER_THREADS = 4


def resize_size(image_size, preprocessing=None):
    """The default side of the stored training squares: the crop / 0.875 (224 -> 256), or by the weights' ratio."""
    return round(image_size * (preprocessing or DEFAULT_PREPROCESSING)["resize_ratio"])


def train_square_size(image_size, requested=None, preprocessing=None):
    """Side of the stored training squares: --device_train_size, else the validation resize."""
    return requested or resize_size(image_size, preprocessing)


def dataset_bytes(num_train, num_val, image_size, train_size=None, preprocessing=None):
    return 3 * (num_train * train_square_size(image_size, train_size, preprocessing) ** 2
                + num_val * val_sizes(image_size, preprocessing)[1] ** 2)


TIERS = {"on": "device", "cache": "cache", "off": "workers"}  # --data_on_device -> where batches come from


def choose_device_data(mode, device, num_train, num_val, image_size, train_size=None, state_bytes=0,
                       cache_root=None, preprocessing=None):
    """(tier, why) for --data_on_device auto|on|cache|off: "device" (the decoded dataset in the device's
    memory), "cache" (memory-mapped from the decoded-image cache under `cache_root`, each batch copied to
    the device) or "workers" (DataLoader workers decode every epoch). Decided before the engine exists (the
    dataset decodes while DeepSpeed sets up), so the model's states on this GPU, `state_bytes`
    (engine.memory.state_bytes_per_gpu), are counted as taken."""
    if mode != "auto":
        return TIERS[mode], f"--data_on_device {mode}"
    if device.type != "cuda":
        return "workers", "auto: the device is a CPU"
    data = dataset_bytes(num_train, num_val, image_size, train_size, preprocessing)
    needed = data + crop_weights_bytes(train_square_size(image_size, train_size, preprocessing), image_size)
    free = max(torch.cuda.mem_get_info(device)[0] - state_bytes, 0)
    return auto_tier(data, needed, free, cache_root)


def auto_tier(data, needed, free, cache_root):
    """choose_device_data's auto choice for a GPU with `free` bytes and a dataset of `data` bytes decoded
    (`needed` with the crop weights)."""
    if needed <= FREE_MEMORY_SHARE * free:
        return "device", f"auto: the decoded dataset and crop weights ({needed / 2**30:.2f} GiB) fit on the GPU"
    too_large = (f"auto: the decoded dataset and crop weights ({needed / 2**30:.2f} GiB) need more than "
                 f"{FREE_MEMORY_SHARE:.0%} of the GPU's {free / 2**30:.1f} GiB free beside the model's states")
    if cache_root is None:
        return "workers", f"{too_large}, and --cache_dir is off"
    disk = shutil.disk_usage(existing_parent(cache_root)).free
    if data > disk:
        return "workers", f"{too_large}, and the cache's disk has {disk / 2**30:.1f} GiB free"
    return "cache", f"{too_large}: decoded once into the cache {cache_root}"


def existing_parent(path):
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


# EXIF orientation -> the (C, H, W) tensor op that makes the image upright, as PIL's ImageOps.exif_transpose.
# torchvision applies EXIF orientation on the CPU only, so it is applied here for both devices.
EXIF_TRANSPOSES = {
    2: lambda image: image.flip(-1),
    3: lambda image: image.flip(-2, -1),
    4: lambda image: image.flip(-2),
    5: lambda image: image.transpose(-2, -1),
    6: lambda image: image.rot90(-1, (-2, -1)),
    7: lambda image: image.transpose(-2, -1).flip(-2, -1),
    8: lambda image: image.rot90(1, (-2, -1)),
}


def jpeg_header(data):
    """(mode, EXIF orientation) of a file's bytes from its header alone; None when it is not a JPEG."""
    if data[:2].tolist() != [0xFF, 0xD8]:
        return None
    with Image.open(io.BytesIO(data.numpy().tobytes()), formats=["JPEG"]) as image:
        return image.mode, image.getexif().get(EXIF_ORIENTATION, 1)


def checked_header(record):
    """jpeg_header's answer from the data check's record of the file."""
    return (record["mode"], record["orientation"]) if record["format"] == "JPEG" else None


def decode_chunk(paths, device, records=None):
    """(images, unreadable): a list of files decoded, upright, as uint8 (3, H, W) tensors on `device`, None in
    place of each file that does not decode, and {index: why} of those. RGB and grey JPEGs are decoded with
    torchvision (one batched nvJPEG call on a GPU), the rest (CMYK JPEGs, other formats) with the DataLoader
    path's PIL loader, so that both paths give the same pixels. `records` (path -> the data check's record)
    spares reading each header again."""
    images, unreadable, data, headers = [None] * len(paths), {}, [None] * len(paths), [None] * len(paths)
    for i, path in enumerate(paths):
        try:
            data[i] = read_file(str(path))
            headers[i] = checked_header(records[path]) if records and path in records else jpeg_header(data[i])
        except Exception:  # noqa: BLE001 - a file gone since the check, a broken header: PIL says why below
            data[i] = None
    # nvJPEG decodes a JPEG cut short without a word (the rest grey): one that does not end in its EOI marker
    # goes through PIL, which refuses a truncated file (and takes one with bytes after the marker)
    jpegs = [i for i, header in enumerate(headers)
             if header is not None and header[0] in ("RGB", "L") and data[i][-2:].tolist() == [0xFF, 0xD9]]
    if jpegs:
        try:
            decoded = decode_jpeg([data[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
        except NOT_THE_FILES:
            raise
        except RuntimeError:  # a JPEG the decoder rejects: each file alone, so that only that one goes through PIL
            decoded = [decoded_or_none(data[i], device) for i in jpegs]
        for i, image in zip(jpegs, decoded):
            if image is not None:
                images[i] = EXIF_TRANSPOSES.get(headers[i][1], lambda image: image)(image)
    for i, path in enumerate(paths):
        if images[i] is None:
            try:
                picture = load_rgb(path)
            except NOT_THE_FILES:
                raise
            except Exception as err:  # noqa: BLE001 - as the data check: corrupt data raises OSError, SyntaxError, ...
                unreadable[i] = error_line(err)
                continue
            images[i] = torch.from_numpy(np.array(picture)).permute(2, 0, 1).to(device)
    return images, unreadable


# Out of memory is not the file's fault: it stops the run (with advice), never leaves a good image out, which the
# cache would remember and a rank alone would do (its shuffle then differs from the others').
NOT_THE_FILES = (torch.OutOfMemoryError, MemoryError)


def decoded_or_none(data, device):
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except NOT_THE_FILES:
        raise
    except RuntimeError:
        return None


def resize_and_crop(image, resize, crop):
    """torchvision's Resize(resize) + CenterCrop(crop) on a uint8 tensor, antialiased."""
    try:
        resized = TF.resize(image.float(), resize, antialias=True)
    except RuntimeError:  # CUDA's antialiased resize cannot shrink a 9,500 px side to 36 ("too much shared memory")
        resized = TF.resize(image.float().cpu(), resize, antialias=True).to(image.device)
    return TF.center_crop(resized, crop).round_().clamp_(0, 255).to(torch.uint8)


def decoded_chunks(paths, resize, crop, device, records=None):
    """(start, uint8 (n, 3, crop, crop) tensor on `device`, {index in paths: why} of the files that do not
    decode, zeros in their place) for each DECODE_CHUNK of `paths`, in order."""
    for start in range(0, len(paths), DECODE_CHUNK):
        chunk, unreadable = decode_chunk(paths[start:start + DECODE_CHUNK], device, records)
        blank = torch.zeros((3, crop, crop), dtype=torch.uint8, device=device)
        yield start, torch.stack([blank if image is None else resize_and_crop(image, resize, crop) for image in chunk]), \
            {start + i: why for i, why in unreadable.items()}


def decode_dataset(paths, resize, crop, device, records=None, home=None):
    """(images, unreadable): all images, decoded on `device`, as one uint8 (N, 3, crop, crop) tensor on `home`
    (default `device`), and {index: why} of those that do not decode (zeros)."""
    out = torch.empty((len(paths), 3, crop, crop), dtype=torch.uint8, device=home or device)
    unreadable = {}
    for start, images, failed in decoded_chunks(paths, resize, crop, device, records):
        out[start:start + len(images)] = images
        unreadable.update(failed)
    return out, unreadable


def decode_split(paths, resize, crop, device, records=None, cache_root=None, source=None, home=None):
    """(images, decoded, unreadable, cached): one split as uint8 (N, 3, crop, crop), whether this call decoded it,
    {index: why} of the files that do not decode (the data check may have read their headers only) and whether
    the cache holds it. Without a
    cache, or when it cannot be written, decoded on `device` into `home`'s memory (default `device`'s); with
    one, mapped from its entry in host memory, which is filled first (decoding on `device`) when no earlier
    run left it."""
    if cache_root is None:
        return decoded_here(paths, resize, crop, device, records, home)

    def fill(f):
        unreadable = {}
        for _, images, failed in decoded_chunks(paths, resize, crop, device, records):
            f.write(images.cpu().numpy().tobytes())
            unreadable.update(failed)
        return unreadable

    decoder = "nvjpeg" if device.type == "cuda" else "cpu"  # their pixels may differ by a level here and there
    try:
        images, unreadable, filled = image_cache.load_or_fill(paths, resize, crop, decoder, cache_root, fill,
                                                              records, source)
        return images, filled, unreadable, True
    except OSError as err:  # a full disk, a read-only folder: the run goes on as without a cache
        sys.stderr.write(f"warning: cannot use the decoded-image cache {cache_root} ({err.strerror or err}); decoding "
                         "without it (--cache_dir picks another folder)\n")  # one write: ranks print it at once
        sys.stderr.flush()
        return decoded_here(paths, resize, crop, device, records, home)


def decoded_here(paths, resize, crop, device, records, home):
    images, unreadable = decode_dataset(paths, resize, crop, device, records, home)
    return images, True, unreadable, False


def first_that_fits(fits, found, fallback, *tries):
    """Each of `tries` ((count, tries) tensors) at each row's first try that `fits`, as torchvision's loops take
    it; `fallback` in the rows where `found` is False."""
    first = fits.int().argmax(dim=1, keepdim=True)
    return [torch.where(found, values.gather(1, first).squeeze(1), fallback) for values in tries]


def random_resized_crops(count, side, generator):
    """torchvision RandomResizedCrop.get_params for `count` square images of `side` pixels, vectorised.

    Returns (top, left, height, width, flip), each a (count,) tensor; flip is RandomHorizontalFlip's coin.
    """
    area = side * side * torch.empty(count, CROP_TRIES).uniform_(*CROP_SCALE, generator=generator)
    log_ratio = torch.empty(count, CROP_TRIES).uniform_(math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]),
                                                        generator=generator)
    width = torch.sqrt(area * torch.exp(log_ratio)).round()
    height = torch.sqrt(area / torch.exp(log_ratio)).round()
    fits = (width > 0) & (width <= side) & (height > 0) & (height <= side)
    # No try fits: torchvision falls back to the whole image (a square's ratio lies within 3/4-4/3).
    width, height = first_that_fits(fits, fits.any(dim=1), torch.tensor(float(side)), width, height)
    top = (torch.rand(count, generator=generator) * (side - height + 1)).floor()
    left = (torch.rand(count, generator=generator) * (side - width + 1)).floor()
    flip = torch.rand(count, generator=generator) < 0.5
    return top, left, height, width, flip


def random_erasing_boxes(count, height, width, p, generator):
    """torchvision's RandomErasing (value 0) for `count` images of height x width, vectorised: its coin of
    probability `p`, then the first of its tries whose box fits. Returns (count, 4) long: top, left, height,
    width of each image's box, height and width 0 where it erases nothing."""
    erased = torch.rand(count, generator=generator, dtype=torch.float64) < p
    area = height * width * torch.empty(count, ERASE_TRIES, dtype=torch.float64).uniform_(*ERASE_SCALE,
                                                                                          generator=generator)
    ratio = torch.empty(count, ERASE_TRIES, dtype=torch.float64).uniform_(
        math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1]), generator=generator).exp()
    box_height, box_width = (area * ratio).sqrt().round(), (area / ratio).sqrt().round()
    fits = (box_height < height) & (box_width < width)
    box_height, box_width = first_that_fits(fits, erased & fits.any(dim=1), 0, box_height, box_width)
    top = (torch.rand(count, generator=generator, dtype=torch.float64) * (height - box_height + 1)).floor()
    left = (torch.rand(count, generator=generator, dtype=torch.float64) * (width - box_width + 1)).floor()
    return torch.stack([top, left, box_height, box_width], dim=1).long()


def erase(images, boxes):
    """Each image of the batch with its box of `boxes` (random_erasing_boxes) set to 0, as torchvision's erase."""
    top, left, height, width = (column.view(-1, 1, 1, 1) for column in boxes.unbind(1))
    rows = torch.arange(images.shape[-2], device=images.device).view(1, 1, -1, 1)
    columns = torch.arange(images.shape[-1], device=images.device).view(1, 1, 1, -1)
    inside = (rows >= top) & (rows < top + height) & (columns >= left) & (columns < left + width)
    return images.masked_fill_(inside, 0)


def resize_weights(lengths, side, out_size):
    """torchvision's antialiased bilinear resize of the window [0, length) of a `side`-pixel axis to `out_size`
    pixels, as an (out_size, side) matrix per length: PIL's triangle filter, widened by the shrink factor
    when the window shrinks, each row normalised over the pixels inside the window."""
    scale = (lengths / out_size).view(-1, 1, 1)
    centre = scale * (torch.arange(out_size, device=lengths.device) + 0.5).view(1, -1, 1)
    pixel = torch.arange(side, device=lengths.device).view(1, 1, -1)
    weights = (1 - (pixel + 0.5 - centre).abs() / scale.clamp(min=1)).clamp_(min=0)
    weights *= pixel < lengths.view(-1, 1, 1)
    return weights / weights.sum(-1, keepdim=True)


def crop_weights_bytes(side, out_size):
    """GPU memory of ResizedCrops' weight table (float16 there: 2 bytes a weight)."""
    return 2 * (side + 1) * out_size * 2 * side * 2


class ResizedCrops:
    """torchvision's resized_crop(antialias=True) + hflip for whole batches of (N, 3, side, side) images, as
    two batched matrix products: rows @ image @ columns^T, each (out_size, side) weight matrix a window's
    resize_weights. The weights of every window length, plain and mirrored, are computed once, zero-padded
    so that shifting a window to its start is a strided view; a batch then fetches its weight matrices with
    one gather. Pixels in `dtype` (float16 holds uint8 values exactly; CPUs lack fast float16 matmuls)."""

    def __init__(self, side, out_size, device, dtype=torch.float32):
        table = resize_weights(torch.arange(1, side + 1, dtype=torch.float32, device=device), side, out_size)
        padded = torch.zeros(2, side + 1, out_size, 2 * side, dtype=dtype, device=device)
        padded[0, 1:, :, side:] = table
        padded[1, 1:, :, side:] = table.flip(1)
        # windows[mirrored, length, i, side - start, pixel]: output i's weight of each pixel of the axis
        self.windows = padded.unfold(-1, side, 1)
        self.side, self.dtype = side, dtype

    def __call__(self, images, top, left, height, width, flip):
        mirrored = torch.stack([torch.zeros_like(flip), flip], 1).long()  # only the columns are mirrored
        lengths = torch.stack([height, width], 1).long()
        shifts = self.side - torch.stack([top, left], 1).long()
        rows, columns = self.windows[mirrored, lengths, :, shifts].unbind(1)  # each (N, out, side)
        # Channels between the rows and the columns ((N, side, C, side), made by the copy into `dtype`), so that
        # each pass is one batched product over all channels: broadcasting a window over the channels copied
        # it for each (a fifth of the batch's time on an H100)
        count, channels, side, out = len(images), images.shape[1], self.side, rows.shape[1]
        pixels = images.permute(0, 2, 1, 3).to(self.dtype, memory_format=torch.contiguous_format)
        # reshape: pixels already in `dtype` (float crops, data_path_accuracy.py's) are not copied by .to()
        resized = rows @ pixels.reshape(count, side, channels * side)  # (N, out, C * side)
        resized = resized.view(count, out * channels, side) @ columns.transpose(1, 2)  # (N, out * C, out)
        return resized.view(count, out, channels, out).permute(0, 2, 1, 3)


class Normalize:
    """uint8 images -> (x / 255 - mean) / std in `dtype`, channels_last on a GPU."""

    def __init__(self, device, dtype, preprocessing=None):
        pre = preprocessing or DEFAULT_PREPROCESSING
        std = torch.tensor(pre["std"], device=device).view(1, 3, 1, 1)
        self.scale = 1 / (255 * std)
        self.shift = -torch.tensor(pre["mean"], device=device).view(1, 3, 1, 1) / std
        self.dtype = dtype
        self.memory_format = batch_memory_format(device)

    def __call__(self, images):
        # one pass: computed in float32, written in `dtype` and the memory format the model wants
        out = torch.empty(images.shape, dtype=self.dtype, device=images.device, memory_format=self.memory_format)
        return torch.addcmul(self.shift, images, self.scale, out=out)


def named_device(device):
    """`device`, a GPU named by its index ("cuda" alone is the current one): the reading thread sets it."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device


class DeviceTrainLoader:
    """Training batches of one rank, cut from uint8 squares (same interface as folders.TrainLoader): resident on
    `device`, or in host memory (`images` and `labels` there: the cache tier), gathered a few batches ahead
    in a thread and copied over."""

    def __init__(self, images, labels, *, micro_batch_size, image_size, rank, world_size, seed, dtype,
                 preprocessing=None, device=None, host=False, indices=None, repetitions=1, random_erase=0.0,
                 policy=None):
        self.images, self.labels = images, labels
        # the images it draws from (default all): those that decoded
        self.indices = torch.arange(len(labels)) if indices is None else torch.as_tensor(indices)
        self.device = named_device(device or images.device)
        self.host = host or images.device != self.device
        # each repeat of an image (repeated augmentation) gets its own crop: crops are drawn per place in the epoch
        self.sampler = EpochSampler(range(len(self.indices)), num_replicas=world_size, rank=rank, shuffle=True,
                                    seed=seed, drop_last=True, repetitions=repetitions)
        self.seed, self.rank, self.micro_batch_size, self.image_size = seed, rank, micro_batch_size, image_size
        self.random_erase = random_erase  # erasing's probability (torchvision's RandomErasing, after normalising)
        self.policy = policy  # --auto_augment's, a batched_policies.BatchedPolicy, on the uint8 crops
        self.policy_chunk = 1 if policy is None else policy_chunk(micro_batch_size)
        self.batches_per_epoch = self.sampler.num_samples // micro_batch_size
        self.normalize = Normalize(self.device, dtype, preprocessing)
        self.crops = ResizedCrops(images.shape[-1], image_size, self.device,
                                  torch.float16 if self.device.type == "cuda" else torch.float32)

    def epoch_boxes(self, epoch, start_batch=0):
        """(indices, boxes) of the epoch's batches from `start_batch` on; boxes (B, 5): top, left, height,
        width, flip of each image's crop, all drawn at the epoch's start from (seed, rank, epoch); with
        random erasing (B, 9), each image's erased box after them (random_erasing_boxes)."""
        self.sampler.set_epoch(epoch)
        self.sampler.start = 0
        order = self.indices[torch.tensor(self.sampler.images(), dtype=torch.long)]
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.rank, epoch))
        boxes = torch.stack(random_resized_crops(len(order), self.images.shape[-1], generator), dim=1).long()
        if self.random_erase:
            erasing = torch.Generator().manual_seed(epoch_seed(self.seed, self.rank, epoch, ERASE_STREAM))
            boxes = torch.cat([boxes, random_erasing_boxes(len(order), self.image_size, self.image_size,
                                                           self.random_erase, erasing)], dim=1)
        order, boxes = order.to(self.images.device), boxes.to(self.device)
        return ((order[start:start + self.micro_batch_size], boxes[start:start + self.micro_batch_size])
                for start in range(start_batch * self.micro_batch_size,
                                   self.batches_per_epoch * self.micro_batch_size, self.micro_batch_size))

    def epoch_policies(self, epoch, start_batch=0):
        """The policy's draws (BatchedPolicy.draw) of each of the epoch's batches from `start_batch` on, all
        drawn at the epoch's start from (seed, rank, epoch) on the host (apply then never waits for the GPU);
        None for each batch without a policy."""
        if self.policy is None:
            return itertools.repeat(None)
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.rank, epoch, POLICY_STREAM))
        # kept on the host: apply() reads each batch's op counts from them, which on the GPU waited for the GPU
        # once a batch (the epochs of ResNet18 with TrivialAugmentWide ran at about half speed)
        drawn = self.policy.draw(self.sampler.num_samples, generator)
        size = self.micro_batch_size
        return ({name: values[start:start + size] for name, values in drawn.items()}
                for start in range(start_batch * size, self.batches_per_epoch * size, size))

    def epoch(self, epoch, start_batch=0):
        # from the first batch of start_batch's policy chunk: a resumed epoch applies the policy to the same
        # groups of images as the uninterrupted one
        first = start_batch - start_batch % self.policy_chunk
        batches = self.epoch_boxes(epoch, first)
        policies = self.epoch_policies(epoch, first)
        if self.host:
            items = self._gathered_ahead(batches, policies)
        else:
            items = ((self.images[indices], self.labels[indices], boxes, policy)
                     for (indices, boxes), policy in zip(batches, policies))
        chunks = (self.batches(chunk) for chunk in chunked(items, self.policy_chunk))
        return itertools.islice(itertools.chain.from_iterable(chunks), start_batch - first, None)

    def batch(self, images, labels, boxes, policy=None):
        return next(self.batches([(images, labels, boxes, policy)]))

    def batches(self, chunk):
        """The finished batches of `chunk`, a list of (images, labels, boxes, policy draws) of consecutive batches:
        crops and normalisation batch by batch, the policy on the whole chunk's crops at once."""
        crops = (self.crops(images, *boxes[:, :5].unbind(1)) for images, _, boxes, _ in chunk)
        if self.policy is not None:  # torchvision's order: the policy on the crops' uint8 pixels, then normalisation
            pixels = torch.cat([crop.round_().clamp_(0, 255).to(torch.uint8, memory_format=torch.contiguous_format)
                                for crop in crops])
            draws = {name: torch.cat([item[3][name] for item in chunk]) for name in chunk[0][3]}
            crops = self.policy.apply(pixels, draws).split([len(item[1]) for item in chunk])
        for crop, (_, labels, boxes, _) in zip(crops, chunk):
            batch = self.normalize(crop)
            yield (erase(batch, boxes[:, 5:]) if self.random_erase else batch), labels

    def _gathered_ahead(self, batches, policies):
        """Host batches: each batch's images and labels gathered from the mapped file and sent to the device a
        few batches ahead, as (images, labels, boxes, policy draws)."""
        gather = lambda batch: gathered_host((self.images, self.labels), batch[0], self.device)  # noqa: E731
        # the policy takes a chunk's batches at once: read that many more ahead, or each chunk waits for one
        ahead = HOST_BATCHES_AHEAD + self.policy_chunk - 1
        for ((_, boxes), (images, labels)), policy in zip(sent_ahead(batches, gather, self.device, ahead), policies):
            yield images, labels, boxes, policy


def chunked(items, size):
    """Lists of `size` consecutive items (the last one shorter): itertools.batched, which Python 3.11 lacks."""
    items = iter(items)
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def policy_chunk(micro_batch_size):
    """How many batches the policy runs on at once (POLICY_CHUNK_IMAGES)."""
    return max(1, min(POLICY_CHUNK_BATCHES, POLICY_CHUNK_IMAGES // micro_batch_size))


def gathered_host(sources, indices, device):
    """The rows `indices` of each host tensor of `sources`, gathered (index_select, without the GIL) into memory
    that copies to `device` without waiting."""
    return [torch.index_select(source, 0, indices, out=empty_host((len(indices), *source.shape[1:]), source.dtype,
                                                                  device))
            for source in sources]


COPY_STREAMS = {}


def copy_stream(device):
    """The device's stream for host batches, one for the process: torch.cuda.Stream() takes the next of a
    pool shared with NCCL and DeepSpeed, so one taken each epoch would sooner or later share theirs."""
    if device not in COPY_STREAMS:
        COPY_STREAMS[device] = torch.cuda.Stream(device)
    return COPY_STREAMS[device]


def empty_host(shape, dtype, device):
    """A host tensor to copy to `device` from: pinned for a GPU, so that the copy need not wait."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def start_reader(device, threads):
    """A reading thread's setup: its gathers on `threads` torch threads, and its CUDA calls (pinned memory
    included) on this rank's GPU, not on GPU 0.

    torch.set_num_threads sets the calling thread's OpenMP team and the count that threads take at their first
    parallel op, which sent_ahead sets back once the reader has its own."""
    torch.get_num_threads()  # ATen's per-thread lazy init, now: done later it would take the process-wide count
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def sent_ahead(items, read, device, ahead=HOST_BATCHES_AHEAD):
    """(item, read(item)'s tensors on `device`) for each item, read `ahead` items ahead in a thread.
    On a GPU read() fills pinned memory and the thread copies it on a stream of its own, so the copy overlaps
    the step instead of queueing before its kernels (50 MB a ResNet18 batch of 256: about a tenth of its step
    on an H100), and the host never waits for the GPU (a copy from pageable memory would)."""
    cuda = device.type == "cuda"
    copies = copy_stream(device) if cuda else None

    def read_and_send(item):
        tensors = read(item)
        if not cuda:
            return tensors, None
        with torch.cuda.stream(copies):
            tensors = [tensor.to(device, non_blocking=True) for tensor in tensors]
            copied = torch.cuda.Event()
            copied.record(copies)
        return tensors, copied

    def arrived(item, pending):
        tensors, copied = pending.result()
        if copied is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(copied)
            for tensor in tensors:  # allocated on the copy stream, used (and freed) on this one
                tensor.record_stream(stream)
        return item, tensors

    own = torch.get_num_threads()
    threads = min(GATHER_THREADS, own)  # the training thread's count caps it
    with ThreadPoolExecutor(1, initializer=start_reader, initargs=(device, threads)) as reader:
        # torch.set_num_threads also sets the count every thread starts with: once the reader has its own,
        # set it back to this thread's, so that threads started later (autograd's, the checkpoint writer) keep it
        reader.submit(int).result()
        torch.set_num_threads(own)
        pending = collections.deque()
        for item in items:
            pending.append((item, reader.submit(read_and_send, item)))
            if len(pending) > ahead:
                yield arrived(*pending.popleft())
        while pending:
            yield arrived(*pending.popleft())


class DeviceValLoader:
    """Validation batches of one rank's shard (images rank, rank + world_size, ... of `indices`, default all),
    resident on `device` or in host memory (the cache tier), copied a few batches ahead."""

    def __init__(self, images, labels, *, micro_batch_size, rank, world_size, dtype, preprocessing=None, device=None,
                 host=False, indices=None):
        indices = torch.arange(len(labels)) if indices is None else torch.as_tensor(indices)
        self.positions = indices[rank::world_size].to(images.device)
        self.images, self.labels = images, labels
        self.micro_batch_size = micro_batch_size
        self.device = named_device(device or images.device)
        self.host = host or images.device != self.device
        self.normalize = Normalize(self.device, dtype, preprocessing)

    def __len__(self):
        return math.ceil(len(self.positions) / self.micro_batch_size)

    def __iter__(self):
        size = self.micro_batch_size
        batches = (self.positions[start:start + size] for start in range(0, len(self.positions), size))
        if self.host:  # the cache tier: copied over a few batches ahead
            gather = lambda batch: gathered_host((self.images, self.labels), batch, self.device)  # noqa: E731
            parts = (tensors for _, tensors in sent_ahead(batches, gather, self.device))
        else:
            parts = ((self.images[batch], self.labels[batch]) for batch in batches)
        for images, labels in parts:
            yield self.normalize(images), labels


def recipe_arguments(recipe, preprocessing=None):
    """DeviceTrainLoader's random_erase and policy for `recipe` (recipe_of; None: neither)."""
    if not recipe:
        return {}
    policy = None
    if recipe["auto_augment"]:
        from .batched_policies import BatchedPolicy  # torchvision's private kernels, only when asked for

        interpolation = InterpolationMode((preprocessing or DEFAULT_PREPROCESSING)["interpolation"])
        # torchvision's tensor affine takes nearest and bilinear only: weights of bicubic preprocessing (most of
        # timm's) stopped every rank; the GPU path resizes bilinearly too
        if interpolation not in (InterpolationMode.NEAREST, InterpolationMode.BILINEAR):
            interpolation = InterpolationMode.BILINEAR
        policy = BatchedPolicy(auto_augment_policy(recipe, interpolation))
    return {"random_erase": recipe["random_erase"], "policy": policy}


def build_device_loaders(train_set, val_set, *, micro_batch_size, image_size, rank, world_size, seed, device, dtype,
                         train_size=None, records=None, preprocessing=None, tier="device", cache_root=None,
                         repetitions=1, recipe=None):
    """Both ImageFolders decoded, or read from the decoded-image cache under `cache_root` (None: no cache),
    as training squares of `train_size` pixels (default the validation resize; `records`: the data check's,
    see decode_chunk), kept on `device` (tier "device") or in host memory (tier "cache"); `repetitions`: repeated
    augmentation's (folders.EpochSampler), `recipe` (recipe_of): DeviceTrainLoader's policy and erasing; returns
    (train_loader, val_loader, a line saying what was decoded or read and how long it took, {path: why} of
    the files left out because they do not decode)."""
    start = time.perf_counter()
    train_size = train_square_size(image_size, train_size, preprocessing)
    home = device if tier == "device" else torch.device("cpu")  # the cache tier's dataset may not fit the device
    splits, unreadable, decoded, cached = [], {}, 0, cache_root is not None
    for dataset, resize, crop in ((train_set, train_size, train_size),
                                  (val_set, *val_sizes(image_size, preprocessing))):
        paths, labels = zip(*dataset.samples) if dataset.samples else ((), ())
        # once the cache failed (a warning), the other split decodes without it
        images, split_decoded, failed, split_cached = decode_split(list(paths), resize, crop, device, records,
                                                                   cache_root if cached else None,
                                                                   getattr(dataset, "root", None), home)
        cached &= split_cached
        unreadable.update({paths[index]: why for index, why in failed.items()})
        decoded += len(paths) * split_decoded
        kept = [index for index in range(len(paths)) if index not in failed]
        splits.append((images.to(home), torch.tensor(labels, dtype=torch.long, device=home), kept))
    (train_images, train_labels, train_kept), (val_images, val_labels, val_kept) = splits
    shared = dict(micro_batch_size=micro_batch_size, rank=rank, world_size=world_size, dtype=dtype,
                  preprocessing=preprocessing, device=device, host=tier == "cache")
    train_loader = DeviceTrainLoader(train_images, train_labels, image_size=image_size, seed=seed, indices=train_kept,
                                     repetitions=repetitions, **recipe_arguments(recipe, preprocessing), **shared)
    val_loader = DeviceValLoader(val_images, val_labels, indices=val_kept, **shared)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    read = len(train_set.samples) + len(val_set.samples) - decoded
    done = ([f"decoded {decoded} images"] if decoded else []) + (
        [f"read {read} decoded by an earlier run from the cache"] if read else [])
    where = f" (cache: {cache_root})" if cached else ""
    return train_loader, val_loader, f"{', '.join(done)} in {time.perf_counter() - start:.1f} s{where}", unreadable
