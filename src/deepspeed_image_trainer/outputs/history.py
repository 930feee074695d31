"""logs/training_history.json: the run's settings, one record per epoch and the best epoch."""
import copy
from pathlib import Path

from ..engine.distributed import rank_zero_only
from ..utils.failures import stop_on_write_error
from ..utils.files import parse_json, write_atomic, write_json_atomic

HISTORY_FILE = "training_history.json"  # in --log_dir
ARGS_FILE = "args.yaml"  # beside it: the run's flags, a recipe (--config)

# epoch_time_s: the training loop; data_wait_s: the part of it spent waiting for batches; compute_s: the rest.
# validation_s and checkpoint_s after the loop (checkpoint_s: the copy of the state to host memory, and any
# wait for the previous checkpoint's files; they are written while the next epoch trains); epoch_wall_s: all.
# skipped_steps: optimizer steps the fp16 loss scaler skipped (overflow); nonfinite_steps: micro-batches
# whose training loss was NaN/inf (the most on any rank).
# backbone_lr: the learning rate of all but the classifier head (lr x --backbone_lr_scale, 0 while frozen).
# ema_val_loss, ema_val_acc: the weights' average's (--model_ema; None without it).
EPOCH_KEYS = ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "ema_val_loss", "ema_val_acc", "val_images",
              "lr", "backbone_lr",
              "epoch_time_s", "images_per_s", "data_wait_s", "compute_s", "validation_s", "checkpoint_s", "epoch_wall_s",
              "peak_gpu_memory_gib", "skipped_steps", "nonfinite_steps")


def epoch_line(record, epochs, is_best):
    """The line printed after each epoch, from its history record."""
    r = record
    return (f"Epoch {r['epoch']}/{epochs}: train loss {r['train_loss']:.4f} acc {r['train_acc']:.4f} | "
            f"val loss {r['val_loss']:.4f} acc {r['val_acc']:.4f} | "
            + (f"EMA val loss {r['ema_val_loss']:.4f} acc {r['ema_val_acc']:.4f} | "
               if r.get("ema_val_acc") is not None else "")
            + f"{r['images_per_s']:.1f} img/s, "
            f"{r['data_wait_s'] / r['epoch_time_s']:.0%} waiting for data | epoch {r['epoch_wall_s']:.1f} s "
            f"(training {r['epoch_time_s']:.1f}, validation {r['validation_s']:.1f}, checkpoints {r['checkpoint_s']:.1f})"
            + (f" | peak GPU memory {r['peak_gpu_memory_gib']:.2f} GiB" if r["peak_gpu_memory_gib"] is not None else "")
            + (f" | {r['skipped_steps']} step(s) skipped (fp16 overflow)" if r["skipped_steps"] else "")
            + (f" | {r['nonfinite_steps']} non-finite loss(es)" if r["nonfinite_steps"] else "")
            + (" | best" if is_best else ""))


AFTER_SAVE = ("checkpoint_s", "epoch_wall_s")


class TrainingHistory:
    def __init__(self, path, config, timing=None):
        self.path = Path(path)
        self.data = {"config": config, "timing": timing or {}, "epochs": [], "best": {"epoch": None, "val_acc": None}}

    def add(self, record, best_on="raw"):
        """Append one epoch's record (the times measured after it, None until update_last); return True when
        it is the best validation accuracy so far: the weights' (`best_on` raw) or their average's (ema)."""
        self.data["epochs"].append({key: record.get(key) for key in EPOCH_KEYS})
        best = self.data["best"]
        acc = record["ema_val_acc" if best_on == "ema" else "val_acc"]
        if best["val_acc"] is None or acc > best["val_acc"]:
            self.data["best"] = {"epoch": record["epoch"], "val_acc": acc, "on": best_on}
            return True
        return False

    def update_last(self, **values):
        self.data["epochs"][-1].update(values)

    def epochs_since_best(self):
        """Completed epochs after the best one: 0 when the last epoch was the best (--early_stopping_patience)."""
        return self.data["epochs"][-1]["epoch"] - self.data["best"]["epoch"]

    def restore(self, saved):
        """Take the epochs and best of a resumed run's saved history; keep this run's config."""
        self.data["epochs"] = [dict(record) for record in saved["epochs"]]
        self.data["best"] = dict(saved["best"])
        # The figures measured after an epoch's save (AFTER_SAVE) are not in that checkpoint: the file has them.
        try:
            written = {r.get("epoch"): r for r in parse_json(self.path.read_bytes())["epochs"] if isinstance(r, dict)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            written = {}
        for record in self.data["epochs"]:
            same = written.get(record.get("epoch"))
            if same is not None and same.get("val_loss") == record.get("val_loss"):
                record.update({key: same[key] for key in AFTER_SAVE if record.get(key) is None and key in same})

    def file_is_behind(self):
        """Whether the file holds fewer epochs than this history (a stop between a checkpoint's publication and
        its history line), or cannot be read."""
        try:
            return len(parse_json(self.path.read_bytes())["epochs"]) < len(self.data["epochs"])
        except (OSError, ValueError, KeyError, TypeError):
            return True

    def snapshot(self):
        """The history as it stands now, for a save that happens later (after a checkpoint's publication)."""
        return copy.deepcopy(self.data)

    @rank_zero_only
    @stop_on_write_error("training history", "--log_dir")
    def save(self, data=None):
        data = self.data if data is None else data
        flags = data["config"].get("args")
        if flags is not None:  # beside the history, as it: a recipe of this run (--config)
            write_atomic(self.path.with_name(ARGS_FILE), recipe_text(flags).encode())
        write_json_atomic(self.path, data)


def recipe_text(flags):
    """args.yaml: the flags a run was given, as YAML, then its defaults commented out (resolved_flags)."""
    import yaml

    defaults = yaml.safe_dump(flags["defaults"], sort_keys=False).splitlines()
    return ("# this run's flags: python launch_deepspeed.py --config <this file> trains it again\n"
            + (yaml.safe_dump(flags["given"], sort_keys=False) if flags["given"] else "")
            + "# the defaults it ran with (left to the trainer, as a --deepspeed_config's values win over them):\n"
            + "".join(f"# {line}\n" for line in defaults))
