"""Where a step with gradient accumulation goes, per configuration: forward, backward and DeepSpeed's step()
timed apart (the GPU synchronised around each) for the micro-batches between optimizer steps and the one
that ends a step, under a GPU held to --gpu_memory_gib, beside plain PyTorch at the same micro-batch on the
whole GPU (the GPU's own work); then torch.profiler's busiest operations over one optimizer step.

Each configuration (memory_profile.py's names) runs in a process of its own, built as the trainer builds it.

    python benchmarks/offload_profile.py --model vit_h_14 --micro_batch 11 --accumulation 8 --gpu_memory_gib 8
    python benchmarks/offload_profile.py --model vit_h_14 --micro_batch 11 --accumulation 8 --gpu_memory_gib 8 \
        --overrides 1 overflow_on_device,grad_norm_on_device   # with and without one of the trainer's overrides
    python benchmarks/offload_profile.py --model vit_h_14 --micro_batch 11 --accumulation 8 --gpu_memory_gib 8 \
        --coalesce   # also with DeepSpeed's coalesce_grad_reduction: one reduction per optimizer step

Prints a table last; writes benchmarks/results/offload_profile_<model>_<gpu>.json and one
offload_profile_<model>_<configuration>.txt of profiler tables per configuration.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import memory_profile
from common import ROOT, environment, failed, settings_of, shown, slug_of
from deepspeed_image_trainer.engine.loop import GradientAccumulation
from machine import machine_slug

DEFAULT_CONFIGS = [memory_profile.PLAIN, "ZeRO-2 + offload optimizer, half weights"]
PHASES = ("forward", "backward", "step")


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_l_16")
    parser.add_argument("--micro_batch", type=int, default=32)
    parser.add_argument("--accumulation", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps (after one untimed)")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--gpu_memory_gib", type=float, default=None, help="hold PyTorch to this much GPU memory")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(memory_profile.CONFIGS),
                        metavar="NAME", help="memory_profile.py's configuration names")
    parser.add_argument("--overrides", nargs="+", default=["1"], metavar="VALUE",
                        help="run each DeepSpeed configuration under each of these TRAINER_DEEPSPEED_OVERRIDES "
                             "values (1: all of src/deepspeed_image_trainer/engine/overrides.py's groups, 0: none, or a list of groups)")
    parser.add_argument("--coalesce", action="store_true",
                        help="also run each DeepSpeed configuration inside DeepSpeed's engine.coalesce_grad_reduction(): "
                             "the micro-batches before the last keep their gradients on the GPU, without ZeRO's "
                             "per-parameter hooks, and one reduction (and copy to the CPU) ends the step")
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--config", help=argparse.SUPPRESS)  # the child process of one configuration
    parser.add_argument("--coalesced", action="store_true", help=argparse.SUPPRESS)  # and it coalesces
    return parser


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(engine, batch, accumulation, plain, device, coalesced=False):
    """One optimizer step of `accumulation` micro-batches: {phase: seconds} for the micro-batches between
    steps ("... between", averaged) and the one that ends the step ("... at the step"). `coalesced`: as the
    trainer coalesces (training.GradientAccumulation); the one reduction of the summed gradients counts as the
    last micro-batch's step."""
    images, labels = batch
    between = {phase: 0.0 for phase in PHASES}
    last = {}
    steps = None if plain else GradientAccumulation(engine, coalesced)
    for micro in range(accumulation):
        times = {}
        synchronize(device)
        started = time.perf_counter()
        loss = F.cross_entropy(engine(images).float(), labels)
        synchronize(device)
        times["forward"] = time.perf_counter() - started
        started = time.perf_counter()
        if steps is None:
            engine.backward(loss)
        else:
            steps.backward(loss, micro == accumulation - 1)
        synchronize(device)
        times["backward"] = time.perf_counter() - started
        started = time.perf_counter()
        if steps is not None:  # DeepSpeed's step() steps the optimizer at the boundary
            steps.step(micro == accumulation - 1)
        elif micro == accumulation - 1:
            engine.step()
        synchronize(device)
        times["step"] = time.perf_counter() - started
        if micro == accumulation - 1:
            last = times
        else:
            between = {phase: between[phase] + times[phase] / max(1, accumulation - 1) for phase in PHASES}
    return between, last


