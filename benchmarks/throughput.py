"""Training throughput of the trainer against plain PyTorch, in one run on one GPU.

Three kinds of measurement, each in its own process (a fresh CUDA context and peak-memory counter):

- reference: plain PyTorch, the torchvision model of --model (ResNet18 by default; 90 classes), AdamW
  (torch defaults), on synthetic images already on the GPU: fp32/TF32, autocast bf16/fp16, channels_last,
  optionally torch.compile.
- trainer, synthetic: the trainer's own model, DeepSpeed config (built from the same flags as
  launch_deepspeed.py) and train_one_epoch, fed the same GPU-resident synthetic batch.
- trainer, real data: src/train_deepspeed.py end to end on a JPEG image folder the size of Animals-90
  (drawn by prepare_data.py, 256 px), with the dataset on the GPU or from DataLoader workers; images/s
  is the median over the epochs after the first (from logs/training_history.json).

Ratios compare each trainer run with the reference loop of the same precision, channels_last.
Prints a table last and writes JSON to benchmarks/results/throughput_<gpu>.json (throughput_<model>_<gpu>.json
for a --model other than resnet18).

    python benchmarks/throughput.py                  # all but the torch.compile runs; micro-batch 256, 224 px
    python benchmarks/throughput.py --only reference "step: zero2 bf16 compile"
    python benchmarks/throughput.py --only "torch bf16 channels_last" real --update   # into the same JSON
    python benchmarks/throughput.py --model vit_b_16 --only "torch bf16 channels_last" "step: zero2 bf16"

With --update, measurements not run this time keep their earlier results (same GPU and versions only),
so one JSON can come from several shorter runs; every ratio is still taken against the reference
measured in the same run as the measurement (`reference_images_per_s`), and `commands` lists the runs.
"""
import cProfile
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import (BF16_REF, FP16_REF, FSDP2_REF, REFERENCES, ROOT, SYNC_BN_REF, earlier_results, environment, failed, fmt,
                    measurement_parser, ratio, reference_case, run_case_of, settings_of, shown, slug_of,
                    trainer_case, write_profile)
from machine import machine_slug

# name -> (trainer flags, reference, goal ratio from the GPU-speed issue or None)
SYNTHETIC = {
    "step: zero0 bf16": (["--zero_stage", "0", "--bf16"], BF16_REF, None),
    "step: zero1 bf16": (["--zero_stage", "1", "--bf16"], BF16_REF, None),
    "step: zero2 bf16": (["--zero_stage", "2", "--bf16"], BF16_REF, None),
    "step: zero3 bf16": (["--zero_stage", "3", "--bf16"], BF16_REF, None),
    # ZeRO-3 as FSDP2 shards: DeepSpeed's bf16 weights, fp32 gradients reduced (several GPUs)
    "step: zero3 bf16 half_weights": (["--zero_stage", "3", "--bf16", "--precision_mode", "half_weights"],
                                      FSDP2_REF, None),
    "step: zero2 fp16": (["--zero_stage", "2", "--fp16"], FP16_REF, None),
    "step: zero2 bf16 half_weights": (["--zero_stage", "2", "--bf16", "--precision_mode", "half_weights"],
                                      BF16_REF, None),
    "step: zero2 bf16 sync_bn": (["--zero_stage", "2", "--bf16", "--sync_bn"], SYNC_BN_REF, None),
    "step: zero2 bf16 clip_grad 1": (["--zero_stage", "2", "--bf16", "--clip_grad", "1"], BF16_REF, None),
    "step: zero2 bf16 compile": (["--zero_stage", "2", "--bf16", "--compile"], BF16_REF, None),
    "step: zero2 bf16 offload_optimizer": (["--zero_stage", "2", "--bf16", "--offload_optimizer"], BF16_REF, None),
    "step: zero2 bf16 offload_optimizer, DeepSpeed's methods": (["--zero_stage", "2", "--bf16", "--offload_optimizer"],
                                                                 BF16_REF, None),
    "step: zero2 bf16 half_weights offload_optimizer": (["--zero_stage", "2", "--bf16", "--precision_mode", "half_weights",
                                                         "--offload_optimizer"], BF16_REF, None),
    "step: zero2 bf16 half_weights offload_optimizer, DeepSpeed's methods": (
        ["--zero_stage", "2", "--bf16", "--precision_mode", "half_weights", "--offload_optimizer"], BF16_REF, None),
}
# torchvision's "new recipe" (references/classification, ResNet50 v2) less its schedule: TrivialAugmentWide, random
# erasing, mixup or cutmix, label smoothing
RECIPE = ["--auto_augment", "ta_wide", "--random_erase", "0.1", "--mixup_alpha", "0.2", "--cutmix_alpha", "1.0",
          "--label_smoothing", "0.1"]
