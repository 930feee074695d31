"""A fine-tune as a user runs it, end to end, timed: launch_deepspeed.py on the sample data drawn at Animals-90's
layout (90 classes), one epoch, then export_model.py to one safetensors file and evaluate.py on it. For the giant
models issue 39 is about, where what matters is that the run fits, how fast it trains, and that its export
reproduces what it validated.

    python benchmarks/finetune_run.py --model timm:vit_7b_patch16_dinov3 --batch_size 32 -- \\
        --zero_stage 3 --grad_checkpointing --precision_mode half_weights --bf16

Flags after `--` go to launch_deepspeed.py as they are. Writes benchmarks/results/timm/finetune_<model>_<gpu>.json:
the epoch's figures from the training history (images/s, peak GPU memory, the seconds of each part), the first
step's startup line, the export's size and evaluate.py's report, the model's training FLOPs per image (3 forward
passes' worth, counted by torch's FlopCounterMode on the meta device) and what that makes per GPU.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, environment, slug_of
from machine import machine_slug


REPORTED = ("images", "loss", "top1", "top5", "decode", "device")  # of evaluate.py's report


def training_flops_per_image(model, image_size, num_classes):
    """3x the forward pass's FLOPs (forward, and the backward's two), recomputation under checkpointing not counted."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from deepspeed_image_trainer.models.build import shape_model

    with torch.device("meta"):
        net = shape_model(model, num_classes, image_size)
        with FlopCounterMode(display=False) as counter:
            net(torch.zeros(1, 3, image_size, image_size))
    return 3 * counter.get_total_flops()


def run(command, log, timeout):
    started = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
    return code, round(time.perf_counter() - started, 1)


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch_size", type=int, required=True, help="micro-batch per GPU")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--num_gpus", type=int, default=None, help="default: every GPU")
    parser.add_argument("--train_per_class", type=int, default=36, help="sample images per class to train on")
    parser.add_argument("--work_dir", type=Path, default=None, help="where the data, checkpoints and export go "
                        "(a 7 B model's checkpoint is about 80 GB, its export 27 GB; default: a temporary folder)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds for each of the three commands")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results" / "timm")
    parser.add_argument("launch_flags", nargs="*", help="after --: more flags for launch_deepspeed.py")
    return parser


def main():
    args = get_args_parser().parse_args()
    import torch

    gpus = args.num_gpus or max(torch.cuda.device_count(), 1)
    env = environment()
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        data, logs, checkpoints, exported = work / "data", work / "logs", work / "ck", work / "model.safetensors"
        subprocess.run([sys.executable, "src/prepare_data.py", "sample", "--output", str(data), "--train_per_class",
                        str(args.train_per_class)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        launch = [sys.executable, "launch_deepspeed.py", "--num_gpus", str(gpus), "--model", args.model,
                  "--image_size", str(args.image_size), "--batch_size", str(args.batch_size), "--epochs", "1",
                  "--save_every", "0", "--train_dir", str(data / "train"), "--val_dir", str(data / "val"),
                  "--log_dir", str(logs), "--checkpoint_dir", str(checkpoints), *args.launch_flags]
        result = {"launch_flags": launch[2:], "num_gpus": gpus}
        result["train_status"], result["train_s"] = run(launch, work / "train.log", args.timeout)
        text = (work / "train.log").read_text(errors="replace")
        result["startup"] = next((line for line in text.splitlines() if line.startswith("First optimizer step")), None)
        if result["train_status"] == 0:
            history = json.loads((logs / "training_history.json").read_text())
            result["epoch"] = history["epochs"][-1]
            result["checkpoint_gb"] = round(sum(f.stat().st_size for f in checkpoints.rglob("*") if f.is_file()
                                                and not f.is_symlink()) / 1e9, 1)
            result["export_status"], result["export_s"] = run(
                [sys.executable, "src/export_model.py", str(checkpoints / "last"), "--output", str(exported)],
                work / "export.log", args.timeout)
            if result["export_status"] == 0:
                result["export_gb"] = round(exported.stat().st_size / 1e9, 1)
                # room on the disk for what evaluate reads, and nothing more to read from it
                subprocess.run(["rm", "-rf", str(checkpoints)], check=True)
                result["evaluate_status"], result["evaluate_s"] = run(
                    [sys.executable, "src/evaluate.py", "--model", str(exported), "--data_dir", str(data / "val"),
                     "--output_dir", str(work / "eval")], work / "evaluate.log", args.timeout)
                if result["evaluate_status"] == 0:
                    report = json.loads((work / "eval" / "report.json").read_text())
                    result["evaluate"] = {key: report.get(key) for key in REPORTED}
        else:
            result["train_log_tail"] = text[-3000:]
    flops = training_flops_per_image(args.model, args.image_size, 90)
    result["training_tflop_per_image"] = flops / 1e12
    if "epoch" in result:
        result["tflops_per_gpu"] = flops * result["epoch"]["images_per_s"] / gpus / 1e12
    path = args.output_dir / f"finetune_{slug_of(args.model)}_{machine_slug(env)}{f'_x{gpus}' if gpus > 1 else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": env, "settings": {k: str(v) if isinstance(v, Path) else v
                                                                 for k, v in vars(args).items()},
                                "result": result}, indent=2) + "\n")
    print(json.dumps(result)[:2000])
    print(f"results: {path}")


if __name__ == "__main__":
    main()
