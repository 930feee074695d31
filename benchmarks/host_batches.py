"""Where the cache tier's batches come from, and what they wait on: the trainer's DeviceTrainLoader over a
decoded-image cache in host memory, beside the same loader with the squares on the GPU, under the trainer's
ResNet18 ZeRO-0 and ZeRO-2 steps, and alone.

The cache is --images random squares in a file mapped as image_cache maps it (from a warm page cache, as a
second run reads it). For each ZeRO stage, in a process of its own, the trainer's model, DeepSpeed config and
train_one_epoch over whole epochs of the loader:

- "GPU-resident squares": the device tier, the ceiling of the cache tier;
- "host squares": the cache tier as the trainer runs it; at ZeRO-2 also with the reading thread's gather
  (index_select) on 1 torch thread and on every core instead of device_data.GATHER_THREADS, and with batches
  gathered into pageable memory;
- "reader alone": the cache tier's batches drawn with no training, as fast as the reading thread goes.

images/s is over the timed epochs (after a warm-up epoch); "waiting" is the share of them spent waiting for
the next batch; "gather ms" is the mean time of one batch's gathered_host (index_select into pinned memory)
in the reading thread. Writes benchmarks/results/host_batches_<gpu>.json and prints the table last.

    python benchmarks/host_batches.py
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import report
from common import ROOT, environment, shown
from machine import machine_slug

# case -> (where the squares are, the reading thread's torch threads (None: the trainer's GATHER_THREADS),
# host batches "pinned" (the trainer's) or "pageable")
CASES = {"GPU-resident squares": ("device", None, "pinned"), "host squares": ("host", None, "pinned"),
         "host squares, gather on 1 thread": ("host", 1, "pinned"),
         "host squares, gather on every core": ("host", os.cpu_count(), "pinned"),
         "host squares, pageable batches": ("host", None, "pageable"), "reader alone": ("alone", None, "pinned")}
STAGE_CASES = {0: ["GPU-resident squares", "host squares", "reader alone"], 2: list(CASES)}


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=5400, help="squares in the cache")
    parser.add_argument("--square", type=int, default=256, help="side of a cached square")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=6, help="timed epochs per case, after one warm-up epoch")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 2], choices=[0, 2])
    parser.add_argument("--output_dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)  # a child process: this stage's cases
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    return parser


def mapped_squares(path, count, side):
    """`count` random squares written to `path` and mapped back, as image_cache.open_entry maps an entry."""
    size = count * 3 * side * side
    if not path.exists() or path.stat().st_size != size:
        generator = torch.Generator().manual_seed(0)
        with open(path, "wb") as file:
            for start in range(0, count, 512):
                rows = min(512, count - start)
                file.write(torch.randint(0, 256, (rows * 3 * side * side,), dtype=torch.uint8,
                                         generator=generator).numpy().tobytes())
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8).view(count, 3, side, side)


def timed_gathers(device_data):
    """Wrap device_data.gathered_host to record each call's seconds; returns the list they go to."""
    seconds, gathered = [], device_data.gathered_host

    def timed(*args):
        started = time.perf_counter()
        result = gathered(*args)
        seconds.append(time.perf_counter() - started)
        return result

    device_data.gathered_host = timed
    return seconds


