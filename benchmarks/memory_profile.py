"""What each ZeRO stage and offload really costs in memory, and what fits a GPU: real training steps per configuration.

For each configuration (plain PyTorch, the hand-written reference; ZeRO-0, the DDP-like baseline; ZeRO-1, 2,
3; optimizer offload; optimizer and parameter offload, each offload also with DeepSpeed's half-precision
weights) this builds the model and the DeepSpeed config the trainer would, runs a few steps on synthetic
images and records on every rank:

- model states: GPU memory still allocated between steps (parameters, gradients, optimizer state and
  the buffers DeepSpeed keeps, such as its reduce buckets);
- activations: the peak during a step above that (activations, their gradients, temporaries, and the
  buffers DeepSpeed allocates for the step only, such as ZeRO-1/2's gradient reduce buckets);
- peak allocated and reserved GPU memory, and the process's peak resident host memory (offloaded
  state lives there; on a CPU-only machine the host figure is the only one);

next to DeepSpeed's own estimators (estimate_zero2/zero3_model_states_mem_needs, what the `_all_live`
helpers print) and the ZeRO paper's per-GPU model-state formulas for Adam: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N,
16Ψ/N bytes with half-precision weights; with fp32 weights (fp32, or autocast) 16Ψ, 8Ψ + 8Ψ/N,
4Ψ + 12Ψ/N, 16Ψ/N. Prints a table and writes JSON and a bar chart PNG.

With --find_max_batch it searches each configuration's largest micro-batch instead and times the steps
there, on one GPU or, with --num_gpus N, on N ranks of this host (each try a torchrun of its own); with
--gpu_memory_gib, as on smaller GPUs, and then plain PyTorch (DDP on N) on the whole GPUs at --batch_size is
the speed every configuration is compared with. The configurations named ", coalesced" (measured only when
named in --configs) run with the trainer's --coalesce_grad_reduction on: each step's micro-batches inside
DeepSpeed's coalesce_grad_reduction(); the ZeRO-2 offload ones without it, with off: DeepSpeed's own way.
The ones named " + activation checkpointing" (also only when named) train with the trainer's
--grad_checkpointing: each repeated block's activations recomputed in the backward.

    python src/memory_profile.py --model resnet18 --batch_size 64 --bf16
    deepspeed --num_gpus 2 src/memory_profile.py --model wide_resnet50_2 --bf16
    python src/memory_profile.py --model vit_h_14 --bf16 --find_max_batch --gpu_memory_gib 8 --global_batch 512
    python src/memory_profile.py --model vit_h_14 --bf16 --find_max_batch --gpu_memory_gib 8 --num_gpus 2 --configs ZeRO-3
"""
import argparse
import gc
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import max_batch
from common import environment, settings_of, slug_of
from deepspeed_image_trainer.cli import train as train_deepspeed
from deepspeed_image_trainer.cli.options import check_input_fits, memory_gib, parse_args, run_cli
from deepspeed_image_trainer.data.folders import batch_memory_format
from deepspeed_image_trainer.engine import distributed
from deepspeed_image_trainer.engine import overrides as deepspeed_overrides
from deepspeed_image_trainer.engine.config import build_ds_config, coalesces_grad_reduction, precision
from deepspeed_image_trainer.engine.distributed import (alike_on_each_node, checked_world_size, exit_now,
                                                        init_distributed, rank_zero_only, run_on_free_port, shut_down)
from deepspeed_image_trainer.engine.loop import GradientAccumulation, input_dtype
from deepspeed_image_trainer.models.build import build_model, check_image_size, construction_args, shape_model
from deepspeed_image_trainer.models import timm_models
from deepspeed_image_trainer.models.timm_models import is_timm
from deepspeed_image_trainer.utils.failures import (CliParser, UsageError, check_outside_checkpoints, check_writable,
                                                    path_argument)
from deepspeed_image_trainer.utils.files import check_regular, parse_json
from machine import machine_slug, source_commit, usable_cores

PLAIN = "plain PyTorch"
HALF_WEIGHTS = ["--precision_mode", "half_weights"]
NOT_COALESCED = ["--coalesce_grad_reduction", "off"]


def with_coalescing(flags, mode):
    """Trainer `flags` with --coalesce_grad_reduction `mode` in place of any they give."""
    kept = [flag for i, flag in enumerate(flags)
            if "--coalesce_grad_reduction" not in (flag, flags[i - 1] if i else None)]
    return [*kept, "--coalesce_grad_reduction", mode]


# name -> trainer flags (None: plain PyTorch, no DeepSpeed)
CONFIGS = {
    PLAIN: None,
    "ZeRO-0 (DDP-like)": ["--zero_stage", "0"],
    "ZeRO-1": ["--zero_stage", "1"],
    "ZeRO-2": ["--zero_stage", "2"],
    "ZeRO-3": ["--zero_stage", "3"],
    # With accumulation (--global_batch), DeepSpeed's way: every micro-batch's gradients through the CPU
    "ZeRO-2 + offload optimizer": ["--zero_stage", "2", "--offload_optimizer", *NOT_COALESCED],
    "ZeRO-3 + offload optimizer + params": ["--zero_stage", "3", "--offload_optimizer", "--offload_param"],
    # DeepSpeed's fp16/bf16 weights move half the bytes of fp32 weights between the CPU and the GPU
    "ZeRO-2 + offload optimizer, half weights": ["--zero_stage", "2", "--offload_optimizer", *HALF_WEIGHTS,
                                                 *NOT_COALESCED],
    "ZeRO-3 + offload optimizer + params, half weights": ["--zero_stage", "3", "--offload_optimizer",
                                                          "--offload_param", *HALF_WEIGHTS],
}
# The same run inside DeepSpeed's engine.coalesce_grad_reduction() (--coalesce_grad_reduction on): the micro-batches
# of a step sum their gradients on the GPU, without ZeRO's per-parameter hooks, and one reduction ends the step.
COALESCED = ", coalesced"
for _name in ("ZeRO-2", "ZeRO-2 + offload optimizer", "ZeRO-2 + offload optimizer, half weights"):
    CONFIGS[_name + COALESCED] = with_coalescing(CONFIGS[_name], "on")
