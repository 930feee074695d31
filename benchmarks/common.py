"""What every benchmark shares: the machine and versions behind a measurement, the command as a user
would type it, the earlier results an --update run adds to, and the measurements several scripts take
(the plain-PyTorch reference loop, the trainer's step on a synthetic batch, each in a child process).

The benchmarks are one unit: each script imports this module before the trainer's package, and this is
the one place that puts src/ on the import path (a clone runs them without installing the package);
plain_loop.py alone, the reference a user would write, does it itself."""
import argparse
import hashlib
import io
import itertools
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# this folder before src/, whose memory_profile.py only forwards to this folder's
sys.path[:] = [str(ROOT / "benchmarks"), str(ROOT / "src"),
               *(entry for entry in sys.path if entry not in (str(ROOT / "benchmarks"), str(ROOT / "src")))]

from machine import environment as run_environment, shown  # noqa: E402,F401 (shown: for the benchmarks)

# The keys of the environment that must match for measurements to share one JSON.
MACHINE = ("gpu", "torch", "torchvision", "deepspeed", "cuda")


def environment():
    return run_environment(shown([sys.executable, *sys.argv]))


def earlier_results(path, env, args=None, settings=()):
    """(results, commands) of the JSON at `path` for --update; refused if another GPU or versions measured it,
    or other values of `args`' `settings` (the flags every row of the JSON must share)."""
    if not path.exists():
        return {}, []
    earlier = json.loads(path.read_text())
    differs = [key for key in MACHINE if earlier["environment"].get(key) != env.get(key)]
    differs += [f"--{key}" for key in settings if earlier["settings"].get(key) != getattr(args, key)]
    if differs:
        sys.exit(f"error: --update: {path} was measured with another {', '.join(differs)}; "
                 f"write to another --output_dir")
    return earlier["results"], earlier.get("commands", [earlier["environment"]["command"]])


def peak_memory(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def settings_of(args, leave_out=()):
    """The JSON's "settings": the parsed flags, paths as a user would type them."""
    return {k: shown([str(v)]) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in leave_out}


def fmt(value):
    return "-" if value is None else f"{value:.2f}"


def run_trainer(flags, keep_output=False):
    """launch_deepspeed.py with `flags`, its logs and checkpoints in a temporary folder, as a user runs it:
    {"command", "wall_s", "history"} (and "output" with keep_output), or {"command", "error"}."""
    from deepspeed_image_trainer.engine.distributed import run_on_free_port  # not at the top: plain_loop.py times its startup

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        command = [sys.executable, str(ROOT / "launch_deepspeed.py"), *flags,
                   "--log_dir", str(tmp / "logs"), "--checkpoint_dir", str(tmp / "checkpoints")]
        started = time.perf_counter()
        result = run_on_free_port(lambda port: subprocess.run(command + ["--master_port", str(port)],
                                                              capture_output=True, text=True))
        wall_s = round(time.perf_counter() - started, 2)
        if result.returncode != 0:
            return {"command": shown(command), "error": (result.stdout + result.stderr)[-2000:]}
        history = json.loads((tmp / "logs" / "training_history.json").read_text())
    return {"command": shown(command), "wall_s": wall_s, "history": history,
            **({"output": result.stdout + result.stderr} if keep_output else {})}


def draw_sample_data(folder):
    """The built-in sample dataset at `folder`, as `prepare_data.py sample` draws it (kept when already there)."""
    subprocess.run([sys.executable, str(ROOT / "src" / "prepare_data.py"), "sample", "--output", str(folder)],
                   check=True, stdout=subprocess.DEVNULL)


# name -> settings of a plain-PyTorch loop on GPU-resident synthetic data
REFERENCES = {
    "torch fp32": {"dtype": None, "channels_last": False},
    "torch bf16 channels_last": {"dtype": "bf16", "channels_last": True},
    "torch fp16 channels_last": {"dtype": "fp16", "channels_last": True},
    "torch bf16 channels_last compile": {"dtype": "bf16", "channels_last": True, "compile": True},
    # on several GPUs: DDP with every BatchNorm2d made torch.nn.SyncBatchNorm (the reference of --sync_bn)
    "torch bf16 channels_last SyncBatchNorm": {"dtype": "bf16", "channels_last": True, "sync_bn": True},
    # fed by the trainer's GPU data path (crops_loader) instead of one synthetic batch: a DDP user who augments
    # on the GPU as the trainer does
    "torch bf16 channels_last crops": {"dtype": "bf16", "channels_last": True, "crops": True},
    # PyTorch's FSDP2 on several GPUs: fully_shard per repeated block and the root, bf16 weights, fp32 reduction
    # (the reference of ZeRO-3 with DeepSpeed's bf16 weights)
    "torch bf16 FSDP2": {"dtype": None, "channels_last": False, "fsdp2": True},
    "torch bf16 FSDP2 compile": {"dtype": None, "channels_last": False, "fsdp2": True, "compile": True},
}
BF16_REF, FP16_REF = "torch bf16 channels_last", "torch fp16 channels_last"
SYNC_BN_REF, CROPS_REF = "torch bf16 channels_last SyncBatchNorm", "torch bf16 channels_last crops"
FSDP2_REF = "torch bf16 FSDP2"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def synthetic_batch(args, device, dtype=torch.float32, channels_last=True):
    generator = torch.Generator(device).manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device, generator=generator)
    labels = torch.randint(0, args.num_classes, (args.batch_size,), device=device, generator=generator)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return images.to(dtype, memory_format=memory_format), labels


