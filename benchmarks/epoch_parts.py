"""What a training epoch adds to the trainer's step, part by part, on 1 or N GPUs of one host: the step on one
synthetic batch (as throughput.py's "step" rows), then with each of what the epoch does besides (the device data
path's crops of resident uint8 squares, the stop agreement between ranks, the non-finite-loss check, the seeding
of each micro-batch) and with all of them, beside plain PyTorch (DistributedDataParallel on several GPUs) on the
same synthetic batch, and plain PyTorch fed by the same crops (a user of DDP who augments on the GPU as the
trainer does). Each in its own processes (torchrun's on several GPUs).

Prints a table last (images/s, ratio to the reference, milliseconds a step each part adds) and writes JSON to
benchmarks/results/epoch_parts/epoch_parts_<model>_<gpu>_x<N>.json.

    python benchmarks/epoch_parts.py --num_gpus 2 --zero_stage 2
"""
import json
import os
import sys
import time

import torch

from common import (BF16_REF, CROPS_REF, EPOCH_PARTS, REFERENCES, ROOT, environment, failed, fmt, measurement_parser,
                    reference_case, run_case_of, settings_of, trainer_case)
from machine import machine_slug

STEP = "step"
# name -> the parts of trainer_case it adds to the step
CASES = {STEP: (), **{f"step + {part}": (part,) for part in EPOCH_PARTS}, "step + all": EPOCH_PARTS}


def get_args_parser():
    parser = measurement_parser(__doc__)
    parser.set_defaults(output_dir=ROOT / "benchmarks" / "results" / "epoch_parts")
    parser.add_argument("--zero_stage", type=int, default=2, choices=range(4))
    return parser


def child(stage, name, args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke test only
    if name in (BF16_REF, CROPS_REF):
        result = reference_case(REFERENCES[name], args, device)
    else:
        result = trainer_case(["--zero_stage", str(stage), "--bf16"], args, device, parts=CASES[name])
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)


def step_ms(result, args):
    """Milliseconds of one optimizer step (every rank's micro-batch at once)."""
    return 1000 * args.batch_size * args.num_gpus / result["images_per_s"]


def main():
    args = get_args_parser().parse_args()
    if args.case:
        return child(*json.loads(args.case), args)  # [ZeRO stage, name], as main passes it to run_case_of
    if not torch.cuda.is_available():
        print("warning: no CUDA GPU; running on the CPU as a smoke test, the figures mean nothing", flush=True)
    env = environment()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"epoch_parts_{args.model}_zero{args.zero_stage}_{machine_slug(env)}_x{args.num_gpus}.json"
    results = {}
    for name in [BF16_REF, CROPS_REF, *CASES]:
        started = time.perf_counter()
        result = run_case_of(__file__, args.zero_stage, name, args)
        results[name] = {**result, "wall_s": round(time.perf_counter() - started, 1)}
        print(f"{name}: {json.dumps(results[name])[:300]}", flush=True)
        path.write_text(json.dumps({"environment": env, "settings": settings_of(args, leave_out=("case",)),
                                    "results": results}, indent=2) + "\n")

    print(f"\n{env['gpu'] or 'CPU'} x{args.num_gpus} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | "
          f"{args.model}, micro-batch {args.batch_size} per GPU, {args.image_size} px, ZeRO-{args.zero_stage} bf16")
    width = len(CROPS_REF) + 2
    print(f"{'measurement':<{width}}{'images/s':>9}{'of ref':>8}{'of crops ref':>13}{'ms/step':>9}{'added ms':>9}")
    step = results[STEP]
    for name, result in results.items():
        if "error" in result:
            print(failed(name, result, width))
            continue
        of_ref, of_crops = (result["images_per_s"] / results[ref]["images_per_s"]
                            if "images_per_s" in results[ref] else None for ref in (BF16_REF, CROPS_REF))
        added = step_ms(result, args) - step_ms(step, args) if name in CASES and "images_per_s" in step else None
        print(f"{name:<{width}}{result['images_per_s']:>9.0f}{fmt(of_ref):>8}{fmt(of_crops):>13}"
              f"{step_ms(result, args):>9.2f}{fmt(added):>9}")


if __name__ == "__main__":
    sys.exit(main())
