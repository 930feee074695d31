"""Scaling from 1 to N GPUs of one host, in one run: plain PyTorch DDP as the reference, the trainer's step
per ZeRO stage and with optimizer offload, end-to-end epochs with the dataset on the GPU (ZeRO 0-3) and
in the decoded-image cache (ZeRO-2), whether N GPUs reach the validation accuracy of one GPU at the same
global batch, and runs saved on 1 GPU resumed on N and back (ZeRO-2 and 3, through universal checkpoints):
after an epoch ("resume"), and stopped mid-epoch on 1 GPU, then on N, then finished on 1 ("chain").

Every speed measurement is throughput.py's (same loops, same settings, each in its own processes), run once
with 1 GPU and once with N; speed-up = images/s on N GPUs / images/s on 1 GPU (micro-batch per GPU fixed),
efficiency = speed-up / N. Prints a table last and writes JSON to
benchmarks/results/scaling_<gpu>_x<N>.json (scaling_<model>_<gpu>_x<N>.json for a --model other than resnet18).

    python benchmarks/scaling.py                      # 1 and 2 GPUs
    python benchmarks/scaling.py --model vit_b_16 --batch_size 128 --only reference real
    python benchmarks/scaling.py --only accuracy resume chain --update
"""
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import throughput
from common import ROOT, SYNC_BN_REF, earlier_results, environment, failed, fmt, settings_of, shown
from machine import machine_slug

DDP = "torch bf16 channels_last"  # as DistributedDataParallel when run on several GPUs
CACHE = "epoch: zero2 bf16, data in the cache"
MEASUREMENTS = [("reference", DDP)] + [("synthetic", f"step: zero{stage} bf16") for stage in range(4)] + [
    ("synthetic", "step: zero2 bf16 offload_optimizer")] + [
    ("real", f"epoch: zero{stage} bf16, data on GPU") for stage in range(4)] + [("real", CACHE)] + [
    ("reference", SYNC_BN_REF), ("synthetic", "step: zero2 bf16 sync_bn"), ("real", "epoch: zero2 bf16 sync_bn, data on GPU")]
# --only sync_bn: --sync_bn and torch's SyncBatchNorm beside the same runs without them; named or chosen so only
SYNC_BN = [DDP, SYNC_BN_REF, "step: zero2 bf16", "step: zero2 bf16 sync_bn", "epoch: zero2 bf16, data on GPU",
           "epoch: zero2 bf16 sync_bn, data on GPU"]
# speed-up on N GPUs: N -> {name: goal} (the two-GPU and the four-GPU issues' goals)
GOALS = {2: {**{f"epoch: zero{stage} bf16, data on GPU": 1.9 for stage in range(3)},
             "epoch: zero3 bf16, data on GPU": 1.8, CACHE: 1.9},
         4: {**{f"epoch: zero{stage} bf16, data on GPU": 3.7 for stage in range(3)}, CACHE: 3.7}}
# Same global batch on 1 and N GPUs: the micro-batch is divided by N; with and without --sync_bn.
ACCURACY = {"accuracy: 1 GPU": (1, []), "accuracy: N GPUs": (None, []), "accuracy: N GPUs --sync_bn": (None, ["--sync_bn"])}
# what every row of one JSON shares (--update refuses others)
SHARED_SETTINGS = ("model", "batch_size", "image_size", "num_classes", "steps", "warmup_steps", "epochs",
                   "images_per_class", "max_gpus", "accuracy_epochs", "accuracy_batch", "resume_epochs")
# A run saved on one GPU count goes on on the other: name -> (ZeRO stage, GPUs before, GPUs after; "N": --max_gpus)
RESUMES = {f"resume: zero{stage}, {before} → {after} GPUs": (stage, before, after)
           for stage in (2, 3) for before, after in ((1, "N"), ("N", 1))}
# One run stopped by SIGTERM mid-epoch on A GPUs, resumed on B and stopped mid-epoch again, then resumed on C to its
# end (--chain_gpus A B C; 1 N 1 by default), beside the same run uninterrupted on 1 GPU, at ZeRO-2 and ZeRO-3
CHAIN_STAGES = (2, 3)


def chain_name(stage, counts, n):
    """The chain's row: its GPU counts, N where a count is --max_gpus ("resume mid-epoch: zero2, 1 → N → 1 GPUs")."""
    return f"resume mid-epoch: zero{stage}, {' → '.join('N' if c == n else str(c) for c in counts)} GPUs"


def reference_of(name):
    """The plain-PyTorch measurement `name` is compared with on N GPUs."""
    return SYNC_BN_REF if "sync" in name.lower() else DDP