def child(args):
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    plain = memory_profile.CONFIGS[args.config] is None
    if args.gpu_memory_gib and device.type == "cuda" and not plain:  # plain PyTorch: what the GPU itself takes
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * 2**30 / total), device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    profile_args = memory_profile.get_args_parser().parse_args(
        ["--model", args.model, "--bf16", "--image_size", str(args.image_size)])
    os.environ.setdefault("MASTER_PORT", str(memory_profile.distributed.free_port()))
    memory_profile.init_distributed()
    params = memory_profile.model_sizes(args.model, profile_args.num_classes, args.image_size)[0]
    config = memory_profile.config_of(profile_args, args.config, args.micro_batch, 1, device, params, args.accumulation)
    engine = memory_profile.new_engine(profile_args, args.config, config, device, 1)
    batch = memory_profile.synthetic_batch(profile_args, config, args.micro_batch, device)
    coalesced = memory_profile.coalesces(args.config, config, "on" if args.coalesced else None)
    timed_step(engine, batch, args.accumulation, plain, device, coalesced)  # allocates the optimizer state, tunes cuDNN
    runs = [timed_step(engine, batch, args.accumulation, plain, device, coalesced) for _ in range(args.steps)]
    between = {phase: sum(run[0][phase] for run in runs) / len(runs) * 1e3 for phase in PHASES}
    at_step = {phase: sum(run[1][phase] for run in runs) / len(runs) * 1e3 for phase in PHASES}
    step_ms = sum(between.values()) * (args.accumulation - 1) + sum(at_step.values())
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profiler:
        timed_step(engine, batch, args.accumulation, plain, device, coalesced)
    table = profiler.key_averages()
    text = (f"{args.model}, {args.config}, micro-batch {args.micro_batch} x {args.accumulation}, one optimizer step\n\n"
            f"By the host's own time:\n{table.table(sort_by='self_cpu_time_total', row_limit=25)}\n")
    if device.type == "cuda":
        text += f"By the GPU's own time:\n{table.table(sort_by='self_cuda_time_total', row_limit=15)}\n"
    overrides = os.environ.get("TRAINER_DEEPSPEED_OVERRIDES", "1")
    path = args.output_dir / (f"offload_profile_{slug_of(args.model)}_{slug_of(args.config)}"
                              + ("" if plain or overrides == "1" else f"_overrides_{slug_of(overrides)}")
                              + ("_coalesced" if args.coalesced else "") + ".txt")
    path.write_text(text)
    print("RESULT " + json.dumps({
        "coalesced": coalesced, "between_ms": between, "at_step_ms": at_step, "step_ms": step_ms,
        "images_per_s": args.micro_batch * args.accumulation / step_ms * 1e3,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
        "profile": shown([str(path)])}), flush=True)
    memory_profile.exit_now(0)


def run_config(args, name, overrides="1", coalesced=False):
    command = [sys.executable, __file__, "--config", name, "--model", args.model,
               "--micro_batch", str(args.micro_batch),
               "--accumulation", str(args.accumulation), "--steps", str(args.steps), "--image_size",
               str(args.image_size), "--output_dir", str(args.output_dir),
               *(["--gpu_memory_gib", str(args.gpu_memory_gib)] if args.gpu_memory_gib else []),
               *(["--coalesced"] if coalesced else [])]
    result = subprocess.run(command, capture_output=True, text=True, env={
        **os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "TRAINER_DEEPSPEED_OVERRIDES": overrides})
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    said = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    raised = [line for line in said if re.search(r"\w(Error|Exception): ", line)]  # not the traceback's paths
    return {"error": (raised or said or [f"exit status {result.returncode}"])[-1]}


def main():
    args = get_args_parser().parse_args()
    if args.config:
        return child(args)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    results = {}
    path = args.output_dir / f"offload_profile_{slug_of(args.model)}_{machine_slug(env)}.json"
    settings = settings_of(args, leave_out=("config",))
    for name in args.configs:
        flags = memory_profile.CONFIGS[name]
        plain = flags is None
        both = args.coalesce and not plain and flags[flags.index("--zero_stage") + 1] != "0"  # none at ZeRO-0
        ways = [(overrides, coalesced) for overrides in (args.overrides[:1] if plain else args.overrides)
                for coalesced in ([False, True] if both else [False])]
        for overrides, coalesced in ways:
            key = name + ("" if plain or len(args.overrides) == 1 else f" [overrides: {overrides}]") + (
                " [coalesced]" if coalesced else "")
            results[key] = {"flags": memory_profile.with_coalescing(flags, "on") if coalesced else flags,
                            **({} if plain else {"overrides": overrides, "coalesced": coalesced}),
                            **run_config(args, name, overrides, coalesced)}
            print(f"{key}: {json.dumps(results[key])[:400]}", flush=True)
            path.write_text(json.dumps({"environment": env, "settings": settings, "results": results}, indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} | {args.model}, micro-batch {args.micro_batch} x {args.accumulation}, bf16, "
          f"{args.image_size} px" + (f", held to {args.gpu_memory_gib:g} GiB" if args.gpu_memory_gib else ""))
    print(f"{'configuration':<62}{'fwd':>7}{'bwd':>7}{'step':>7}{'| last: fwd':>11}{'bwd':>7}{'step':>8}"
          f"{'step ms':>9}{'img/s':>7}")
    for name, r in results.items():
        if "error" in r:
            print(failed(name, r, 61))
            continue
        print(f"{name:<62}" + "".join(f"{r['between_ms'][p]:>7.1f}" for p in PHASES)
              + f"{r['at_step_ms']['forward']:>11.1f}{r['at_step_ms']['backward']:>7.1f}{r['at_step_ms']['step']:>8.1f}"
              + f"{r['step_ms']:>9.0f}{r['images_per_s']:>7.1f}")
    print(f"results: {shown([str(path)])}")


if __name__ == "__main__":
    main()
