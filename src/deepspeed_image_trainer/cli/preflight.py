"""The run's preflight, one function the launcher (before any process starts) and every rank (before the
engine) both call: the DeepSpeed config resolved from the flags and the user's JSON, what no run can use
refused, and the checkpoint it resumes from, checked against this run."""
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..engine.config import build_ds_config, built_optimizer, check_run, check_with_deepspeed, steps_per_epoch
from ..engine.distributed import rank_zero_only
from ..outputs.checkpoints import check_resumable, find_checkpoint, read_info, saved_precision, saved_stage
from ..outputs import run_folders
from ..outputs.monitor import check_csv_files
from ..outputs.record import resume_settings, run_record
from ..utils.failures import UsageError

say = rank_zero_only(print)  # in the launcher, and in rank 0


@dataclass
class Preflight:
    ds_config: dict
    coalesced: bool  # whether the run coalesces the gradient reduction (engine/config.py)
    record: dict  # the run's settings (outputs/record.py)
    resume_from: Path | None
    resumed_info: dict | None  # the extra_info.json of resume_from
    finished: str | None = None  # why there is nothing to train: resume_from ended at --epochs or later


def weights_to_load(args):
    """--pretrained, but None for a run that resumes a checkpoint, which holds every weight: the resume needs
    neither the file nor the network the start did."""
    if args.pretrained and args.resume and find_checkpoint(args.resume, args.checkpoint_dir) is not None:
        return None
    return args.pretrained


def take_saved_weights_name(args):
    """A resumed run's --pretrained is its checkpoint's: the preprocessing (mean, std, resize, interpolation) and
    the record follow the weights the run started from, without loading them. Left out, it is taken from the
    checkpoint (the resumed epochs used the default preprocessing, and the history said pretrained null); another
    is refused."""
    resume_from = find_checkpoint(args.resume, args.checkpoint_dir) if args.resume else None
    if resume_from is None:
        return
    saved = read_info(resume_from).get("pretrained")
    if args.pretrained is None or same_file(args.pretrained, saved):
        args.pretrained = saved
    elif args.pretrained != saved:
        raise UsageError(f"--pretrained {args.pretrained}: {resume_from} continues a run started from "
                         f"{'--pretrained ' + saved if saved else 'random weights'}, whose trained weights it holds; "
                         "leave --pretrained out to resume it")


def same_file(given, saved):
    """Whether two --pretrained values name one file (w/p.pt and ./w/p.pt)."""
    try:
        return isinstance(saved, str) and os.path.samefile(given, saved)
    except (OSError, ValueError):
        return False


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def keep_saved_global_batch(args, base, resume_from, world_size):
    """A run resumed on another number of ranks keeps the checkpoint's global batch, which its optimizer and
    schedule were built for, through its gradient accumulation: the same command goes on when a job comes back
    on fewer or more GPUs. Returns the line that says so (None when nothing changes); stops with the flags that
    would keep it when this micro-batch cannot. A user's JSON that sets the batch ("auto" does not) is left to
    check_resumable."""
    saved = read_info(resume_from).get("settings", {}).get("train_batch_size")
    per_step = args.batch_size * world_size
    if not isinstance(saved, int) or any(base.get(key, "auto") != "auto" for key in BATCH_KEYS) \
            or saved == per_step * args.gradient_accumulation_steps:
        return None
    if "gradient_accumulation_steps" not in args.explicit and saved % per_step == 0:
        args.gradient_accumulation_steps = saved // per_step
        return (f"Resuming on {world_size} rank(s) with the checkpoint's global batch {saved}: micro-batch "
                f"{args.batch_size} x --gradient_accumulation_steps {args.gradient_accumulation_steps}")
    split = next((micro for micro in range(min(args.batch_size, saved), 0, -1) if saved % (micro * world_size) == 0),
                 None)
    how = (f"--batch_size {split} --gradient_accumulation_steps {saved // (split * world_size)}" if split else
           f"a number of ranks that divides {saved}")
    raise UsageError(f"cannot resume from {resume_from} on {world_size} rank(s): it was saved with the global batch "
                     f"{saved}, which its optimizer and schedule were built for, and micro-batch {args.batch_size} x "
                     f"{world_size} rank(s) x --gradient_accumulation_steps "
                     f"{args.gradient_accumulation_steps if 'gradient_accumulation_steps' in args.explicit else 'N'} "
                     f"does not make it; resume with {how}")


def preflight(args, base, *, world_size, device_type, class_names, num_train_images, num_params, read_shards=False,
              parameter_groups=1):
    """Stop with one line on what this run cannot do; `base`: the user's JSON as read (load_base_config);
    `read_shards`: read every file of the checkpoint resumed as its rank will (the launcher, before any rank
    starts: a rank that could not would stop alone, its peers waiting in DeepSpeed's load); `parameter_groups`:
    how many the optimizer takes (finetune.parameter_groups)."""
    skipped = []
    resume_from = find_checkpoint(args.resume, args.checkpoint_dir, skipped) if args.resume else None
    kept = keep_saved_global_batch(args, base, resume_from, world_size) if resume_from is not None else None
    if getattr(args, "launch_token", None) is None:  # else its launcher said it
        for folder, why in skipped:
            say(f"warning: --resume auto skips {folder}: {why}", file=sys.stderr)
        if kept:
            say(kept, file=sys.stderr)
        if len(class_names) == 1:  # trains, at a loss of 0 from the first step
            say(f"warning: {args.train_dir} holds one class ({class_names[0]}): every image is labelled with it, so "
                "the loss is 0 from the first step and the model learns nothing; a classifier needs two classes "
                "or more", file=sys.stderr)
    ds_config = build_ds_config(args, world_size, num_train_images, base=base, device_type=device_type,
                                num_params=num_params, resumed_stage=saved_stage(resume_from),
                                resumed_precision=saved_precision(resume_from))
    coalesced = check_run(ds_config, args, device_type)
    run_folders.check_output_places(args, ds_config)
    run_folders.check_output_files(args)
    check_csv_files(ds_config)
    if args.deepspeed_config:
        check_with_deepspeed(ds_config, args.deepspeed_config, device_type, args.epochs * steps_per_epoch(
            num_train_images, world_size, ds_config["train_micro_batch_size_per_gpu"],
            ds_config["gradient_accumulation_steps"]), parameter_groups=parameter_groups)
    else:  # --optimizer's: DeepSpeed's Lamb and Lion are CUDA ops (Lion has a CPU version under offload)
        built_optimizer(ds_config, f"--optimizer {args.optimizer}", device_type, parameter_groups)
    record = run_record(args, ds_config, class_names)
    resumed_info = (check_resumable(resume_from, world_size, record["zero_stage"], resume_settings(record),
                                    read_shards) if resume_from is not None else None)
    finished = None
    stopped = (resumed_info or {}).get("interrupted_at")
    if resumed_info is not None and (stopped["epoch"] if stopped else resumed_info["epoch"] + 1) > args.epochs:
        where = f"stopped in epoch {stopped['epoch']}" if stopped else f"ends at epoch {resumed_info['epoch']}"
        finished = (f"Nothing to train: {resume_from} {where} and --epochs is {args.epochs}; its checkpoints and "
                    "history are left as they are (a larger --epochs trains on)")
    return Preflight(ds_config, coalesced, record, resume_from, resumed_info, finished)