def sample_command(num_gpus, epochs, flags, args, workdir):
    """launch_deepspeed.py's command on the built-in sample dataset at the global batch --accuracy_batch, its logs
    and checkpoints in `workdir`."""
    return [sys.executable, str(ROOT / "launch_deepspeed.py"), "--num_gpus", str(num_gpus),
            "--train_dir", str(args.sample_data / "train"), "--val_dir", str(args.sample_data / "val"),
            "--epochs", str(epochs), "--batch_size", str(args.accuracy_batch // num_gpus),
            "--image_size", "96", "--bf16", "--data_on_device", "on",
            "--log_dir", str(workdir / "logs"), "--checkpoint_dir", str(workdir / "checkpoints"), *flags]


def sample_run(num_gpus, epochs, flags, args, workdir):
    """sample_command run to its end: (command, history), or (command, {"error": ...})."""
    command = sample_command(num_gpus, epochs, flags, args, workdir)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout)
    except subprocess.TimeoutExpired:
        return shown(command), {"error": f"over {args.case_timeout} s"}
    if result.returncode != 0:
        return shown(command), {"error": (result.stdout + result.stderr)[-3000:] or f"exit status {result.returncode}"}
    return shown(command), {**json.loads((workdir / "logs" / "training_history.json").read_text()),
                            "output": result.stdout}


def per_epoch(history):
    return {"val_acc_per_epoch": [epoch["val_acc"] for epoch in history["epochs"]],
            "val_loss_per_epoch": [epoch["val_loss"] for epoch in history["epochs"]],
            "train_loss_per_epoch": [epoch["train_loss"] for epoch in history["epochs"]]}


def accuracy_run(num_gpus, flags, args):
    """Best and last validation accuracy of --accuracy_epochs at ZeRO-2."""
    with tempfile.TemporaryDirectory() as tmp:
        command, history = sample_run(num_gpus, args.accuracy_epochs, ["--zero_stage", "2", "--save_every", "0",
                                                                       "--save_last_every", "0", *flags],
                                      args, Path(tmp))
    if "error" in history:
        return history
    return {"command": command, "num_gpus": num_gpus, "global_batch": args.accuracy_batch,
            "best_val_acc": history["best"]["val_acc"], "last_val_acc": history["epochs"][-1]["val_acc"],
            "val_images": history["epochs"][-1]["val_images"], **per_epoch(history)}


