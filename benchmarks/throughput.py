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
import argparse
import cProfile
import io
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import earlier_results, environment, fmt, peak_memory, shown  # noqa: E402
from machine import machine_slug  # noqa: E402
from deepspeed_image_trainer.engine.distributed import run_on_free_port  # noqa: E402

# name -> settings of a plain-PyTorch loop on GPU-resident synthetic data
REFERENCES = {
    "torch fp32": {"dtype": None, "channels_last": False},
    "torch bf16 channels_last": {"dtype": "bf16", "channels_last": True},
    "torch fp16 channels_last": {"dtype": "fp16", "channels_last": True},
    "torch bf16 channels_last compile": {"dtype": "bf16", "channels_last": True, "compile": True},
}
BF16_REF, FP16_REF = "torch bf16 channels_last", "torch fp16 channels_last"
# name -> (trainer flags, reference, goal ratio from the GPU-speed issue or None)
SYNTHETIC = {
    "step: zero0 bf16": (["--zero_stage", "0", "--bf16"], BF16_REF, None),
    "step: zero1 bf16": (["--zero_stage", "1", "--bf16"], BF16_REF, None),
    "step: zero2 bf16": (["--zero_stage", "2", "--bf16"], BF16_REF, None),
    "step: zero3 bf16": (["--zero_stage", "3", "--bf16"], BF16_REF, None),
    "step: zero2 fp16": (["--zero_stage", "2", "--fp16"], FP16_REF, None),
    "step: zero2 bf16 half_weights": (["--zero_stage", "2", "--bf16", "--precision_mode", "half_weights"],
                                      BF16_REF, None),
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
    "epoch: zero2 bf16, DataLoader": (["--zero_stage", "2", "--bf16", "--data_on_device", "off"], BF16_REF, None),
    # the dataset memory-mapped from the decoded-image cache, batches copied to the GPU (data larger than it)
    "epoch: zero2 bf16, data in the cache": (["--zero_stage", "2", "--bf16", "--data_on_device", "cache"], BF16_REF,
                                             0.85),
    "epoch: zero2 bf16 compile, data on GPU": (["--zero_stage", "2", "--bf16", "--compile", "--data_on_device", "on"],
                                               BF16_REF, 0.9),
}
# minutes of compiling, or measured for benchmarks/scaling.py only
SKIPPED_BY_DEFAULT = {"torch bf16 channels_last compile", "step: zero2 bf16 compile", "step: zero2 bf16 offload_optimizer",
                      "epoch: zero2 bf16 compile, data on GPU",
                      "epoch: zero0 bf16, data on GPU", "epoch: zero1 bf16, data on GPU",
                      *(name for name in [*SYNTHETIC, *REAL] if "offload" in name and name.startswith("step") or
                        name.endswith("DeepSpeed's methods"))}
# without src/deepspeed_image_trainer/engine/overrides.py's replacements (TRAINER_DEEPSPEED_OVERRIDES=0), to measure what they gain
DEEPSPEED_OWN_METHODS = {name for name in [*SYNTHETIC, *REAL] if name.endswith("DeepSpeed's methods")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def synthetic_batch(args, device, dtype=torch.float32, channels_last=True):
    generator = torch.Generator(device).manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device, generator=generator)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), device=device, generator=generator)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return images.to(dtype, memory_format=memory_format), labels


