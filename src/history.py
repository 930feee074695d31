"""logs/training_history.json: the run's settings, one record per epoch and the best epoch."""
import json
import os
from pathlib import Path

from distributed import rank_zero_only
from failures import stop_on_write_error

# data_wait_s: time the training loop waited for batches; compute_s: the rest of epoch_time_s.
# skipped_steps: optimizer steps the fp16 loss scaler skipped (overflow); nonfinite_steps: micro-batches
# whose training loss was NaN/inf (the most on any rank).
EPOCH_KEYS = ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "val_images", "lr", "epoch_time_s",
              "images_per_s", "data_wait_s", "compute_s", "peak_gpu_memory_gib", "skipped_steps", "nonfinite_steps")


def write_json_atomic(path, data):
    """Write JSON so that readers see the old file or the new one, never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # several writers (nodes) never share one
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temporary file behind
        raise


class TrainingHistory:
    def __init__(self, path, config):
        self.path = Path(path)
        self.data = {"config": config, "epochs": [], "best": {"epoch": None, "val_acc": None}}

    def add(self, record):
        """Append one epoch's record; return True when it is the best validation accuracy so far."""
        self.data["epochs"].append({key: record[key] for key in EPOCH_KEYS})
        best = self.data["best"]
        if best["val_acc"] is None or record["val_acc"] > best["val_acc"]:
            self.data["best"] = {"epoch": record["epoch"], "val_acc": record["val_acc"]}
            return True
        return False

    def epochs_since_best(self):
        """Completed epochs after the best one: 0 when the last epoch was the best (--early_stopping_patience)."""
        return self.data["epochs"][-1]["epoch"] - self.data["best"]["epoch"]

    def restore(self, saved):
        """Take the epochs and best of a resumed run's saved history; keep this run's config."""
        self.data["epochs"] = list(saved["epochs"])
        self.data["best"] = dict(saved["best"])

    @rank_zero_only
    @stop_on_write_error("training history", "--log_dir")
    def save(self):
        write_json_atomic(self.path, self.data)
