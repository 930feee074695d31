"""What each ZeRO stage and offload really costs in memory: a few real training steps per configuration.

For each configuration (ZeRO-0, the DDP-like baseline; ZeRO-1, 2, 3; optimizer offload; optimizer and
parameter offload) this builds the model and the DeepSpeed config the trainer would, runs a few steps
on synthetic images and records on every rank:

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

    python src/memory_profile.py --model resnet18 --batch_size 64 --bf16
    deepspeed --num_gpus 2 src/memory_profile.py --model wide_resnet50_2 --bf16
    python src/memory_profile.py --model resnet50 --bf16 --find_max_batch --gpu_memory_gib 8
"""
import argparse
import gc
import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

import train_deepspeed
from data import batch_memory_format
from distributed import init_distributed, rank_zero_only, run_on_free_port, shut_down
from ds_config import build_ds_config, precision
from failures import UsageError
from model import build_model
from options import parse_args, run_cli
from reproducibility import environment, machine_slug
from training import input_dtype

# name -> trainer flags
CONFIGS = {
    "ZeRO-0 (DDP-like)": ["--zero_stage", "0"],
    "ZeRO-1": ["--zero_stage", "1"],
    "ZeRO-2": ["--zero_stage", "2"],
    "ZeRO-3": ["--zero_stage", "3"],
    "ZeRO-2 + offload optimizer": ["--zero_stage", "2", "--offload_optimizer"],
    "ZeRO-3 + offload optimizer + params": ["--zero_stage", "3", "--offload_optimizer", "--offload_param"],
}
GIB = 2**30
CUDA_CONTEXT_GIB = 1  # what a process's CUDA context takes on the GPU besides its capped allocations, at most


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="any torchvision classifier, as the trainer's --model")
    parser.add_argument("--num_classes", type=int, default=90)
    parser.add_argument("--batch_size", type=int, default=64, help="micro-batch per rank")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--fp16", action="store_true", help="fp16 compute (GPU only)")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute")
    parser.add_argument("--precision_mode", choices=["auto", "autocast", "half_weights"], default="auto",
                        help="as the trainer's flag: autocast keeps fp32 weights, half_weights DeepSpeed's fp16/bf16")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), metavar="NAME",
                        help=f"configurations to measure (default: all): {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=3, help="training steps per configuration")
    parser.add_argument("--find_max_batch", action="store_true",
                        help="also search the largest micro-batch that trains without running out of GPU memory "
                             "(one GPU, one process)")
    parser.add_argument("--gpu_memory_gib", type=float, default=None,
                        help="let PyTorch use only this much GPU memory, as on a smaller GPU")
    parser.add_argument("--output_dir", type=Path, default=Path("memory_profile"))
    parser.add_argument("--probe", nargs=2, metavar=("CONFIG", "BATCH"), help=argparse.SUPPRESS)  # one try of fits()
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by `deepspeed`
    return parser


def trainer_config(args, flags, micro_batch, world_size, device, num_params):
    precision_flags = [flag for flag in ("fp16", "bf16") if getattr(args, flag)]
    argv = ["--model", args.model, "--batch_size", str(micro_batch), "--epochs", "1",
            "--precision_mode", args.precision_mode,
            *[f"--{flag}" for flag in precision_flags], *flags]
    train_args = parse_args(train_deepspeed.get_args_parser, argv)
    return build_ds_config(train_args, world_size, micro_batch * world_size * (args.steps + 1),
                           device_type=device.type, num_params=num_params)


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