def reference_case(settings, args, device):
    """Plain PyTorch: the loop a user writes by hand, timed like the trainer's epochs. Started by torchrun
    with several processes, it is plain DistributedDataParallel (NCCL), and images/s counts every rank."""
    import torch.distributed as dist
    import torch.nn.functional as F
    import torchvision

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        device = torch.device(device.type, int(os.environ["LOCAL_RANK"])) if device.type == "cuda" else device
        if device.type == "cuda":
            torch.cuda.set_device(device)
    dtype = DTYPES.get(settings["dtype"])
    from deepspeed_image_trainer.models.build import construction_args

    model = torchvision.models.get_model(args.model, num_classes=args.num_classes,
                                         **construction_args(args.model, args.image_size)).to(device)
    if settings["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    scaler = torch.amp.GradScaler(enabled=dtype == torch.float16)
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    forward = torch.compile(model) if settings.get("compile") else model
    images, labels = synthetic_batch(args, device, channels_last=settings["channels_last"])

    def steps(count):
        start = time.perf_counter()
        for _ in range(count):
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(forward(images), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        loss.item()
        return time.perf_counter() - start

    steps(args.warmup_steps)
    reset_peak_memory(device)
    return {"images_per_s": world_size * args.steps * args.batch_size / steps(args.steps),
            "peak_gpu_memory_gib": peak_memory(device)}


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def trainer_case(flags, args, device, profile=None):
    """The trainer's model, config and train_one_epoch on one synthetic batch, repeated; then, with a
    cProfile.Profile `profile`, the same steps again under it (not in the figures)."""
    import deepspeed

    from deepspeed_image_trainer.engine import overrides as deepspeed_overrides
    from deepspeed_image_trainer.cli import train as train_deepspeed
    from deepspeed_image_trainer.engine.distributed import init_distributed
    from deepspeed_image_trainer.engine.config import (build_ds_config, coalesces_grad_reduction, load_base_config,
                                                       precision)
    from deepspeed_image_trainer.models.build import build_model
    from deepspeed_image_trainer.cli.options import parse_args
    from deepspeed_image_trainer.engine.loop import input_dtype, train_one_epoch

    argv = ["--model", args.model, "--batch_size", str(args.batch_size), "--image_size", str(args.image_size), *flags]
    train_args = parse_args(train_deepspeed.get_args_parser, argv)
    _, world_size = init_distributed()
    device = torch.device(device.type, torch.cuda.current_device()) if device.type == "cuda" else device
    torch.backends.cudnn.benchmark = True
    images_per_epoch = args.batch_size * world_size * (args.warmup_steps + args.steps)
    model = build_model(args.model, args.num_classes, args.image_size)
    config = build_ds_config(train_args, world_size, images_per_epoch, base=load_base_config(train_args.deepspeed_config),
                             device_type=device.type, num_params=sum(p.numel() for p in model.parameters()))
    deepspeed_overrides.install()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if train_args.compile:
        engine.compile()
    dtype = input_dtype(precision(config))
    batch = synthetic_batch(args, device, dtype)
    coalesced = coalesces_grad_reduction(train_args.coalesce_grad_reduction, config)
    train_one_epoch(engine, [batch] * args.warmup_steps, 0, dtype, args.warmup_steps, coalesced=coalesced)
    reset_peak_memory(device)
    metrics = train_one_epoch(engine, [batch] * args.steps, 1, dtype, args.steps, coalesced=coalesced)
    if profile is not None:
        profile.runcall(train_one_epoch, engine, [batch] * args.steps, 2, dtype, args.steps, coalesced=coalesced)
    return {"images_per_s": metrics["images_per_s"], "precision": precision(config),
            "peak_gpu_memory_gib": peak_memory(device), "zero_optimization": config["zero_optimization"]}


def real_case(flags, args, workdir):
    """src/train_deepspeed.py end to end on the JPEG folder (one process, as `python` runs it, for one GPU;
    launch_deepspeed.py for several); figures from the history it writes."""
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
            "data_wait_share": statistics.median(e["data_wait_s"] / e["epoch_time_s"] for e in later),
            "peak_gpu_memory_gib": max(e["peak_gpu_memory_gib"] for e in later),
            "val_acc": history["epochs"][-1]["val_acc"], "decode_s": float(decoded[1]) if decoded else None,
            "precision": history["config"]["precision"], "data_on_device": history["config"]["data_on_device"],
            "data_tier": history["config"].get("data_tier")}


def run_case(kind, name, args):
    return run_case_of(__file__, kind, name, args)


def run_case_of(script, kind, name, args):
    """One measurement, `script --case`, in a child process (torchrun's, one per GPU, for several GPUs; the
    real-data runs start their own); returns its result dict or {"error": ...}."""
    def start(port):
        command = [sys.executable, script, "--case", json.dumps([kind, name]), *passed_settings(args)]
        if args.num_gpus > 1 and kind != "real":
            command[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(args.num_gpus),
                            "--master_port", str(port)]
        return subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout,
                              env={**os.environ, "MASTER_PORT": str(port)})

    try:
        result = run_on_free_port(start)
    except subprocess.TimeoutExpired:
        return {"error": f"over {args.case_timeout} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        # the tail of its output, with paths relative to the project and the import path, as in write_profile
        return {"error": relative_paths((result.stdout + result.stderr)[-3000:])}
    return json.loads(lines[-1][len("RESULT "):])


def write_profile(profile, path):
    """A cProfile.Profile's top 40 functions by their own time, then by their time with what they call, as
    text; file names as relative_paths gives them, not where this machine installed them."""
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40).sort_stats("cumulative").print_stats(40)
    path.write_text(relative_paths(text.getvalue()))


