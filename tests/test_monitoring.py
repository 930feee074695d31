"""DeepSpeed's CSV monitor, early stopping and the training flags in one real run; the CSV files of a
resumed run."""
import csv
import json
import math
import os
import re

import pytest
import torch

from deepspeed_image_trainer.data.prepare import make_sample_dataset
from deepspeed_image_trainer.models.build import ResNet18Animals90
from deepspeed_image_trainer.outputs.monitor import EPOCH_SCALARS, epoch_events, prepare_csv_files

from conftest import TINY_CLASSES, assert_usage_error_in_process, data_args, digests, history_of, train_ranks

# The stalled run's own data, smaller than tiny_data: balanced classes (the mean loss below needs them) and a
# training set of whole micro-batches of 4.
STALLED_TRAIN_PER_CLASS, STALLED_VAL_PER_CLASS = 4, 1
STALLED_TRAIN_IMAGES = TINY_CLASSES * STALLED_TRAIN_PER_CLASS  # 12: 3 steps an epoch
STALLED_VAL_IMAGES = TINY_CLASSES * STALLED_VAL_PER_CLASS


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.fixture(scope="module")
def stalled_run(tmp_path_factory):
    """Three epochs in which val accuracy cannot improve after the first: a classifier head with zero
    weights and bias (1, 0, 0) predicts class 0 for every image, and at learning rate 1e-8 the 6
    steps move its logits by far less than that margin of 1 (a tiny learning rate alone would not do:
    the batch-norm running statistics still move)."""
    workdir = tmp_path_factory.mktemp("stalled")
    data = tmp_path_factory.mktemp("stalled_data")
    make_sample_dataset(data, num_classes=TINY_CLASSES, train_per_class=STALLED_TRAIN_PER_CLASS,
                        val_per_class=STALLED_VAL_PER_CLASS, image_size=32, seed=0)
    model = ResNet18Animals90(num_classes=TINY_CLASSES)
    torch.nn.init.zeros_(model.fc.weight)
    torch.nn.init.zeros_(model.fc.bias)
    model.fc.bias.data[0] = 1.0
    torch.save(model.state_dict(), workdir / "zero_head.pth")
    args = data_args(data) + [
        "--epochs", "3", "--batch_size", "4", "--image_size", "32", "--num_workers", "0", "--zero_stage", "0",
        "--data_on_device", "off", "--pretrained", "zero_head.pth", "--learning_rate", "1e-8",
        "--early_stopping_patience", "1", "--csv_monitor", "--label_smoothing", "0.1", "--lr_schedule", "constant"]
    result = train_ranks(args, workdir)  # the trainer's run (the launcher adds nothing it checks)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir, result


