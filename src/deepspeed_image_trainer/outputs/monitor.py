"""Per-epoch scalars for DeepSpeed's own monitors (--tensorboard, --csv_monitor).

DeepSpeed itself logs the learning rate of every optimizer step (`Train/Samples/lr`, step = samples
seen); this adds one `Epoch/<metric>` scalar per epoch (step = epoch number).
"""
import csv
from pathlib import Path

from ..engine.distributed import rank_zero_only
from ..utils.files import write_atomic

EPOCH_PREFIX = "Epoch/"
EPOCH_SCALARS = ("train_loss", "train_acc", "val_loss", "val_acc", "images_per_s", "lr", "peak_gpu_memory_gib")
# DeepSpeed's CSV monitor names a scalar's file after it, "/" as "_". Its own scalars are all Train/Samples/<name>
# (lr, and loss_scale or step timings by config and version); the trainer's are the Epoch/ ones above.
DEEPSPEED_FILE_PREFIX = "Train_Samples_"
EPOCH_FILES = {(EPOCH_PREFIX + key).replace("/", "_") + ".csv" for key in EPOCH_SCALARS}


def epoch_events(record):
    """[(name, value, step)] of one epoch's history record; a metric without a value (GPU memory on CPU)
    is left out."""
    return [(EPOCH_PREFIX + key, record[key], record["epoch"])
            for key in EPOCH_SCALARS if record.get(key) is not None]


def monitor_files(log_dir):
    """The CSV monitor's own files in `log_dir`, the folder it writes in: a fresh run replaces their rows and a
    resumed one carries them over; any other file there is the user's, and left alone."""
    return sorted(path for path in Path(log_dir).glob("*.csv")
                  if path.name.startswith(DEEPSPEED_FILE_PREFIX) or path.name in EPOCH_FILES)


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
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows:
            continue
        header = rows[0]
        # A header again: an --overwrite run's rows, appended below, that never reached its first checkpoint.
        ours = rows[1:rows.index(header, 1)] if header in rows[1:] else rows[1:]
        limit = next_epoch - 1 if path.name in EPOCH_FILES else engine.global_samples
        kept = [row for row in ours if row and float(row[0]) <= limit]
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([header, *kept])
        monitor.filenames.append(path.stem)  # DeepSpeed writes the header only for names not in this list
    return None
