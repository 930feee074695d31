"""What a checkpoint costs the training loop, with DeepSpeed's checkpoint engines and the trainer's own.

Each engine runs in a process of its own: the trainer's model and DeepSpeed config (ZeRO-2, the flags
below) on synthetic GPU-resident batches. After warm-up steps it times, several times over, a checkpoint
(`engine.save_checkpoint`) and the training steps after it, against the same number of steps without
one: what the loop loses per checkpoint is the call itself plus what the steps after it are slowed by
(a write that finishes during them, or a commit that waits for one), and the time until the files are
complete is reported beside it. Engines:

- torch: DeepSpeed's default (TorchCheckpointEngine, torch.save in the call);
- decoupled: DeepSpeed's DecoupledCheckpointEngine (`"checkpoint": {"writer": {"decoupled": true}}`,
  python writer): a process of its own writes, and the next optimizer step commits (waits for) it;
- fast: DeepSpeed's FastCheckpointEngine (`"writer": {"type": "fast"}`, its async I/O op);
- background: the trainer's BackgroundCheckpointEngine (a copy to host memory, torch.save on a thread).

Prints a table last and writes JSON to benchmarks/results/checkpoint_engines_<machine>.json.

    python benchmarks/checkpoint_engines.py --batch_size 256 --bf16
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

from common import ROOT, environment, shown
from deepspeed_image_trainer.engine.distributed import free_port
from machine import machine_slug

WRITERS = {
    "torch": None,
    "decoupled": {"type": "python", "decoupled": True, "data_parallel": "replica"},
    "fast": {"type": "fast", "decoupled": False, "data_parallel": "replica"},
    "background": None,
}


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name, args):
    """In this process: the per-checkpoint cost of one engine, as a dict."""
    import torch
    import torch.nn.functional as F

    from deepspeed_image_trainer.engine.distributed import init_distributed
    from deepspeed_image_trainer.utils.loading import load_checked
    from deepspeed_image_trainer.engine.config import build_ds_config
    from deepspeed_image_trainer.models.build import ResNet18Animals90
    from deepspeed_image_trainer.cli.options import add_training_args, parse_args

    init_distributed()
    import deepspeed

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flags = ["--batch_size", str(args.batch_size), "--zero_stage", "2", *(["--bf16"] if args.bf16 else [])]
    options = parse_args(lambda: add_training_args(argparse.ArgumentParser()), flags)
    model = ResNet18Animals90(num_classes=90)
    config = build_ds_config(options, 1, 100_000, device_type=device.type,
                             num_params=sum(p.numel() for p in model.parameters()))
    if WRITERS[name]:
        config["checkpoint"] = {"writer": WRITERS[name]}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if name == "background":
        from deepspeed_image_trainer.outputs.checkpoint_engine import BackgroundCheckpointEngine

        engine.checkpoint_engine = BackgroundCheckpointEngine()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device).to(
        dtype=dtype, memory_format=memory_format)
    labels = torch.randint(0, 90, (args.batch_size,), device=device)

    def steps(count):
        sync(device)
        started = time.perf_counter()
        for _ in range(count):
            loss = F.cross_entropy(engine(images).float(), labels)
            engine.backward(loss)
            engine.step()
        sync(device)
        return time.perf_counter() - started

    steps(args.warmup_steps)
    folder = Path(tempfile.mkdtemp())
    without, calls, after, complete = [], [], [], []
    for repeat in range(args.repeats):
        without.append(steps(args.steps_after))
        sync(device)
        expected = {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()}
        started = time.perf_counter()
        engine.save_checkpoint(str(folder), tag=f"r{repeat}")
        sync(device)
        calls.append(time.perf_counter() - started)
        after.append(steps(args.steps_after))
        if name == "background":
            engine.checkpoint_engine.wait()
        complete.append(time.perf_counter() - started)
    files = list((folder / f"r{args.repeats - 1}").glob("*.pt"))
    saved = load_checked(folder / f"r{args.repeats - 1}" / "mp_rank_00_model_states.pt")["module"]
    # the file holds the weights as they were at the call, not as the steps after it left them
    matches = saved.keys() == expected.keys() and all(torch.equal(saved[k].cpu(), expected[k]) for k in expected)
    cost = [c + a - w for c, a, w in zip(calls, after, without)]
    return {"save_call_s": statistics.median(calls), "cost_per_checkpoint_s": statistics.median(cost),
            "files_complete_after_s": statistics.median(complete),
            "step_s": statistics.median(without) / args.steps_after,
            "checkpoint_mib": sum(f.stat().st_size for f in files) / 2**20, "files": len(files),
            "model_file_holds_the_state_at_the_call": matches}


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(WRITERS), choices=list(WRITERS))
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--warmup_steps", type=int, default=20)
    parser.add_argument("--steps_after", type=int, default=10, help="steps timed after each checkpoint")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    return parser


def main():
    args = get_args_parser().parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, args)), flush=True)
        return 0

    env = environment()
    results = {}
    for name in args.engines:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", name,
                   *[part for key in ("batch_size", "image_size", "warmup_steps", "steps_after", "repeats")
                     for part in (f"--{key}", str(getattr(args, key)))], *(["--bf16"] if args.bf16 else [])]
        # What DeepSpeed's launcher sets for a rank (its data-parallel writers read the node layout from it).
        child_env = {**os.environ, "MASTER_PORT": str(free_port()), "CROSS_RANK": "0", "CROSS_SIZE": "1",
                     "LOCAL_SIZE": "1"}
        result = subprocess.run(command, capture_output=True, text=True, env=child_env)
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        results[name] = ({"command": shown(command), **json.loads(lines[-1][7:])} if lines else
                         {"command": shown(command), "error": (result.stdout + result.stderr)[-2000:]})
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"checkpoint_engines_{machine_slug(env)}.json"
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "output_dir")}
    path.write_text(json.dumps({"environment": env, "settings": settings, "results": results}, indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | ResNet18, ZeRO-2, "
          f"micro-batch {args.batch_size}, {'bf16' if args.bf16 else 'fp32'}; medians of {args.repeats}")
    print(f"{'engine':<12}{'step s':>8}{'save call s':>13}{'cost / ckpt s':>15}{'files done s':>14}{'MiB':>7}"
          f"{'state as at the call':>22}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<12} FAILED: {r['error'].strip().splitlines()[-1][:100]}")
            continue
        print(f"{name:<12}{r['step_s']:>8.3f}{r['save_call_s']:>13.3f}{r['cost_per_checkpoint_s']:>15.3f}"
              f"{r['files_complete_after_s']:>14.3f}{r['checkpoint_mib']:>7.0f}"
              f"{str(r['model_file_holds_the_state_at_the_call']):>22}")
    print(f"results: {shown([str(path)])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
