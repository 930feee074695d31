"""One run at a time in --checkpoint_dir and --log_dir, and never over another run's results unasked."""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from deepspeed_image_trainer.outputs import run_folders
from deepspeed_image_trainer.outputs.checkpoints import EXTRA_INFO, find_checkpoint
from deepspeed_image_trainer.outputs.run_folders import (LAUNCH_LOCK_FILE, LOCK_FILE, check_new_run, check_unlocked,
                                                         earlier_results, lock, tidy)
from deepspeed_image_trainer.utils.failures import UsageError

from conftest import (ROOT, assert_usage_error_in_process, data_args, digests, history_of, launch,
                      train_ranks)

# A process that holds a folder's lock (as a training run's rank 0 does) until killed.
# It forks a child that outlives it, as a loader worker outlives a rank killed with SIGKILL for a few seconds.
HOLD_LOCK = ("import os, sys, time; sys.path.insert(0, sys.argv[1]); from deepspeed_image_trainer.outputs.run_folders import lock; "
             "lock(sys.argv[2], '--checkpoint_dir'); child = os.fork(); child or time.sleep(600); "
             "print('held', child, flush=True); time.sleep(600)")


# A launcher that holds the folders under tmp_path (argv[2]) for its run, until killed.
HOLD_LAUNCH = ("import sys, time; sys.path.insert(0, sys.argv[1]); from argparse import Namespace; from deepspeed_image_trainer.outputs import run_folders; "
               "from pathlib import Path; root = Path(sys.argv[2]); print(run_folders.claim(Namespace("
               "checkpoint_dir=root / 'ckpt', log_dir=root / 'logs', resume=None, overwrite=False), None), flush=True); "
               "time.sleep(600)")


def args_for(tmp_path, resume=None, overwrite=False, launch_token=None):
    from argparse import Namespace

    return Namespace(checkpoint_dir=tmp_path / "ckpt", log_dir=tmp_path / "logs", resume=resume, overwrite=overwrite,
                     launch_token=launch_token)


def publish(checkpoint_dir, name, epoch, **info):
    """A ZeRO-0 checkpoint as the trainer publishes it (its model states an empty zip)."""
    folder = checkpoint_dir / name
    (folder / name).mkdir(parents=True)
    zipfile.ZipFile(folder / name / "mp_rank_00_model_states.pt", "w").close()
    (folder / "latest").write_text(name)
    (folder / "extra_info.json").write_text(json.dumps({"epoch": epoch, "tag": name, **info}))
    return folder


