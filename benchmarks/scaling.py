"""Scaling from 1 to N GPUs of one host, in one run: plain PyTorch DDP as the reference, the trainer's step
per ZeRO stage and with optimizer offload, end-to-end epochs with the dataset on the GPU, and whether N
GPUs reach the validation accuracy of one GPU at the same global batch.

Every measurement is throughput.py's (same loops, same settings, each in its own processes), run once
with 1 GPU and once with N; speed-up = images/s on N GPUs / images/s on 1 GPU (micro-batch per GPU fixed),
efficiency = speed-up / N. Prints a table last and writes JSON to benchmarks/results/scaling_<gpu>_x<N>.json.

    python benchmarks/scaling.py                      # 1 and 2 GPUs
    python benchmarks/scaling.py --only accuracy
"""
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import throughput  # noqa: E402
from common import environment, fmt, shown  # noqa: E402
from reproducibility import machine_slug  # noqa: E402

DDP = "torch bf16 channels_last"  # as DistributedDataParallel when run on several GPUs
MEASUREMENTS = [("reference", DDP)] + [("synthetic", f"step: zero{stage} bf16") for stage in range(4)] + [
    ("synthetic", "step: zero2 bf16 offload_optimizer")] + [
    ("real", f"epoch: zero{stage} bf16, data on GPU") for stage in range(3)]
GOALS = {f"epoch: zero{stage} bf16, data on GPU": 1.9 for stage in range(3)}  # speed-up on 2 GPUs
# Same global batch on 1 and N GPUs: the micro-batch is divided by N; with and without --sync_bn.
ACCURACY = {"accuracy: 1 GPU": (1, []), "accuracy: N GPUs": (None, []), "accuracy: N GPUs --sync_bn": (None, ["--sync_bn"])}


