"""ZeRO-3's settings, and ZeRO-1/2's gradient hooks, one at a time, against the plain PyTorch loop of the same
model in the same run.

ZeRO-3 gathers and releases parameters in Python hooks around every module, and how much work that is
depends on settings DeepSpeed leaves to the user: which modules are gathered as one unit (leaf modules,
which the trainer sets to each family's repeated block, or the granularity threshold), which parameters
stay whole on every GPU (the persistence threshold), how far ahead a parameter that is used again is kept
(the reuse distance). Each variant below is the trainer's own ZeRO-3 config (the same flags as
launch_deepspeed.py) with one of them changed, through a base config as a user passes one with
--deepspeed_config; each runs train_one_epoch on a GPU-resident synthetic batch
in a process of its own (throughput.py's trainer case), the plain loop in another.

    python benchmarks/zero3_settings.py                                   # resnet18, micro-batch 256
    python benchmarks/zero3_settings.py --model vit_l_16 --batch_size 32 --steps 20 --warmup_steps 5
    python benchmarks/zero3_settings.py --model vit_b_16 --batch_size 64 --steps 20 --warmup_steps 5 \
        --variants zero2 "zero2 contiguous_gradients on" zero1 "zero1 contiguous_gradients on"   # ZeRO-1/2 only
    python benchmarks/zero3_settings.py --model vit_l_16 --batch_size 32 --steps 20 --warmup_steps 10 \
        --case_timeout 420 --variants "zero3 torch.compile" "zero3 DeepCompile"   # + the compiled plain loop
    python benchmarks/zero3_settings.py --model timm:vit_gigantic_patch14_clip_224 --batch_size 32 --num_gpus 2 \
        --half_weights --reference "torch bf16 FSDP2" --steps 10 --warmup_steps 3 --variants \
        "zero3 (trainer: blocks as leaf modules)" "zero3 ZeRO++ quantized weights" \
        "zero3 ZeRO++ quantized gradients" "zero3 ZeRO++ hpZ over the node's GPUs"   # ZeRO++, one at a time
    python benchmarks/zero3_settings.py --model timm:vit_gigantic_patch14_clip_224 --batch_size 32 --num_gpus 2 \
        --half_weights --reference "torch bf16 FSDP2" --steps 10 --warmup_steps 10 --case_timeout 420 \
        --variants "zero3 DeepCompile"   # + FSDP2 under torch.compile

A variant that compiles (--compile) is also compared with the reference's loop under torch.compile (the plain
loop's, or FSDP2's), measured in the same run. --trace (GPU) runs each case's steps once more under
torch.profiler and adds what the trace says to its JSON: the GPU's busy time (compute kernels, NCCL's), kernels
a step, and how long compute kernels wait between their launch on the host and their start, which tells a GPU
held back by the host from one that is not.

Prints a table last; writes benchmarks/results/zero3_settings_<model>_b<micro-batch>_<gpu>.json.
"""
import cProfile
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import (REFERENCES, ROOT, GpuTrace, environment, failed, fmt, measurement_parser, ratio, reference_case,
                    run_case_of, settings_of, shown, slug_of, trainer_case, write_profile)
from deepspeed_image_trainer.engine import overrides
from machine import machine_slug

REFERENCE = "torch bf16 channels_last"
# measured too where a variant compiles, the fair reference for it: the reference's loop under torch.compile
COMPILED = {REFERENCE: "torch bf16 channels_last compile", "torch bf16 FSDP2": "torch bf16 FSDP2 compile"}
NO_LEAVES = {"leaf_module": {"classes": []}}  # a config's own leaf_module (here: none) replaces the trainer's
# measured only when named: minutes of compiling each, and DeepCompile needs CUDA
COMPILING = {"zero3 torch.compile", "zero3 DeepCompile"}
ZERO_PLUS_PLUS = {"zero3 ZeRO++ quantized weights", "zero3 ZeRO++ quantized gradients",
                  "zero3 ZeRO++ hpZ over the node's GPUs"}  # also only when named: CUDA kernels, several nodes' tools


