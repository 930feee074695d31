"""The dataset decoded once and kept on the training device as uint8; augmentation per batch there.

The DataLoader path (data.py) decodes and augments every image in worker processes every epoch.
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
from torchvision.transforms import functional as TF

import image_cache
from data import DEFAULT_PREPROCESSING, EpochSampler, batch_memory_format, epoch_seed, load_rgb
from data_check import EXIF_ORIENTATION

DECODE_CHUNK = 256  # images decoded per nvJPEG call: bounds the memory the decode needs
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10  # as torchvision's RandomResizedCrop
FREE_MEMORY_SHARE = 0.25  # auto mode uses the GPU for data when it needs at most this share of free memory
MODEL_STATE_BYTES_PER_PARAMETER = 16  # fp32 weights, gradients and AdamW's two moments
# The reading thread takes the GIL between its ops, which a Python-heavy step (ZeRO-2's gradient hooks) holds
# for up to sys.getswitchinterval() at a time; one batch ahead left ResNet18 at ZeRO-2 waiting (H100: 16% of
# the epoch), so reads start this many batches ahead (pinned and device memory: this many batches more).
HOST_BATCHES_AHEAD = 3


def resize_size(image_size, preprocessing=None):
    """The validation resize (224 -> 256 by default), and the default side of the stored training squares."""
    return round(image_size * (preprocessing or DEFAULT_PREPROCESSING)["resize_ratio"])


def train_square_size(image_size, requested=None, preprocessing=None):
    """Side of the stored training squares: --device_train_size, else the validation resize."""
    return requested or resize_size(image_size, preprocessing)


def dataset_bytes(num_train, num_val, image_size, train_size=None):
    return 3 * (num_train * train_square_size(image_size, train_size) ** 2 + num_val * image_size ** 2)


TIERS = {"on": "device", "cache": "cache", "off": "workers"}  # --data_on_device -> where batches come from


def choose_device_data(mode, device, num_train, num_val, image_size, train_size=None, num_params=0,
                       cache_root=None):
    """(tier, why) for --data_on_device auto|on|cache|off: "device" (the decoded dataset in the device's
    memory), "cache" (memory-mapped from the decoded-image cache under `cache_root`, each batch copied to
    the device) or "workers" (DataLoader workers decode every epoch). Decided before the engine exists (the
    dataset decodes while DeepSpeed sets up), so the model's states, at most 16 bytes a parameter for
    AdamW with fp32 weights, are counted as taken."""
    if mode != "auto":
        return TIERS[mode], f"--data_on_device {mode}"
    if device.type != "cuda":
        return "workers", "auto: the device is a CPU"
    data = dataset_bytes(num_train, num_val, image_size, train_size)
    needed = data + crop_weights_bytes(train_square_size(image_size, train_size), image_size)
    free = torch.cuda.mem_get_info(device)[0] - MODEL_STATE_BYTES_PER_PARAMETER * num_params
    return auto_tier(data, needed, free, cache_root)


def auto_tier(data, needed, free, cache_root):
    """choose_device_data's auto choice for a GPU with `free` bytes and a dataset of `data` bytes decoded
    (`needed` with the crop weights)."""
    if needed <= FREE_MEMORY_SHARE * free:
        return "device", f"auto: the decoded dataset and crop weights ({needed / 2**30:.2f} GiB) fit on the GPU"
    too_large = (f"auto: the decoded dataset and crop weights ({needed / 2**30:.2f} GiB) need more than "
                 f"{FREE_MEMORY_SHARE:.0%} of the GPU's free {free / 2**30:.1f} GiB")
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
    """Decode a list of files, upright, as uint8 (3, H, W) tensors on `device`: RGB and grey JPEGs with
    torchvision (one batched nvJPEG call on a GPU), the rest (CMYK JPEGs, other formats) with the
    DataLoader path's PIL loader, so that both paths give the same pixels. `records` (path -> the data
    check's record) spares reading each header again."""
    data = [read_file(str(path)) for path in paths]
    headers = [checked_header(records[path]) if records and path in records else jpeg_header(d)
               for path, d in zip(paths, data)]
    jpegs = [i for i, header in enumerate(headers) if header is not None and header[0] in ("RGB", "L")]
    decoded = {}
    if jpegs:
        try:
            images = decode_jpeg([data[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
            decoded = {i: EXIF_TRANSPOSES.get(headers[i][1], lambda image: image)(image)
                       for i, image in zip(jpegs, images)}
        except RuntimeError:  # a JPEG the decoder rejects: this chunk goes through PIL
            pass
    return [decoded[i] if i in decoded else torch.from_numpy(np.array(load_rgb(path))).permute(2, 0, 1).to(device)
            for i, path in enumerate(paths)]


def resize_and_crop(image, resize, crop):
    """torchvision's Resize(resize) + CenterCrop(crop) on a uint8 tensor, antialiased."""
    resized = TF.resize(image.float(), resize, antialias=True)
    return TF.center_crop(resized, crop).round_().clamp_(0, 255).to(torch.uint8)


def decode_dataset(paths, resize, crop, device, records=None):
    """All images as one uint8 (N, 3, crop, crop) tensor on `device`."""
    out = torch.empty((len(paths), 3, crop, crop), dtype=torch.uint8, device=device)
    for start in range(0, len(paths), DECODE_CHUNK):
        for offset, image in enumerate(decode_chunk(paths[start:start + DECODE_CHUNK], device, records)):
            out[start + offset] = resize_and_crop(image, resize, crop)
    return out


def decode_split(paths, resize, crop, device, records=None, cache_root=None, source=None):
    """(images, decoded): one split as uint8 (N, 3, crop, crop) and whether this call decoded it. Without a
    cache, decoded onto `device`; with one, mapped from its entry in host memory, which is filled first
    (decoding on `device`) when no earlier run left it."""
    if cache_root is None:
        return decode_dataset(paths, resize, crop, device, records), True

    def fill(f):
        for start in range(0, len(paths), DECODE_CHUNK):
            chunk = decode_chunk(paths[start:start + DECODE_CHUNK], device, records)
            f.write(torch.stack([resize_and_crop(image, resize, crop) for image in chunk]).cpu().numpy().tobytes())

    decoder = "nvjpeg" if device.type == "cuda" else "cpu"  # their pixels may differ by a level here and there
    try:
        return image_cache.load_or_fill(paths, resize, crop, decoder, cache_root, fill, records, source)
    except OSError as err:  # a full disk, a read-only folder: the run goes on as without a cache
        print(f"warning: cannot use the decoded-image cache {cache_root} ({err.strerror or err}); decoding without "
              f"it (--cache_dir picks another folder)", file=sys.stderr, flush=True)
        return decode_dataset(paths, resize, crop, device, records), True


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
    first = fits.int().argmax(dim=1, keepdim=True)  # the first try that fits, as torchvision takes it
    found = fits.any(dim=1)
    # No try fits: torchvision falls back to the whole image (a square's ratio lies within 3/4-4/3).
    width = torch.where(found, width.gather(1, first).squeeze(1), torch.tensor(float(side)))
    height = torch.where(found, height.gather(1, first).squeeze(1), torch.tensor(float(side)))
    top = (torch.rand(count, generator=generator) * (side - height + 1)).floor()
    left = (torch.rand(count, generator=generator) * (side - width + 1)).floor()
    flip = torch.rand(count, generator=generator) < 0.5
    return top, left, height, width, flip


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
        return rows.unsqueeze(1) @ images.to(self.dtype) @ columns.transpose(1, 2).unsqueeze(1)


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
        out = torch.addcmul(self.shift, images.float(), self.scale)
        return out.to(self.dtype, memory_format=self.memory_format)


class DeviceTrainLoader:
    """Training batches of one rank, cut from uint8 squares (same interface as data.TrainLoader): resident on
    `device`, or in host memory (`images` and `labels` there: the cache tier), gathered a few batches ahead
    in a thread and copied over."""

    def __init__(self, images, labels, micro_batch_size, image_size, rank, world_size, seed, dtype,
                 preprocessing=None, device=None, host=False):
        self.images, self.labels = images, labels
        self.device = device or images.device
        if self.device.type == "cuda" and self.device.index is None:  # named, for the reading thread's set_device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.host = host or images.device != self.device
        self.sampler = EpochSampler(range(len(labels)), num_replicas=world_size, rank=rank, shuffle=True,
                                    seed=seed, drop_last=True)
        self.seed, self.rank, self.micro_batch_size, self.image_size = seed, rank, micro_batch_size, image_size
        self.batches_per_epoch = self.sampler.num_samples // micro_batch_size
        self.normalize = Normalize(self.device, dtype, preprocessing)
        self.crops = ResizedCrops(images.shape[-1], image_size, self.device,
                                  torch.float16 if self.device.type == "cuda" else torch.float32)
        self.copy_stream = None  # host batches' copies to a GPU

    def epoch_boxes(self, epoch, start_batch=0):
        """(indices, boxes) of the epoch's batches from `start_batch` on; boxes (B, 5): top, left, height,
        width, flip of each image's crop, all drawn at the epoch's start from (seed, rank, epoch)."""
        self.sampler.set_epoch(epoch)
        self.sampler.start = 0
        order = torch.tensor(list(self.sampler))
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.rank, epoch))
        boxes = torch.stack(random_resized_crops(len(order), self.images.shape[-1], generator), dim=1).long()
        order, boxes = order.to(self.images.device), boxes.to(self.device)
        return ((order[start:start + self.micro_batch_size], boxes[start:start + self.micro_batch_size])
                for start in range(start_batch * self.micro_batch_size,
                                   self.batches_per_epoch * self.micro_batch_size, self.micro_batch_size))

    def epoch(self, epoch, start_batch=0):
        batches = self.epoch_boxes(epoch, start_batch)
        if self.host:
            return self._gathered_ahead(batches)
        return (self.batch(self.images[indices], self.labels[indices], boxes) for indices, boxes in batches)

    def batch(self, images, labels, boxes):
        return self.normalize(self.crops(images, *boxes.unbind(1))), labels

    def _gathered_ahead(self, batches):
        """Host batches: the next HOST_BATCHES_AHEAD batches' images are read from the mapped file
        (index_select, without the GIL) and sent to the device while this one trains."""
        # the thread's CUDA calls (pinned memory included) on this rank's GPU, not on GPU 0
        on_device = {"initializer": torch.cuda.set_device, "initargs": (self.device,)} if self.device.type == "cuda" else {}
        with ThreadPoolExecutor(1, **on_device) as reader:
            pending = collections.deque()
            for indices, boxes in batches:
                pending.append((reader.submit(self.gather, indices), boxes))
                if len(pending) > HOST_BATCHES_AHEAD:
                    yield self._arrived(*pending.popleft())
            while pending:
                yield self._arrived(*pending.popleft())

    def gather(self, indices):
        """The images and labels of `indices` on the device (from the reading thread): on a GPU, gathered
        into pinned memory and copied on a stream of their own, so the copy overlaps the step instead of
        queueing before its kernels (50 MB a ResNet18 batch of 256: about a tenth of its step on an H100),
        and the host never waits for the GPU (a copy from pageable memory would)."""
        cuda = self.device.type == "cuda"
        images, labels = (torch.index_select(source, 0, indices, out=torch.empty((len(indices), *source.shape[1:]),
                                                                                 dtype=source.dtype, pin_memory=cuda))
                          for source in (self.images, self.labels))
        if not cuda:
            return images, labels, None
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            images, labels = images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        return images, labels, copied

    def _arrived(self, gathered, boxes):
        images, labels, copied = gathered.result()
        if copied is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)
            for tensor in (images, labels):  # allocated on the copy stream, used (and freed) on this one
                tensor.record_stream(stream)
        return self.batch(images, labels, boxes)


