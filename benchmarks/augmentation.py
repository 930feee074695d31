"""Time of the device data path's training augmentation per batch, against torchvision on the same device.

Every variant turns a batch of resident uint8 squares into normalised bf16 channels_last crops
(RandomResizedCrop 0.08-1, ratio 3/4-4/3, horizontal flip):

- reference: torchvision's transforms.v2 RandomResizedCrop (antialiased) and RandomHorizontalFlip applied
  image by image on the device, stacked and normalised: what one writes by hand with torchvision.
- device path: the trainer's DeviceTrainLoader (two batched matrix products, float16 on a GPU), and the
  same in float32.
- grid_sample: one bilinear grid_sample per batch without antialiasing, the device path's earlier method.

Besides the time, each variant's crops are compared with torchvision's float resized_crop of the same
boxes (mean |difference| in grey levels). Prints a table last and writes JSON to
benchmarks/results/augmentation_<machine>.json.

    python benchmarks/augmentation.py --square_sizes 256 320 384
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision.transforms import v2
from torchvision.transforms import functional as TF

from common import ROOT, environment, settings_of, shown
from deepspeed_image_trainer.data.device import DeviceTrainLoader, Normalize, ResizedCrops
from machine import machine_slug

REFERENCE = "torchvision per image"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torchvision_batches(loader, epoch):
    """The reference: torchvision's own transforms, image by image, on the loader's shuffled indices."""
    transform = v2.Compose([v2.RandomResizedCrop(loader.image_size, antialias=True), v2.RandomHorizontalFlip()])
    order = torch.tensor(list(loader.sampler), device=loader.images.device)
    for start in range(0, loader.batches_per_epoch * loader.micro_batch_size, loader.micro_batch_size):
        indices = order[start:start + loader.micro_batch_size]
        yield loader.normalize(torch.stack([transform(loader.images[i]) for i in indices])), loader.labels[indices]


def grid_sample_batches(loader, epoch):
    """The earlier device path: every crop box as an affine grid, one bilinear grid_sample, no antialiasing."""
    side = loader.images.shape[-1]
    for indices, boxes in loader.epoch_boxes(epoch):
        top, left, height, width, flip = boxes.unbind(1)
        theta = torch.zeros(len(indices), 2, 3, device=boxes.device)
        theta[:, 0, 0] = width / side * torch.where(flip.bool(), -1.0, 1.0)
        theta[:, 0, 2] = (2 * left + width) / side - 1
        theta[:, 1, 1] = height / side
        theta[:, 1, 2] = (2 * top + height) / side - 1
        grid = F.affine_grid(theta, (len(indices), 3, loader.image_size, loader.image_size), align_corners=False)
        crops = F.grid_sample(loader.images[indices].float(), grid, mode="bilinear", padding_mode="border",
                              align_corners=False)
        yield loader.normalize(crops), loader.labels[indices]


def device_path(pixel_dtype):
    def batches(loader, epoch):
        if loader.crops.dtype != pixel_dtype:  # built once, by the warm-up: the trainer builds it at start
            loader.crops = ResizedCrops(loader.images.shape[-1], loader.image_size, loader.images.device, pixel_dtype)
        return loader.epoch(epoch)
    return batches


VARIANTS = {
    REFERENCE: torchvision_batches,
    "device path, float16 matmuls": device_path(torch.float16),
    "device path, float32 matmuls": device_path(torch.float32),
    "grid_sample, no antialias (before)": grid_sample_batches,
}


def time_per_batch(batches, loader, args, device):
    """Median milliseconds per batch over args.repeats timed epochs of args.batches batches each."""
    def run(epoch):
        synchronize(device)
        start = time.perf_counter()
        for count, (images, _) in enumerate(batches(loader, epoch), 1):
            if count == args.batches:
                break
        synchronize(device)
        return (time.perf_counter() - start) * 1000 / count

    run(0)  # warm-up: kernels, allocator, cuBLAS handles
    return statistics.median(run(epoch) for epoch in range(1, args.repeats + 1))


def torchvision_crop(image, box, size):
    top, left, height, width, flip = (int(v) for v in box)
    crop = TF.resized_crop(image.float(), top, left, height, width, [size, size], antialias=True)
    return crop.flip(-1) if flip else crop


def pixel_difference(batches, loader, device):
    """Mean |crop - torchvision's float resized_crop of the same box| in grey levels, over one batch."""
    normalize = Normalize(device, torch.float32)
    loader.normalize, kept = normalize, loader.normalize  # float32 output, so it can be mapped back to grey levels
    try:
        images, _ = next(iter(batches(loader, 0)))
    finally:
        loader.normalize = kept
    grey = (images.float() - normalize.shift) / normalize.scale
    indices, boxes = next(iter(loader.epoch_boxes(0)))
    expected = torch.stack([torchvision_crop(loader.images[i], box, loader.image_size)
                            for i, box in zip(indices.tolist(), boxes.tolist())])
    return (grey - expected).abs().mean().item()


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--square_sizes", type=int, nargs="+", default=[256, 320, 384],
                        help="sides of the stored training squares (the trainer's --device_train_size)")
    parser.add_argument("--num_images", type=int, default=4320, help="resident images (Animals-90's training set)")
    parser.add_argument("--batches", type=int, default=16, help="timed batches per epoch")
    parser.add_argument("--repeats", type=int, default=5, help="timed epochs; the median is reported")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    return parser


def main():
    args = get_args_parser().parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as the trainer runs; float16 matmuls are unaffected
    env = environment()
    results = {}
    for side in args.square_sizes:
        generator = torch.Generator(device).manual_seed(side)
        images = torch.randint(0, 256, (args.num_images, 3, side, side), dtype=torch.uint8, device=device,
                               generator=generator)
        loader = DeviceTrainLoader(images, torch.zeros(args.num_images, dtype=torch.long, device=device),
                                   micro_batch_size=args.batch_size, image_size=args.image_size, rank=0, world_size=1,
                                   seed=0, dtype=torch.bfloat16)
        for name, batches in VARIANTS.items():
            ms = time_per_batch(batches, loader, args, device)
            results[f"{side} px: {name}"] = {
                "square_size": side, "variant": name, "ms_per_batch": ms, "images_per_s": args.batch_size * 1000 / ms,
                "mean_abs_diff_to_torchvision": None if name == REFERENCE else pixel_difference(batches, loader, device)}
            print(f"{side} px, {name}: {ms:.2f} ms per batch", flush=True)
        for name, r in results.items():
            if r["square_size"] == side:
                r["speedup_vs_reference"] = results[f"{side} px: {REFERENCE}"]["ms_per_batch"] / r["ms_per_batch"]
        del images, loader

    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"augmentation_{machine_slug(env)}.json"
    settings = settings_of(args)
    path.write_text(json.dumps({"environment": env, "settings": settings, "results": results}, indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | torchvision {env['torchvision']} | batch "
          f"{args.batch_size}, {args.image_size} px crops from uint8 squares, bf16 channels_last out")
    print(f"{'squares':>8}  {'variant':<36}{'ms/batch':>9}{'images/s':>10}{'speedup':>9}{'|diff| grey':>12}")
    for r in results.values():
        diff = r["mean_abs_diff_to_torchvision"]
        print(f"{r['square_size']:>6}px  {r['variant']:<36}{r['ms_per_batch']:>9.2f}{r['images_per_s']:>10.0f}"
              f"{r['speedup_vs_reference']:>8.1f}x{'-' if diff is None else f'{diff:.2f}':>12}")
    print(f"results: {shown([str(path)])}")


if __name__ == "__main__":
    main()
