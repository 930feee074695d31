"""fp16 loss scaling where DeepSpeed checks for overflow itself: skipped steps and accuracy.

Under torch_autocast fp16 a GradScaler scales the loss. With optimizer offload (or gradient clipping)
DeepSpeed's ZeRO optimizer computes the gradient norm and skips a step whose norm is inf before the
GradScaler's step()/update() run; the trainer then lowers the scale itself (numerics.back_off). This
trains the seed's 2 GB-GPU recipe (`--batch_size 8 --fp16 --offload_optimizer`) and its neighbours on
the built-in sample data, several seeds each, and reports per run the steps skipped in the first epoch
and after it, and the last epoch's validation accuracy, with fp16 + offload paired by seed against
bf16 + offload. Prints a table last and writes JSON to benchmarks/results/fp16_offload_<gpu>.json.

    python benchmarks/fp16_offload.py --seeds 1 2 3 --epochs 4 --jobs 4
"""
import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ROOT, draw_sample_data, environment, run_trainer, shown
from machine import machine_slug

REFERENCE = "bf16 + offload optimizer"
# ZeRO-2 throughout: where DeepSpeed's ZeRO optimizer checks for overflow itself (offload, clipping).
VARIANTS = {
    "fp16 + offload optimizer": ["--fp16", "--offload_optimizer", "--zero_stage", "2"],
    REFERENCE: ["--bf16", "--offload_optimizer", "--zero_stage", "2"],
    "fp16 + clip_grad 1": ["--fp16", "--clip_grad", "1", "--zero_stage", "2"],
    "fp16": ["--fp16", "--zero_stage", "2"],
}
SETTLING_STEPS = 100  # the dynamic scale starts at 2^16 and halves on each overflow until it fits


def train(name, seed, args):
    result = run_trainer(["--num_gpus", "1", "--train_dir", str(args.sample_data / "train"),
                          "--val_dir", str(args.sample_data / "val"), "--epochs", str(args.epochs),
                          "--batch_size", str(args.batch_size), "--image_size", str(args.image_size),
                          "--seed", str(seed), "--save_every", "0", *VARIANTS[name]])
    if "error" in result:
        return {**result, "seed": seed}
    history = result.pop("history")
    epochs = history["epochs"]
    steps_per_epoch = history["config"]["train_images"] // args.batch_size
    skipped = [e["skipped_steps"] for e in epochs]
    steps = steps_per_epoch * len(epochs)
    # Per-epoch counts only: every skip is counted against the steps after the first SETTLING_STEPS, an
    # upper bound on the share skipped after them.
    return {**result, "seed": seed, "steps": steps, "skipped_per_epoch": skipped,
            "skipped_after_settling_at_most": (sum(skipped) / (steps - SETTLING_STEPS) if steps > SETTLING_STEPS
                                               else None),
            "val_acc": epochs[-1]["val_acc"], "best_val_acc": history["best"]["val_acc"]}


def fmt_share(value):
    return "-" if value is None else f"{value:.2%}"


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample_data", type=Path, default=ROOT / "sample_data")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--jobs", type=int, default=4, help="trainings run at the same time")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    return parser


def main():
    args = get_args_parser().parse_args()

    draw_sample_data(args.sample_data)
    env = environment()
    cases = [(name, seed) for seed in args.seeds for name in args.variants]
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda case: train(*case, args), cases))
    results = {name: {"flags": VARIANTS[name], "runs": [r for (n, _), r in zip(cases, done) if n == name]}
               for name in args.variants}
    for name, result in results.items():
        accs = [run["val_acc"] for run in result["runs"] if "val_acc" in run]
        if accs:
            result["val_acc_mean"] = statistics.mean(accs)
        if name != REFERENCE and REFERENCE in results:
            reference = {run["seed"]: run.get("val_acc") for run in results[REFERENCE]["runs"]}
            pairs = [run["val_acc"] - reference[run["seed"]] for run in result["runs"]
                     if "val_acc" in run and reference.get(run["seed"]) is not None]
            if pairs:
                result["val_acc_difference_to_reference"] = statistics.mean(pairs)
    settings = {k: str(v.relative_to(ROOT)) if isinstance(v, Path) and v.is_relative_to(ROOT) else str(v)
                if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"fp16_offload_{machine_slug(env)}.json"
    path.write_text(json.dumps({"environment": env, "settings": settings, "reference": REFERENCE,
                                "settling_steps": SETTLING_STEPS, "results": results}, indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | sample data, "
          f"{args.epochs} epochs, micro-batch {args.batch_size}, {args.image_size} px")
    print(f"{'variant':<28}{'seed':>5}{'steps':>7}{'skipped per epoch':>22}{'after 100 (at most)':>21}"
          f"{'val acc':>9}")
    failed = 0
    for name, result in results.items():
        for run in result["runs"]:
            if "error" in run:
                failed += 1
                print(f"{name:<28}{run['seed']:>5}  FAILED: {run['error'].strip().splitlines()[-1][:80]}")
                continue
            print(f"{name:<28}{run['seed']:>5}{run['steps']:>7}{str(run['skipped_per_epoch']):>22}"
                  f"{fmt_share(run['skipped_after_settling_at_most']):>21}{run['val_acc']:>9.3f}")
        if "val_acc_difference_to_reference" in result:
            print(f"{'':<28}mean val acc {result['val_acc_mean']:.3f}, "
                  f"{result['val_acc_difference_to_reference']:+.3f} against {REFERENCE} (paired by seed)")
    print(f"results: {shown([str(path)])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