class DeviceValLoader:
    """Validation batches of one rank's shard (images rank, rank + world_size, ...), resident on `device` or
    copied there from host memory batch by batch."""

    def __init__(self, images, labels, micro_batch_size, rank, world_size, dtype, preprocessing=None, device=None):
        self.images, self.labels = images[rank::world_size], labels[rank::world_size]
        self.micro_batch_size = micro_batch_size
        self.device = device or images.device
        self.normalize = Normalize(self.device, dtype, preprocessing)

    def __len__(self):
        return math.ceil(len(self.labels) / self.micro_batch_size)

    def __iter__(self):
        for start in range(0, len(self.labels), self.micro_batch_size):
            end = start + self.micro_batch_size
            yield self.normalize(self.images[start:end].to(self.device)), self.labels[start:end].to(self.device)


def build_device_loaders(train_set, val_set, micro_batch_size, image_size, rank, world_size, seed, device, dtype,
                         train_size=None, records=None, preprocessing=None, tier="device", cache_root=None):
    """Both ImageFolders decoded, or read from the decoded-image cache under `cache_root` (None: no cache),
    as training squares of `train_size` pixels (default the validation resize; `records`: the data check's,
    see decode_chunk), kept on `device` (tier "device") or in host memory (tier "cache"); returns
    (train_loader, val_loader, a line saying what was decoded or read, and how long it took)."""
    start = time.perf_counter()
    (train_paths, train_labels), (val_paths, val_labels) = zip(*train_set.samples), zip(*val_set.samples)
    train_size = train_square_size(image_size, train_size, preprocessing)
    train_images, train_decoded = decode_split(train_paths, train_size, train_size, device, records, cache_root,
                                               getattr(train_set, "root", None))
    val_images, val_decoded = decode_split(val_paths, resize_size(image_size, preprocessing), image_size, device,
                                           records, cache_root, getattr(val_set, "root", None))
    home = device if tier == "device" else torch.device("cpu")
    train_images, val_images = train_images.to(home), val_images.to(home)
    train_loader = DeviceTrainLoader(train_images, torch.tensor(train_labels, device=home), micro_batch_size,
                                     image_size, rank, world_size, seed, dtype, preprocessing, device,
                                     host=tier == "cache")
    val_loader = DeviceValLoader(val_images, torch.tensor(val_labels, device=home), micro_batch_size, rank,
                                 world_size, dtype, preprocessing, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    decoded = len(train_paths) * train_decoded + len(val_paths) * val_decoded
    read = len(train_paths) + len(val_paths) - decoded
    done = ([f"decoded {decoded} images"] if decoded else []) + (
        [f"read {read} decoded by an earlier run from the cache"] if read else [])
    where = f" (cache: {cache_root})" if cache_root is not None else ""
    return train_loader, val_loader, f"{', '.join(done)} in {time.perf_counter() - start:.1f} s{where}"