def variants(model, num_gpus=1):
    """name -> (trainer flags, zero_optimization keys of the base config[, other keys of the base config[,
    environment variables of the case]])."""
    zero3 = ["--zero_stage", "3", "--bf16"]

    def all_but(left_out):  # the trainer's overrides without one group
        return ",".join(group for group in overrides.GROUPS if group != left_out)
    return {
        "zero0": (["--zero_stage", "0", "--bf16"], {}),
        "zero2": (["--zero_stage", "2", "--bf16"], {}),
        # DeepSpeed's contiguous gradients copy each gradient into the reduce bucket and the partition in a Python
        # hook; the trainer turns them off without offload (engine/config.py). In the JSON of commit c183514 "zero1"
        # and "zero2" still had them on, and "... contiguous_gradients off" measured them off.
        "zero2 contiguous_gradients on": (["--zero_stage", "2", "--bf16"], {"contiguous_gradients": True}),
        "zero2 overlap_comm on": (["--zero_stage", "2", "--bf16"], {"overlap_comm": True}),
        "zero1": (["--zero_stage", "1", "--bf16"], {}),
        "zero1 contiguous_gradients on": (["--zero_stage", "1", "--bf16"], {"contiguous_gradients": True}),
        "zero3 (trainer: blocks as leaf modules)": (zero3, {}),
        "zero3 DeepSpeed's defaults": (zero3, {**NO_LEAVES, "stage3_module_granularity_threshold": 0}),
        "zero3 granularity 200k, no leaf modules": (zero3, {**NO_LEAVES, "stage3_module_granularity_threshold": 200_000}),
        "zero3 reuse distance 0": (zero3, {"stage3_max_reuse_distance": 0}),
        "zero3 persistence 1e6": (zero3, {"stage3_param_persistence_threshold": 1_000_000}),
        "zero3 everything persistent": (zero3, {"stage3_param_persistence_threshold": 10**12}),
        # nothing persistent: every parameter gathered with its block, as FSDP2 does; DeepSpeed otherwise gathers
        # each persistent one (a bias, a norm) by its own collective after every optimizer step
        "zero3 persistence 0": (zero3, {"stage3_param_persistence_threshold": 0}),
        "zero3 persistence 0, prefetch bucket 2e8": (zero3, {"stage3_param_persistence_threshold": 0,
                                                             "stage3_prefetch_bucket_size": 200_000_000}),
        # the trainer's replacements of DeepSpeed code (engine/overrides.py): all left out, or one
        "zero3 without the trainer's overrides": (zero3, {}, {}, {"TRAINER_DEEPSPEED_OVERRIDES": "0"}),
        "zero3 DeepSpeed's current_stream": (zero3, {}, {}, {
            "TRAINER_DEEPSPEED_OVERRIDES": all_but("cuda_current_stream_by_index")}),
        # one collective per persistent parameter after each optimizer step, as DeepSpeed gathers them
        "zero3 DeepSpeed's persistent gathers": (zero3, {}, {}, {
            "TRAINER_DEEPSPEED_OVERRIDES": all_but("zero3_persistent_parameters_in_one_gather")}),
        "zero3 overlap_comm off": (zero3, {"overlap_comm": False}),
        # the trainer caps its buckets at 5e7 elements (engine/config.py's BUCKET_CAP): a giant's block is about that
        "zero3 prefetch bucket 2e8": (zero3, {"stage3_prefetch_bucket_size": 200_000_000}),
        "zero3 reduce bucket 2e8": (zero3, {"reduce_bucket_size": 200_000_000}),
        "zero3 max live 3e9": (zero3, {"stage3_max_live_parameters": 3_000_000_000}),
        "zero3 contiguous_gradients off": (zero3, {"contiguous_gradients": False}),  # as ZeRO-1/2 gained
        # ZeRO++ (CUDA only), for several nodes: weights gathered in int8 and gradients reduced in int4 (each cuts
        # the bytes between nodes), a secondary copy of the weights within a node (hpZ: gathers stay in the node);
        # measured on one node, what each costs where the links are fast
        "zero3 ZeRO++ quantized weights": (zero3, {"zero_quantized_weights": True}),
        "zero3 ZeRO++ quantized gradients": (zero3, {"zero_quantized_gradients": True}),
        "zero3 ZeRO++ hpZ over the node's GPUs": (zero3, {"zero_hpz_partition_size": num_gpus}),
        # DeepSpeed's own Linear function (saves the partitioned weight, gathers it again in the backward): an
        # autograd.Function whose apply binds its arguments through inspect.signature on every call
        "zero3 memory_efficient_linear off": (zero3, {"memory_efficient_linear": False}),
        # torch.compile through engine.compile(): the model's graph compiled, DeepSpeed's hooks still around it
        "zero3 torch.compile": ([*zero3, "--compile"], {}),
        # DeepCompile (CUDA only) takes the gathers, releases and reductions out of the Python hooks and into
        # the compiled graph, with prefetching scheduled from a profile of the first steps; the trainer then sets
        # no leaf modules (engine/config.py). Measured with NO_LEAVES in the base config before it did.
        "zero3 DeepCompile": ([*zero3, "--compile"], {}, {"compile": {"deepcompile": True}}),
        **({"zero3 leaf layer1-4": (zero3, {"leaf_module": {"names": ["layer1", "layer2", "layer3", "layer4"]}})}
           if model.startswith("resnet") else {}),
    }