@pytest.mark.slow
def test_early_stopping_ends_the_run_and_the_csv_monitor_holds_every_epoch(stalled_run):
    workdir, result = stalled_run
    history = history_of(workdir)
    class_0_share = STALLED_VAL_PER_CLASS / STALLED_VAL_IMAGES
    epochs = history["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2]  # stopped before epoch 3
    assert [e["val_acc"] for e in epochs] == [class_0_share] * 2
    # Logits (1, 0, 0) over balanced classes: the mean loss is log(e + 2) - 1/3, label smoothing or not.
    assert all(e["train_loss"] == pytest.approx(math.log(math.e + 2) - 1 / 3, abs=1e-4) for e in epochs)
    assert history["best"] == {"epoch": 1, "val_acc": class_0_share, "on": "raw"}
    assert "Early stopping after epoch 2: val acc has not improved on epoch 1's for 1 epoch(s) " \
           "(--early_stopping_patience 1)" in result.stdout
    assert re.search(r"Best val acc 0\.3333 at epoch 1; total time \d+:\d\d:\d\d; history in "
                     r"logs/training_history\.json, checkpoints in checkpoints_deepspeed", result.stdout)
    checkpoints = workdir / "checkpoints_deepspeed"
    assert json.loads((checkpoints / "last/extra_info.json").read_text())["epoch"] == 2
    assert json.loads((checkpoints / "best_model/extra_info.json").read_text())["epoch"] == 1

    config = history["config"]
    assert config["training"] == {"optimizer": "AdamW", "lr_schedule": "constant", "learning_rate": 1e-8,
                                  "weight_decay": 0.05,
                                  "warmup_epochs": 1.0, "label_smoothing": 0.1, "early_stopping_patience": 1,
                                  "backbone_lr_scale": 1.0, "freeze_backbone_epochs": 0, "parameter_groups": False,
                                  "augmentation": None, "ra_reps": 1, "mixup_alpha": 0.0, "cutmix_alpha": 0.0,
                                  "drop_path": None, "grad_checkpointing": False, "momentum": None, "nesterov": None,
                                  "groups": None,
                                  "coalesce_grad_reduction": False, "model_ema": False, "best_on": "raw",
                                  "model_ema_decay": None, "model_ema_steps": None}
    assert config["deepspeed"]["scheduler"]["type"] == "WarmupLR"
    assert config["deepspeed"]["csv_monitor"] == {"enabled": True, "output_path": "logs/csv_monitor",
                                                  "job_name": "train"}

    csv_dir = workdir / "logs/csv_monitor/train"
    for key in ("train_loss", "train_acc", "val_loss", "val_acc", "images_per_s", "lr"):
        header, *rows = read_csv(csv_dir / f"Epoch_{key}.csv")
        assert header == ["step", key]
        assert [int(step) for step, _ in rows] == [1, 2]
        assert [float(value) for _, value in rows] == pytest.approx([e[key] for e in epochs])
    assert not (csv_dir / "Epoch_peak_gpu_memory_gib.csv").exists()  # null on CPU
    # DeepSpeed's own per-step learning rate, at every optimizer step (4 images per step, 2 epochs).
    header, *rows = read_csv(csv_dir / "Train_Samples_lr.csv")
    assert header == ["step", "lr"]
    assert [int(step) for step, _ in rows] == list(range(4, 2 * STALLED_TRAIN_IMAGES + 1, 4))
    assert max(float(value) for _, value in rows) == pytest.approx(1e-8)  # after the warmup epoch


def test_epoch_events_leave_out_missing_values():
    record = {"epoch": 7, "train_loss": 1.5, "train_acc": 0.5, "val_loss": 1.25, "val_acc": 0.75,
              "ema_val_loss": None, "ema_val_acc": None, "images_per_s": 100.0, "lr": 0.001,
              "peak_gpu_memory_gib": None}
    events = epoch_events(record)
    assert events == [(f"Epoch/{key}", record[key], 7) for key in EPOCH_SCALARS if record[key] is not None]
    assert ("Epoch/peak_gpu_memory_gib", 2.5, 7) in epoch_events({**record, "peak_gpu_memory_gib": 2.5})
    assert ("Epoch/ema_val_acc", 0.5, 7) in epoch_events({**record, "ema_val_acc": 0.5})  # --model_ema's


def csv_process(tmp_path, monkeypatch, global_samples=0, job_name="train"):
    """An engine's CSV monitor in a new process, as prepare_csv_files sees it (no process group)."""
    from types import SimpleNamespace

    import deepspeed.comm
    from deepspeed.monitor.config import CSVConfig
    from deepspeed.monitor.csv_monitor import csvMonitor

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda: 0)
    monitor = csvMonitor(CSVConfig(enabled=True, output_path=str(tmp_path), job_name=job_name))
    return SimpleNamespace(global_samples=global_samples, monitor=SimpleNamespace(csv_monitor=monitor))


def test_resumed_run_continues_the_csv_files_under_one_header(tmp_path, monkeypatch):
    """A resumed run (a new process) keeps the rows up to its checkpoint and appends below them; a fresh
    run's rows replace the earlier ones once its first checkpoint is published (until then both are kept)."""
    def new_process(global_samples):
        return csv_process(tmp_path, monkeypatch, global_samples)

    first = new_process(0)
    for epoch in (1, 2, 3):  # killed after epoch 3's events, before its checkpoint
        first.monitor.csv_monitor.write_events([("Train/Samples/lr", 0.1 * epoch, 10 * epoch),
                                                ("Epoch/val_acc", 0.2 * epoch, epoch)])
    resumed = new_process(global_samples=20)  # the checkpoint after epoch 2
    prepare_csv_files(resumed, next_epoch=3)
    resumed.monitor.csv_monitor.write_events([("Train/Samples/lr", 0.25, 30), ("Epoch/val_acc", 0.5, 3)])
    assert read_csv(tmp_path / "train/Epoch_val_acc.csv") == [["step", "val_acc"], ["1", "0.2"], ["2", "0.4"],
                                                             ["3", "0.5"]]
    assert read_csv(tmp_path / "train/Train_Samples_lr.csv") == [["step", "lr"], ["10", "0.1"], ["20", "0.2"],
                                                                ["30", "0.25"]]
    before = digests(tmp_path)
    failed = new_process(0)  # an --overwrite run that stopped before its first checkpoint
    assert prepare_csv_files(failed) is not None and digests(tmp_path) == before
    failed.monitor.csv_monitor.write_events([("Train/Samples/lr", 0.9, 10)])
    prepare_csv_files(new_process(global_samples=30), next_epoch=4)  # the earlier run, resumed: without its rows
    assert digests(tmp_path) == before
    fresh = new_process(0)
    earlier = prepare_csv_files(fresh)
    assert digests(tmp_path) == before
    fresh.monitor.csv_monitor.write_events([("Train/Samples/lr", 0.5, 10)])
    earlier.retire(["best_model", "last"])
    assert [p.name for p in (tmp_path / "train").iterdir()] == ["Train_Samples_lr.csv"]
    assert read_csv(tmp_path / "train/Train_Samples_lr.csv") == [["step", "lr"], ["10", "0.5"]]