def train_steps(engine, config, micro_batch, args, device, steps):
    """`steps` optimizer steps on a synthetic batch; returns the memory held between steps after each."""
    dtype = input_dtype(precision(config))
    images = torch.randn(micro_batch, 3, args.image_size, args.image_size, device=device)
    images = images.to(dtype, memory_format=batch_memory_format(device))
    labels = torch.randint(0, args.num_classes, (micro_batch,), device=device)
    held = []
    for _ in range(steps):
        loss = F.cross_entropy(engine(images).float(), labels)
        engine.backward(loss)
        engine.step()
        held.append(torch.cuda.memory_allocated(device) if device.type == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return held


def new_engine(args, config):
    import deepspeed

    model = build_model(args.model, args.num_classes, args.image_size)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return model, engine


def release(engine):
    """Drop an engine and what DeepSpeed keeps of it, so the next configuration starts from nothing."""
    engine.destroy()  # also the optimizer's: ZeRO-3 removes its hooks and partitioned parameters
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args, name, world_size, device, counters, sizes):
    """One configuration's figures on this rank; `sizes`: (parameters, largest layer's parameters)."""
    config = trainer_config(args, CONFIGS[name], args.batch_size, world_size, device, sizes[0])
    counters.reset()
    started = time.perf_counter()
    _, engine = new_engine(args, config)
    after_init = counters.since_reset(counters.allocated())
    held = [counters.since_reset(value) for value in train_steps(engine, config, args.batch_size, args, device,
                                                                 args.steps)]
    peaks = counters.peaks()
    estimate_gpu, estimate_cpu = deepspeed_estimate_bytes(config, *sizes, world_size)
    release(engine)
    model_states = held[-1]
    activations = (None if model_states is None or peaks["peak_allocated_gib"] is None
                   else peaks["peak_allocated_gib"] - model_states)
    return {"config": name, "flags": CONFIGS[name], "precision": precision(config), "params": sizes[0],
            "paper_formula_gib": paper_formula_bytes(config, sizes[0], world_size) / GIB,
            "deepspeed_estimate_gpu_gib": None if estimate_gpu is None else estimate_gpu / GIB,
            "deepspeed_estimate_cpu_gib": None if estimate_cpu is None else estimate_cpu / GIB,
            "after_init_gib": after_init, "model_states_gib": model_states, "activations_gib": activations,
            **peaks, "seconds": time.perf_counter() - started}


def is_out_of_memory(err):
    # some of DeepSpeed's allocations report it as a plain RuntimeError
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err))


PROBE_OUT_OF_MEMORY = 3  # exit status of a --probe that ran out of memory