def summary(runs):
    """The median run's figures, with every run's images/s."""
    timed = sorted((run for run in runs if "images_per_s" in run), key=lambda run: run["images_per_s"])
    if not timed:
        return runs[-1]
    return {**timed[(len(timed) - 1) // 2], "runs_images_per_s": [run.get("images_per_s") for run in runs]}


def child(kind, name, args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trace = GpuTrace(args.steps) if kind.get("trace") else None
    if name in REFERENCES:
        result = reference_case(REFERENCES[name], args, device, trace)
    else:
        flags, zero, *top = variants(args.model, args.num_gpus)[name]
        flags = [*flags, *kind.get("extra", [])]
        os.environ.update(top[1] if len(top) > 1 else {})
        profile = trace or (cProfile.Profile() if args.profile else None)  # the host's time in --steps more steps
        with tempfile.TemporaryDirectory() as tmp:
            base = Path(tmp) / "base.json"
            base.write_text(json.dumps({"zero_optimization": zero, **(top[0] if top else {})}))
            result = trainer_case([*flags, "--deepspeed_config", str(base)], args, device, profile)
        if args.profile:  # main refuses it beside --trace
            write_profile(profile, args.output_dir / f"zero3_profile_{slug_of(args.model)}_{slug_of(name)}.txt")
    if trace is not None:
        result["trace"] = trace.summary
    print("RESULT " + json.dumps(result), flush=True)


def get_args_parser():
    parser = measurement_parser(__doc__)
    parser.set_defaults(output_dir=ROOT / "benchmarks" / "results")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        help=f"only these (default: all but {', '.join(sorted(COMPILING | ZERO_PLUS_PLUS))})")
    parser.add_argument("--repeat", type=int, default=1, help="measure each variant this many times (the median)")
    parser.add_argument("--trace", action="store_true",
                        help="(GPU) each case's --steps more steps under torch.profiler, summed up in the JSON: the "
                             "GPU's busy time, NCCL's, and how long kernels wait between launch and start")
    parser.add_argument("--half_weights", action="store_true",
                        help="every variant with DeepSpeed's bf16 weights (--precision_mode half_weights)")
    parser.add_argument("--reference", choices=sorted(REFERENCES), default=REFERENCE,
                        help=f"the plain loop the variants are measured against (default {REFERENCE}; on several "
                             "GPUs with --half_weights: torch bf16 FSDP2)")
    return parser


def main():
    args = get_args_parser().parse_args()
    if args.case:
        return child(*json.loads(args.case), args)
    if args.trace and not torch.cuda.is_available():
        get_args_parser().error("--trace profiles CUDA kernels: it needs a GPU")
    if args.trace and args.profile:
        get_args_parser().error("--trace and --profile each profile the same extra steps: give one")
    reference = args.reference
    compiled = COMPILED.get(reference)
    extra = ["--precision_mode", "half_weights"] if args.half_weights else []
    known = variants(args.model, args.num_gpus)
    names = [reference, *(args.variants or [name for name in known if name not in COMPILING | ZERO_PLUS_PLUS])]
    unknown = set(names) - {reference, *known}
    if unknown:
        sys.exit(f"error: unknown variant(s): {', '.join(sorted(unknown))}; known: {', '.join(known)}")
    if any("--compile" in known[name][0] for name in names if name != reference):
        if compiled is None:
            sys.exit(f"error: a compiled variant needs the reference compiled too; {reference} has no compiled "
                     f"loop here: {' or '.join(COMPILED)}")
        names.insert(1, compiled)
    env = environment()
    path = args.output_dir / (f"zero3_settings_{slug_of(args.model)}_b{args.batch_size}"
                              f"{'_half_weights' if args.half_weights else ''}_{machine_slug(env)}"
                              f"{f'_x{args.num_gpus}' if args.num_gpus > 1 else ''}.json")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    settings = settings_of(args, leave_out=("case",))
    if "TRAINER_DEEPSPEED_OVERRIDES" in os.environ:  # every case's, where no variant sets its own
        settings["TRAINER_DEEPSPEED_OVERRIDES"] = os.environ["TRAINER_DEEPSPEED_OVERRIDES"]
    runs = {name: [] for name in names}
    for _ in range(args.repeat):  # round by round, so that a slower spell of the machine hits every variant
        for name in names:
            started = time.perf_counter()
            runs[name].append({**run_case_of(__file__, {"extra": extra, "trace": args.trace}, name, args),
                               "wall_s": round(time.perf_counter() - started, 1)})
            results[name] = summary(runs[name])
            if name not in (reference, compiled):
                flags, zero, *top = known[name]
                results[name].update(flags=[*flags, *extra], changed=zero, **({"base_config": top[0]} if top else {}),
                                     **({"environment": top[1]} if len(top) > 1 else {}),
                                     reference=reference, ratio_to_reference=ratio(results, name, reference))
                if "--compile" in flags:
                    results[name]["ratio_to_compiled_reference"] = ratio(results, name, compiled)
            print(f"{name}: {json.dumps(runs[name][-1])[:300]}", flush=True)
            path.write_text(json.dumps({"environment": env, "settings": settings, "results": results}, indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | {args.model}, "
          f"micro-batch {args.batch_size}, {args.image_size} px, bf16")
    print(f"{'variant':<40}{'images/s':>9}{'ratio':>7}{'compiled':>9}{'peak GiB':>9}  runs")
    for name, r in results.items():
        if "error" in r:
            print(failed(name, r, 40))
            continue
        print(f"{name:<40}{r['images_per_s']:>9.0f}{fmt(r.get('ratio_to_reference')):>7}"
              f"{fmt(r.get('ratio_to_compiled_reference')):>9}"
              f"{fmt(r['peak_gpu_memory_gib']):>9}  {' '.join(f'{v:.0f}' for v in r.get('runs_images_per_s', []) if v)}")
    traced = {name: r["trace"] for name, r in results.items() if "trace" in r}
    if traced:
        print(f"\n{'traced (rank ' + str(next(iter(traced.values()))['rank']) + ')':<40}{'ms/step':>9}{'compute':>9}"
              f"{'NCCL':>7}{'kernels':>9}{'launch->start p50 us':>22}{'fed late':>9}")
        for name, t in traced.items():
            print(f"{name:<40}{t['profiled_ms_per_step']:>9.0f}{t['compute_busy_ms_per_step']:>9.0f}"
                  f"{t['nccl_busy_ms_per_step']:>7.0f}{t['kernels_per_step']:>9.0f}"
                  f"{fmt(t['launch_to_start_us']['p50']):>22}{fmt(t['started_within_50us']):>9}")
    print(f"results: {shown([str(path)])}")


if __name__ == "__main__":
    main()
