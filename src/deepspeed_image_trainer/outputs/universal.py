"""Resuming a ZeRO-1/2/3 checkpoint on another number of ranks, through DeepSpeed's universal checkpoints.

Each rank of a ZeRO-1/2/3 run saves its own shard of the optimizer state, cut for that world size.
DeepSpeed's ds_to_universal merges the shards into one file per parameter and optimizer state, which an
engine started with `"checkpoint": {"load_universal": true}` cuts again for its own ranks. Rank 0 converts
into a hidden folder of --checkpoint_dir (a run's own, under its lock), every rank loads it, and it goes.

ds_to_universal and the universal loader unpickle anything (no weights-only load): the checkpoint's files
pass loading.load_checked first, and the universal folder holds only what the conversion wrote from them.
A universal load skips the module's state dict, so the trainer puts back what is not a parameter (the
batch-norm running statistics) from the checkpoint's model-states file.
"""
import contextlib
import io
import shutil
from argparse import Namespace
from pathlib import Path

import torch

from ..engine.distributed import barrier, from_rank_zero, rank, world_size
from ..utils.failures import CliError, UsageError, WriteFailed
from ..utils.loading import check_checkpoint_files, load_checked

UNIVERSAL = ".universal"  # in --checkpoint_dir: where a checkpoint is converted, for the one resume that needs it


# The optimizers whose ZeRO state ds_to_universal converts: it reads exp_avg and exp_avg_sq, Adam's moments
# (DeepSpeed 0.19.8; SGD's momentum_buffer, Lion's exp_avg alone: KeyError)
CONVERTIBLE_OPTIMIZERS = ("adam", "adamw", "lamb")


def needed(info, world_size):
    """Whether a checkpoint described by `info` must go through a universal checkpoint on `world_size` ranks."""
    return info.get("zero_stage", 0) > 0 and info.get("world_size") != world_size


def enable(ds_config):
    """The engine loads universal checkpoints (set before deepspeed.initialize)."""
    ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}


def convert(tag_folder, output):
    """ds_to_universal of `tag_folder` into `output` (replaced); its progress lines go nowhere."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    check_checkpoint_files(tag_folder.parent, tag_folder.name)
    shutil.rmtree(output.parent, ignore_errors=True)
    output.parent.mkdir(parents=True)
    # One worker each: the pools would fork this process, CUDA context and all, for a few files per parameter.
    args = Namespace(input_folder=str(tag_folder), output_folder=str(output), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            ds_to_universal(args)
    except OSError as err:
        shutil.rmtree(output.parent, ignore_errors=True)
        raise WriteFailed(f"cannot write the universal checkpoint under {output.parent}: {err.strerror or err}; "
                          "it takes as much disk as the optimizer state: free some, or resume on the number of "
                          "ranks that saved the checkpoint") from None
    except Exception as err:  # noqa: BLE001 - files that passed load_checked but are not a ZeRO checkpoint
        shutil.rmtree(output.parent, ignore_errors=True)
        raise UsageError(f"cannot convert {tag_folder} for another number of ranks with DeepSpeed's "
                         f"ds_to_universal ({type(err).__name__}: {err})") from None


def model_states(tag_folder):
    """The model-states file rank 0 wrote (ZeRO-1/2: mp_rank_00_..., ZeRO-3: zero_pp_rank_0_mp_rank_00_...)."""
    files = sorted(tag_folder.glob("*mp_rank_00_model_states.pt"))
    if not files:
        raise UsageError(f"{tag_folder} holds no model-states file")
    return files[0]


def restore_buffers(module, tag_folder):
    """The module's buffers (batch-norm running statistics and counts) from the checkpoint: those its state_dict
    holds (EVA's key bias and rotary table are not saved: the model makes them)."""
    saved = load_checked(model_states(tag_folder))["module"]
    buffers = {f"{prefix}.{name}" if prefix else name: buffer for prefix, owner in module.named_modules()
               for name, buffer in owner._buffers.items()
               if buffer is not None and name not in owner._non_persistent_buffers_set}
    missing = sorted(set(buffers) - set(saved))
    if missing:
        raise UsageError(f"{tag_folder} holds no {missing[0]} ({len(missing)} buffer(s) missing)")
    for name, buffer in buffers.items():
        buffer.copy_(saved[name])


def _ranks(count):
    return f"{count} rank{'s' if count != 1 else ''}"


def load(engine, folder, info, checkpoint_dir):
    """engine.load_checkpoint of checkpoint `folder` (its extra_info.json: `info`), saved by another number
    of ranks: (load_path, client state)."""
    tag = info["tag"]
    output = Path(checkpoint_dir) / UNIVERSAL / tag
    failed = None
    if rank() == 0:
        print(f"Converting {folder} (saved by {_ranks(info['world_size'])}) for {_ranks(world_size())} with "
              "DeepSpeed's universal checkpoint", flush=True)
        try:
            convert(Path(folder) / tag, output)
        except CliError as err:
            failed = err
    failed = from_rank_zero(failed)  # the other ranks stop with rank 0 instead of waiting for it
    if failed is not None:
        failed.every_rank = True
        raise failed
    try:
        loaded = engine.load_checkpoint(str(output.parent), tag=tag)
        with torch.no_grad():
            restore_buffers(engine.module, output)
    except CliError as err:  # each rank's, alike: said once
        err.every_rank = True
        raise
    finally:
        barrier()
        if rank() == 0:
            shutil.rmtree(output.parent, ignore_errors=True)
    return loaded
