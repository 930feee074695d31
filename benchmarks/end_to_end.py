"""End-to-end epochs of the real trainer against a plain-PyTorch loop on the same data pipeline.

Both read the same JPEG image folder through the same transforms and DataLoader settings, train
ResNet18 (90 classes) with AdamW, and are timed per epoch in the same run on the same machine. The
trainer runs through launch_deepspeed.py exactly as a user would; its figures come from
logs/training_history.json (last epoch). Prints a table last and writes JSON to benchmarks/results/.

    python benchmarks/end_to_end.py --epochs 3 --num_workers 8
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from data import build_loaders, load_datasets  # noqa: E402
from prepare_data import make_sample_dataset  # noqa: E402
from common import environment, fmt, peak_memory, shown  # noqa: E402
from reproducibility import machine_slug  # noqa: E402

# name -> (launcher flags, the plain-PyTorch reference it is compared with)
TRAINER_VARIANTS = {
    "bf16": (["--bf16"], "torch-autocast-bf16"),
    "fp16": (["--fp16"], "torch-autocast-fp16"),
    "ds_config_zero2.json": (["--deepspeed_config", str(ROOT / "ds_config_zero2.json")], "torch-autocast-fp16"),
    "ds_config_zero3.json": (["--deepspeed_config", str(ROOT / "ds_config_zero3.json")], "torch-autocast-fp16"),
}
REFERENCE_DTYPES = {"torch-autocast-bf16": torch.bfloat16, "torch-autocast-fp16": torch.float16}


def reference_run(dtype, args, device):
    """Plain PyTorch: torchvision ResNet18, AdamW, torch.autocast (+ GradScaler for fp16)."""
    torch.manual_seed(0)
    train_set, val_set, _ = load_datasets(args.data / "train", args.data / "val", args.image_size)
    train_loader, _ = build_loaders(train_set, val_set, args.batch_size, args.num_workers, 0, 1, 0,
                                    pin_memory=device.type == "cuda")
    model = torchvision.models.resnet18(num_classes=len(train_set.classes)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.05)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    epochs = []
    for epoch in range(args.epochs):
        loader = train_loader.epoch(epoch)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start, seen = time.perf_counter(), 0
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype):
                loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            seen += labels.numel()
        loss.item()  # wait for the GPU before stopping the clock
        elapsed = time.perf_counter() - start
        epochs.append({"images_per_s": seen / elapsed, "peak_gpu_memory_gib": peak_memory(device)})
    return epochs[-1]




def trainer_run(flags, args, workdir):
    command = [sys.executable, str(ROOT / "launch_deepspeed.py"), "--num_gpus", str(args.num_gpus),
               "--train_dir", str(args.data / "train"), "--val_dir", str(args.data / "val"),
               "--epochs", str(args.epochs), "--batch_size", str(args.batch_size),
               "--num_workers", str(args.num_workers), "--image_size", str(args.image_size),
               "--learning_rate", str(args.learning_rate), "--save_every", "0",
               "--log_dir", str(workdir / "logs"), "--checkpoint_dir", str(workdir / "checkpoints"), *flags]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log = result.stdout + result.stderr
    (workdir / "output.log").write_text(log)
    if result.returncode != 0:
        return {"command": shown(command), "error": log[-2000:]}
    history = json.loads((workdir / "logs" / "training_history.json").read_text())
    last = history["epochs"][-1]
    return {"command": shown(command), "images_per_s": last["images_per_s"],
            "peak_gpu_memory_gib": last["peak_gpu_memory_gib"], "val_acc": last["val_acc"],
            "best_val_acc": history["best"]["val_acc"], "wall_s": wall,
            "loss_scale_overflows": len(re.findall(r"OVERFLOW", log))}






def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("bench_data"),
                        help="image folder; the sample dataset is drawn there if missing")
    parser.add_argument("--num_classes", type=int, default=90)
    parser.add_argument("--images_per_class", type=int, default=60, help="80%% train, 20%% val")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num_gpus", type=int, default=1, help="GPUs for the trainer; the reference uses one")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--num_workers", type=int, default=8)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--learning_rate", type=float, default=0.001)
    parser.add_argument("--variants", nargs="+", default=list(TRAINER_VARIANTS), choices=list(TRAINER_VARIANTS))
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()

    # By default the size of Animals-90 (90 classes x 60 images), drawn at 256 px.
    val_per_class = max(1, args.images_per_class // 5)
    make_sample_dataset(args.data, args.num_classes, args.images_per_class - val_per_class, val_per_class,
                        image_size=256, seed=0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    env = environment()
    references = {}
    for name in sorted({TRAINER_VARIANTS[v][1] for v in args.variants}):
        references[name] = reference_run(REFERENCE_DTYPES[name], args, device)
    trainer = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            workdir = Path(tmp) / re.sub(r"[^a-z0-9]+", "_", name)
            workdir.mkdir()
            flags, reference = TRAINER_VARIANTS[name]
            trainer[name] = {**trainer_run(flags, args, workdir), "reference": reference}
            if "images_per_s" in trainer[name]:
                trainer[name]["ratio_to_reference"] = (trainer[name]["images_per_s"]
                                                       / references[reference]["images_per_s"])

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {"environment": env, "settings": settings, "reference": references, "trainer": trainer}
    slug = machine_slug(env)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"end_to_end_{slug}_x{args.num_gpus}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | "
          f"trainer on {args.num_gpus} GPU(s), reference on 1 | micro-batch {args.batch_size} per GPU, "
          f"{args.image_size} px, {args.num_workers} workers per rank, last of {args.epochs} epochs")
    print(f"{'run':<34}{'images/s':>10}{'ratio':>8}{'peak GiB':>10}{'val acc':>9}")
    for name, r in references.items():
        print(f"{'reference ' + name:<34}{r['images_per_s']:>10.0f}{'1.00':>8}{fmt(r['peak_gpu_memory_gib']):>10}")
    for name, r in trainer.items():
        if "error" in r:
            print(f"{'trainer ' + name:<34} FAILED: {r['error'].strip().splitlines()[-1]}")
            continue
        print(f"{'trainer ' + name:<34}{r['images_per_s']:>10.0f}{r['ratio_to_reference']:>8.2f}"
              f"{fmt(r['peak_gpu_memory_gib']):>10}{r['val_acc']:>9.3f}   vs {r['reference']}")
    print(f"results: {path}")




if __name__ == "__main__":
    main()