def fits(args, name, micro_batch, device, num_params):
    """Whether `micro_batch` trains for two steps on one GPU without running out of memory.

    Each try runs in a process of its own: what a try leaves behind after an out-of-memory error is not
    all freed in the process (engine.destroy(), gc, empty_cache). On an H100 limited to 8 GiB, the two
    offload configurations searched after ZeRO-3's search "ran out of memory" even at micro-batch 1, with
    wide_resnet50_2, which ZeRO-0 trained at 128 in the same run.
    """
    command = [sys.executable, os.path.abspath(__file__), "--probe", name, str(micro_batch),
               "--model", args.model, "--num_classes", str(args.num_classes), "--image_size", str(args.image_size),
               "--precision_mode", args.precision_mode, *[f"--{flag}" for flag in ("fp16", "bf16") if getattr(args, flag)],
               *(["--gpu_memory_gib", str(args.gpu_memory_gib)] if args.gpu_memory_gib else [])]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    started = time.perf_counter()
    result = run_on_free_port(lambda port: subprocess.run(command, env={**env, "MASTER_PORT": str(port)},
                                                          capture_output=True, text=True))
    if result.returncode not in (0, PROBE_OUT_OF_MEMORY):
        raise RuntimeError(f"the try of {name} at micro-batch {micro_batch} failed:\n{result.stderr[-3000:]}")
    print(f"  {name}: micro-batch {micro_batch} {'fits' if result.returncode == 0 else 'runs out of memory'} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    return result.returncode == 0


def probe(args, device, num_params):
    """--probe NAME BATCH: two training steps; exit status 0 if they fit, PROBE_OUT_OF_MEMORY if not."""
    name, micro_batch = args.probe[0], int(args.probe[1])
    config = trainer_config(args, CONFIGS[name], micro_batch, 1, device, num_params)
    try:
        _, engine = new_engine(args, config)
        train_steps(engine, config, micro_batch, args, device, 2)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_out_of_memory(err):
            raise
        return PROBE_OUT_OF_MEMORY
    return 0


def find_max_batch(args, name, device, num_params, start=16):
    """Double the micro-batch until a step runs out of memory, then bisect to within 5%."""
    low, high = 0, start
    while fits(args, name, high, device, num_params):
        low, high = high, high * 2
    while high - low > max(1, low // 20):
        middle = (low + high) // 2
        low, high = (middle, high) if fits(args, name, middle, device, num_params) else (low, middle)
    return low


def max_batches(args, device, num_params):
    """{config: (largest micro-batch, whether --batch_size fits)}. Under --gpu_memory_gib every try is held to
    the cap, so when the GPU has room for one capped process per configuration, the searches run side by side."""
    def search(name):
        fits_given = fits(args, name, args.batch_size, device, num_params)
        return find_max_batch(args, name, device, num_params, start=16 if fits_given else 1), fits_given

    side_by_side = 1
    if args.gpu_memory_gib:
        free, _ = torch.cuda.mem_get_info(device)
        side_by_side = max(1, min(len(args.configs), int(free // ((args.gpu_memory_gib + CUDA_CONTEXT_GIB) * GIB))))
    with ThreadPoolExecutor(side_by_side) as pool:
        return dict(zip(args.configs, pool.map(search, args.configs)))


def fmt(value):
    return "-" if value is None else f"{value:.2f}"


@rank_zero_only
def report(args, rows, world_size, env):
    """Print the table and write the JSON and the bar chart; returns the JSON path."""
    slug = machine_slug(env)
    stem = f"memory_{args.model}_{slug}_x{world_size}"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "local_rank"}
    data = {"environment": env, "settings": settings, "world_size": world_size, "results": rows}
    (args.output_dir / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(rows, args, world_size, env, args.output_dir / f"{stem}.png")

    params = rows[0]["params"] if rows else 0
    print(f"\n{args.model} ({params / 1e6:.1f} M params), micro-batch {args.batch_size}, {args.image_size} px, "
          f"{world_size} rank(s) on {env['gpu'] or 'CPU'}; GiB per rank, the largest over ranks")
    header = (f"{'configuration':<38}{'paper':>7}{'DS est':>8}{'states':>8}{'activ':>8}{'peak':>8}{'reserved':>9}"
              f"{'host':>7}" + (f"{'max batch':>10}" if args.find_max_batch else ""))
    print(header)
    for row in rows:
        figures = ("paper_formula_gib", "deepspeed_estimate_gpu_gib", "model_states_gib", "activations_gib",
                   "peak_allocated_gib", "peak_reserved_gib", "host_peak_rss_gib")
        shown = ([fmt(row.get(key)) for key in figures] if not row.get("out_of_memory")
                 else ["-"] * 4 + [f"OOM at {args.batch_size}", "-", "-"])
        print(f"{row['config']:<38}" + "".join(f"{value:>{width}}" for value, width in zip(shown, (7, 8, 8, 8, 8, 9, 7)))
              + (f"{row.get('max_micro_batch') or '-':>10}" if args.find_max_batch else ""))
    print(f"results: {args.output_dir / stem}.json and .png")
    return args.output_dir / f"{stem}.json"


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
    ax.set_title(f"{args.model}, micro-batch {args.batch_size}, {args.image_size} px, {world_size} rank(s), "
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


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    if args.fp16 and args.bf16:
        raise UsageError("--fp16 and --bf16 exclude each other")
    if args.batch_size < 1 or args.steps < 1:
        raise UsageError("--batch_size and --steps must be at least 1")
    cuda = torch.cuda.is_available()
    if args.fp16 and not cuda:
        raise UsageError("fp16 needs a GPU: use --bf16 on a CPU-only machine")
    if args.find_max_batch and (not cuda or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise UsageError("--find_max_batch needs one GPU and one process: an out-of-memory error on one rank "
                         "would leave the others waiting in a collective")
    if args.gpu_memory_gib and not cuda:
        raise UsageError("--gpu_memory_gib needs a GPU")
    _, world_size = init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.gpu_memory_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * GIB / total), device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    from deepspeed.runtime.zero.stage3 import model_to_params

    sizes = model_to_params(build_model(args.model, args.num_classes, args.image_size))
    if args.probe:
        return probe(args, device, sizes[0])
    counters = MemoryCounters(device)
    env = environment(shlex.join(["python", *sys.argv]))
    max_batch = max_batches(args, device, sizes[0]) if args.find_max_batch else {}
    mine = []
    for name in args.configs:
        if max_batch.get(name, (None, True))[1]:
            mine.append({**measure(args, name, world_size, device, counters, sizes),
                         **({"max_micro_batch": max_batch[name][0]} if name in max_batch else {})})
        else:
            mine.append({"config": name, "flags": CONFIGS[name], "params": sizes[0], "out_of_memory": True,
                         "max_micro_batch": max_batch[name][0]})
    per_rank = [mine]
    if world_size > 1:
        per_rank = [None] * world_size
        torch.distributed.all_gather_object(per_rank, mine)
    report(args, largest_over_ranks(per_rank), world_size, env)
    shut_down()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