def resume_run(stage, before, after, args):
    """--resume_epochs epochs on `before` GPUs, then `--resume auto` on `after` GPUs for as many more (ZeRO-1/2/3
    through DeepSpeed's universal checkpoint): the resumed run's epochs, and how long its start took."""
    flags = ["--zero_stage", str(stage), "--save_every", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        first_command, first = sample_run(before, args.resume_epochs, flags, args, Path(tmp))
        if "error" in first:
            return {"commands": [first_command], **first}
        command, history = sample_run(after, 2 * args.resume_epochs, [*flags, "--resume", "auto"], args, Path(tmp))
    if "error" in history:
        return {"commands": [first_command, command], **history}
    resumed = re.search(r"Resumed from \S+: ([^\n]*)", history["output"])
    return {"commands": [first_command, command], "num_gpus": [before, after], "global_batch": args.accuracy_batch,
            "resumed_at": resumed[1] if resumed else None, "epochs": [epoch["epoch"] for epoch in history["epochs"]],
            "val_acc_before": history["epochs"][args.resume_epochs - 1]["val_acc"],
            "resumed_timing": history.get("timing"),
            "last_val_acc": history["epochs"][-1]["val_acc"], **per_epoch(history)}


def stopped_run(num_gpus, epochs, flags, args, workdir, stop_in):
    """sample_command started, and stopped by SIGTERM a step or more into epoch `stop_in` (the ranks agree on the stop
    within 10 steps and save it); returns (command, where it stopped: "epoch E, step S", or {"error": ...})."""
    command = sample_command(num_gpus, epochs, flags, args, workdir)
    log = workdir / f"stopped_{num_gpus}_{stop_in}.log"
    with open(log, "w") as out:
        run = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + args.case_timeout
    progress = re.compile(rf"Epoch {stop_in} train:[^\r\n]*\| [1-9]\d*/")
    while not progress.search(log.read_text(errors="replace")):
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            return shown(command), {"error": f"no step of epoch {stop_in} seen: " + log.read_text()[-3000:]}
        time.sleep(0.02)
    run.send_signal(signal.SIGTERM)
    status = run.wait(timeout=args.case_timeout)
    stopped = re.search(r"Stopped by SIGTERM at (epoch \d+, step \d+)", log.read_text(errors="replace"))
    if status != 128 + signal.SIGTERM or not stopped:
        return shown(command), {"error": f"exit status {status}: " + log.read_text(errors="replace")[-3000:]}
    return shown(command), stopped[1]


def chain_run(stage, counts, args):
    """2 x --resume_epochs epochs at ZeRO `stage`: stopped mid-epoch 2 on counts[0] GPUs, resumed on counts[1] and
    stopped mid-epoch --resume_epochs + 1, resumed on counts[2] to the end; beside the same run on 1 GPU never
    stopped."""
    epochs, flags = 2 * args.resume_epochs, ["--zero_stage", str(stage), "--save_every", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        whole_command, whole = sample_run(1, epochs, flags, args, Path(tmp) / "whole")
        if "error" in whole:
            return {"commands": [whole_command], **whole}
        commands, stops, workdir = [whole_command], [], Path(tmp) / "chain"
        workdir.mkdir()
        for num_gpus, stop_in in ((counts[0], 2), (counts[1], args.resume_epochs + 1)):
            command, stopped = stopped_run(num_gpus, epochs, [*flags, "--resume", "auto"], args, workdir, stop_in)
            commands.append(command)
            if isinstance(stopped, dict):
                return {"commands": commands, **stopped}
            stops.append(stopped)
        command, history = sample_run(counts[2], epochs, [*flags, "--resume", "auto"], args, workdir)
        commands.append(command)
    if "error" in history:
        return {"commands": commands, **history}
    return {"commands": commands, "num_gpus": list(counts), "global_batch": args.accuracy_batch, "stopped_at": stops,
            "last_val_acc": history["epochs"][-1]["val_acc"], **per_epoch(history),
            "uninterrupted": {"last_val_acc": whole["epochs"][-1]["val_acc"], **per_epoch(whole)}}


def get_args_parser():
    parser = throughput.get_args_parser()
    parser.description = __doc__
    parser.set_defaults(output_dir=ROOT / "benchmarks" / "results")
    parser.add_argument("--max_gpus", type=int, default=2, help="N: the largest GPU count measured")
    parser.add_argument("--sample_data", type=Path, default=ROOT / "sample_data",
                        help="the built-in sample dataset for the accuracy runs; drawn there if missing")
    parser.add_argument("--accuracy_epochs", type=int, default=30)
    parser.add_argument("--accuracy_batch", type=int, default=128,
                        help="global batch of the accuracy and resume runs")
    parser.add_argument("--resume_epochs", type=int, default=3,
                        help="epochs before a resume on the other GPU count, and as many after it")
    parser.add_argument("--chain_gpus", type=int, nargs=3, metavar=("A", "B", "C"),
                        help="the chain part's GPU counts: stopped on A, then on B, finished on C (default 1 N 1)")
    return parser


def main():
    args = get_args_parser().parse_args()
    only = set(args.only or ())
    chosen = [(kind, name) for kind, name in MEASUREMENTS if name in only or "sync_bn" in only and name in SYNC_BN
              or "sync" not in name.lower() and (not only or kind in only)]
    accuracy = [name for name in ACCURACY if not only or name in only or "accuracy" in only]
    resumes = [name for name in RESUMES if not only or name in only or "resume" in only]
    chain_gpus = tuple(args.chain_gpus or (1, args.max_gpus, 1))
    every_chain = {chain_name(stage, chain_gpus, args.max_gpus): stage for stage in CHAIN_STAGES}
    chains = {name: stage for name, stage in every_chain.items() if not only or name in only or "chain" in only}
    unknown = only - {"reference", "synthetic", "real", "accuracy", "resume", "chain", "sync_bn",
                      *(name for _, name in MEASUREMENTS), *ACCURACY, *RESUMES, *every_chain}
    if unknown:
        sys.exit(f"error: unknown measurement(s): {', '.join(sorted(unknown))}")
    if (accuracy or resumes or chains) and any(args.accuracy_batch % n for n in {args.max_gpus, *chain_gpus}):
        sys.exit(f"error: --accuracy_batch {args.accuracy_batch} must divide by --max_gpus {args.max_gpus} and the "
                 "--chain_gpus counts: the same global batch on every GPU count")
    if chosen and not (args.data / "train").is_dir():
        subprocess.run(throughput.drawing_command(args), check=True, stdout=subprocess.DEVNULL)
    if (accuracy or resumes or chains) and not (args.sample_data / "train").is_dir():
        subprocess.run([sys.executable, str(ROOT / "src" / "prepare_data.py"), "sample", "--output",
                        str(args.sample_data)], check=True, stdout=subprocess.DEVNULL)
    env = environment()
    slug = machine_slug(env)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    model = "" if args.model == "resnet18" else f"{args.model}_"
    path = args.output_dir / f"scaling_{model}{slug}_x{args.max_gpus}.json"
    gpu_counts = [1, args.max_gpus]
    results, commands = earlier_results(path, env, args, SHARED_SETTINGS) if args.update else ({}, [])
    if results:  # the JSON's commit becomes this run's: a row from before per-row commits keeps the one it ran at
        earlier_commit = json.loads(path.read_text())["environment"].get("commit")
        for row in results.values():
            row.setdefault("commit", earlier_commit)
    commands.append(env["command"])

    def save():
        settings = settings_of(args, leave_out=("case",))
        path.write_text(json.dumps({"environment": env, "settings": settings, "commands": commands,
                                    "results": results}, indent=2) + "\n")

    for kind, name in chosen:
        results[name] = {"kind": kind, "commit": env["commit"]}  # an --update's rows may come from several commits
        for num_gpus in gpu_counts:
            args.num_gpus = num_gpus
            started = time.perf_counter()
            measured = throughput.run_case(kind, name, args)
            results[name][f"{num_gpus}_gpu"] = {**measured, "wall_s": round(time.perf_counter() - started, 1)}
            print(f"{name} on {num_gpus} GPU(s): {json.dumps(measured)[:300]}", flush=True)
        one, many = (results[name][f"{n}_gpu"].get("images_per_s") for n in gpu_counts)
        if one and many:
            results[name].update(speedup=many / one, efficiency=many / one / args.max_gpus,
                                 goal=GOALS.get(args.max_gpus, {}).get(name))
        reference = reference_of(name)
        ref_many = results.get(reference, {}).get(f"{args.max_gpus}_gpu", {}).get("images_per_s")
        if many and ref_many and name != reference:
            results[name].update(reference=reference, of_reference=many / ref_many)
        save()
    for name in accuracy:
        num_gpus, flags = ACCURACY[name]
        results[name] = {"kind": "accuracy", **accuracy_run(num_gpus or args.max_gpus, flags, args)}
        print(f"{name}: {json.dumps(results[name])[:300]}", flush=True)
        save()
    for name in resumes:
        stage, before, after = RESUMES[name]
        results[name] = {"kind": "resume", **resume_run(stage, *(args.max_gpus if count == "N" else count
                                                                  for count in (before, after)), args)}
        print(f"{name}: {json.dumps(results[name])[:300]}", flush=True)
        save()
    for name, stage in chains.items():
        results[name] = {"kind": "chain", **chain_run(stage, chain_gpus, args)}
        print(f"{name}: {json.dumps(results[name])[:300]}", flush=True)
        save()

    print(f"\n{env['gpu'] or 'CPU'} | torch {env['torch']} | DeepSpeed {env['deepspeed']} | CUDA {env['cuda']} | "
          f"micro-batch {args.batch_size} per GPU, {args.image_size} px")
    print(f"{'measurement':<40}{'1 GPU':>9}{f'{args.max_gpus} GPUs':>9}{'speed-up':>9}{'eff.':>6}{'goal':>6}"
          f"{'of ref':>7}{'peak GiB':>9}  (of ref: N-GPU images/s over DDP's, or DDP with SyncBatchNorm's for sync_bn)")
    for name, r in results.items():
        label = re.sub(r"\bN\b", str(args.max_gpus), name)
        if "error" in r:
            print(failed(label, r, 40))
            continue
        if r["kind"] in ("resume", "accuracy", "chain"):
            if r["kind"] == "chain":
                line = (f"stopped at {' and '.join(r['stopped_at'])}; val acc {r['last_val_acc']:.3f} at the end, "
                        f"{r['uninterrupted']['last_val_acc']:.3f} uninterrupted")
            elif r["kind"] == "resume":
                line = f"resumed at {r['resumed_at']}; val acc {r['val_acc_before']:.3f} before, {r['last_val_acc']:.3f} at the end"
            else:
                line = (f"best val acc {r['best_val_acc']:.3f}, last {r['last_val_acc']:.3f}, "
                        f"last val loss {r['val_loss_per_epoch'][-1]:.3f}")
            print(f"{label:<40}{line}")
            continue
        one, many = (r[f"{n}_gpu"] for n in gpu_counts)
        if "error" in one or "error" in many:
            print(failed(label, one if "error" in one else many, 40))
            continue
        print(f"{name:<40}{one['images_per_s']:>9.0f}{many['images_per_s']:>9.0f}{fmt(r.get('speedup')):>9}"
              f"{fmt(r.get('efficiency')):>6}{fmt(r.get('goal')):>6}"
              f"{fmt(r.get('of_reference')):>7}{fmt(many['peak_gpu_memory_gib']):>9}")
    print(f"results: {shown([str(path)])}")


if __name__ == "__main__":
    main()