def accuracy_run(num_gpus, flags, args):
    """launch_deepspeed.py on the built-in sample dataset; best and last validation accuracy."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        command = [sys.executable, str(ROOT / "launch_deepspeed.py"), "--num_gpus", str(num_gpus),
                   "--train_dir", str(args.sample_data / "train"), "--val_dir", str(args.sample_data / "val"),
                   "--epochs", str(args.accuracy_epochs), "--batch_size", str(args.accuracy_batch // num_gpus),
                   "--image_size", "96", "--bf16", "--zero_stage", "2", "--data_on_device", "on",
                   "--save_every", "0", "--save_last_every", "0",
                   "--log_dir", str(tmp / "logs"), "--checkpoint_dir", str(tmp / "checkpoints"), *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout)
        if result.returncode != 0:
            return {"error": (result.stdout + result.stderr)[-3000:]}
        history = json.loads((tmp / "logs" / "training_history.json").read_text())
    return {"command": shown(command), "num_gpus": num_gpus, "global_batch": args.accuracy_batch,
            "best_val_acc": history["best"]["val_acc"], "last_val_acc": history["epochs"][-1]["val_acc"],
            "val_images": history["epochs"][-1]["val_images"],
            "val_acc_per_epoch": [epoch["val_acc"] for epoch in history["epochs"]],
            "val_loss_per_epoch": [epoch["val_loss"] for epoch in history["epochs"]]}


def get_args_parser():
    parser = throughput.get_args_parser()
    parser.description = __doc__
    parser.set_defaults(output_dir=ROOT / "benchmarks" / "results")
    parser.add_argument("--max_gpus", type=int, default=2, help="N: the largest GPU count measured")
    parser.add_argument("--sample_data", type=Path, default=ROOT / "sample_data",
                        help="the built-in sample dataset for the accuracy runs; drawn there if missing")
    parser.add_argument("--accuracy_epochs", type=int, default=30)
    parser.add_argument("--accuracy_batch", type=int, default=128, help="global batch of the accuracy runs")
    return parser


def main():
    args = get_args_parser().parse_args()
    only = set(args.only or ())
    chosen = [(kind, name) for kind, name in MEASUREMENTS if not only or name in only or kind in only]
    accuracy = [name for name in ACCURACY if not only or name in only or "accuracy" in only]
    if chosen and not (args.data / "train").is_dir():
        subprocess.run([sys.executable, str(ROOT / "src" / "prepare_data.py"), "sample", "--output", str(args.data),
                        "--num_classes", str(args.num_classes), "--train_per_class", "48", "--val_per_class", "12",
                        "--image_size", "256", "--seed", "0"], check=True, stdout=subprocess.DEVNULL)
    if accuracy:
        subprocess.run([sys.executable, str(ROOT / "src" / "prepare_data.py"), "sample", "--output",
                        str(args.sample_data)], check=True, stdout=subprocess.DEVNULL)
    env = environment()
    slug = machine_slug(env)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"scaling_{slug}_x{args.max_gpus}.json"
    gpu_counts = [1, args.max_gpus]
    results = {}

    def save():
        settings = {k: (str(v.relative_to(ROOT)) if v.is_relative_to(ROOT) else str(v)) if isinstance(v, Path)
                    else v for k, v in vars(args).items() if k != "case"}
        path.write_text(json.dumps({"environment": env, "settings": settings, "results": results}, indent=2) + "\n")

    for kind, name in chosen:
        results[name] = {"kind": kind}
        for num_gpus in gpu_counts:
            args.num_gpus = num_gpus
            started = time.perf_counter()
            measured = throughput.run_case(kind, name, args)
            results[name][f"{num_gpus}_gpu"] = {**measured, "wall_s": round(time.perf_counter() - started, 1)}
            print(f"{name} on {num_gpus} GPU(s): {json.dumps(measured)[:300]}", flush=True)
        one, many = (results[name][f"{n}_gpu"].get("images_per_s") for n in gpu_counts)
        if one and many:
            results[name].update(speedup=many / one, efficiency=many / one / args.max_gpus, goal=GOALS.get(name))
        save()
    for name in accuracy:
        num_gpus, flags = ACCURACY[name]
        results[name] = {"kind": "accuracy", **accuracy_run(num_gpus or args.max_gpus, flags, args)}
        print(f"{name}: {json.dumps(results[name])[:300]}", flush=True)
        save()

    ddp = results.get(DDP, {}).get("speedup")
    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | CUDA {env['cuda']} | "
          f"micro-batch {args.batch_size} per GPU, {args.image_size} px")
    print(f"{'measurement':<40}{'1 GPU':>9}{f'{args.max_gpus} GPUs':>9}{'speed-up':>9}{'eff.':>6}{'goal':>6}"
          f"{'vs DDP':>7}{'peak GiB':>9}")
    for name, r in results.items():
        if r["kind"] == "accuracy":
            line = (f"best val acc {r['best_val_acc']:.3f}, last {r['last_val_acc']:.3f}, "
                    f"last val loss {r['val_loss_per_epoch'][-1]:.3f}"
                    if "error" not in r else "FAILED: " + r["error"].strip().splitlines()[-1][:80])
            print(f"{name:<40}{line}")
            continue
        one, many = (r[f"{n}_gpu"] for n in gpu_counts)
        if "error" in one or "error" in many:
            failed = one if "error" in one else many
            print(f"{name:<40} FAILED: {failed['error'].strip().splitlines()[-1][:80] if failed['error'].strip() else '?'}")
            continue
        print(f"{name:<40}{one['images_per_s']:>9.0f}{many['images_per_s']:>9.0f}{fmt(r.get('speedup')):>9}"
              f"{fmt(r.get('efficiency')):>6}{fmt(r.get('goal')):>6}"
              f"{fmt(r['speedup'] / ddp if ddp and r.get('speedup') else None):>7}{fmt(many['peak_gpu_memory_gib']):>9}")
    print(f"results: {shown([str(path)])}")


if __name__ == "__main__":
    main()
