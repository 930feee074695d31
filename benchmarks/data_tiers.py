"""The three data tiers over dataset sizes: end-to-end training epochs of the trainer with the dataset on
the GPU, in the decoded-image cache and from DataLoader workers, against plain PyTorch, on one GPU.

For each of --sizes N: a JPEG folder of N images (90 classes, 80% train, sides of 300-500 px, textured so
that a file weighs about what a photo of its size does), drawn on every CPU core. Then, each in a process
of its own:

- plain DataLoader: benchmarks/plain_loop.py (torchvision ImageFolder, RandomResizedCrop + flip in
  --num_workers workers, autocast bf16, channels_last): what a user writes by hand;
- the trainer through launch_deepspeed.py, ZeRO-2 bf16: the cache tier twice in a cache folder of its own
  (the first run on the dataset decodes it into the cache, the second reads it: nothing decoded), the
  dataset on the GPU, and DataLoader workers; and the cache tier at ZeRO-0, the default on one GPU.

Once per run, and recorded with each size it ran with, the plain bf16 channels_last loop on one
GPU-resident synthetic batch (throughput.py's reference): the ceiling, which no data pipeline can pass.
images/s is the training loop's, the median over the epochs after the first. The cache tier's goals: 0.85x the synthetic loop and 4x plain DataLoader.
Writes benchmarks/results/data_tiers_<gpu>.json after every measurement and prints a table last.

    python benchmarks/data_tiers.py --sizes 5400 54000 --data /tmp/tiers
    python benchmarks/data_tiers.py --sizes 5400 --only "plain DataLoader" --update
"""
import argparse
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

import throughput
from common import BF16_REF, ROOT, earlier_results, environment, fmt, run_trainer, settings_of, shown
from deepspeed_image_trainer.data.prepare import ANIMALS_90, draw_sample_image
from machine import machine_slug

SYNTHETIC = "plain synthetic"
PLAIN = "plain DataLoader"
# measurement -> the trainer's --data_on_device and --zero_stage, in order: the cache's second run reads what the
# first wrote, and so do the runs after it (the GPU tier's decode is the cache's)
FIRST_RUN = "trainer, cache, first run"
TRAINER = {FIRST_RUN: ("cache", 2), "trainer, cache, second run": ("cache", 2),
           "trainer, data on GPU": ("on", 2), "trainer, DataLoader": ("off", 2),
           "trainer, cache, ZeRO-0 (the one-GPU default)": ("cache", 0)}
GOALS = {"trainer, cache, second run": (0.85, 4.0)}  # (x synthetic, x plain DataLoader) from the data-at-scale issue
NUM_CLASSES = 90


def draw_image(job):
    """One JPEG of the dataset: the sample dataset's shape of its class on a side of 300-500 px, cut to a
    random aspect, with sensor-like noise, so that the file weighs what a photo does (59 KB on average;
    a flat drawing compresses to a fraction of that and decodes faster than a photo would)."""
    path, class_index, seed = job
    rng = random.Random(seed)
    width, height = rng.randint(300, 500), rng.randint(300, 500)
    image = np.asarray(draw_sample_image(class_index, rng, max(width, height)), dtype=np.int16)[:height, :width]
    noise = np.random.default_rng(seed).normal(0, 12, image.shape).astype(np.int16)
    Image.fromarray(np.clip(image + noise, 0, 255).astype(np.uint8)).save(path, quality=90)