def test_a_new_run_over_an_earlier_one_stops_unless_told(tmp_path):
    args = args_for(tmp_path)
    check_new_run(args, None)  # empty folders: nothing to protect
    publish(args.checkpoint_dir, "last", 2)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/training_history.json").write_text("{}")
    with pytest.raises(UsageError, match=r"an earlier run's results are here: .*last \(epoch 2\); .*"
                                         r"training_history.json; continue it with --resume auto, replace it "
                                         r"with --overwrite"):
        check_new_run(args, None)
    check_new_run(args_for(tmp_path, resume="auto"), args.checkpoint_dir / "last")  # continuing it is fine
    overwrite = args_for(tmp_path, overwrite=True)
    check_new_run(overwrite, None)
    publish(args.checkpoint_dir, "epoch_2", 2)
    earlier = run_folders.start(overwrite, None)
    assert len(earlier_results(args.checkpoint_dir, args.log_dir)) == 3  # kept until the new run has a checkpoint
    (tmp_path / "logs/ds_config.json").write_text("the earlier run's")
    run_folders.config_path(overwrite).write_text("the new run's")  # the launcher's, beside the earlier run's
    assert (tmp_path / "logs/ds_config.json").read_text() == "the earlier run's"
    shutil.rmtree(args.checkpoint_dir / "last")
    publish(args.checkpoint_dir, "last", 1, run_started=1e9)  # the new run's first checkpoint
    assert find_checkpoint("auto", args.checkpoint_dir).name == "last"  # not the earlier run's epoch_2
    earlier.retire(["best_model", "last"])  # its first checkpoint's names: those the new run replaced
    assert earlier_results(args.checkpoint_dir, args.log_dir) == [f"{args.checkpoint_dir / 'last'} (epoch 1)"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["ds_config.json"]
    assert (tmp_path / "logs/ds_config.json").read_text() == "the new run's"


def test_a_launcher_holds_the_folders_before_it_writes_and_its_rank_0_takes_them_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LAUNCH, str(ROOT / "src"), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        token = holder.stdout.readline().strip()
        for folder, flag in ((tmp_path / "ckpt", "--checkpoint_dir"), (tmp_path / "logs", "--log_dir")):
            with pytest.raises(UsageError, match=rf"{flag} {folder} is in use by pid {holder.pid} on "):
                check_unlocked(folder, flag, LAUNCH_LOCK_FILE)
        with pytest.raises(UsageError, match=f"in use by pid {holder.pid}"):  # a rank 0 of another run
            run_folders.take(args_for(tmp_path, launch_token="0123"))
        with pytest.raises(UsageError, match=f"in use by pid {holder.pid}"):  # one started without a launcher
            run_folders.take(args_for(tmp_path))
        run_folders.release()
        run_folders.take(args_for(tmp_path, launch_token=token))  # its own rank 0
        assert len(run_folders._held) == 2  # rank 0's own lock of each folder, not the launcher's
        with pytest.raises(UsageError, match=f"in use by pid {os.getpid()}"):
            check_unlocked(tmp_path / "ckpt", "--checkpoint_dir")
    finally:
        run_folders.release()
        holder.kill()
        holder.wait()
    run_folders.take(args_for(tmp_path, launch_token=token))  # the launcher gone: rank 0 holds both itself
    try:
        assert len(run_folders._held) == 4
    finally:
        run_folders.release()


def test_a_second_launch_into_held_folders_writes_nothing_there(tiny_data, tmp_path, monkeypatch, capsys):
    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    holder = subprocess.Popen([sys.executable, "-c", HOLD_LAUNCH, str(ROOT / "src"), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        (tmp_path / "logs/ds_config.json").write_text('{"first": "run"}')
        (tmp_path / "logs/ds_config_given.json").write_text('{"optimizer": {"params": {"lr": 0.001}}}')
        (tmp_path / "second.json").write_text('{"optimizer": {"type": "AdamW", "params": {"lr": 0.05}}}')
        # the first run between two writes of its checkpoint: read by the second launch, it passed for damaged
        (tmp_path / "ckpt/last").mkdir()
        (tmp_path / "ckpt/last/extra_info.json").write_text('{"epoch": 1, "model_ema_files": 2}')
        before = digests(tmp_path / "logs"), digests(tmp_path / "ckpt")
        monkeypatch.chdir(tmp_path)
        for resume in ([], ["--resume", "auto"]):
            assert_usage_error_in_process(launch_deepspeed.main, data_args(tiny_data) + [
                "--checkpoint_dir", "ckpt", "--log_dir", "logs", "--deepspeed_config", "second.json", *resume],
                capsys, f"--checkpoint_dir ckpt is in use by pid {holder.pid} on ")
        assert (digests(tmp_path / "logs"), digests(tmp_path / "ckpt")) == before
        assert run_folders._held == []  # the refused launcher let go of what it had taken
    finally:
        holder.kill()
        holder.wait()


def test_resume_auto_does_not_start_over_a_damaged_checkpoint(tmp_path):
    args = args_for(tmp_path, resume="auto")
    folder = publish(args.checkpoint_dir, "last", 3)
    (folder / "extra_info.json").unlink()
    with pytest.raises(UsageError, match=r"--resume auto found no checkpoint to continue from, but .*last "
                                         r"\(no extra_info.json: damaged\).*--overwrite replaces them"):
        check_new_run(args, None)
    (folder / "extra_info.json").write_bytes(b"\x00\xff garbage")
    with pytest.raises(UsageError, match=r"last \(an extra_info.json this trainer cannot use\)"):
        check_new_run(args, None)


def test_a_second_run_waits_for_no_lock_the_dead_one_held(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(ROOT / "src"), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(holder.stdout.readline().removeprefix("held "))
        with pytest.raises(UsageError, match=rf"--checkpoint_dir {tmp_path} is in use by pid {holder.pid} on "):
            check_unlocked(tmp_path, "--checkpoint_dir")
        with pytest.raises(UsageError, match=f"in use by pid {holder.pid}"):
            lock(tmp_path, "--checkpoint_dir")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    try:
        check_unlocked(tmp_path, "--checkpoint_dir")  # the OS released it with the process, not its child's
        lock(tmp_path, "--checkpoint_dir")
    finally:
        os.kill(child, signal.SIGKILL)
    try:
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        run_folders._held.pop().close()


@pytest.mark.parametrize("make", [os.mkdir, os.mkfifo], ids=["folder", "fifo"])
def test_a_lock_or_an_output_file_that_is_not_a_file_is_one_line(tmp_path, make):
    """A FIFO by a lock's name: open() raised io.UnsupportedOperation (a folder: IsADirectoryError), a traceback; by
    the history's name a resume waited for good on reading it, and a folder there failed the first write after an
    epoch (status 4)."""
    for name in (LOCK_FILE, LAUNCH_LOCK_FILE):
        make(tmp_path / name)
        with pytest.raises(UsageError, match=rf"--log_dir {tmp_path}: {tmp_path / name}, the lock of the run in it, "
                                             "is not a regular file"):
            lock(tmp_path, "--log_dir", name)
    args = argparse.Namespace(log_dir=str(tmp_path / "logs"), checkpoint_dir=str(tmp_path / "ck"), overwrite=False)
    run_folders.check_output_files(args)  # nothing there yet
    for name, what in (("training_history.json", "history"), ("ds_config.json", "DeepSpeed config"),
                       ("args.yaml", "flags")):
        (tmp_path / "logs").mkdir(exist_ok=True)
        make(tmp_path / "logs" / name)
        with pytest.raises(UsageError, match=rf"logs/{name}, where the run writes its {what}, is not a regular file"):
            run_folders.check_output_files(args)
        os.rmdir(tmp_path / "logs" / name) if make is os.mkdir else os.unlink(tmp_path / "logs" / name)


def test_a_finished_run_gives_its_folders_back_to_the_next_in_the_same_process(tmp_path):
    lock(tmp_path, "--checkpoint_dir")
    try:  # a lock is held by its open file, not its process: a second run here is refused as any other
        with pytest.raises(UsageError, match=f"in use by pid {os.getpid()}"):
            lock(tmp_path, "--checkpoint_dir")
    finally:
        run_folders.release()
    lock(tmp_path, "--checkpoint_dir")  # as train_deepspeed.main() run again on the same folders does
    run_folders.release()
    check_unlocked(tmp_path, "--checkpoint_dir")


def test_tidy_completes_or_undoes_a_cut_swap_and_removes_staging(tmp_path):
    publish(tmp_path, "best_model", 1)
    publish(tmp_path, ".old-best_model", 1)  # cut after the second rename: the new one is published
    publish(tmp_path, ".old-last", 2)  # cut between the renames: only the old one is left
    publish(tmp_path, ".ready-epoch_3", 3)
    (tmp_path / ".staging/staged").mkdir(parents=True)
    tidy(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_model", "last"]
    assert json.loads((tmp_path / "last/extra_info.json").read_text())["epoch"] == 2


@pytest.mark.parametrize("overwrite, launch_token, kept", [(False, None, False), (True, None, False),
                                                         (False, "token", False), (True, "token", True)])
def test_a_killed_overwrite_launchs_config_goes_unless_this_runs_launcher_wrote_it(tmp_path, overwrite,
                                                                                    launch_token, kept):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / run_folders.NEXT_DS_CONFIG).write_text("{}")
    try:
        run_folders.take(args_for(tmp_path, overwrite=overwrite, launch_token=launch_token))
    finally:
        run_folders.release()
    assert (tmp_path / "logs" / run_folders.NEXT_DS_CONFIG).exists() == kept


@pytest.mark.slow
def test_the_same_command_twice_keeps_the_first_runs_results(trained, tiny_data, tmp_path, monkeypatch, capsys):
    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    workdir, first = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    before = (tmp_path / "logs/training_history.json").read_bytes()
    args = first.args[2:]  # the same flags as the first run
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(launch_deepspeed.main, args, capsys, "an earlier run's results are here")
    assert (tmp_path / "logs/training_history.json").read_bytes() == before
    # Started without the launcher, the training script stops the same way (its run_cli(main) in a spawn_ranks
    # rank: a process of its own without the ~5 s of imports a script pays).
    result = train_ranks(args, tmp_path)
    assert result.returncode == 2 and "an earlier run's results are here" in result.stderr, result.stderr[-2000:]
    assert (tmp_path / "logs/training_history.json").read_bytes() == before
    # --overwrite that fails before its first checkpoint leaves the earlier run as it was
    (tmp_path / "given.json").write_text('{"gradient_clipping": 0.5}')
    everything = digests(tmp_path)
    result = train_ranks([*args, "--overwrite", "--fp16"], tmp_path)
    assert result.returncode == 2 and "error: fp16 needs a GPU" in result.stderr, result.stderr[-2000:]
    assert digests(tmp_path) == everything
    monkeypatch.setattr(launch_deepspeed, "run_and_forward_signals", lambda *_: 1)  # ranks that fail at once
    assert launch_deepspeed.main(args + ["--overwrite"]) == 1
    assert digests(tmp_path) == everything  # nor the launcher's config of the new run (.ds_config.next.json)
    assert launch_deepspeed.main(args + ["--overwrite", "--deepspeed_config", str(tmp_path / "given.json")]) == 1
    assert digests(tmp_path) == everything  # nor the copy of the user's JSON it made for the ranks
    # --keep_last counts this run's epoch_N only: the earlier run's epoch_2 goes, not the new epoch_1
    result = launch(args + ["--overwrite", "--epochs", "1", "--keep_last", "1"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    history = history_of(tmp_path)
    assert len(history["epochs"]) == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints_deepspeed").iterdir()) == sorted(
        [LAUNCH_LOCK_FILE, LOCK_FILE, "best_model", "epoch_1", "last"])


@pytest.mark.slow
def test_two_runs_at_once_and_a_killed_launcher(tiny_data, tmp_path, monkeypatch, capsys):
    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    args = data_args(tiny_data) + ["--batch_size", "4", "--image_size", "32", "--num_workers", "0"]
    first = subprocess.Popen([sys.executable, str(ROOT / "launch_deepspeed.py"), *args, "--epochs", "50"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:  # the first epoch is over: its rank 0 holds the lock
            if "Epoch 1/" in line and "train loss" in line:
                break
        monkeypatch.chdir(tmp_path)  # the second launcher, in this process: refused before it starts anything
        assert_usage_error_in_process(launch_deepspeed.main, args + ["--resume", "auto"], capsys,
                                      "--checkpoint_dir checkpoints_deepspeed is in use by pid ")
        first.send_signal(signal.SIGKILL)  # the launcher alone: its training processes must not outlive it
        first.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                check_unlocked(tmp_path / "checkpoints_deepspeed", "--checkpoint_dir")
                break
            except UsageError:
                time.sleep(0.5)
        else:
            pytest.fail("the training outlived its launcher by a minute")
    finally:
        first.kill()
    # what its training processes saved as they went resumes, in folders they left free: the launcher's checks of
    # both, every shard read as the ranks would (the resume itself: test_resume.py)
    saved = json.loads((tmp_path / "checkpoints_deepspeed" / "last" / EXTRA_INFO).read_text())["epoch"]
    assert launch_deepspeed.main(args + ["--epochs", str(saved + 1), "--resume", "auto", "--dry_run"]) == 0
    assert "--resume auto" in capsys.readouterr().out


def test_a_run_refused_on_its_second_folder_removes_the_first_it_made(tmp_path):
    from argparse import Namespace

    (tmp_path / "logs").mkdir()
    lock(tmp_path / "logs", "--log_dir")  # another run's (a lock is held by its open file)
    refused = Namespace(checkpoint_dir=tmp_path / "new/ckpt", log_dir=tmp_path / "logs", launch_token=None)
    try:
        with pytest.raises(UsageError, match=f"--log_dir {tmp_path / 'logs'} is in use by pid {os.getpid()}"):
            run_folders.take(refused)
    finally:
        run_folders.release()  # the refused run's end, as train.main's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    run_folders.take(refused)  # a run that starts keeps the folders it made
    run_folders.keep()
    run_folders.release()
    assert (tmp_path / "new/ckpt").is_dir()


def test_files_written_whole_get_the_permissions_open_gives(tmp_path):
    """tempfile makes its files 0600 and its folders 0700: histories, configs, checkpoint descriptions, exports
    and cache entries stayed private to their owner, where the same file written by open() is not."""
    import tempfile

    from deepspeed_image_trainer.utils.files import as_open_would, write_json_atomic

    write_json_atomic(tmp_path / "history.json", {})
    (tmp_path / "plain.json").write_text("{}")
    (tmp_path / "plain").mkdir()
    entry = Path(tempfile.mkdtemp(dir=tmp_path))
    as_open_would(entry, folder=True)
    mode = lambda path: path.stat().st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "history.json") == mode(tmp_path / "plain.json")
    assert mode(entry) == mode(tmp_path / "plain")