def test_the_csv_monitor_leaves_the_users_own_csv_files_in_its_folder_alone(tmp_path, monkeypatch):
    """A fresh run deleted every *.csv in the monitor's folder (a JSON's output_path with job_name "": the
    user's own folder); only the files the monitor writes are its to replace or carry over."""
    mine = {"important.csv": b"name,value\nfoo,1\n", "Epoch_notes.csv": b"step,notes\n1,mine\n",
            "Train_lr.csv": b"step,lr\n1,x\n"}
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
    earlier = csv_process(tmp_path, monkeypatch, job_name="")
    earlier.monitor.csv_monitor.write_events([("Train/Samples/lr", 0.1, 10), ("Epoch/val_acc", 0.2, 1)])
    fresh = csv_process(tmp_path, monkeypatch, job_name="")
    retired = prepare_csv_files(fresh)
    fresh.monitor.csv_monitor.write_events([("Train/Samples/lr", 0.3, 10), ("Epoch/val_acc", 0.4, 1)])
    retired.retire(["last"])
    assert read_csv(tmp_path / "Epoch_val_acc.csv") == [["step", "val_acc"], ["1", "0.4"]]
    prepare_csv_files(csv_process(tmp_path, monkeypatch, global_samples=10, job_name=""), next_epoch=2)
    assert read_csv(tmp_path / "Train_Samples_lr.csv") == [["step", "lr"], ["10", "0.3"]]
    assert {name: (tmp_path / name).read_bytes() for name in mine} == mine


def test_a_resumed_run_leaves_out_damaged_csv_rows_with_a_warning(tmp_path, monkeypatch, capsys):
    """A row that is not a number (garbage, bytes that are not UTF-8) in a monitor file ended `--resume auto` in a
    ValueError traceback; its file is the run's own output, rewritten from the rows that read, as a damaged history
    is from the checkpoint."""
    folder = tmp_path / "train"
    csv_process(tmp_path, monkeypatch).monitor.csv_monitor.write_events(
        [(name, 0.5, step) for step in (1, 2) for name in ("Epoch/lr", "Epoch/val_acc", "Epoch/val_loss")])
    with open(folder / "Epoch_lr.csv", "ab") as f:
        f.write(b"\x00\x00garbage\n")
    with open(folder / "Epoch_val_acc.csv", "ab") as f:
        f.write(b"\xff\xfe,1\n" + b"x" * 200_000 + b"\n")  # not UTF-8; a field over csv's size limit
    (folder / "Epoch_train_acc.csv").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)  # a binary file
    (folder / "Epoch_train_loss.csv").write_bytes(b"")
    resumed = csv_process(tmp_path, monkeypatch, global_samples=16)
    prepare_csv_files(resumed, next_epoch=3)
    err = capsys.readouterr().err.splitlines()
    damaged = ("Epoch_lr.csv", "Epoch_train_acc.csv", "Epoch_val_acc.csv")
    assert [line.split(": ")[1] for line in err] == [str(folder / name) for name in damaged]
    assert all(line.startswith("warning: ") for line in err)
    assert "1 damaged row(s), without a step number, left out" in err[0] and "2 damaged row(s)" in err[2]
    for name, key in (("Epoch_lr.csv", "lr"), ("Epoch_val_acc.csv", "val_acc"), ("Epoch_val_loss.csv", "val_loss")):
        assert read_csv(folder / name) == [["step", key], ["1", "0.5"], ["2", "0.5"]]
    assert read_csv(folder / "Epoch_train_acc.csv") == [["step", "train_acc"]]
    assert (folder / "Epoch_train_loss.csv").read_bytes() == b""
    resumed.monitor.csv_monitor.write_events([("Epoch/lr", 0.25, 3), ("Epoch/train_loss", 1.5, 3)])
    assert read_csv(folder / "Epoch_lr.csv")[-1] == ["3", "0.25"]
    assert read_csv(folder / "Epoch_train_loss.csv") == [["step", "train_loss"], ["3", "1.5"]]


@pytest.mark.parametrize("kind", ["folder", "fifo", "dangling link"])
def test_a_csv_monitor_file_name_taken_by_what_is_no_file_is_refused_before_anything_starts(
        tiny_data, tmp_path, monkeypatch, capsys, kind):
    """A folder named Epoch_lr.csv stopped a run at its first epoch's rows, its message blaming the checkpoint; a
    FIFO held the run for good."""
    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    folder = tmp_path / "logs/csv_monitor/train"
    folder.mkdir(parents=True)
    path = folder / ("Epoch_lr.csv" if kind == "folder" else "Train_Samples_lr.csv")
    {"folder": path.mkdir, "fifo": lambda: os.mkfifo(path), "dangling link": lambda: path.symlink_to("nowhere")}[kind]()
    monkeypatch.chdir(tmp_path)
    for resume in ([], ["--resume", "auto"]):
        assert_usage_error_in_process(launch_deepspeed.main, data_args(tiny_data) + ["--csv_monitor", "--dry_run"]
                                      + resume, capsys, f"csv_monitor: logs/csv_monitor/train/{path.name} is not a "
                                      "regular file (a folder, a FIFO or a link to nothing)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"] and [*folder.iterdir()] == [path]