def draw_dataset(folder, count):
    """`count` JPEGs under folder/train and folder/val (a fifth), kept when a run drew them before;
    {"train_images", "val_images", "jpeg_mib", "draw_s"}."""
    marker = folder / "drawn.json"
    if marker.is_file():
        return json.loads(marker.read_text())
    started = time.perf_counter()
    jobs = []
    for index in range(count):
        class_index = index % NUM_CLASSES
        split = "val" if index // NUM_CLASSES % 5 == 0 else "train"  # a fifth of each class, its first image
        target = folder / split / ANIMALS_90[class_index]
        target.mkdir(parents=True, exist_ok=True)
        jobs.append((str(target / f"{index:07d}.jpg"), class_index, index))
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(draw_image, jobs, chunksize=64))
    drawn = {"train_images": sum("/train/" in path for path, _, _ in jobs),
             "val_images": sum("/val/" in path for path, _, _ in jobs),
             "jpeg_mib": round(sum(os.path.getsize(path) for path, _, _ in jobs) / 2**20, 1),
             "draw_s": round(time.perf_counter() - started, 1)}
    marker.write_text(json.dumps(drawn) + "\n")
    return drawn


def later_epochs(epochs, key):
    return statistics.median(epoch[key] for epoch in (epochs[1:] or epochs))


def epochs_for(train_images, args):
    return max(args.epochs, 1 + math.ceil(args.min_images / train_images))


def plain_case(data, train_images, args):
    command = [sys.executable, str(ROOT / "benchmarks" / "plain_loop.py"), "--data", str(data),
               "--epochs", str(epochs_for(train_images, args)), "--batch_size", str(args.batch_size), "--image_size",
               str(args.image_size), "--precision", "bf16", "--num_workers", str(args.num_workers)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return {"command": shown(command), "error": (result.stdout + result.stderr)[-2000:]}
    run = json.loads(result.stdout.strip().splitlines()[-1])
    return {"command": shown(command), "wall_s": round(time.perf_counter() - started, 1),
            "images_per_s": later_epochs(run["epochs"], "images_per_s"), "val_acc": run["epochs"][-1]["val_acc"],
            "startup_s": run["startup_s"]}


def trainer_case(data, train_images, tier, zero_stage, cache_dir, args):
    flags = ["--num_gpus", "1", "--train_dir", str(data / "train"), "--val_dir", str(data / "val"),
             "--epochs", str(epochs_for(train_images, args)), "--batch_size", str(args.batch_size),
             "--image_size", str(args.image_size), "--zero_stage", str(zero_stage), "--bf16", "--data_on_device", tier,
             "--cache_dir", str(cache_dir), "--num_workers", str(args.num_workers), "--save_every", "0", "--save_last_every", "0"]
    run = run_trainer(flags, keep_output=True)
    if "error" in run:
        return run
    epochs, config = run["history"]["epochs"], run["history"]["config"]
    # "decoded N images in S s" / "read N decoded by an earlier run from the cache in S s"
    data_line = re.search(r"^Data on .*$", run["output"], re.M)
    decoded = re.search(r"decoded (\d+) images", data_line[0]) if data_line else None
    return {"command": run["command"], "wall_s": run["wall_s"], "data_tier": config["data_tier"],
            "images_per_s": later_epochs(epochs, "images_per_s"),
            "data_wait_share": later_epochs(epochs, "data_wait_s") / later_epochs(epochs, "epoch_time_s"),
            "val_acc": epochs[-1]["val_acc"], "peak_gpu_memory_gib": epochs[-1]["peak_gpu_memory_gib"],
            "startup_s": run["history"]["timing"]["startup_s"], "phases": run["history"]["timing"]["phases"],
            "data_line": data_line[0] if data_line else None, "images_decoded": int(decoded[1]) if decoded else 0}


def synthetic_case(args):
    reference = throughput.get_args_parser().parse_args(
        ["--batch_size", str(args.batch_size), "--image_size", str(args.image_size), "--output_dir", str(args.output_dir)])
    return throughput.run_case("reference", BF16_REF, reference)


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[5400, 54000], help="images per dataset")
    parser.add_argument("--data", type=Path, default=ROOT / "bench_data" / "tiers",
                        help="folder for the drawn datasets (one subfolder per size) and their caches")
    parser.add_argument("--batch_size", type=int, default=256, help="micro-batch, for every loop")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs per run (the first is not counted), more where a run would count fewer than "
                             "--min_images training images")
    parser.add_argument("--min_images", type=int, default=40000,
                        help="training images a run counts at least (16-step epochs of 5,400 images vary by 20%%)")
    parser.add_argument("--num_workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="DataLoader workers of the plain loop and the trainer's DataLoader tier")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=[SYNTHETIC, PLAIN, *TRAINER],
                        help="run only these measurements")
    parser.add_argument("--update", action="store_true",
                        help="keep the JSON's results of the measurements not run this time")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    return parser


