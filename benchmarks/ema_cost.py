"""What --model_ema costs a training step, and what evaluate.py --tta flip costs an evaluation, on one GPU.

- EMA: the trainer's step (its model, DeepSpeed config and train_one_epoch on one GPU-resident synthetic batch,
  as throughput.py times it) without the weights' average, with it updated every 32 steps (torchvision's
  default) and every step, at ZeRO-2 bf16 and at ZeRO-3 bf16 with the optimizer offloaded (the average then in
  host memory). Each run in a process of its own, the variants of a stage in turn --repeat times; the lower median
  of images/s is kept. Each run with the average also times one update and one swap in and out (validation's).
  The reference: one update of torch.optim.swa_utils.AveragedModel with get_ema_multi_avg_fn (what torchvision's
  reference script's ExponentialMovingAverage is) over the same model held whole in fp32 on the GPU.
- TTA: a model trained one epoch by the trainer, then `evaluate.py` on a folder of --val_images images with and
  without --tta flip, in turn --repeat times; the median wall time of each.

Prints a table last and writes JSON to benchmarks/results/ema_cost/ema_cost_<model>_<gpu>.json.

    python benchmarks/ema_cost.py                          # ResNet50, micro-batch 256, 224 px
    python benchmarks/ema_cost.py --model resnet18 --steps 40 --repeat 1
"""
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import (ROOT, earlier_results, environment, fmt, measurement_parser, run_case_of, settings_of, shown,
                    trainer_case)
from machine import machine_slug

STAGES = {"zero2 bf16": ["--zero_stage", "2", "--bf16"],
          "zero3 bf16 offload_optimizer": ["--zero_stage", "3", "--bf16", "--offload_optimizer"]}
VARIANTS = {"no average": [], "average every 32 steps": ["--model_ema"],
            "average every step": ["--model_ema", "--model_ema_steps", "1"]}


def get_args_parser():
    parser = measurement_parser(__doc__)
    parser.set_defaults(model="resnet50", steps=64, warmup_steps=10)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each variant, in turn")
    parser.add_argument("--val_images", type=int, default=3600, help="images evaluated with and without --tta flip")
    parser.add_argument("--only", nargs="+", choices=[*STAGES, "tta"], default=[*STAGES, "tta"],
                        help="the stages (each with the reference) and the evaluation to measure")
    parser.add_argument("--update", action="store_true",
                        help="keep the JSON's other measurements (same GPU and versions)")
    return parser