def relative_paths(text):
    """`text` with the import path's folders (a virtual environment's too, wherever it is) left out of its file
    names, then the project's: deepspeed/..., src/deepspeed_image_trainer/engine/loop.py."""
    project = {str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")}
    for folder in sorted({entry.rstrip("/") for entry in sys.path if entry} - project, key=len, reverse=True):
        text = text.replace(folder + "/", "")
    return text.replace(f"{ROOT}/", "")


def slug_of(name):
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


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
            write_profile(profile, args.output_dir / f"profile_{args.model}_{slug_of(name)}.txt")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = real_case(REAL[name][0], args, Path(tmp))
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)


def failed(name, result, width):
    """A table line for a measurement that failed: the last line of its error."""
    error = result["error"].strip()
    return f"{name:<{width}} FAILED: {error.splitlines()[-1][:80] if error else '?'}"


def passed_settings(args):
    return ["--model", args.model, "--batch_size", str(args.batch_size), "--image_size", str(args.image_size),
            "--num_classes", str(args.num_classes),
            "--steps", str(args.steps), "--warmup_steps", str(args.warmup_steps), "--epochs", str(args.epochs),
            "--num_workers", str(args.num_workers), "--data", str(args.data), "--num_gpus", str(args.num_gpus),
            "--case_timeout", str(args.case_timeout), "--output_dir", str(args.output_dir),
            *(["--profile"] if args.profile else [])]


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="a torchvision classifier (as the trainer's --model)")
    parser.add_argument("--batch_size", type=int, default=256, help="micro-batch, for every loop")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--num_classes", type=int, default=90)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per synthetic measurement")
    parser.add_argument("--warmup_steps", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=4, help="epochs per real-data run (the first is not counted)")
    parser.add_argument("--num_workers", type=int, default=12, help="DataLoader workers for the DataLoader run")
    parser.add_argument("--num_gpus", type=int, default=1,
                        help="GPUs for every measurement (the reference then runs as DistributedDataParallel)")
    parser.add_argument("--data", type=Path, default=ROOT / "bench_data",
                        help="JPEG image folder for the real-data runs; drawn there (Animals-90 size) if missing")
    parser.add_argument("--images_per_class", type=int, default=60,
                        help="of the drawn dataset (80%% train, 20%% val); 60 x 90 classes is Animals-90's size")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these measurements (names as in the table, or: reference, synthetic, real)")
    parser.add_argument("--update", action="store_true",
                        help="keep the JSON's results of the measurements not run this time")
    parser.add_argument("--case_timeout", type=int, default=240, help="seconds before one measurement is given up")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--profile", action="store_true",
                        help="also write each trainer step measurement's host profile of --steps more steps (cProfile, "
                             "top 40 by own time) to profile_<model>_<measurement>.txt beside the JSON")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    return parser


def selected(args):
    groups = {"reference": REFERENCES, "synthetic": SYNTHETIC, "real": REAL}
    chosen = [(kind, name) for kind, group in groups.items() for name in group
              if name in (args.only or ()) or kind in (args.only or ()) or not args.only and name not in SKIPPED_BY_DEFAULT]
    unknown = set(args.only or ()) - set(groups) - {name for group in groups.values() for name in group}
    if unknown:
        sys.exit(f"error: unknown measurement(s): {', '.join(sorted(unknown))}")
    return chosen


def ratio(results, name, reference):
    ran, ref = results.get(name, {}), results.get(reference, {})
    if "images_per_s" in ran and "images_per_s" in ref:
        return ran["images_per_s"] / ref["images_per_s"]
    return None


def main():
    args = get_args_parser().parse_args()
    if args.case:
        return child(*json.loads(args.case), args)
    if not torch.cuda.is_available():
        print("warning: no CUDA GPU; running on the CPU as a smoke test, the figures mean nothing", flush=True)
    cases = selected(args)
    drawing = None
    if any(kind == "real" for kind, _ in cases):  # drawn on the CPU while the first measurements run
        val_per_class = max(1, args.images_per_class // 5)
        drawing = subprocess.Popen([sys.executable, str(ROOT / "src" / "prepare_data.py"), "sample",
                                    "--output", str(args.data), "--num_classes", str(args.num_classes),
                                    "--train_per_class", str(args.images_per_class - val_per_class),
                                    "--val_per_class", str(val_per_class), "--image_size", "256", "--seed", "0"],
                                   stdout=subprocess.DEVNULL)
    env = environment()
    slug = machine_slug(env)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / (f"throughput_{slug}.json" if args.model == "resnet18" else
                              f"throughput_{args.model}_{slug}.json")
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
        settings = {k: os.path.relpath(v, ROOT) if isinstance(v, Path) else v for k, v in vars(args).items()
                    if k != "case"}
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