# the flags' first word for a run of benchmarks/plain_loop.py instead of the trainer
PLAIN_LOOP = "plain_loop.py"
# name -> (trainer flags, reference, goal ratio); JPEG folder -> augmentation -> DeepSpeed step
REAL = {
    "epoch: zero0 bf16, data on GPU": (["--zero_stage", "0", "--bf16", "--data_on_device", "on"], BF16_REF, None),
    "epoch: zero1 bf16, data on GPU": (["--zero_stage", "1", "--bf16", "--data_on_device", "on"], BF16_REF, None),
    "epoch: zero2 bf16, data on GPU": (["--zero_stage", "2", "--bf16", "--data_on_device", "on"], BF16_REF, 0.9),
    "epoch: zero2 fp16, data on GPU": (["--zero_stage", "2", "--fp16", "--data_on_device", "on"], FP16_REF, 0.9),
    "epoch: zero3 bf16, data on GPU": (["--zero_stage", "3", "--bf16", "--data_on_device", "on"], BF16_REF, 0.6),
    "epoch: zero2 bf16 offload_optimizer, data on GPU": (["--zero_stage", "2", "--bf16", "--offload_optimizer",
                                                          "--data_on_device", "on"], BF16_REF, 0.5),
    "epoch: zero2 bf16 offload_optimizer, data on GPU, DeepSpeed's methods": (
        ["--zero_stage", "2", "--bf16", "--offload_optimizer", "--data_on_device", "on"], BF16_REF, 0.5),
    "epoch: zero2 bf16 sync_bn, data on GPU": (["--zero_stage", "2", "--bf16", "--sync_bn", "--data_on_device", "on"],
                                               SYNC_BN_REF, None),
    "epoch: zero2 bf16, DataLoader": (["--zero_stage", "2", "--bf16", "--data_on_device", "off"], BF16_REF, None),
    # the dataset memory-mapped from the decoded-image cache, batches copied to the GPU (data larger than it)
    "epoch: zero2 bf16, data in the cache": (["--zero_stage", "2", "--bf16", "--data_on_device", "cache"], BF16_REF,
                                             0.85),
    "epoch: zero2 bf16 compile, data on GPU": (["--zero_stage", "2", "--bf16", "--compile", "--data_on_device", "on"],
                                               BF16_REF, 0.9),
    # one GPU's default stage, with and without torchvision's "new recipe" augmentation (the recipe issue's goals:
    # 0.9 of the run without it for ResNet18, 0.95 for ResNet50; on the GPU against DataLoader workers)
    "epoch: zero0 bf16, DataLoader": (["--zero_stage", "0", "--bf16", "--data_on_device", "off"], BF16_REF, None),
    "epoch: zero0 bf16 recipe, data on GPU": (["--zero_stage", "0", "--bf16", "--data_on_device", "on", *RECIPE],
                                              BF16_REF, None),
    "epoch: zero0 bf16 recipe, DataLoader": (["--zero_stage", "0", "--bf16", "--data_on_device", "off", *RECIPE],
                                             BF16_REF, None),
    # what a user would write instead: torchvision's reference script's way, benchmarks/plain_loop.py --recipe
    "plain loop bf16 recipe, DataLoader": ([PLAIN_LOOP, "--recipe"], BF16_REF, None),
    "epoch: zero0 bf16, data in the cache": (["--zero_stage", "0", "--bf16", "--data_on_device", "cache"], BF16_REF,
                                             None),
    "epoch: zero0 bf16 recipe, data in the cache": (["--zero_stage", "0", "--bf16", "--data_on_device", "cache",
                                                     *RECIPE], BF16_REF, None),
}
# minutes of compiling, or measured for benchmarks/scaling.py only
SKIPPED_BY_DEFAULT = {"torch bf16 channels_last compile", "step: zero2 bf16 compile", "step: zero2 bf16 offload_optimizer",
                      FSDP2_REF, "step: zero3 bf16 half_weights",  # for several GPUs (--num_gpus)
                      "epoch: zero2 bf16 compile, data on GPU",
                      "epoch: zero0 bf16, data on GPU", "epoch: zero1 bf16, data on GPU",
                      *(name for name in REAL if name.startswith("epoch: zero0 bf16") and name.endswith(
                          ("DataLoader", "cache")) or "recipe" in name),
                      *(name for name in [*REFERENCES, *SYNTHETIC, *REAL] if "sync" in name.lower()),
                      *(name for name in [*SYNTHETIC, *REAL] if "offload" in name and name.startswith("step") or
                        name.endswith("DeepSpeed's methods"))}