def reference_model(args):
    """The plain model a user would build for --model: torchvision's get_model, or timm's create_model for
    timm:NAME (sized for --image_size where timm fixes the input size), without the trainer's fp32 norms."""
    from deepspeed_image_trainer.models import timm_models
    from deepspeed_image_trainer.models.build import construction_args

    if timm_models.is_timm(args.model):
        import timm

        fixed = timm.models.get_pretrained_cfg(timm_models.arch(args.model))
        return timm.create_model(timm_models.arch(args.model), num_classes=args.num_classes,
                                 **({"img_size": args.image_size} if fixed and fixed.fixed_input_size else {}))
    import torchvision

    return torchvision.models.get_model(args.model, num_classes=args.num_classes,
                                        **construction_args(args.model, args.image_size))


def reference_case(settings, args, device, profile=None):
    """Plain PyTorch: the loop a user writes by hand, timed like the trainer's epochs. Started by torchrun
    with several processes, it is plain DistributedDataParallel (NCCL), and images/s counts every rank. With a
    `profile` (a GpuTrace), the same steps again under it (not in the figures)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        device = torch.device(device.type, int(os.environ["LOCAL_RANK"])) if device.type == "cuda" else device
        if device.type == "cuda":
            torch.cuda.set_device(device)
    dtype = DTYPES.get(settings["dtype"])
    model = reference_model(args).to(device)
    if settings.get("sync_bn") and world_size > 1:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if settings["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    if settings.get("fsdp2"):
        model = fully_sharded(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    scaler = torch.amp.GradScaler(enabled=dtype == torch.float16)
    if world_size > 1 and not settings.get("fsdp2"):
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    forward = torch.compile(model) if settings.get("compile") else model
    batch = synthetic_batch(args, device, channels_last=settings["channels_last"])
    loader = (lambda epoch, count: [batch] * count) if not settings.get("crops") else crops_loader(
        args, device, torch.float32, int(os.environ.get("RANK", "0")), world_size)

    def steps(count, epoch):
        start = time.perf_counter()
        for images, labels in itertools.islice(loader(epoch, count), count):
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(forward(images).float(), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        loss.item()
        return time.perf_counter() - start

    steps(args.warmup_steps, 0)
    reset_peak_memory(device)
    result = {"images_per_s": world_size * args.steps * args.batch_size / steps(args.steps, 1),
              "peak_gpu_memory_gib": peak_memory(device)}
    if profile is not None:
        profile.runcall(steps, args.steps, 2)
    return result


def fully_sharded(model):
    """`model` under FSDP2 as its documentation shards a transformer: fully_shard on each repeated block (the
    classes the trainer's ZeRO-3 gathers whole, so both shard at the same grain) and on the root; parameters in
    bf16 for compute, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from deepspeed_image_trainer.models.names import BLOCKS
    from deepspeed_image_trainer.models.timm_models import LEAF_BLOCKS, NORM_BASES, floating_buffers_to

    # FSDP2 casts parameters, not buffers: a bias or table kept as a buffer (EVA's fixed key bias, its rotary
    # embedding) meets bf16 activations in one op and fails, so those outside norm layers are made bf16 first,
    # as the trainer does under DeepSpeed's bf16 weights (models/timm_models.py)
    floating_buffers_to(model, torch.bfloat16, keep=lambda module: isinstance(module, NORM_BASES))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = set(BLOCKS) | set(LEAF_BLOCKS)
    for module in list(model.modules()):
        if f"{type(module).__module__}.{type(module).__qualname__}" in blocks:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# What a training epoch adds to the step (trainer_case's `parts`): the device data path's crops of resident uint8
# squares, the stop agreement between ranks, the non-finite-loss check, the per-micro-batch seeding
EPOCH_PARTS = ("crops", "stop", "health", "seed")


def trainer_case(flags, args, device, profile=None, parts=()):
    """The trainer's model, config and train_one_epoch on one synthetic batch, repeated; then, with a
    cProfile.Profile `profile`, the same steps again under it (not in the figures). `parts` (of EPOCH_PARTS):
    what the trainer's epochs add, each as the trainer sets it up; "crops" feeds batches that DeviceTrainLoader
    cuts from random 256 px squares (as many as the steps take) instead of the one batch."""
    import deepspeed

    from deepspeed_image_trainer.cli import train as train_deepspeed
    from deepspeed_image_trainer.engine import overrides as deepspeed_overrides
    from deepspeed_image_trainer.engine.distributed import init_distributed
    from deepspeed_image_trainer.engine.config import (build_ds_config, coalesces_grad_reduction, load_base_config,
                                                       precision)
    from deepspeed_image_trainer.models.build import build_model
    from deepspeed_image_trainer.models.norms import synchronize_batch_norm
    from deepspeed_image_trainer.cli.options import parse_args
    from deepspeed_image_trainer.engine.loop import (input_dtype, no_single_rank_allreduce,
                                                     train_one_epoch)
    from deepspeed_image_trainer.engine.interrupt import StopOnSignal
    from deepspeed_image_trainer.engine.numerics import StepHealth

    argv = ["--model", args.model, "--batch_size", str(args.batch_size), "--image_size", str(args.image_size), *flags]
    train_args = parse_args(train_deepspeed.get_args_parser, argv)
    rank, world_size = init_distributed()
    device = torch.device(device.type, torch.cuda.current_device()) if device.type == "cuda" else device
    torch.backends.cudnn.benchmark = True
    images_per_epoch = args.batch_size * world_size * (args.warmup_steps + args.steps)
    model = build_model(args.model, args.num_classes, args.image_size, grad_checkpointing=train_args.grad_checkpointing)
    if train_args.sync_bn:
        synchronize_batch_norm(model)
    config = build_ds_config(train_args, world_size, images_per_epoch, base=load_base_config(train_args.deepspeed_config),
                             device_type=device.type, num_params=sum(p.numel() for p in model.parameters()))
    deepspeed_overrides.install()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    no_single_rank_allreduce(engine, config)
    if train_args.compile:
        engine.compile()
    dtype = input_dtype(precision(config))
    batch = synthetic_batch(args, device, dtype)
    loader = (lambda epoch, steps: [batch] * steps) if "crops" not in parts else crops_loader(
        args, device, dtype, rank, world_size)
    options = {"coalesced": coalesces_grad_reduction(train_args.coalesce_grad_reduction, config),
               "stop": StopOnSignal(device, world_size) if "stop" in parts else None,
               "health": StepHealth(engine, train_args.max_nonfinite_steps) if "health" in parts else None,
               "step_seed": (train_args.seed, rank) if "seed" in parts else None}
    if train_args.model_ema:  # as the trainer builds it, past its warmup: every update averages
        from deepspeed_image_trainer.engine.ema import WeightEMA

        options["ema"] = WeightEMA(engine, decay=train_args.model_ema_decay, every=train_args.model_ema_steps,
                                   global_batch=config["train_batch_size"], epochs=1, warmup_steps=0,
                                   steps_per_epoch=args.steps)
    train_one_epoch(engine, loader(0, args.warmup_steps), 0, dtype, args.warmup_steps, **options)
    reset_peak_memory(device)
    metrics = train_one_epoch(engine, loader(1, args.steps), 1, dtype, args.steps, **options)
    if profile is not None:
        profile.runcall(train_one_epoch, engine, loader(2, args.steps), 2, dtype, args.steps, **options)
    return {"images_per_s": metrics["images_per_s"], "precision": precision(config),
            "peak_gpu_memory_gib": peak_memory(device), "zero_optimization": config["zero_optimization"],
            **({"ema": ema_timings(options["ema"], device)} if train_args.model_ema else {})}


def ema_timings(ema, device, repeat=10):
    """Milliseconds of one update of the weights' average (WeightEMA.after_step) and of one swap in and out (the
    validation's), each the median of `repeat`."""
    def timed(fn):
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - started) * 1000)
        return sorted(times)[len(times) // 2]

    def swap():
        with ema.swapped_in():
            pass

    return {"update_ms": timed(lambda: ema.after_step(2, 0)), "swap_ms": timed(swap)}


def crops_loader(args, device, dtype, rank, world_size):
    """epoch, steps -> the batches of DeviceTrainLoader over random resident 256 px uint8 squares, enough for the
    longest epoch of trainer_case on every rank (each rank holds them all, as on the data-on-GPU tier)."""
    from deepspeed_image_trainer.data.device import DeviceTrainLoader

    count = world_size * args.batch_size * max(args.steps, args.warmup_steps)
    generator = torch.Generator(device).manual_seed(0)
    squares = torch.randint(0, 256, (count, 3, 256, 256), dtype=torch.uint8, device=device, generator=generator)
    labels = torch.randint(0, args.num_classes, (count,), device=device, generator=generator)
    train = DeviceTrainLoader(squares, labels, micro_batch_size=args.batch_size, image_size=args.image_size,
                              rank=rank, world_size=world_size, seed=0, dtype=dtype, device=device)
    return lambda epoch, steps: train.epoch(epoch)


def run_case_of(script, kind, name, args):
    """One measurement, `script --case`, in a child process (torchrun's, one per GPU, for several GPUs; the
    real-data runs start their own); returns its result dict or {"error": ...}."""
    from deepspeed_image_trainer.engine.distributed import run_on_free_port

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


def busy_time(intervals):
    """The time covered by the union of (start, end) `intervals`."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


# a compute kernel that starts this soon after its launch found the GPU idle: the GPU waited for the host
FED_LATE_US = 50


def trace_summary(events, steps):
    """What a torch.profiler trace (Chrome trace events, `steps` steps) says holds a step: per step, the time the
    GPU ran compute kernels and NCCL's, its kernels, and how long each compute kernel waited between its launch
    on the host and its start on the GPU. A GPU that the host keeps ahead of has a queue, so its kernels wait
    milliseconds; one that waits for the host starts them microseconds after their launch."""
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    nccl = [e for e in kernels if "nccl" in e["name"].lower()]
    compute = [e for e in kernels if "nccl" not in e["name"].lower()]
    waits = sorted(e["ts"] - launches[e["args"]["correlation"]] for e in compute
                   if e.get("args", {}).get("correlation") in launches)

    def quantile(q):
        return round(waits[min(len(waits) - 1, int(q * len(waits)))], 1) if waits else None

    return {"compute_busy_ms_per_step": busy_time((e["ts"], e["ts"] + e["dur"]) for e in compute) / 1000 / steps,
            "nccl_busy_ms_per_step": busy_time((e["ts"], e["ts"] + e["dur"]) for e in nccl) / 1000 / steps,
            "kernels_per_step": len(kernels) / steps,
            "launch_to_start_us": {"p10": quantile(0.1), "p50": quantile(0.5), "p90": quantile(0.9)},
            "started_within_50us": sum(wait < FED_LATE_US for wait in waits) / len(waits) if waits else None}


class GpuTrace:
    """torch.profiler over one call (runcall, as a cProfile.Profile's), on the CPU and the GPU: `summary` holds
    trace_summary's figures, the profiled milliseconds a step (the profiler slows the host) and the host's
    busiest operations by their own time."""

    def __init__(self, steps):
        self.steps, self.summary = steps, None

    def runcall(self, fn, *args, **kwargs):
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()  # without a GPU: the host's side only (a smoke test)
        synchronize = torch.cuda.synchronize if cuda else (lambda: None)
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as profiler:
            synchronize()
            started = time.perf_counter()
            fn(*args, **kwargs)
            synchronize()
            wall = time.perf_counter() - started
        with tempfile.TemporaryDirectory() as tmp:
            profiler.export_chrome_trace(str(Path(tmp) / "trace.json"))
            events = json.loads((Path(tmp) / "trace.json").read_text())["traceEvents"]
        host = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
        self.summary = {"rank": int(os.environ.get("RANK", "0")), "profiled_ms_per_step": wall * 1000 / self.steps,
                        **trace_summary(events, self.steps),
                        "host_self_ms_per_step": [[e.key[:80], round(e.self_cpu_time_total / 1000 / self.steps, 1),
                                                   e.count / self.steps] for e in host]}


def relative_paths(text):
    """`text` with the import path's folders (a virtual environment's too, wherever it is) left out of its file
    names, then the project's: deepspeed/..., src/deepspeed_image_trainer/engine/loop.py."""
    project = {str(ROOT), str(ROOT / "src"), str(ROOT / "benchmarks")}
    for folder in sorted({entry.rstrip("/") for entry in sys.path if entry} - project, key=len, reverse=True):
        text = text.replace(folder + "/", "")
    return text.replace(f"{ROOT}/", "")


def slug_of(name, limit=96):
    """A file-name piece for name; past limit characters cut, with a hash of the whole so names stay apart
    (a list of every override group is over 200 characters, file names stop at 255 bytes)."""
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    if len(slug) <= limit:
        return slug
    return f"{slug[:limit - 9]}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"


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


def measurement_parser(description):
    """The flags of the measurements run in child processes (reference_case, trainer_case), which
    passed_settings hands on to them."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--case_timeout", type=int, default=240, help="seconds before one measurement is given up")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--profile", action="store_true",
                        help="also write each trainer step measurement's host profile of --steps more steps (cProfile, "
                             "top 40 by own time) to profile_<model>_<measurement>.txt beside the JSON")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    return parser


def ratio(results, name, reference):
    ran, ref = results.get(name, {}), results.get(reference, {})
    if "images_per_s" in ran and "images_per_s" in ref:
        return ran["images_per_s"] / ref["images_per_s"]
    return None