def child(args):
    import deepspeed

    from deepspeed_image_trainer.engine import overrides as deepspeed_overrides
    from deepspeed_image_trainer.data import device as device_data
    from deepspeed_image_trainer.cli import train as train_deepspeed
    from deepspeed_image_trainer.engine.distributed import init_distributed
    from deepspeed_image_trainer.engine.config import build_ds_config, precision
    from deepspeed_image_trainer.models.build import build_model
    from deepspeed_image_trainer.cli.options import parse_args
    from deepspeed_image_trainer.engine.loop import input_dtype, train_one_epoch

    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.backends.cudnn.benchmark = True
    images = mapped_squares(args.cache, args.images, args.square)
    labels = torch.randint(0, 90, (args.images,), generator=torch.Generator().manual_seed(1))
    train_args = parse_args(train_deepspeed.get_args_parser,
                            ["--batch_size", str(args.batch_size), "--image_size", str(args.image_size),
                             "--zero_stage", str(args.stage), "--bf16"])
    model = build_model("resnet18", 90, args.image_size)
    config = build_ds_config(train_args, 1, args.images, device_type=device.type,
                             num_params=sum(p.numel() for p in model.parameters()))
    deepspeed_overrides.install()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = input_dtype(precision(config))
    on_device = (images.to(device), labels.to(device))
    seconds = timed_gathers(device_data)
    gather_threads, empty_host = device_data.GATHER_THREADS, device_data.empty_host
    results = {}
    for name in STAGE_CASES[args.stage]:
        where, threads, memory = CASES[name]
        device_data.GATHER_THREADS = threads or gather_threads
        device_data.empty_host = {"pinned": empty_host,
                                  "pageable": lambda shape, dtype, _: torch.empty(shape, dtype=dtype)}[memory]
        squares, square_labels = on_device if where == "device" else (images, labels)
        loader = device_data.DeviceTrainLoader(squares, square_labels, micro_batch_size=args.batch_size,
                                               image_size=args.image_size, rank=0, world_size=1, seed=0, dtype=dtype,
                                               device=device, host=where != "device")
        timed = {"images": 0, "time_s": 0.0, "data_wait_s": 0.0}
        for epoch in range(args.epochs + 1):
            del seconds[:]
            if where == "alone":
                started = time.perf_counter()
                for batch_images, _ in loader.epoch(epoch):
                    pass
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                metrics = {"time_s": time.perf_counter() - started, "data_wait_s": time.perf_counter() - started}
            else:
                metrics = train_one_epoch(engine, loader.epoch(epoch), epoch, dtype, loader.batches_per_epoch)
            if epoch:  # the first is the warm-up: cuDNN's choices, the page cache, pinned memory
                timed["images"] += loader.batches_per_epoch * args.batch_size
                timed["time_s"] += metrics["time_s"]
                timed["data_wait_s"] += metrics["data_wait_s"]
                timed.setdefault("gather_s", []).extend(seconds)
        gathers = timed.pop("gather_s", [])
        results[name] = {"images_per_s": timed["images"] / timed["time_s"],
                         "waiting": timed["data_wait_s"] / timed["time_s"] if where != "alone" else None,
                         "gather_ms": 1000 * sum(gathers) / len(gathers) if gathers else None,
                         "gather_threads": device_data.GATHER_THREADS, **timed}
        print(f"{name}: {results[name]['images_per_s']:,.0f} images/s", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(results), flush=True)


def run_stage(stage, args, cache):
    from deepspeed_image_trainer.engine.distributed import run_on_free_port

    command = [sys.executable, __file__, "--stage", str(stage), "--cache", str(cache),
               *(f"--{key}={getattr(args, key)}" for key in ("images", "square", "batch_size", "image_size", "epochs"))]
    result = run_on_free_port(lambda port: subprocess.run(command, capture_output=True, text=True,
                                                          env={**os.environ, "MASTER_PORT": str(port)}))
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        return {"error": (result.stdout + result.stderr)[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def main():
    args = get_args_parser().parse_args()
    if args.stage is not None:
        return child(args)
    env = environment()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "squares.bin"
        mapped_squares(cache, args.images, args.square)
        for stage in args.stages:
            results[str(stage)] = run_stage(stage, args, cache)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"host_batches_{machine_slug(env)}.json"
    settings = {key: value for key, value in vars(args).items() if key not in ("stage", "cache", "output_dir")}
    path.write_text(json.dumps({"environment": env, "settings": settings,
                                "results": results}, indent=1, default=str) + "\n")
    report.RESULTS = args.output_dir
    print(f"wrote {shown([str(path)])}\n\n{report.host_batches(path.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
