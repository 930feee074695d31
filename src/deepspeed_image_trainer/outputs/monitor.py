"""Per-epoch scalars for DeepSpeed's own monitors (--tensorboard, --csv_monitor).

DeepSpeed itself logs the learning rate of every optimizer step (`Train/Samples/lr`, step = samples
seen); this adds one `Epoch/<metric>` scalar per epoch (step = epoch number).
"""
import csv
import io
import math
import os
import sys
from pathlib import Path

from ..engine.config import monitor_enabled
from ..engine.distributed import rank_zero_only
from ..utils.failures import UsageError
from ..utils.files import write_atomic

EPOCH_PREFIX = "Epoch/"
EPOCH_SCALARS = ("train_loss", "train_acc", "val_loss", "val_acc", "ema_val_loss", "ema_val_acc", "images_per_s", "lr",
                 "peak_gpu_memory_gib")
# DeepSpeed's CSV monitor names a scalar's file after it, "/" as "_". Its own scalars are all Train/Samples/<name>
# (lr, and loss_scale or step timings by config and version); the trainer's are the Epoch/ ones above.
DEEPSPEED_FILE_PREFIX = "Train_Samples_"
EPOCH_FILE_PREFIX = EPOCH_PREFIX.replace("/", "_")
EPOCH_FILES = {EPOCH_FILE_PREFIX + key + ".csv" for key in EPOCH_SCALARS}


def epoch_events(record):
    """[(name, value, step)] of one epoch's history record; a metric without a value (GPU memory on CPU)
    is left out."""
    return [(EPOCH_PREFIX + key, record[key], record["epoch"])
            for key in EPOCH_SCALARS if record.get(key) is not None]


def _monitor_names(log_dir):
    return sorted(path for path in Path(log_dir).glob("*.csv")
                  if path.name.startswith(DEEPSPEED_FILE_PREFIX) or path.name in EPOCH_FILES)


def monitor_files(log_dir):
    """The CSV monitor's own files in `log_dir`, the folder it writes in: a fresh run replaces their rows and a
    resumed one carries them over; any other file there is the user's, and left alone."""
    return [path for path in _monitor_names(log_dir) if path.is_file()]


def check_csv_files(config):
    """Refuse a name the CSV monitor writes that is taken by something it cannot append to: a folder stopped the
    run at its first epoch's rows (as "cannot write the checkpoint"), a FIFO held the run for good."""
    section = config.get("csv_monitor", {})
    if not monitor_enabled(section) or section.get("output_path") is None:
        return
    for path in _monitor_names(os.path.join(section["output_path"], section.get("job_name", ""))):
        if not path.is_file():
            raise UsageError(f"csv_monitor: {path} is not a regular file (a folder, a FIFO or a link to nothing), "
                             "and the CSV monitor writes its rows there: move it away, or choose another output_path")


@rank_zero_only
def write_epoch_events(engine, record):
    if engine.monitor.enabled:
        engine.monitor.write_events(epoch_events(record))


class EarlierRows:
    """An earlier run's CSV files where a fresh run starts, and their sizes then: the new run's rows are
    appended below (DeepSpeed's CSV monitor appends, with a header row of its own), and the earlier rows go
    once the new run's first checkpoint is published, as its history does (run_folders.EarlierRun)."""

    def __init__(self, paths):
        self.sizes = {path: path.stat().st_size for path in paths}

    def retire(self, published=None):
        for path, size in self.sizes.items():
            rows = path.read_bytes()[size:] if path.exists() else b""
            if rows:
                write_atomic(path, rows)
            else:
                path.unlink(missing_ok=True)


@rank_zero_only
def prepare_csv_files(engine, next_epoch=None):
    """A fresh run (next_epoch None) replaces an earlier run's CSV rows (of monitor_files): the EarlierRows to
    retire after its first checkpoint. A resumed run keeps the rows up to where the checkpoint stands and appends
    below them: DeepSpeed's CSV monitor appends to existing files but writes a header row again in every new
    process."""
    monitor = getattr(engine.monitor, "csv_monitor", None)
    if monitor is None or not monitor.log_dir:
        return None
    paths = monitor_files(monitor.log_dir)
    if next_epoch is None:
        return EarlierRows(paths) if paths else None
    for path in paths:
        rows = [row for row in _read_rows(path) if row != []]
        if not rows:
            continue
        header = ["step", path.stem.removeprefix(DEEPSPEED_FILE_PREFIX).removeprefix(EPOCH_FILE_PREFIX)]
        start = 1 if rows[0] == header else 0
        # A header again: an --overwrite run's rows, appended below, that never reached its first checkpoint.
        ours = rows[start:rows.index(header, start)] if header in rows[start:] else rows[start:]
        limit = next_epoch - 1 if path.name in EPOCH_FILES else engine.global_samples
        steps = [_step(row) for row in ours]
        kept = [row for row, step in zip(ours, steps) if step is not None and step <= limit]
        damaged = steps.count(None)
        if damaged:  # as a damaged history is rewritten from the checkpoint: the run goes on, without them
            print(f"warning: {path}: {damaged} damaged row(s), without a step number, left out; the resumed run "
                  f"rewrites it with the {len(kept)} row(s) up to its checkpoint", file=sys.stderr, flush=True)
        text = io.StringIO()
        csv.writer(text).writerows([header, *kept])
        write_atomic(path, text.getvalue().encode())
        monitor.filenames.append(path.stem)  # DeepSpeed writes the header only for names not in this list
    return None


def _read_rows(path):
    """A monitor file's rows, None for a line that is not one; bytes that are not UTF-8 only spoil their line."""
    rows = []
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():
        try:
            rows.append(next(csv.reader([line]), []))
        except csv.Error:  # a field over csv's size limit
            rows.append(None)
    return rows


def _step(row):
    """The step of a monitor row (a number of samples or an epoch); None when it has none."""
    try:
        step = float(row[0])
    except (TypeError, IndexError, ValueError):
        return None
    return step if math.isfinite(step) else None
