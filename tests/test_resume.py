"""Resume after kill -9 and after SIGTERM, through the launcher, on the real engine (CPU, gloo)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT, TINY_VAL_IMAGES, assert_usage_error, data_args, launch

pytestmark = pytest.mark.slow  # every test here starts training processes

METRICS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")


def train_args(tiny_data, epochs=3, stage=("--zero_stage", "2")):
    """ZeRO-2, whose optimizer state is partitioned, unless `stage` is () (the default, auto: 0 on one rank)."""
    return data_args(tiny_data) + ["--epochs", str(epochs), "--batch_size", "4", "--image_size", "32",
                                   "--num_workers", "1", "--save_every", "1", "--keep_last", "2", *stage]


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


def history(workdir):
    return json.loads((workdir / "logs/training_history.json").read_text())


def metrics(workdir):
    return [{k: e[k] for k in METRICS} for e in history(workdir)["epochs"]]


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = launch(train_args(tiny_data) + ["--resume", "auto"], workdir)  # nothing to resume: starts fresh
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resumed" not in result.stdout
    return workdir


def test_keep_last_prunes_old_epoch_checkpoints(uninterrupted):
    names = sorted(p.name for p in (uninterrupted / "checkpoints_deepspeed").iterdir()
                   if not p.name.startswith("."))
    assert names == ["best_model", "epoch_2", "epoch_3", "last"]


def test_kill_9_then_resume_equals_an_uninterrupted_run(tiny_data, tmp_path, uninterrupted):
    run = start(train_args(tiny_data), tmp_path, tmp_path / "killed.log")
    # epoch 2's checkpoint is written before its line in the history: wait for both
    wait_for(lambda: last_epoch_saved(tmp_path) == 2 and len(history(tmp_path)["epochs"]) == 2, run)
    kill_9_everything(run)
    assert len(history(tmp_path)["epochs"]) == 2, "the kill came after epoch 3 had finished"

    result = launch(train_args(tiny_data) + ["--resume", "auto"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resumed from checkpoints_deepspeed/last: epoch 3" in result.stdout
    assert [e["epoch"] for e in history(tmp_path)["epochs"]] == [1, 2, 3]
    assert metrics(tmp_path) == metrics(uninterrupted)
    assert history(tmp_path)["best"] == history(uninterrupted)["best"]


@pytest.fixture(scope="module")
def uninterrupted_on_device(tiny_data, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted_on_device")
    result = launch(train_args(tiny_data) + ["--data_on_device", "on"], workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir


def test_sigterm_mid_epoch_saves_and_resumes_exactly_with_the_data_on_the_device(tiny_data, tmp_path,
                                                                                  uninterrupted_on_device):
    """With the dataset on the device every batch and crop of an epoch comes from (seed, rank, epoch): a run
    stopped mid-epoch and resumed ends with the metrics of one that never stopped."""
    on_device = ["--data_on_device", "on"]
    log = tmp_path / "stopped.log"
    run = start(train_args(tiny_data) + on_device, tmp_path, log)
    # a few steps into epoch 2 (tqdm's counter, "3/12"), so the stop falls mid-epoch
    wait_for(lambda: re.search(r"Epoch 2 train:[^\r\n]*\| [3-9]/12", log.read_text()), run)
    os.kill(run.pid, signal.SIGTERM)
    assert run.wait(timeout=120) == 128 + signal.SIGTERM
    output = log.read_text()
    assert "Stopped by SIGTERM at epoch 2, step" in output and "--resume auto" in output
    info = json.loads((tmp_path / "checkpoints_deepspeed/last/extra_info.json").read_text())
    assert info["epoch"] == 1 and info["interrupted_at"]["epoch"] == 2 and 0 < info["interrupted_at"]["step"] < 12

    # Without --zero_stage (auto) the run resumes with the checkpoint's stage, 2, rather than refusing it.
    result = launch(train_args(tiny_data, stage=()) + on_device + ["--resume", "auto"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"Resumed from checkpoints_deepspeed/last: epoch 2, step {info['interrupted_at']['step']}" in result.stdout
    assert history(tmp_path)["config"]["zero_stage"] == 2
    assert metrics(tmp_path) == metrics(uninterrupted_on_device)
    assert history(tmp_path)["best"] == history(uninterrupted_on_device)["best"]


def test_resume_with_another_world_size_is_refused_before_anything_starts(tiny_data, uninterrupted):
    before = (uninterrupted / "logs/training_history.json").read_bytes()
    result = launch(train_args(tiny_data, epochs=4) + ["--resume", "auto", "--num_gpus", "2"], uninterrupted)
    assert_usage_error(result, "saved by 1 rank(s) (this run: 2) and ZeRO-1/2/3 checkpoints hold one optimizer shard")
    assert (uninterrupted / "logs/training_history.json").read_bytes() == before


def test_resume_from_a_missing_path_is_a_usage_error(tiny_data, tmp_path):
    assert_usage_error(launch(train_args(tiny_data) + ["--resume", "nowhere"], tmp_path),
                       "no checkpoint at nowhere")



def test_zero0_resumes_on_another_number_of_ranks(tiny_data, tmp_path):
    """1 rank -> 2 -> 1 at ZeRO-0, the global batch kept (micro-batch x ranks): the whole optimizer state is
    in the one model-states file, and the learning rate of every epoch is the uninterrupted run's."""
    args = train_args(tiny_data, epochs=4, stage=("--zero_stage", "0")) + ["--keep_last", "0"]
    run = tmp_path
    whole = launch(args, run)
    assert whole.returncode == 0, whole.stderr[-3000:]
    uninterrupted = json.loads((run / "logs/training_history.json").read_text())["epochs"]
    on_two = launch(args + ["--num_gpus", "2", "--batch_size", "2", "--resume", "epoch_2"], run)
    assert on_two.returncode == 0 and "Resumed from" in on_two.stdout, on_two.stderr[-3000:]
    assert json.loads((run / "checkpoints_deepspeed/epoch_3/extra_info.json").read_text())["world_size"] == 2
    on_one = launch(args + ["--resume", "epoch_3"], run)
    assert on_one.returncode == 0 and "Resumed from" in on_one.stdout, on_one.stderr[-3000:]
    epochs = json.loads((run / "logs/training_history.json").read_text())["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3, 4] and all(e["val_images"] == TINY_VAL_IMAGES for e in epochs)
    assert [e["lr"] for e in epochs] == pytest.approx([e["lr"] for e in uninterrupted], rel=1e-9)
