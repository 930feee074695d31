"""The first minute of a run: time to the first optimizer step, and where each epoch's wall time goes.

Runs the trainer as a user does (launch_deepspeed.py, fresh --log_dir and --checkpoint_dir each time) on a
JPEG image folder, once cold (an empty data-check cache: the first run on a dataset) and then warm, and
the plain PyTorch reference (benchmarks/plain_loop.py) with the same settings, each in processes of
their own. From the trainer's history: the startup (launcher start to the end of the first optimizer
step) and its phases, and per epoch the training loop, validation, checkpoints and the whole epoch; the
command's own wall time too. Prints a table last and writes JSON to
benchmarks/results/first_minute_<machine>.json.

    python benchmarks/first_minute.py --batch_size 256 --epochs 6 --precision bf16    # a GPU, Animals-90 size
    python benchmarks/first_minute.py --image_size 64 --batch_size 32 --epochs 8 \\
        --images_per_class 30 --image_px 96                                        # the CPU Quickstart's size
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, environment, run_trainer, shown
from deepspeed_image_trainer.data.prepare import make_sample_dataset
from machine import machine_slug

PRECISION_FLAGS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}


def reference_run(args):
    command = [sys.executable, str(ROOT / "benchmarks" / "plain_loop.py"), "--data", str(args.data),
               "--epochs", str(args.epochs), "--batch_size", str(args.batch_size), "--image_size", str(args.image_size),
               "--precision", args.precision, "--num_workers", str(args.num_workers)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        return {"command": shown(command), "error": (result.stdout + result.stderr)[-2000:]}
    return {"command": shown(command), "wall_s": wall_s, **json.loads(result.stdout.strip().splitlines()[-1])}


def trainer_run(args, cache_dir):
    flags = ["--train_dir", str(args.data / "train"), "--val_dir", str(args.data / "val"),
             "--epochs", str(args.epochs), "--batch_size", str(args.batch_size), "--image_size", str(args.image_size),
             "--num_workers", str(args.num_workers), *PRECISION_FLAGS[args.precision], *args.trainer_flags]
    os.environ["TRAINER_CACHE_DIR"] = cache_dir
    result = run_trainer(flags)
    if "error" in result:
        return result
    history = result.pop("history")
    epochs = [{"epoch": e["epoch"], "train_s": e["epoch_time_s"], "validation_s": e["validation_s"],
               "checkpoint_s": e["checkpoint_s"], "wall_s": e["epoch_wall_s"], "images_per_s": e["images_per_s"],
               "val_acc": e["val_acc"]} for e in history["epochs"]]
    return {**result, **history["timing"], "epochs": epochs, "data_on_device": history["config"]["data_on_device"]}


def steady(run):
    """Medians over the epochs after the first (which holds one-off costs such as cuDNN's autotuning)."""
    later = run["epochs"][1:] or run["epochs"]
    medians = {key: statistics.median(e[key] for e in later) for key in ("train_s", "validation_s", "checkpoint_s",
                                                                         "wall_s", "images_per_s")}
    medians["outside_training_share"] = (medians["wall_s"] - medians["train_s"]) / medians["train_s"]
    return medians


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "bench_data",
                        help="image folder with train/ and val/; the sample dataset is drawn there if missing")
    parser.add_argument("--num_classes", type=int, default=90)
    parser.add_argument("--images_per_class", type=int, default=75, help="80%% train, 20%% val")
    parser.add_argument("--image_px", type=int, default=256, help="side of the drawn images")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--precision", choices=list(PRECISION_FLAGS), default="bf16")
    parser.add_argument("--num_workers", type=int, default=2, help="DataLoader workers (the trainer's default)")
    parser.add_argument("--warm_runs", type=int, default=2)
    parser.add_argument("--trainer_flags", nargs=argparse.REMAINDER, default=[],
                        help="more flags for launch_deepspeed.py (last on the command line)")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--fresh_machine", action="store_true",
                        help="say that this is the first command on a freshly started machine (nothing imported, "
                             "nothing in the page cache yet): the first run is reported as the fresh machine's")
    return parser


def main():
    args = get_args_parser().parse_args()

    val_per_class = max(1, args.images_per_class // 5)
    make_sample_dataset(args.data, args.num_classes, args.images_per_class - val_per_class, val_per_class,
                        image_size=args.image_px, seed=0)
    env = environment()
    # the trainer first: on a machine that has run nothing else (--fresh_machine) its first run is a fresh machine's
    with tempfile.TemporaryDirectory() as cache_dir:
        runs = [trainer_run(args, cache_dir) for _ in range(1 + args.warm_runs)]
    reference = reference_run(args)
    trainer = {"cold": runs[0], "warm": runs[1:]}
    ok = [run for run in runs if "error" not in run]
    for run in [reference, *ok]:
        if "epochs" in run:
            run["steady"] = steady(run)
    settings = {k: str(v.relative_to(ROOT)) if isinstance(v, Path) and v.is_relative_to(ROOT) else str(v)
                if isinstance(v, Path) else v for k, v in vars(args).items() if k != "output_dir"}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"first_minute_{machine_slug(env)}.json"
    path.write_text(json.dumps({"environment": env, "settings": settings, "reference": reference,
                                "trainer": trainer}, indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | "
          f"{args.num_classes * (args.images_per_class - val_per_class)} + {args.num_classes * val_per_class} "
          f"JPEGs, {args.epochs} epochs, batch {args.batch_size}, {args.image_size} px, {args.precision}")
    print(f"{'run':<22}{'command s':>10}{'first step s':>13}{'train s':>9}{'valid. s':>9}{'ckpt s':>8}"
          f"{'epoch s':>9}{'outside/train':>14}{'val acc':>9}")
    for name, run in [("plain PyTorch", reference), ("trainer, cold", runs[0]),
                      *[(f"trainer, warm {i}", run) for i, run in enumerate(runs[1:], 1)]]:
        if "error" in run:
            print(f"{name:<22} FAILED: {run['error'].strip().splitlines()[-1][:90]}")
            continue
        s = run["steady"]
        print(f"{name:<22}{run['wall_s']:>10.1f}{run['startup_s']:>13.1f}{s['train_s']:>9.2f}{s['validation_s']:>9.2f}"
              f"{s['checkpoint_s']:>8.2f}{s['wall_s']:>9.2f}{s['outside_training_share']:>14.0%}"
              f"{run['epochs'][-1]['val_acc']:>9.3f}")
    for name, run in [("cold", runs[0]), *[(f"warm {i}", run) for i, run in enumerate(runs[1:], 1)]]:
        if "phases" in run:
            print(f"trainer {name} startup: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}"
                                                          for k, v in run["phases"].items()))
    print(f"results: {shown([str(path)])}")
    return 1 if len(ok) < len(runs) or "error" in reference else 0


if __name__ == "__main__":
    sys.exit(main())