# --grad_checkpointing: each repeated block's activations recomputed in the backward (measured when named)
CHECKPOINTED = " + activation checkpointing"
for _name in ("ZeRO-2", "ZeRO-3"):
    CONFIGS[_name + CHECKPOINTED] = [*CONFIGS[_name], "--grad_checkpointing"]
# A model past one GPU with AdamW (issue 39's 7 B ViT): its bf16 weights and gradients on the GPU, ZeRO-3's
# optimizer on the CPU, each micro-batch's gradients offloaded (DeepSpeed's way) or summed on the GPU first
_ZERO3_OFFLOAD = "ZeRO-3 + offload optimizer, half weights"
CONFIGS[_ZERO3_OFFLOAD + CHECKPOINTED] = ["--zero_stage", "3", "--offload_optimizer", *HALF_WEIGHTS, *NOT_COALESCED,
                                          "--grad_checkpointing"]
CONFIGS[_ZERO3_OFFLOAD + COALESCED + CHECKPOINTED] = with_coalescing(CONFIGS[_ZERO3_OFFLOAD + CHECKPOINTED], "on")
GIB = 2**30
OUT_OF_MEMORY = 3  # exit status of a --probe or --search process whose last try ran out of memory


def get_args_parser():
    parser = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18",
                        help="any torchvision classifier or timm:NAME, as the trainer's --model")
    parser.add_argument("--num_classes", type=int, default=90)
    parser.add_argument("--batch_size", type=int, default=64,
                        help="micro-batch per rank (with --find_max_batch: the whole-GPU reference's)")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--fp16", action="store_true", help="fp16 compute (GPU only)")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute")
    parser.add_argument("--precision_mode", choices=["auto", "autocast", "half_weights"], default="auto",
                        help="as the trainer's flag: autocast keeps fp32 weights, half_weights DeepSpeed's fp16/bf16 "
                             "(the configurations named 'half weights' always use them)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), metavar="NAME",
                        default=[name for name in CONFIGS if not name.endswith((COALESCED, CHECKPOINTED))],
                        help=f"configurations to measure (default: all): {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=3, help="training steps per configuration (timed ones with "
                                                             "--find_max_batch)")
    parser.add_argument("--find_max_batch", action="store_true",
                        help="search each configuration's largest micro-batch that trains without running out of "
                             "GPU memory, within 5%%, and its images/s there (start it with python, not deepspeed)")
    parser.add_argument("--num_gpus", type=int, default=1,
                        help="with --find_max_batch: the GPUs of this host each try runs on, one rank each (the "
                             "micro-batch is per rank)")
    parser.add_argument("--max_batch_limit", type=int, default=max_batch.LIMIT, metavar="N",
                        help="with --find_max_batch: stop searching at this micro-batch (default %(default)s)")
    parser.add_argument("--global_batch", type=int, default=None, metavar="N",
                        help="with --find_max_batch: also time each configuration that offloads the optimizer at its "
                             "largest micro-batch with gradient accumulation to at least N images per optimizer step "
                             "(what amortises the optimizer step on the CPU)")
    parser.add_argument("--gpu_memory_gib", type=float, default=None,
                        help="let PyTorch use only this much GPU memory, as on a smaller GPU")
    parser.add_argument("--output_dir", type=lambda value: Path(path_argument(value)), default=Path("memory_profile"))
    parser.add_argument("--update", action="store_true",
                        help="add to the JSON of an earlier run of the same model, GPU and settings: its other "
                             "configurations (and its reference) are kept")
    parser.add_argument("--probe", nargs=2, metavar=("CONFIG", "BATCH"), help=argparse.SUPPRESS)  # one timed try
    parser.add_argument("--accumulation", type=int, default=1, help=argparse.SUPPRESS)  # of a --probe
    parser.add_argument("--search", nargs=2, metavar=("CONFIG", "STATE"), help=argparse.SUPPRESS)  # search process
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by `deepspeed`
    return parser


def trainer_config(args, flags, micro_batch, world_size, device, num_params, accumulation=1):
    precision_flags = [flag for flag in ("fp16", "bf16") if getattr(args, flag)]
    # The offload rows come in pairs, fp32 and half weights: on a GPU "auto" would make both half weights
    # for a large model (ds_config.HALF_WEIGHTS_OFFLOAD_PARAMS), so the first of each pair stays autocast.
    mode = "autocast" if args.precision_mode == "auto" and device.type == "cuda" else args.precision_mode
    argv = ["--model", args.model, "--batch_size", str(micro_batch), "--epochs", "1",
            "--gradient_accumulation_steps", str(accumulation), "--precision_mode", mode,
            *[f"--{flag}" for flag in precision_flags], *flags]
    train_args = parse_args(train_deepspeed.get_args_parser, argv)
    return build_ds_config(train_args, world_size, micro_batch * accumulation * world_size * (args.steps + 2),
                           device_type=device.type, num_params=num_params)


def plain_config(args):
    """What plain PyTorch amounts to in DeepSpeed's terms: fp32 weights, nothing partitioned."""
    half = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    return {"zero_optimization": {"stage": 0},
            **({"torch_autocast": {"enabled": True, "dtype": f"{'b' if half == 'bf16' else ''}float16"}} if half else {})}


def config_of(args, name, micro_batch, world_size, device, num_params, accumulation=1):
    flags = CONFIGS[name]
    if flags is None:
        return plain_config(args)
    return trainer_config(args, flags, micro_batch, world_size, device, num_params, accumulation)


def paper_formula_bytes(config, params, world_size):
    """Per-GPU model-state bytes by the ZeRO paper's accounting, for this config's precision."""
    half = precision(config) in ("fp16", "bf16")  # DeepSpeed's half-precision weights
    weights, grads, optimizer = (2, 2, 12) if half else (4, 4, 8)
    zero = config["zero_optimization"]
    stage, n = zero["stage"], world_size
    if zero.get("offload_param", {}).get("device") == "cpu":
        return 0  # plus the layers being gathered, which the formula leaves out
    if zero.get("offload_optimizer", {}).get("device") == "cpu":
        return weights * params / (n if stage == 3 else 1)  # gradients and optimizer state on the CPU
    per_param = {0: weights + grads + optimizer, 1: weights + grads + optimizer / n,
                 2: weights + (grads + optimizer) / n, 3: (weights + grads + optimizer) / n}[stage]
    return per_param * params


def deepspeed_estimate_bytes(config, total, largest_layer, world_size):
    """(GPU, CPU) bytes from DeepSpeed's estimators (the ZeRO-2 one also for ZeRO-1); None for ZeRO-0."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    zero = config["zero_optimization"]
    offload_optimizer = zero.get("offload_optimizer", {}).get("device") == "cpu"
    if zero["stage"] == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total, largest_layer, num_gpus_per_node=world_size, cpu_offload=offload_optimizer,
            cpu_offload_params=zero.get("offload_param", {}).get("device") == "cpu", zero_init=False)
        return gpu, cpu
    if zero["stage"] in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world_size,
                                                         cpu_offload=offload_optimizer)
        return gpu, cpu
    return None, None


def model_sizes(name, num_classes, image_size):
    """(parameters, the largest layer's parameters), from the model on the meta device (nothing allocated)."""
    model = shape_model(name, num_classes, image_size)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return sum(p.numel() for p in model.parameters()), largest


class MemoryCounters:
    """GPU counters of PyTorch's caching allocator and the host's resident-memory high-water mark."""

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"

    def reset(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        try:  # Linux: "5" resets the peak resident set size (VmHWM) to the current one
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        self.baseline = self.allocated()

    def allocated(self):
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def since_reset(self, value):
        return None if value is None else (value - self.baseline) / GIB

    def peaks(self):
        gpu = {"peak_allocated_gib": None, "peak_reserved_gib": None}
        if self.cuda:
            gpu = {"peak_allocated_gib": self.since_reset(torch.cuda.max_memory_allocated(self.device)),
                   "peak_reserved_gib": torch.cuda.max_memory_reserved(self.device) / GIB}
        return {**gpu, "host_peak_rss_gib": host_peak_rss_gib()}


def host_peak_rss_gib():
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024 / GIB
    except (OSError, TypeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux kB; peak since start


class PlainEngine:
    """Plain PyTorch behind the calls these measurements make of a DeepSpeed engine: torchvision's or timm's
    model of that name, AdamW (fused on a GPU), autocast and channels_last on a GPU, DistributedDataParallel on
    several ranks: the loop a user writes by hand."""

    def __init__(self, args, device, world_size):
        import torchvision

        half = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else None
        if is_timm(args.model):  # timm's create_model, as the trainer builds it (a torchvision name error before)
            model = timm_models.build(args.model, args.num_classes, args.image_size).to(device)
        else:
            model = torchvision.models.get_model(args.model, num_classes=args.num_classes,
                                                 **construction_args(args.model, args.image_size)).to(device)
        model = model.to(memory_format=batch_memory_format(device))
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, fused=device.type == "cuda")
        self.scaler = torch.amp.GradScaler(device.type, enabled=half == torch.float16)
        self.module = model if world_size == 1 else torch.nn.parallel.DistributedDataParallel(model)
        self.autocast = torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None)

    def __call__(self, images):
        with self.autocast:
            return self.module(images)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def destroy(self):
        self.module = self.optimizer = None


def new_engine(args, name, config, device, world_size):
    if CONFIGS[name] is None:
        return PlainEngine(args, device, world_size)
    import deepspeed

    deepspeed_overrides.install()
    model = build_model(args.model, args.num_classes, args.image_size,
                        grad_checkpointing="--grad_checkpointing" in CONFIGS[name])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def release(engine):
    """Drop an engine and what DeepSpeed keeps of it, so the next configuration starts from nothing."""
    engine.destroy()  # also the optimizer's: ZeRO-3 removes its hooks and partitioned parameters
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synthetic_batch(args, config, micro_batch, device):
    images = torch.randn(micro_batch, 3, args.image_size, args.image_size, device=device)
    images = images.to(input_dtype(precision(config)), memory_format=batch_memory_format(device))
    return images, torch.randint(0, args.num_classes, (micro_batch,), device=device)


def train_steps(engine, batch, steps, accumulation=1, coalesced=False):
    """`steps` optimizer steps of `accumulation` micro-batches each; returns the seconds they took and the
    memory held between steps after each. `coalesced`: as the trainer coalesces (training.GradientAccumulation)."""
    images, labels = batch
    cuda = images.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(images.device)
    started, held = time.perf_counter(), []
    accumulating = None if isinstance(engine, PlainEngine) else GradientAccumulation(engine, coalesced)
    for _ in range(steps):
        for micro in range(accumulation):  # DeepSpeed's step() steps the optimizer at the accumulation boundary only
            loss = F.cross_entropy(engine(images).float(), labels)
            if accumulating is None:
                engine.backward(loss)
                engine.step()
            else:
                accumulating.backward(loss, micro == accumulation - 1)
                accumulating.step(micro == accumulation - 1)
        held.append(torch.cuda.memory_allocated(images.device) if cuda else None)
    if cuda:
        torch.cuda.synchronize(images.device)
    return time.perf_counter() - started, held


def figures(config, sizes, world_size):
    """What the formulas say of a configuration: the ZeRO paper's and DeepSpeed's estimators."""
    estimate_gpu, estimate_cpu = deepspeed_estimate_bytes(config, *sizes, world_size)
    return {"precision": precision(config), "params": sizes[0],
            "paper_formula_gib": paper_formula_bytes(config, sizes[0], world_size) / GIB,
            "deepspeed_estimate_gpu_gib": None if estimate_gpu is None else estimate_gpu / GIB,
            "deepspeed_estimate_cpu_gib": None if estimate_cpu is None else estimate_cpu / GIB}


def coalescing_mode(name):
    """Configuration `name`'s --coalesce_grad_reduction (the trainer's default where its flags leave it out)."""
    flags = CONFIGS[name] or []
    return flags[flags.index("--coalesce_grad_reduction") + 1] if "--coalesce_grad_reduction" in flags else "auto"


def accumulation_of(name, accumulation=1):
    """The micro-batches a step configuration `name` runs: one that asks to coalesce at least two, so that its
    peak holds their summed gradients."""
    return max(accumulation, 2) if coalescing_mode(name) == "on" else accumulation


def coalesces(name, config, mode=None):
    """Whether configuration `name`, built as `config`, coalesces its steps' micro-batches, as the trainer decides
    (for --coalesce_grad_reduction `mode`, default the configuration's own)."""
    return CONFIGS[name] is not None and coalesces_grad_reduction(mode or coalescing_mode(name), config)


def coalescing_config_of(args, name, micro_batch, world_size, device, num_params, accumulation=1):
    """(config, micro-batches a step, whether it coalesces) of configuration `name`: config_of at the
    accumulation it runs (accumulation_of), and coalesces() of what that builds."""
    accumulation = accumulation_of(name, accumulation)
    config = config_of(args, name, micro_batch, world_size, device, num_params, accumulation)
    return config, accumulation, coalesces(name, config)


def measure(args, name, world_size, device, counters, sizes):
    """One configuration's figures on this rank at --batch_size; `sizes`: (parameters, largest layer's)."""
    config, accumulation, coalesced = coalescing_config_of(args, name, args.batch_size, world_size, device, sizes[0])
    counters.reset()
    started = time.perf_counter()
    engine = new_engine(args, name, config, device, world_size)
    after_init = counters.since_reset(counters.allocated())
    _, held = train_steps(engine, synthetic_batch(args, config, args.batch_size, device), args.steps,
                          accumulation, coalesced)
    peaks = counters.peaks()
    release(engine)
    model_states = counters.since_reset(held[-1])
    activations = (None if model_states is None or peaks["peak_allocated_gib"] is None
                   else peaks["peak_allocated_gib"] - model_states)
    return {"config": name, "flags": CONFIGS[name], **figures(config, sizes, world_size),
            "after_init_gib": after_init, "model_states_gib": model_states, "activations_gib": activations,
            **peaks, "seconds": time.perf_counter() - started}


def is_out_of_memory(err):
    # some of DeepSpeed's allocations report it as a plain RuntimeError, cuBLAS and cuDNN as their own status
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and any(
        text in str(err) for text in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")))


def timed_try(engine, config, micro_batch, args, device, counters, timed_steps, accumulation=1, coalesced=False):
    """Two steps at `micro_batch` (whether it fits, and the peak), then `timed_steps` timed ones: the try's figures."""
    counters.reset()
    counters.baseline = 0  # the whole process's figures: the engine's states count
    batch = synthetic_batch(args, config, micro_batch, device)
    # the first step allocates the optimizer state (and tunes cuDNN), the second runs with it
    train_steps(engine, batch, 2 if accumulation == 1 else 1, accumulation, coalesced)
    seconds, held = (train_steps(engine, batch, timed_steps, accumulation, coalesced) if timed_steps
                     else (None, [None]))
    peaks = counters.peaks()
    allocated = held[-1] if held[-1] is not None else counters.allocated()
    return {"batch": micro_batch, "fits": True, "accumulation": accumulation, **({"coalesced": True} if coalesced else {}),
            "images_per_s": micro_batch * accumulation * timed_steps / seconds if seconds else None,
            "model_states_gib": None if allocated is None else allocated / GIB,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if counters.cuda else 0,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if counters.cuda else 0, **peaks}


OVER_RANKS = ("peak_allocated_bytes", "peak_reserved_bytes", "model_states_gib", "peak_allocated_gib",
              "peak_reserved_gib", "host_peak_rss_gib")


def over_ranks(attempt, device, world_size):
    """One try's figures for all ranks, on every rank: each peak the largest over ranks (what every GPU must
    hold), images/s the slowest rank's times the ranks (each step waits for it)."""
    if world_size == 1:
        return attempt
    keys = [key for key in OVER_RANKS if attempt.get(key) is not None]  # None on every rank alike (no GPU)
    speed = attempt.get("images_per_s")
    values = torch.tensor([attempt[key] for key in keys] + ([-speed] if speed else []), dtype=torch.float64,
                          device=device)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    values = values.tolist()
    return {**attempt, **dict(zip(keys, values)), **({"images_per_s": -values[-1] * world_size} if speed else {})}


def say(tag, value):
    # one write (under PIPE_BUF): torchrun's ranks share one pipe, and print() writes the newline apart
    sys.stdout.write(f"{tag} {json.dumps(value)}\n")
    sys.stdout.flush()


def tries(args, device, sizes, name, first, following, accumulation=1):
    """Build `name`'s engine once, then try micro-batch `first` and the ones following(batch, try) gives
    until None, each said on a TRY line; status OUT_OF_MEMORY at the first that runs out of memory."""
    micro_batch, started = first, time.perf_counter()
    rank, world_size = distributed.rank(), distributed.world_size()
    config, accumulation, coalesced = coalescing_config_of(args, name, micro_batch, world_size, device, sizes[0],
                                                           accumulation)
    counters = MemoryCounters(device)
    try:
        engine = new_engine(args, name, config, device, world_size)
        engine_s = time.perf_counter() - started  # what each of these processes costs before its first try
        while micro_batch is not None:
            # 1 and 2 only start the line a search predicts from: untimed (a search ending there times it apart)
            timed_steps = args.steps if micro_batch > 2 or not args.search else 0
            attempt = timed_try(engine, config, micro_batch, args, device, counters, timed_steps, accumulation,
                                coalesced)
            attempt = over_ranks(attempt, device, world_size)  # every rank then picks the same next micro-batch
            if rank == 0:
                say("TRY", {**attempt, "engine_s": engine_s, "process_s": time.perf_counter() - started})
            micro_batch = following(micro_batch, attempt)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_out_of_memory(err):
            raise
        say("TRY", {"batch": micro_batch, "fits": False, "rank": rank})
        return OUT_OF_MEMORY
    return 0


def probe(args, device, sizes):
    """--probe NAME BATCH: one timed try (of --accumulation micro-batches a step) in this process."""
    return tries(args, device, sizes, args.probe[0], int(args.probe[1]), lambda batch, attempt: None, args.accumulation)


def search_process(args, device, sizes, budget):
    """--search NAME STATE: try micro-batches upwards from STATE (see max_batch.next_batch) until one runs out
    of memory or the search is done."""
    state = json.loads(args.search[1])
    peaks = list(state["peaks"])

    def following(batch, attempt):
        peaks.append([batch, attempt["peak_allocated_bytes"], attempt["peak_reserved_bytes"]])
        return max_batch.next_batch(batch, state["high"], peaks, budget, state["limit"])

    first = max_batch.next_batch(state["low"], state["high"], peaks, budget, state["limit"])
    return tries(args, device, sizes, args.search[0], first, following)


def child(args, mode, name, *values, capped=True):
    """memory_profile.py --MODE NAME VALUES... in a process of its own: (its TRY lines, whether it ended without
    running out of memory)."""
    command = [sys.executable, os.path.abspath(__file__), f"--{mode}", name, *values,
               "--model", args.model, "--num_classes", str(args.num_classes), "--image_size", str(args.image_size),
               "--precision_mode", args.precision_mode, "--steps", str(args.steps),
               *[f"--{flag}" for flag in ("fp16", "bf16") if getattr(args, flag)],
               *(["--gpu_memory_gib", str(args.gpu_memory_gib)] if args.gpu_memory_gib and capped else [])]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    if args.num_gpus > 1:  # torchrun sets the ranks'; when one runs out of memory it stops the others (SIGTERM)
        # and would hold each rank to one CPU thread, which offload's CPU Adam runs on: the cores shared instead
        env = {"OMP_NUM_THREADS": str(max(1, usable_cores() // args.num_gpus)), **os.environ}

    def start(port):
        ranks = (["-m", "torch.distributed.run", "--nproc_per_node", str(args.num_gpus), "--master_port", str(port)]
                 if args.num_gpus > 1 else [])
        return subprocess.run(command[:1] + ranks + command[1:], env={**env, "MASTER_PORT": str(port)},
                              capture_output=True, text=True)

    result = run_on_free_port(start)
    tries = said_tries(result.stdout)
    out_of_memory = result.returncode == OUT_OF_MEMORY or any(not attempt["fits"] for attempt in tries)
    if result.returncode != 0 and not out_of_memory:
        # a process killed by a signal (the kernel's out-of-memory killer: the host's memory) leaves no traceback
        ended = (f"killed by {signal.Signals(-result.returncode).name}" if result.returncode < 0
                 else f"exit status {result.returncode}")
        raise RuntimeError(f"the {mode} of {name} ({' '.join(values)}) failed ({ended}):\n"
                           f"{ranks_errors(result.stderr)[-3000:]}")
    for attempt in tries:
        speed = f", {attempt['images_per_s']:.1f} images/s" if attempt.get("images_per_s") else ""
        print(f"  {name}: micro-batch {attempt['batch']}"
              + (f" x {attempt['accumulation']}" if attempt.get("accumulation", 1) > 1 else "")
              + (f" fits ({fmt(attempt['peak_reserved_gib'])} GiB reserved{speed})" if attempt["fits"]
                 else " runs out of memory"), flush=True)
    return tries, not out_of_memory


def said_tries(stdout):
    """The tries of a probe or search process's TRY lines: every one that fitted (rank 0 says those, for all
    ranks), then the smallest that failed (any rank may say one, and before rank 0's last line)."""
    said = []
    for line in stdout.splitlines():
        if line.startswith("TRY "):
            try:
                said.append(json.loads(line[4:]))
            except ValueError:  # a line some other output broke into
                continue
    failed = sorted((attempt for attempt in said if not attempt["fits"]), key=lambda attempt: attempt["batch"])
    return [attempt for attempt in said if attempt["fits"]] + failed[:1]


def ranks_errors(stderr):
    """A failed process's stderr without torchrun's own traceback and summary, which come after the ranks'
    and name none of their errors."""
    end = stderr.find("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    start = stderr.rfind("Traceback (most recent call last)", 0, end)
    return stderr if end < 0 or start <= 0 else stderr[:start]


def largest_batches(args, sizes, on_row=lambda rows: None):
    """With --find_max_batch: one row per configuration with its largest micro-batch and the figures there;
    on_row(rows so far) after each."""
    rows = []
    for name in args.configs:
        started = time.perf_counter()
        try:
            largest, best, tries = max_batch.search(
                lambda state: child(args, "search", name, json.dumps(state)), args.max_batch_limit)
        except RuntimeError as err:  # the other configurations are still worth measuring
            print(f"  {name}: {err}", flush=True)
            rows.append({"config": name, "flags": CONFIGS[name], "error": str(err)[-3000:]})
            on_row(rows)
            continue
        row = {"config": name, "flags": CONFIGS[name], "commit": source_commit(),  # --update adds later commits' rows
               **figures(config_of(args, name, max(1, largest), args.num_gpus, torch.device("cuda"), sizes[0]), sizes,
                         args.num_gpus),
               "max_micro_batch": largest, "out_of_memory": largest == 0,
               **{key: (best or {}).get(key) for key in ("images_per_s", "model_states_gib", "peak_allocated_gib",
                                                         "peak_reserved_gib", "host_peak_rss_gib")},
               "tries": [{k: t.get(k) for k in ("batch", "fits", "peak_reserved_gib", "images_per_s", "engine_s")}
                         for t in tries]}
        if largest and not row["images_per_s"]:  # found at an untimed micro-batch
            timed, _ = child(args, "probe", name, str(largest))
            row["images_per_s"] = timed[0].get("images_per_s") if timed and timed[0]["fits"] else None
        if args.global_batch and largest and offloads_optimizer(name):
            accumulation = math.ceil(args.global_batch / largest)
            row["global_batch"] = largest * accumulation
            try:
                timed, _ = child(args, "probe", name, str(largest), "--accumulation", str(accumulation))
            except RuntimeError as err:  # the row found without accumulation is kept, with why this one failed
                print(err, flush=True)
                timed, row["global_batch_error"] = None, str(err).splitlines()[0]
            row["global_batch_images_per_s"] = timed[0].get("images_per_s") if timed and timed[0]["fits"] else None
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        on_row(rows)
    return rows


def offloads_optimizer(name):
    return "--offload_optimizer" in (CONFIGS[name] or [])


def reference_speed(args):
    """Plain PyTorch on the whole GPU at --batch_size: the speed the configurations on a smaller one are
    compared with (None when it does not fit there either)."""
    try:
        tries, _ = child(args, "probe", PLAIN, str(args.batch_size), capped=False)
    except RuntimeError as err:
        print(f"  reference: {err}", flush=True)
        return {"config": PLAIN, "batch": args.batch_size, "images_per_s": None, "error": str(err)[-3000:]}
    return {"config": PLAIN, "batch": args.batch_size, "gpu_memory_gib": None,
            "images_per_s": tries[0].get("images_per_s") if tries and tries[0]["fits"] else None}


def fmt(value):
    return "-" if value is None else f"{value:.2f}"


def results_path(args, env, world_size):
    return args.output_dir / f"memory_{slug_of(args.model)}_{machine_slug(env)}_x{world_size}.json"


def earlier_results(args, env, world_size):
    """With --update: (rows, reference, commands) of the JSON this run adds to; refused if another GPU or
    other versions or settings measured it, and with or without --update if its JSON or chart is not a file."""
    path = results_path(args, env, world_size)
    for written in (path, path.with_suffix(".png")):
        try:  # a FIFO there: the --update read, or the write after measuring, waited for its other end for good
            check_regular(written)
        except OSError:
            raise UsageError(f"{written} is not a regular file (a folder, a FIFO or a device): move it away or write "
                             "to another --output_dir") from None
    if not args.update or not path.exists():
        return [], None, []
    try:
        earlier = parse_json(path.read_text())
        measured = {**earlier["environment"], **{f"--{key}": value for key, value in earlier["settings"].items()}}
        results = earlier["results"], earlier.get("reference"), earlier["environment"].get("commands", [])
        if not (isinstance(results[2], list) and all(isinstance(command, str) for command in results[2])):
            raise ValueError(f"environment.commands is {_shown(results[2])}, not a list of commands")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UsageError(f"--update: {path} is not a memory report's JSON ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}); move it away or write to another "
                         "--output_dir") from None
    differs = [key for key in ("gpu", "torch", "torchvision", "deepspeed", "cuda")
               if measured.get(key) != env.get(key)]
    shared = ("num_classes", "image_size", "fp16", "bf16", "precision_mode", "find_max_batch", "gpu_memory_gib", "steps",
              *(() if args.find_max_batch else ("batch_size",)))  # the search picks each row's own micro-batch
    differs += [f"--{key}" for key in shared if measured.get(f"--{key}") != getattr(args, key)]
    if differs:
        raise UsageError(f"--update: {path} was measured with another {', '.join(differs)}; write to another "
                         "--output_dir")
    check_rows(results[0], path, args.find_max_batch)
    reference = results[1]
    if reference is not None and not (isinstance(reference, dict) and _whole(reference.get("batch"))
                                      and _figure_of("images_per_s", reference.get("images_per_s"))):
        raise UsageError(f"--update: {path}: its reference {_shown(reference)} is not the plain loop's batch and "
                         "images/s; move it away or write to another --output_dir")
    return results


PRECISIONS = ("fp32", "fp16", "bf16", "autocast-fp16", "autocast-bf16")  # engine.config.precision's names
# the largest figure a row can hold, by its kind: no rank has a pebibyte, no model 10**13 parameters
LIMITS = {"gib": 2 ** 20, "count": 10 ** 13}
# what a row holds besides its figures (any *_gib key, and ROW_FIGURES), as the report writes it: name -> (what it
# must be, a test of a value); a key of neither kind (another script's) is carried over as it is
ROW_FIELDS = {
    "config": ("a configuration's name", lambda v: isinstance(v, str)),
    "flags": ("a list of flags", lambda v: v is None or isinstance(v, list) and all(isinstance(f, str) for f in v)),
    "precision": (f"one of {', '.join(PRECISIONS)}", lambda v: v in PRECISIONS),
    "commit": ("a commit", lambda v: isinstance(v, str)),
    "error": ("a message", lambda v: isinstance(v, str) and v.strip()),
    "out_of_memory": ("true or false", lambda v: isinstance(v, bool)),
    "max_micro_batch": ("a whole number of images", lambda v: _whole(v)),
    "global_batch": ("a whole number of images", lambda v: v is None or _whole(v)),
    "params": ("a whole number of parameters", lambda v: _whole(v)),
    "tries": ("a list of the search's tries", lambda v: isinstance(v, list) and all(
        isinstance(t, dict) and _whole(t.get("batch")) and isinstance(t.get("fits"), bool)
        and all(_figure_of(k, x) for k, x in t.items() if k not in ("batch", "fits")) for t in v)),
    "per_rank": ("a list of each rank's GiB figures", lambda v: isinstance(v, list) and all(
        isinstance(r, dict) and all(k.endswith("_gib") and _figure_of(k, x) for k, x in r.items()) for r in v)),
}
ROW_FIGURES = ("images_per_s", "ratio_to_reference", "global_batch_images_per_s", "seconds")


def _figure(value):
    """JSON's NaN and Infinity, which json reads as floats, are no figures (the table said "(inf M params)", and the
    JSON was written back with tokens strict readers refuse), nor are true and false, nor a whole number past a
    float's range (10**400: the table's division ended in an OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _whole(value):
    return type(value) is int and 0 <= value <= LIMITS["count"]


def _figure_of(key, value):
    """Whether `value` can be row figure `key`: null (not measured), or a number from 0 to its kind's limit."""
    return value is None or (_figure(value) and 0 <= value <= LIMITS["gib" if key.endswith("_gib") else "count"])


def _shown(value):
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _row_problem(row):
    """What makes an earlier row one the merge, the table or the chart cannot read, or write back as it should."""
    if not isinstance(row, dict) or not isinstance(row.get("config"), str):
        return "is not an object with its configuration's name (config)"
    for key, value in row.items():
        if key in ROW_FIELDS and not ROW_FIELDS[key][1](value):
            return f"has {key} {_shown(value)}, not {ROW_FIELDS[key][0]}"
        if (key.endswith("_gib") or key in ROW_FIGURES) and not _figure_of(key, value):
            why = ("not a number" if not _figure(value) else "below 0" if value < 0 else
                   f"over {LIMITS['gib']:,} GiB" if key.endswith("_gib") else f"over {LIMITS['count']:.0e}")
            return f"has {key} {_shown(value)}, {why}"
    return None


def check_rows(rows, path, searched):
    """Refuse an --update file's rows that the merge, the table or the chart cannot read, or that it would write
    back wrong: found only when the report was written, they ended the run in a traceback after measuring (the
    measurement lost), or went into the new report as they were."""
    if not isinstance(rows, list):
        raise UsageError(f"--update: {path}: its results are not a list of rows; move it away or write to another "
                         "--output_dir")
    for at, row in enumerate(rows):
        why = _row_problem(row)
        if why is None and searched and "error" not in row and "max_micro_batch" not in row:
            why = "has no max_micro_batch"
        if why is None and row["config"] in (earlier["config"] for earlier in rows[:at]):
            why = f"is a second row of {row['config']!r} (a report has one row a configuration)"
        if why is not None:
            raise UsageError(f"--update: {path}: results[{at}] {why}; move it away or write to another --output_dir")


def write_results(args, rows, world_size, env, reference=None):
    """The JSON and the bar chart of `rows` (with --update, merged into the earlier JSON's: this run's rows
    replace the configurations it measured again); returns (all rows, the reference)."""
    earlier_rows, earlier_reference, commands = earlier_results(args, env, world_size)
    measured = {row["config"] for row in rows}
    order = list(CONFIGS)
    # a configuration this script no longer has (an earlier JSON's row) keeps its place after the known ones
    rows = sorted([row for row in earlier_rows if row["config"] not in measured] + rows,
                  key=lambda row: order.index(row["config"]) if row["config"] in order else len(order))
    reference = reference or earlier_reference
    for row in rows:
        if reference and reference.get("images_per_s") and row.get("images_per_s"):
            row["ratio_to_reference"] = row["images_per_s"] / reference["images_per_s"]
    settings = settings_of(args, leave_out=("local_rank",))
    env = {**env, "commands": [*commands, env["command"]] if env["command"] not in commands else commands}
    data = {"environment": env, "settings": settings, "world_size": world_size, "results": rows,
            **({"reference": reference} if reference else {})}
    path = results_path(args, env, world_size)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    plot(rows, args, world_size, env, path.with_suffix(".png"))
    return rows, reference


@rank_zero_only
def report(args, rows, world_size, env, reference=None):
    """Write the JSON and the bar chart, and print the table; returns the JSON path."""
    rows, reference = write_results(args, rows, world_size, env, reference)
    stem = results_path(args, env, world_size).with_suffix("")

    params = next((row["params"] for row in rows if "params" in row), 0)
    at = (f"the largest micro-batch of each under {args.gpu_memory_gib:g} GiB" if args.find_max_batch and args.gpu_memory_gib
          else "the largest micro-batch of each" if args.find_max_batch else f"micro-batch {args.batch_size}")
    print(f"\n{args.model} ({params / 1e6:.1f} M params), {at}, {args.image_size} px, {world_size} rank(s) on "
          f"{env['gpu'] or 'CPU'}; GiB per rank, the largest over ranks")
    if reference:
        whole = "the whole GPU" if world_size == 1 else f"{world_size} whole GPUs (DDP; images/s of all)"
        print(f"reference: {PLAIN} on {whole} at micro-batch {reference['batch']}: "
              + (f"{reference['images_per_s']:.1f} images/s" if reference["images_per_s"] else "out of memory"))
    searched = args.find_max_batch
    columns = [("paper", "paper_formula_gib", 7), ("DS est", "deepspeed_estimate_gpu_gib", 8),
               ("states", "model_states_gib", 8), *([] if searched else [("activ", "activations_gib", 8)]),
               ("peak", "peak_allocated_gib", 8), ("reserved", "peak_reserved_gib", 9), ("host", "host_peak_rss_gib", 7)]
    print(f"{'configuration':<50}" + "".join(f"{title:>{width}}" for title, _, width in columns)
          + (f"{'max batch':>10}{'images/s':>10}{'ratio':>7}" if searched else ""))
    for row in rows:
        if "error" in row:
            print(f"{row['config']:<50}FAILED: {row['error'].strip().splitlines()[-1][:100]}")
            continue
        shown = [fmt(row.get(key)) for _, key, _ in columns]
        print(f"{row['config']:<50}" + "".join(f"{value:>{width}}" for value, (_, _, width) in zip(shown, columns))
              + (f"{row['max_micro_batch']:>10}{fmt(row.get('images_per_s')):>10}{fmt(row.get('ratio_to_reference')):>7}"
                 if searched else ""))
    print(f"results: {stem}.json and .png")
    return stem.with_suffix(".json")


def plot(rows, args, world_size, env, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = env["gpu"] is not None
    series = ([("paper formula (model states)", "paper_formula_gib"),
               ("DeepSpeed estimator (model states)", "deepspeed_estimate_gpu_gib"),
               ("measured model states", "model_states_gib"), ("measured peak", "peak_allocated_gib")]
              if gpu else [("host peak RSS", "host_peak_rss_gib")])
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 5), constrained_layout=True)
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        ax.bar([x + i * width for x in range(len(rows))], [row.get(key) or 0 for row in rows], width, label=label)
    centres = [x + width * (len(series) - 1) / 2 for x in range(len(rows))]
    ax.set_xticks(centres, [row["config"].replace(" + ", "\n+ ").replace(", ", ",\n") for row in rows], fontsize=8)
    top = max((row.get(key) or 0 for row in rows for _, key in series), default=0)
    for centre, row in zip(centres, rows):
        if row.get("max_micro_batch") is not None:
            ax.text(centre, top * 1.04, f"max batch {row['max_micro_batch']}", ha="center", fontsize=8)
    if any(row.get("max_micro_batch") is not None for row in rows):
        ax.set_ylim(0, top * 1.12)
    ax.set_ylabel("GiB per rank (largest over ranks)" if gpu else "GiB per process")
    at = "the largest micro-batch" if args.find_max_batch else f"micro-batch {args.batch_size}"
    ax.set_title(f"{args.model}, {at}, {args.image_size} px, {world_size} rank(s), "
                 f"{rows[0].get('precision', '') if rows else ''} — {env['gpu'] or 'CPU'}")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def largest_over_ranks(per_rank):
    """One row per configuration: for every figure the largest over ranks (what must fit on each GPU)."""
    rows = []
    for results in zip(*per_rank):
        row = dict(results[0])
        for key, value in row.items():
            if key.endswith("_gib") and value is not None:
                row[key] = max(r[key] for r in results)
        row["per_rank"] = [{k: v for k, v in r.items() if k.endswith("_gib")} for r in results]
        rows.append(row)
    return rows


def check_args(args, cuda):
    if args.fp16 and args.bf16:
        raise UsageError("--fp16 and --bf16 exclude each other")
    for name in ("batch_size", "steps", "image_size", "num_classes"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    twice = sorted({name for name in args.configs if args.configs.count(name) > 1})
    if twice:  # a report holds one row a configuration: --update then refused the report this wrote
        raise UsageError(f"--configs names {', '.join(twice)} twice: give each configuration once")
    check_outside_checkpoints(args.output_dir, "--output_dir")  # the checkpoint's next save deleted the report
    check_writable(args.output_dir, "--output_dir")
    check_input_fits(args.batch_size, args.image_size)
    shapes = check_image_size(args.model, args.num_classes, args.image_size, args.batch_size,  # on the meta device
                              sync_bn=False)
    weights_gib, memory = sum(p.numel() for p in shapes.parameters()) * 4 / 2**30, memory_gib()
    if memory is not None and weights_gib > memory:  # a head of 10**8 classes: an allocation's traceback
        raise UsageError(f"--num_classes {args.num_classes}: the model's fp32 weights alone are {weights_gib:,.0f} GiB, "
                         f"more than this machine's {memory:,.0f} GiB of memory")
    if args.fp16 and not cuda:
        raise UsageError("fp16 needs a GPU: use --bf16 on a CPU-only machine")
    if args.find_max_batch and not cuda:
        raise UsageError("--find_max_batch needs a GPU (it searches for the largest micro-batch the GPU's memory "
                         "holds), and this machine has none")
    if args.find_max_batch and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--find_max_batch runs as one process: start it with python (--num_gpus N for N ranks); "
                         "under a launcher an out-of-memory error on one rank would leave the others waiting")
    if not 1 <= args.num_gpus <= max(1, torch.cuda.device_count()) or args.num_gpus > 1 and not args.find_max_batch:
        here = torch.cuda.device_count()
        raise UsageError("--num_gpus goes with --find_max_batch and "
                         + (f"is 1 to the GPUs here ({here})" if here else "a GPU (this machine has none)")
                         + "; without it start several ranks with deepspeed --num_gpus")
    if args.max_batch_limit < 1:
        raise UsageError("--max_batch_limit must be at least 1")
    if args.global_batch is not None and (not args.find_max_batch or args.global_batch < 1):
        raise UsageError("--global_batch goes with --find_max_batch and must be at least 1")
    if args.gpu_memory_gib is not None and (not cuda or not args.gpu_memory_gib > 0):
        raise UsageError("--gpu_memory_gib needs a GPU and a positive size")


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    child_process = args.probe or args.search
    if not child_process:
        check_args(args, cuda)
    sizes = model_sizes(args.model, args.num_classes, args.image_size)
    if child_process:
        device, budget = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu"), 0
        if cuda:
            budget = torch.cuda.get_device_properties(device).total_memory
            if args.gpu_memory_gib:
                torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * GIB / budget), device)
                budget = min(budget, args.gpu_memory_gib * GIB)
            torch.backends.cudnn.benchmark = True
        _, world_size = init_distributed()
        if world_size > 1:  # every rank must predict the same next micro-batch: the smallest GPU's budget
            budget = torch.tensor([float(budget)], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(budget, op=torch.distributed.ReduceOp.MIN)
            budget = budget.item()
        return probe(args, device, sizes) if args.probe else search_process(args, device, sizes, budget)
    env = environment()
    with alike_on_each_node():  # every rank reads the same file: refused before measuring, not after
        _, reference, _ = earlier_results(args, env, args.num_gpus if args.find_max_batch else checked_world_size())
    if args.find_max_batch:  # every try runs in a child process: this one keeps no GPU memory
        if args.gpu_memory_gib and not (reference and reference["batch"] == args.batch_size):
            reference = reference_speed(args)
        rows = largest_batches(args, sizes, lambda rows: write_results(args, rows, args.num_gpus, env, reference))
        report(args, rows, args.num_gpus, env, reference)
        return 0
    _, world_size = init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.gpu_memory_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * GIB / total), device)
    if cuda:
        torch.backends.cudnn.benchmark = True
    counters = MemoryCounters(device)
    mine = [measure(args, name, world_size, device, counters, sizes) for name in args.configs]
    per_rank = [mine]
    if world_size > 1:
        per_rank = [None] * world_size
        torch.distributed.all_gather_object(per_rank, mine)
    report(args, largest_over_ranks(per_rank), world_size, env)
    shut_down()
    return 0


if __name__ == "__main__":
    exit_now(run_cli(main))  # the report is written: leave without the interpreter's teardown, as the trainer does
