"""Resume after kill -9 and after SIGTERM, through the launcher, on the real engine (CPU, gloo)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from deepspeed_image_trainer.cli import launch as launch_deepspeed

from conftest import (ROOT, TINY_VAL_IMAGES, assert_usage_error_in_process, data_args, history_of, join_process_group,
                      make_sample_dataset, spawn_ranks, split_dry_run, train_ranks)

pytestmark = pytest.mark.slow  # every test here but the missing path's starts training processes

METRICS = ("train_loss", "train_acc", "val_loss", "val_acc", "ema_val_loss", "ema_val_acc", "lr")


def train_args(tiny_data, epochs=2, stage=("--zero_stage", "2")):
    """ZeRO-2, whose optimizer state is partitioned, unless `stage` is () (the default, auto: 0 on one rank)."""
    return data_args(tiny_data) + ["--epochs", str(epochs), "--batch_size", "4", "--image_size", "32",
                                   "--num_workers", "1", "--save_every", "1", "--keep_last", "1", *stage]


def start(args, workdir, log):
    """The launcher in the background, in its own process group; output to `log`."""
    return subprocess.Popen([sys.executable, str(ROOT / "launch_deepspeed.py"), *args], cwd=workdir,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for(condition, process, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, "the run ended before the moment the test waits for"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def kill_9_everything(process):
    """SIGKILL the launcher and every process under it (the deepspeed runner, ranks, loader workers)."""
    tree = [process.pid] + [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    psutil.wait_procs([p for p in map(_process, tree[1:]) if p], timeout=30)


def _process(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def last_epoch_saved(workdir):
    info = workdir / "checkpoints_deepspeed/last/extra_info.json"
    try:
        return json.loads(info.read_text())["epoch"]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def epochs_logged(workdir):
    try:
        return len(history_of(workdir)["epochs"])
    except FileNotFoundError:  # before the first epoch's line
        return 0


def metrics(workdir):
    return [{k: e[k] for k in METRICS} for e in history_of(workdir)["epochs"]]


# the data on the device, with the recipe: its policy runs on chunks of batches, and a resume mid-chunk regroups them
# (the DataLoader tier's stop and resume: test_two_ranks_stopped_mid_epoch_resume_with_each_ranks_batch_norm_statistics);
# and the weights' average, which the warmup keeps a copy in epoch 1
ON_DEVICE = ["--data_on_device", "on", "--auto_augment", "ra", "--random_erase", "0.25", "--mixup_alpha", "0.2",
             "--cutmix_alpha", "1.0", "--label_smoothing", "0.1", "--model_ema", "--model_ema_steps", "2"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    # nothing to resume: fresh. The training script in a rank of its own (the launcher's runs are the stopped ones)
    result = train_ranks(train_args(tiny_data) + ON_DEVICE + ["--resume", "auto"], workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resumed" not in result.stdout
    return workdir


def test_keep_last_prunes_old_epoch_checkpoints(uninterrupted):
    names = sorted(p.name for p in (uninterrupted / "checkpoints_deepspeed").iterdir()
                   if not p.name.startswith("."))
    assert names == ["best_model", "epoch_2", "last"]


def test_kill_9_then_sigterm_mid_epoch_then_resume_equals_an_uninterrupted_run(tiny_data, tmp_path, uninterrupted,
                                                                              monkeypatch, capsys):
    """kill -9 after epoch 1, then a SIGTERM in the middle of the resumed run's epoch 2. With the dataset on the
    device every batch, crop and policy draw of an epoch comes from (seed, rank, epoch), and each mixing from its
    step: the run resumed twice ends with the metrics of one that never stopped, and goes on on two ranks from
    the same place."""
    run = start(train_args(tiny_data) + ON_DEVICE, tmp_path, tmp_path / "killed.log")
    # epoch 1's checkpoint is written before its line in the history: wait for both
    wait_for(lambda: last_epoch_saved(tmp_path) == 1 and epochs_logged(tmp_path) == 1, run)
    kill_9_everything(run)
    assert len(history_of(tmp_path)["epochs"]) == 1, "the kill came after epoch 2 had finished"

    log = tmp_path / "stopped.log"
    run = start(train_args(tiny_data) + ON_DEVICE + ["--resume", "auto"], tmp_path, log)
    # a few steps into epoch 2 (tqdm's counter, "3/12"), so the stop falls mid-epoch
    wait_for(lambda: re.search(r"Epoch 2 train:[^\r\n]*\| [3-9]/12", log.read_text()), run)
    os.kill(run.pid, signal.SIGTERM)
    assert run.wait(timeout=120) == 128 + signal.SIGTERM
    output = log.read_text()
    assert "Resumed from checkpoints_deepspeed/last: epoch 2" in output
    assert "Stopped by SIGTERM at epoch 2, step" in output and "--resume auto" in output
    info = json.loads((tmp_path / "checkpoints_deepspeed/last/extra_info.json").read_text())
    assert info["epoch"] == 1 and info["interrupted_at"]["epoch"] == 2 and 0 < info["interrupted_at"]["step"] < 12
    mid_epoch = tmp_path / "mid_epoch"  # a copy (hard links) for the resume on 2 ranks below
    shutil.copytree(tmp_path / "checkpoints_deepspeed/last", mid_epoch, copy_function=os.link)

    # Without --zero_stage (auto) the run resumes with the checkpoint's stage, 2, rather than refusing it: the
    # launcher's config says so, and the training script resumes with it. The launcher's part of a resume (the
    # runs above) is done: the rest trains in spawn_ranks ranks, without a launcher's ~10 s of start-up each.
    resumed_argv = train_args(tiny_data, stage=()) + ON_DEVICE + ["--resume", "auto"]
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert launch_deepspeed.main(resumed_argv + ["--dry_run"]) == 0
    assert split_dry_run(capsys.readouterr().out)[0]["zero_optimization"]["stage"] == 2
    result = train_ranks(resumed_argv, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"Resumed from checkpoints_deepspeed/last: epoch 2, step {info['interrupted_at']['step']}" in result.stdout
    assert [e["epoch"] for e in history_of(tmp_path)["epochs"]] == [1, 2]
    assert history_of(tmp_path)["config"]["zero_stage"] == 2
    assert metrics(tmp_path) == metrics(uninterrupted)
    assert history_of(tmp_path)["best"] == history_of(uninterrupted)["best"]
    assert metrics(tmp_path)[1]["ema_val_loss"] != metrics(tmp_path)[1]["val_loss"]  # averaged after the warmup
    resumed_epoch = history_of(tmp_path)["epochs"][1]  # its time before the stop is in both figures
    assert resumed_epoch["epoch_wall_s"] >= sum(resumed_epoch[key] for key in ("epoch_time_s", "validation_s",
                                                                              "checkpoint_s"))

    # The same checkpoint on 2 ranks, the global batch kept (ZeRO-2: through a universal checkpoint; the exact
    # state is checked in test_universal.py): it goes on at the same sample and learning rate.
    two = tmp_path / "two"
    two.mkdir()
    result = train_ranks(train_args(tiny_data) + ON_DEVICE + ["--batch_size", "2", "--resume", str(mid_epoch)], two,
                         nprocs=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "mid_epoch (saved by 1 rank) for 2 ranks with DeepSpeed's universal checkpoint" in result.stdout
    assert f"epoch 2, step {info['interrupted_at']['step']} of 12" in result.stdout
    assert history_of(two)["config"]["world_size"] == 2 and not (two / "checkpoints_deepspeed/.universal").exists()
    resumed, whole = metrics(two), metrics(uninterrupted)
    assert resumed[0] == whole[0] and [e["lr"] for e in resumed] == pytest.approx([e["lr"] for e in whole], rel=1e-9)
    assert all(e["val_images"] == TINY_VAL_IMAGES for e in history_of(two)["epochs"])


def test_resume_from_a_missing_path_is_a_usage_error(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the launcher refuses it, in this process
    assert_usage_error_in_process(launch_deepspeed.main, train_args(tiny_data) + ["--resume", "nowhere"], capsys,
                                  "no checkpoint at nowhere")


# each image's draws from its own seed, each batch's mixing from its step's
RECIPE = ["--auto_augment", "ta_wide", "--random_erase", "0.25", "--mixup_alpha", "0.2", "--cutmix_alpha", "1.0",
          "--ra_reps", "3", "--data_on_device", "off", "--model_ema", "--model_ema_steps", "3", "--warmup_epochs", "0"]


def stop_then_resume(rank, port, results, data, workdir):
    """Two ranks, with the recipe's augmentation: a run that never stops; the same run stopped by SIGTERM
    mid-epoch 1 (raised in each rank at its third batch, agreed at the tenth step), then resumed."""
    import gc

    from deepspeed_image_trainer.cli import train
    from deepspeed_image_trainer.engine.distributed import barrier

    from deepspeed_image_trainer.data.mixing import BatchMixing

    join_process_group(rank, port, world_size=2)
    train.shut_down = barrier  # the group serves every run: spawn_ranks leaves it at the end
    train_one_epoch, mix, mixed = train.train_one_epoch, BatchMixing.__call__, []
    BatchMixing.__call__ = lambda *args: mixed.append(args[-1]) or mix(*args)  # the steps it mixed

    def stopped(engine, loader, epoch, *args, **kwargs):
        def batches():
            for index, batch in enumerate(loader):
                if epoch == 1 and index == 2:
                    signal.raise_signal(signal.SIGTERM)
                yield batch
        return train_one_epoch(engine, batches(), epoch, *args, **kwargs)

    unsaved = ["--save_every", "0", "--save_last_every", "0"]  # the stop saves all the resume needs
    for run, folder, extra in (("whole", "whole", unsaved), ("stopped", "stopped", unsaved),
                               ("resumed", "stopped", [*unsaved, "--resume", "auto"])):
        train.train_one_epoch = stopped if run == "stopped" else train_one_epoch
        results[run, rank] = train.main(data_args(data) + [
            "--epochs", "1", "--batch_size", "4", "--image_size", "32", "--num_workers", "0", *RECIPE,
            "--checkpoint_dir", str(workdir / folder / "checkpoints"), "--log_dir", str(workdir / folder / "logs"),
            *extra])
        gc.unfreeze()  # the trainer froze what it built; the next run needs the memory
        gc.collect()
    results["mixed", rank] = len(mixed)


def test_two_ranks_stopped_mid_epoch_resume_with_each_ranks_batch_norm_statistics(tmp_path):
    """The stop averages the batch-norm statistics over the ranks for the checkpoint; the ranks then went on from
    that average, where the run that never stopped went on from each rank's own (val_loss differed by rounding)."""
    make_sample_dataset(tmp_path / "data", num_classes=3, train_per_class=32, val_per_class=2, image_size=32, seed=0)
    statuses = spawn_ranks(stop_then_resume, 2, tmp_path / "data", tmp_path)
    # 12 steps an epoch: 12 for the whole run, 10 before the stop, 2 after it (and the epoch's validation, with the
    # ranks' own batch-norm statistics put back)
    assert statuses == {**{(run, rank): status for run, status in (("whole", 0), ("stopped", 128 + signal.SIGTERM),
                                                                   ("resumed", 0)) for rank in (0, 1)},
                        ("mixed", 0): 24, ("mixed", 1): 24}
    assert history_of(tmp_path / "stopped")["epochs"][0]["epoch"] == 1
    training = history_of(tmp_path / "stopped")["config"]["training"]
    assert training["augmentation"]["auto_augment"] == "ta_wide" and training["cutmix_alpha"] == 1.0
    assert training["ra_reps"] == 3
    assert history_of(tmp_path / "stopped")["config"]["data_tier"] == "workers"
    assert metrics(tmp_path / "stopped") == metrics(tmp_path / "whole")
    epoch = history_of(tmp_path / "stopped")["epochs"][0]  # the average is not the weights
    assert epoch["ema_val_loss"] is not None and epoch["ema_val_loss"] != epoch["val_loss"]