def ratios(result):
    """Each trainer run's images/s over the plain synthetic and plain DataLoader loops of the same size."""
    synthetic = result.get(SYNTHETIC, {}).get("images_per_s")
    plain = result.get(PLAIN, {}).get("images_per_s")
    for name in TRAINER:
        run = result.get(name, {})
        if "images_per_s" in run:
            run["x_synthetic"] = run["images_per_s"] / synthetic if synthetic else None
            run["x_plain_dataloader"] = run["images_per_s"] / plain if plain else None
            run["goals"] = GOALS.get(name)


def main():
    args = get_args_parser().parse_args()
    env = environment()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"data_tiers_{machine_slug(env)}.json"
    results, commands = earlier_results(path, env) if args.update else ({}, [])
    commands.append(env["command"])
    chosen = set(args.only or [SYNTHETIC, PLAIN, *TRAINER])

    def save():
        settings = settings_of(args)
        path.write_text(json.dumps({"environment": env, "settings": settings, "commands": commands,
                                    "results": results}, indent=2) + "\n")

    synthetic = {**synthetic_case(args), "run": len(commands) - 1, "commit": env["commit"]} if SYNTHETIC in chosen else None
    for size in args.sizes:
        folder = args.data / str(size)
        result = results.setdefault(str(size), {})
        result["dataset"] = draw_dataset(folder / "images", size)
        print(f"{size} images: {json.dumps(result['dataset'])}", flush=True)
        if synthetic is not None:
            result[SYNTHETIC] = synthetic
        os.environ["TRAINER_CACHE_DIR"] = str(folder / "cache")  # the data check's records too: a first run
        for name in [PLAIN, *TRAINER]:
            if name not in chosen:
                continue
            train_images = result["dataset"]["train_images"]
            if name == FIRST_RUN:  # a cache an earlier benchmark run left would make it a second run
                shutil.rmtree(folder / "cache", ignore_errors=True)
            result[name] = {**(plain_case(folder / "images", train_images, args) if name == PLAIN else
                               trainer_case(folder / "images", train_images, *TRAINER[name], folder / "cache" / "decoded",
                                            args)),
                            "run": len(commands) - 1, "commit": env["commit"]}
            print(f"{size} {name}: {json.dumps(result[name])[:400]}", flush=True)
            ratios(result)
            save()

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | "
          f"resnet18, micro-batch {args.batch_size}, {args.image_size} px, bf16")
    width = max(len(name) for name in TRAINER) + 2
    print(f"{'images':>8}  {'measurement':<{width}}{'images/s':>9}{'x synth':>8}{'x plain':>8}{'wall s':>8}  notes")
    for size, result in results.items():
        for name in [SYNTHETIC, PLAIN, *TRAINER]:
            run = result.get(name)
            if run is None:
                continue
            if "error" in run:
                print(f"{size:>8}  {name:<{width}}FAILED: {run['error'].strip().splitlines()[-1][:80]}")
                continue
            print(f"{size:>8}  {name:<{width}}{run['images_per_s']:>9.0f}{fmt(run.get('x_synthetic')):>8}"
                  f"{fmt(run.get('x_plain_dataloader')):>8}{fmt(run.get('wall_s')):>8}  {run.get('data_line') or ''}")
    print(f"results: {shown([str(path)])}")


if __name__ == "__main__":
    main()