# without src/deepspeed_image_trainer/engine/overrides.py's replacements (TRAINER_DEEPSPEED_OVERRIDES=0), to measure what they gain
DEEPSPEED_OWN_METHODS = {name for name in [*SYNTHETIC, *REAL] if name.endswith("DeepSpeed's methods")}


def plain_loop_case(flags, args):
    """benchmarks/plain_loop.py on the JPEG folder, one GPU, bf16; figures from the JSON it prints."""
    command = [sys.executable, str(ROOT / "benchmarks" / PLAIN_LOOP), "--data", str(args.data), "--model", args.model,
               "--epochs", str(args.epochs), "--batch_size", str(args.batch_size), "--image_size",
               str(args.image_size), "--num_workers", str(args.num_workers), "--precision", "bf16", *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout)
    if result.returncode != 0:
        raise RuntimeError((result.stdout + result.stderr)[-3000:])
    epochs = json.loads(result.stdout.strip().splitlines()[-1])["epochs"]
    later = epochs[1:] or epochs
    return {"command": shown(command), "images_per_s": statistics.median(e["images_per_s"] for e in later),
            "val_acc": epochs[-1]["val_acc"], "data_tier": "workers", "peak_gpu_memory_gib": None}


def drawing_command(args):
    """prepare_data.py drawing the JPEG folder of the real-data measurements into --data: --images_per_class a
    class, a fifth of them (at least one) for validation, 256 px."""
    val_per_class = max(1, args.images_per_class // 5)
    return [sys.executable, str(ROOT / "src" / "prepare_data.py"), "sample", "--output", str(args.data),
            "--num_classes", str(args.num_classes), "--train_per_class", str(args.images_per_class - val_per_class),
            "--val_per_class", str(val_per_class), "--image_size", "256", "--seed", "0"]


def best_epochs(epochs):
    """Whether each epoch's validation accuracy was the best so far (the trainer then saved best_model)."""
    best, flags = float("-inf"), []
    for epoch in epochs:
        flags.append(epoch["val_acc"] > best)
        best = max(best, epoch["val_acc"])
    return flags


def real_case(flags, args, workdir):
    """src/train_deepspeed.py end to end on the JPEG folder (one process, as `python` runs it, for one GPU;
    launch_deepspeed.py for several); figures from the history it writes."""
    if flags[0] == PLAIN_LOOP:
        return plain_loop_case(flags[1:], args)
    script = (["src/train_deepspeed.py"] if args.num_gpus == 1
              else ["launch_deepspeed.py", "--num_gpus", str(args.num_gpus)])
    command = [sys.executable, str(ROOT / script[0]), *script[1:],
               "--train_dir", str(args.data / "train"), "--val_dir", str(args.data / "val"),
               "--model", args.model, "--epochs", str(args.epochs), "--batch_size", str(args.batch_size),
               "--image_size", str(args.image_size), "--num_workers", str(args.num_workers),
               "--save_every", "0", "--save_last_every", "0",
               "--log_dir", str(workdir / "logs"), "--checkpoint_dir", str(workdir / "checkpoints"), *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout)
    if result.returncode != 0:
        raise RuntimeError((result.stdout + result.stderr)[-3000:])
    history = json.loads((workdir / "logs" / "training_history.json").read_text())
    later = history["epochs"][1:] or history["epochs"]
    # "decoded N images in S s", or with the decoded-image cache "read N decoded by an earlier run ... in S s"
    decoded = re.search(r"(?:decoded|read) \d+ [^\n]*? in ([\d.]+) s", result.stdout)
    return {"command": shown(command), "images_per_s": statistics.median(e["images_per_s"] for e in later),
            # each epoch's, and whether the one before it saved best_model (written in the background meanwhile)
            "images_per_s_per_epoch": [e["images_per_s"] for e in history["epochs"]],
            "after_a_best_save": [False] + best_epochs(history["epochs"])[:-1],
            "data_wait_share": statistics.median(e["data_wait_s"] / e["epoch_time_s"] for e in later),
            "peak_gpu_memory_gib": max(e["peak_gpu_memory_gib"] for e in later),
            "val_acc": history["epochs"][-1]["val_acc"], "decode_s": float(decoded[1]) if decoded else None,
            "precision": history["config"]["precision"], "data_on_device": history["config"]["data_on_device"],
            "data_tier": history["config"].get("data_tier")}


def run_case(kind, name, args):
    return run_case_of(__file__, kind, name, args)


def child(kind, name, args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke test only
    if name in DEEPSPEED_OWN_METHODS:
        os.environ["TRAINER_DEEPSPEED_OVERRIDES"] = "0"
    if kind == "reference":
        result = reference_case(REFERENCES[name], args, device)
    elif kind == "synthetic":
        profile = cProfile.Profile() if args.profile else None  # the host's time in --steps more steps
        result = trainer_case(SYNTHETIC[name][0], args, device, profile)
        if profile is not None and int(os.environ.get("RANK", "0")) == 0:
            write_profile(profile, args.output_dir / f"profile_{slug_of(args.model)}_{slug_of(name)}.txt")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = real_case(REAL[name][0], args, Path(tmp))
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)


def get_args_parser():
    parser = measurement_parser(__doc__)
    parser.add_argument("--images_per_class", type=int, default=60,
                        help="of the drawn dataset (80%% train, 20%% val); 60 x 90 classes is Animals-90's size")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these measurements (names as in the table, or: reference, synthetic, real)")
    parser.add_argument("--update", action="store_true",
                        help="keep the JSON's results of the measurements not run this time")
    return parser


def selected(args):
    groups = {"reference": REFERENCES, "synthetic": SYNTHETIC, "real": REAL}
    chosen = [(kind, name) for kind, group in groups.items() for name in group
              if name in (args.only or ()) or kind in (args.only or ()) or not args.only and name not in SKIPPED_BY_DEFAULT]
    unknown = set(args.only or ()) - set(groups) - {name for group in groups.values() for name in group}
    if unknown:
        sys.exit(f"error: unknown measurement(s): {', '.join(sorted(unknown))}")
    return chosen


def main():
    args = get_args_parser().parse_args()
    if args.case:
        return child(*json.loads(args.case), args)
    if not torch.cuda.is_available():
        print("warning: no CUDA GPU; running on the CPU as a smoke test, the figures mean nothing", flush=True)
    cases = selected(args)
    drawing = None
    if any(kind == "real" for kind, _ in cases):  # drawn on the CPU while the first measurements run
        drawing = subprocess.Popen(drawing_command(args), stdout=subprocess.DEVNULL)
    env = environment()
    slug = machine_slug(env)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / (f"throughput_{slug}.json" if args.model == "resnet18" else
                              f"throughput_{slug_of(args.model)}_{slug}.json")
    results, commands = earlier_results(path, env) if args.update else ({}, [])
    commands.append(env["command"])
    for kind, name in cases:
        if kind == "real" and drawing is not None and drawing.wait() != 0:
            sys.exit(f"error: drawing the sample dataset into {args.data} failed")
        started = time.perf_counter()
        results[name] = {"kind": kind, **run_case(kind, name, args), "wall_s": round(time.perf_counter() - started, 1),
                         "run": len(commands) - 1}
        if kind != "reference":
            reference, goal = {**SYNTHETIC, **REAL}[name][1:]
            results[name].update(reference=reference, goal_ratio=goal,
                                 reference_images_per_s=results.get(reference, {}).get("images_per_s"),
                                 ratio_to_reference=ratio(results, name, reference))
        print(f"{name}: {json.dumps(results[name])[:300]}", flush=True)
        settings = settings_of(args, leave_out=("case",))
        path.write_text(json.dumps({"environment": env, "settings": settings, "commands": commands, "results": results},
                                   indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | CUDA {env['cuda']} | "
          f"{args.model}, micro-batch {args.batch_size}, {args.image_size} px")
    width = max(46, *(len(name) + 1 for name in results))
    print(f"{'measurement':<{width}}{'images/s':>9}{'ratio':>7}{'goal':>6}{'peak GiB':>9}  notes")
    for name, r in results.items():
        if "error" in r:
            print(failed(name, r, width))
            continue
        notes = []
        if "data_wait_share" in r:
            notes.append(f"data wait {r['data_wait_share']:.0%}, val acc {r['val_acc']:.3f}")
        if r.get("reference"):
            notes.append(f"vs {r['reference']}")
        if len(commands) > 1:
            notes.append(f"run {r.get('run', 0) + 1} of {len(commands)}")
        print(f"{name:<{width}}{r['images_per_s']:>9.0f}{fmt(r.get('ratio_to_reference')):>7}{fmt(r.get('goal_ratio')):>6}"
              f"{fmt(r['peak_gpu_memory_gib']):>9}  {'; '.join(notes)}")
    print(f"results: {shown([str(path)])}")


if __name__ == "__main__":
    main()
