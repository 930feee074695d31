"""Checkpoints in the layout users know: best_model/best/ and epoch_N/epoch_N/, each with extra_info.json.

Every rank must call save(): DeepSpeed's save_checkpoint is collective (each rank writes its shards).
"""
from pathlib import Path

from distributed import barrier, rank_zero_only
from history import write_json_atomic

EXTRA_INFO = "extra_info.json"


def save(engine, checkpoint_dir, kind, epoch, extra_info):
    """Save `kind` ("best" or "epoch") and return the checkpoint's folder (best_model or epoch_N)."""
    name, tag = ("best_model", "best") if kind == "best" else (f"epoch_{epoch}", f"epoch_{epoch}")
    folder = Path(checkpoint_dir) / name
    engine.save_checkpoint(str(folder), tag=tag)
    barrier()
    _write_extra_info(folder, {**extra_info, "epoch": epoch, "tag": tag})
    return folder


@rank_zero_only
def _write_extra_info(folder, info):
    write_json_atomic(Path(folder) / EXTRA_INFO, info)