def reference_update(args, device):
    """ms of one AveragedModel EMA update over the model whole in fp32 (median of 10)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from deepspeed_image_trainer.models.build import build_model

    model = build_model(args.model, args.num_classes, args.image_size).to(device)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
    times = []
    for _ in range(11):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        averaged.update_parameters(model)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1000)
    return {"update_ms": statistics.median(times[1:]), "params": sum(p.numel() for p in model.parameters())}


def child(kind, name, args):
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if kind == "reference":
        result = reference_update(args, device)
    else:
        stage, variant = name.split(": ")
        result = trainer_case(STAGES[stage] + VARIANTS[variant], args, device)
    print("RESULT " + json.dumps(result), flush=True)


def tta_cost(args):
    """Median wall seconds of evaluate.py with and without --tta flip on --val_images images."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        drawn = [sys.executable, str(ROOT / "src/prepare_data.py"), "sample", "--output", str(data), "--num_classes",
                 str(args.num_classes), "--train_per_class", "2", "--val_per_class",
                 str(args.val_images // args.num_classes), "--image_size", "128"]
        subprocess.run(drawn, check=True, stdout=subprocess.DEVNULL)
        trained = subprocess.run([sys.executable, str(ROOT / "launch_deepspeed.py"), "--train_dir", str(data / "train"),
                        "--val_dir", str(data / "val"), "--epochs", "1", "--model", args.model, "--image_size",
                        str(args.image_size), "--batch_size", "32", "--bf16", "--checkpoint_dir", f"{tmp}/ck",
                        "--log_dir", f"{tmp}/logs"], capture_output=True, text=True)
        if trained.returncode != 0:
            return {"error": (trained.stdout + trained.stderr)[-2000:]}
        subprocess.run([sys.executable, str(ROOT / "src/export_model.py"), f"{tmp}/ck/last", "--output",
                        f"{tmp}/model.pt"], check=True, capture_output=True)
        walls = {"plain": [], "tta flip": []}
        reports = {}
        for _ in range(args.repeat):
            for variant, extra in (("plain", []), ("tta flip", ["--tta", "flip"])):
                command = [sys.executable, str(ROOT / "src/evaluate.py"), "--model", f"{tmp}/model.pt", "--data_dir",
                           str(data / "val"), "--output_dir", f"{tmp}/eval", "--num_workers", "8", *extra]
                started = time.perf_counter()
                subprocess.run(command, check=True, capture_output=True)
                walls[variant].append(time.perf_counter() - started)
                reports[variant] = json.loads(Path(tmp, "eval", "report.json").read_text())
    return {"images": reports["plain"]["images"], "decode": reports["plain"]["decode"],
            "wall_s": {variant: statistics.median(values) for variant, values in walls.items()},
            "runs_s": walls, "tta_gain_top1": reports["tta flip"]["tta_gain"]["top1"],
            "command": shown(command)}


def main():
    args = get_args_parser().parse_args()
    if args.case:
        return child(*json.loads(args.case), args)
    env = environment()
    out_dir = args.output_dir / "ema_cost"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"ema_cost_{args.model}_{machine_slug(env)}.json"
    results, commands = earlier_results(path, env) if args.update else ({}, [])
    commands.append(env["command"])
    results["reference"] = run_case_of(__file__, "reference", "AveragedModel", args)
    for stage in [name for name in STAGES if name in args.only]:
        runs = {variant: [] for variant in VARIANTS}
        for turn in range(args.repeat):  # each variant first in turn: offloaded runs showed an order effect
            names = list(VARIANTS)
            for variant in names[turn % len(names):] + names[:turn % len(names)]:
                runs[variant].append(run_case_of(__file__, "trainer", f"{stage}: {variant}", args))
        for variant, measured in runs.items():
            errors = [r for r in measured if "error" in r]
            if errors:
                results[f"{stage}: {variant}"] = errors[0]
                continue
            speeds = sorted(r["images_per_s"] for r in measured)
            results[f"{stage}: {variant}"] = {
                "images_per_s": speeds[(len(speeds) - 1) // 2], "runs_images_per_s": speeds,
                "peak_gpu_memory_gib": max(r["peak_gpu_memory_gib"] or 0 for r in measured),
                "ema": measured[0].get("ema"), "zero_optimization": measured[0]["zero_optimization"]}
        base = results[f"{stage}: no average"].get("images_per_s")
        for variant in VARIANTS:
            row = results[f"{stage}: {variant}"]
            if base and "images_per_s" in row:
                row["step_cost"] = base / row["images_per_s"] - 1  # the step's added time, as a share of it
    if "tta" in args.only:
        results["tta"] = tta_cost(args)
    path.write_text(json.dumps({"environment": env, "settings": settings_of(args, leave_out=("case", "only", "update")),
                                "commands": commands, "results": results}, indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | {args.model}, "
          f"micro-batch {args.batch_size}, {args.image_size} px")
    print(f"{'measurement':<50}{'images/s':>9}{'cost':>8}{'update ms':>11}{'swap ms':>9}")
    reference = results["reference"]
    print(f"{'AveragedModel (torchvision reference), one update':<50}{'':>9}{'':>8}"
          f"{fmt(reference.get('update_ms')):>11}")
    for name, r in results.items():
        if name in ("reference", "tta"):
            continue
        if "error" in r:
            print(f"{name:<50} FAILED: {r['error'].strip().splitlines()[-1][:80]}")
            continue
        ema = r.get("ema") or {}
        cost = f"{r['step_cost']:+.1%}" if "step_cost" in r else "-"
        print(f"{name:<50}{r['images_per_s']:>9.0f}{cost:>8}{fmt(ema.get('update_ms')):>11}"
              f"{fmt(ema.get('swap_ms')):>9}")
    tta = results.get("tta", {"error": "not measured"})
    if "error" in tta:
        print(f"evaluate --tta flip FAILED: {tta['error'].strip().splitlines()[-1][:80]}")
    else:
        print(f"evaluate.py on {tta['images']} images ({tta['decode']} decode): {tta['wall_s']['plain']:.1f} s, "
              f"with --tta flip {tta['wall_s']['tta flip']:.1f} s")
    print(f"results: {shown([str(path)])}")


if __name__ == "__main__":
    main()
