"""The capacity ladder: on a GPU held to a few sizes, the largest micro-batch of each configuration (plain
PyTorch, ZeRO-0, 2, 3, optimizer offload, optimizer and parameter offload) for a ladder of models, its
images/s there, and its model states beside the ZeRO paper's formulas and DeepSpeed's estimators.

Runs `src/memory_profile.py --find_max_batch --gpu_memory_gib N` once per model and size (every try in a
process of its own; plain PyTorch on the whole GPU is the speed reference), writes
benchmarks/results/capacity_<N>gib/memory_<model>_<gpu>_x<GPUs>.json (and .png), and prints the ladder tables
last: the ones docs/memory.md shows, which benchmarks/report.py generates from the same JSON.

    python benchmarks/capacity.py                                        # the whole ladder at 8 and 24 GiB
    python benchmarks/capacity.py --models vit_h_14 regnet_y_128gf --gib 8
    python benchmarks/capacity.py --models vit_l_16 --gib 8 --global_batch 512   # offload with accumulation
    python benchmarks/capacity.py --models vit_l_16 vit_h_14 --gib 8 --num_gpus 2 --configs ZeRO-3   # sharded on 2
    python benchmarks/capacity.py --gib 8 24 --configs ZeRO-2 --replace   # measure one configuration again
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import report
from common import ROOT, slug_of

# model -> micro-batch of the whole-GPU reference (the table: what the plain loop runs well at)
LADDER = {"resnet50": 128, "vit_b_16": 64, "convnext_large": 64, "vit_l_16": 32, "vit_h_14": 32, "regnet_y_128gf": 32}
CONFIGS = ["plain PyTorch", "ZeRO-0 (DDP-like)", "ZeRO-2", "ZeRO-3", "ZeRO-2 + offload optimizer",
           "ZeRO-3 + offload optimizer + params", "ZeRO-2 + offload optimizer, half weights",
           "ZeRO-3 + offload optimizer + params, half weights"]


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(LADDER), help="torchvision classifiers (default: the ladder)")
    parser.add_argument("--gib", nargs="+", type=float, default=[8, 24], help="GPU sizes to hold PyTorch to")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, metavar="NAME", help="memory_profile.py's names")
    parser.add_argument("--global_batch", type=int, default=None,
                        help="also time each configuration that offloads the optimizer with gradient accumulation to "
                             "this global batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps at each micro-batch tried")
    parser.add_argument("--num_gpus", type=int, default=1, help="GPUs of this host each try runs on (one rank each)")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--update", action="store_true",
                        help="go on from each model's earlier JSON: measure only the configurations it lacks "
                             "(memory_profile.py --update), as after a run that was cut short")
    parser.add_argument("--replace", action="store_true",
                        help="measure --configs again and replace their rows in each model's earlier JSON, keeping "
                             "the others (after a change that affects them)")
    return parser


def folder(gib):
    return f"capacity_{gib:g}gib"


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    for gib in args.gib:
        for model in args.models:
            configs = args.configs
            if args.update and not args.replace:
                reports = (args.output_dir / folder(gib)).glob(f"memory_{slug_of(model)}_*_x{args.num_gpus}.json")
                done = {row["config"] for path in reports
                        for row in json.loads(path.read_text())["results"]}
                configs = [name for name in configs if name not in done]
                if not configs:
                    continue
            command = [sys.executable, str(ROOT / "src" / "memory_profile.py"), "--model", model, "--bf16",
                       "--find_max_batch", "--gpu_memory_gib", f"{gib:g}", "--batch_size", str(LADDER.get(model, 32)),
                       "--steps", str(args.steps), "--num_gpus", str(args.num_gpus), "--configs", *configs,
                       "--output_dir", str(args.output_dir / folder(gib)),
                       *(["--global_batch", str(args.global_batch)] if args.global_batch else []),
                       *(["--update"] if args.update or args.replace else [])]
            started = time.perf_counter()
            print(f"== {model} under {gib:g} GiB", flush=True)
            status = subprocess.run(command).returncode
            print(f"== {model} under {gib:g} GiB: {'done' if status == 0 else f'FAILED ({status})'} in "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    report.RESULTS = args.output_dir
    for gib in args.gib:
        print(f"\n{report.capacity(folder(gib), args.num_gpus)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
