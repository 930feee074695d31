import base64
import shlex
import sys
import time

import pytest

from deepspeed_image_trainer.models.build import ResNet18Animals90

from conftest import (ROOT, TINY_CLASSES, assert_usage_error, assert_usage_error_in_process, data_args, launch, run,
                      split_dry_run)


def test_dry_run_prints_config_and_command_and_spawns_nothing(tiny_data, tmp_path, monkeypatch, capsys):
    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    monkeypatch.chdir(tmp_path)  # in this process (the script's own dry run: test_ds_config's)
    assert launch_deepspeed.main(data_args(tiny_data) + ["--dry_run", "--num_gpus", "2", "--bf16", "--zero_stage", "3",
                                                         "--batch_size", "2", "--epochs", "3", "--offload_param"]) == 0
    config, command = split_dry_run(capsys.readouterr().out)
    assert config["train_batch_size"] == 2 * 1 * 2
    assert config["bf16"] == {"enabled": True}
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    # DeepSpeed's buckets, which it allocates at full size, capped at the model's parameter count (odd for 3
    # classes), rounded up to the even size ZeRO-1/2 require
    params = sum(p.numel() for p in ResNet18Animals90(num_classes=TINY_CLASSES).parameters())
    assert params % 2 == 1
    assert config["zero_optimization"]["reduce_bucket_size"] == params + 1
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == params + 1
    # 48 train images / 2 ranks / micro-batch 2 = 12 steps per epoch.
    assert config["scheduler"]["params"]["total_num_steps"] == 36
    # One node: DeepSpeed's per-node launcher, with the world description its runner would give it.
    assert command[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]
    assert command[4] == "--world_info=" + base64.urlsafe_b64encode(b'{"localhost": [0, 1]}').decode()
    assert command[5] == "--master_addr=127.0.0.1"
    assert command[6].startswith("--master_port=") and 1024 <= int(command[6].split("=")[1]) < 65536
    assert command[7] == str(ROOT / "src/train_deepspeed.py")
    for flag in (["--bf16"], ["--offload_param"], ["--zero_stage", "3"], ["--epochs", "3"]):
        assert " ".join(flag) in " ".join(command[8:])
    assert "--deepspeed_config" not in command  # the training script resolves the config itself
    assert "--dry_run" not in command and "--num_gpus" not in command[7:]
    assert list(tmp_path.iterdir()) == []


def test_a_dry_runs_command_reads_the_users_json_which_it_can_run_with(tiny_data, tmp_path, monkeypatch, capsys):
    """It named the copy a run keeps in --log_dir, which a dry run does not write: the printed command failed."""
    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.json").write_text('{"gradient_clipping": 2.0}')
    assert launch_deepspeed.main(data_args(tiny_data) + ["--deepspeed_config", "mine.json", "--dry_run",
                                                         "--master_addr", "10.1.2.3"]) == 0
    out, err = capsys.readouterr()
    command = shlex.split(out.strip().splitlines()[-1])
    assert command[command.index("--deepspeed_config") + 1] == "mine.json"
    # one node meets at 127.0.0.1 whatever --master_addr says: said, not silent
    assert "note: --master_addr 10.1.2.3 is for runs over several nodes" in err and "10.1.2.3" not in out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine.json"]


def test_a_dry_run_downloads_no_weights(tiny_data, tmp_path, monkeypatch, capsys):
    """A dry run writes nothing: named weights missing from the torch hub cache were downloaded into it."""
    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.chdir(tmp_path)
    assert launch_deepspeed.main(data_args(tiny_data) + ["--pretrained", "DEFAULT", "--dry_run"]) == 0
    assert "note: --pretrained DEFAULT: the run downloads resnet18-f37072fd.pth into" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_one_class_is_trained_with_a_warning_that_nothing_is_learned(tiny_data, tmp_path, monkeypatch, capsys):
    """A folder of one class trained at a loss of 0 with no remark."""
    import shutil

    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    name = sorted(p.name for p in (tiny_data / "train").iterdir())[0]
    for split in ("train", "val"):
        shutil.copytree(tiny_data / split / name, tmp_path / "one" / split / name)
    monkeypatch.chdir(tmp_path)
    assert launch_deepspeed.main(data_args(tmp_path / "one") + ["--dry_run"]) == 0
    assert (f"warning: {tmp_path / 'one/train'} holds one class ({name}): every image is labelled with it, so the "
            "loss is 0") in capsys.readouterr().err
    assert launch_deepspeed.main(data_args(tiny_data) + ["--dry_run"]) == 0
    assert "one class" not in capsys.readouterr().err


def test_the_training_script_gets_the_users_json_as_read_not_the_config_resolved_here():
    """The config resolved here holds the LR schedule's step counts, from the data check's count of images, as
    numbers: the training script would take them for the user's own. It gets the user's JSON as the launcher
    read it, copied into the log folder."""
    from deepspeed_image_trainer.cli.launch import forwarded_args, get_args_parser
    from deepspeed_image_trainer.cli.options import parse_args

    args = parse_args(get_args_parser, ["--deepspeed_config", "mine.json", "--num_gpus", "2", "--epochs", "3"])
    assert forwarded_args(args, "logs/given.json") == ["--deepspeed_config", "logs/given.json", "--epochs", "3"]
    assert forwarded_args(parse_args(get_args_parser, ["--epochs", "3"])) == ["--epochs", "3"]


def test_a_one_node_run_uses_the_gpus_cuda_visible_devices_names(monkeypatch):
    """The `deepspeed` runner drops CUDA_VISIBLE_DEVICES once --num_gpus is given, and DeepSpeed's per-node
    launcher then sets it to the ids it was handed: those must be the visible ones."""
    from deepspeed_image_trainer.cli.launch import local_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    assert local_devices(2) == ["2", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local_devices(2) == [0, 1]


@pytest.mark.slow
def test_wrapper_script_passes_arguments_through(tiny_data, tmp_path):
    result = run(["bash", str(ROOT / "train_deepspeed.sh"), *data_args(tiny_data), "--dry_run",
                  "--gradient_accumulation_steps", "3", "--batch_size", "2"], tmp_path)
    assert result.returncode == 0, result.stderr
    config, command = split_dry_run(result.stdout)
    assert config["gradient_accumulation_steps"] == 3 and config["train_batch_size"] == 6
    assert "--gradient_accumulation_steps" in command


BAD_INPUT = [
    (["--train_dir", "nowhere"], "image folder not found: nowhere"),
    (["--fp16"], "fp16 needs a GPU"),
    (["--optimizer", "lamb"], "--optimizer lamb: optimizer Lamb is DeepSpeed's FusedLamb, a CUDA op: it needs a GPU"),
    (["--val_crop_size", "0"], "--val_crop_size must be 1 .. 4096 pixels, got 0"),
    (["--image_size", "32", "--val_resize_size", "30"], "--val_resize_size 30 is smaller than the validation crop 32"),
    (["--model", "vit_b_16", "--image_size", "32", "--val_crop_size", "48"],  # ViT's input size is fixed when built
     "--val_crop_size 48: --model vit_b_16 built for --image_size 32 cannot take it"),
    (["--zero_stage", "2", "--offload_param"], "offload_param needs ZeRO stage 3"),
    (["--zero_stage", "0", "--offload_optimizer"], "offload_optimizer needs ZeRO stage 1, 2 or 3"),
    (["--coalesce_grad_reduction", "on", "--zero_stage", "0", "--gradient_accumulation_steps", "2"],
     "--coalesce_grad_reduction on needs --zero_stage 1, 2 or 3"),
    (["--deepspeed_config", "missing.json"], "--deepspeed_config missing.json: file not found"),
    (["--deepspeed_config", "."], "--deepspeed_config .: a folder, not a JSON file"),
    (["--train_dir", "FILE"], "FILE is a file, not an image folder (<folder>/<class>/<image>)"),
    (["--batch_size", "100"], "too few"),
    (["--pretrained", "missing.pth"], "--pretrained missing.pth: no such file, and not a weights name of resnet18"),
    (["--num_gpus", "0"], "--num_gpus and --num_nodes must be at least 1"),
    (["--batch_size", "0"], "--batch_size must be at least 1"),
    (["--learning_rate", "-0.1"], "--learning_rate must be positive"),
    (["--learning_rate", "nan"], "--learning_rate must be a finite number"),
    (["--fp16", "--bf16"], "fp16 and bf16 are both enabled: choose one"),
    (["--master_port", "70000"], "--master_port 70000 is not a port number"),
    (["--deepspeed_config", "BROKEN"], "not valid JSON"),
    (["--deepspeed_config", "LIST"], "expected a JSON object ({...}), got list"),
    (["--deepspeed_config", "WRONG_BATCH"], "train_batch_size 7 in the DeepSpeed config is not micro-batch 4"),
    (["--deepspeed_config", "WRONG_TYPE"], 'zero_optimization in the DeepSpeed config must be a JSON object, got 2'),
    (["--deepspeed_config", "DEEPCOMPILE", "--compile"], "DeepCompile (compile.deepcompile with --compile) is not"),
    (["--checkpoint_dir", "FILE/checkpoints"], "is not a folder; choose another --checkpoint_dir"),
    # each a RuntimeError traceback from Path.resolve before the check that names the loop
    (["--cache_dir", "LOOP", "--data_on_device", "off"], "--cache_dir LOOP: LOOP is a link to nothing or a link loop"),
    (["--hostfile", "HOSTFILE", "--master_addr", "no.such.host.invalid"],  # the ranks retried it for 10 minutes
     "--master_addr 'no.such.host.invalid' is not an address this machine can find"),
]


def bad_input_argv(tmp_path, tiny_data, extra):
    files = {"BROKEN": "{\"train_batch_size\": ", "LIST": "[]", "FILE": "",
             "WRONG_BATCH": '{"train_batch_size": 7, "train_micro_batch_size_per_gpu": 4}',
             "WRONG_TYPE": '{"zero_optimization": 2}', "DEEPCOMPILE": '{"compile": {"deepcompile": true}}',
             "HOSTFILE": "localhost slots=1\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "LOOP").symlink_to("LOOP2")
    (tmp_path / "LOOP2").symlink_to("LOOP")
    return data_args(tiny_data) + [str(tmp_path / arg) if arg.split("/")[0] in files else arg for arg in extra]


@pytest.mark.parametrize("extra, message", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_status_2(tiny_data, tmp_path, monkeypatch, capsys, extra, message):
    # In process (a launcher process takes 5 s to import torch and torchvision); the command line's own
    # path, from the process's exit status to its stderr, is the test below.
    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    argv = bad_input_argv(tmp_path, tiny_data, extra)
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(launch_deepspeed.main, argv, capsys, message)
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", BAD_INPUT[:1])  # the rest in process, above
def test_bad_input_on_the_command_line_is_one_line_and_exit_status_2(tiny_data, tmp_path, extra, message):
    assert_usage_error(launch(bad_input_argv(tmp_path, tiny_data, extra), tmp_path), message)
    assert not (tmp_path / "logs").exists()


def test_a_master_port_another_process_listens_on_is_refused_before_anything_starts(
        tiny_data, tmp_path, monkeypatch, capsys):
    import socket

    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    monkeypatch.chdir(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_usage_error_in_process(launch_deepspeed.main, data_args(tiny_data) + ["--master_port", str(port)], capsys,
                                      f"error: --master_port {port}: the port is taken on this machine")
    assert not (tmp_path / "logs").exists()


def test_more_gpus_than_the_machine_has_are_refused(tiny_data, tmp_path, monkeypatch, capsys):
    import torch

    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # what a two-GPU machine reports
    monkeypatch.chdir(tmp_path)
    argv = data_args(tiny_data) + ["--num_gpus", "4", "--dry_run"]
    out, err = assert_usage_error_in_process(launch_deepspeed.main, argv, capsys, "--num_gpus 4")
    assert out == ""
    assert err == ("error: --num_gpus 4, but this machine has 2 visible GPU(s): use --num_gpus 2 or fewer "
                   "(CUDA_VISIBLE_DEVICES decides which GPUs are visible)\n")


@pytest.mark.slow
def test_unknown_flag_is_rejected_by_argparse_with_status_2(tmp_path):
    result = launch(["--no_such_flag"], tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: unrecognized arguments: --no_such_flag (--help lists the flags)"]  # one line, not the usage


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["sys.exit(-9)", "os.kill(os.getpid(), signal.SIGKILL)"],
                         ids=["a rank", "DeepSpeed's launcher"])
def test_a_training_process_killed_from_outside_is_one_line_and_status_137(ending):
    """DeepSpeed's launcher exits with a killed rank's return code, -9 (status 247) for the out-of-memory killer's
    SIGKILL, or is killed itself (pkill -9 -f train_deepspeed matches its command line too): stand-ins that end
    so, a progress bar's line left unfinished."""
    import subprocess

    stand_in = f"import os, signal, sys; sys.stderr.write('Epoch 1 train:  33%'); sys.stderr.flush(); {ending}"
    code = ("import sys; from deepspeed_image_trainer.cli.launch import run_and_forward_signals; "
            f"sys.exit(run_and_forward_signals([sys.executable, '-c', {stand_in!r}], 0))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 137, result.stderr[-2000:]
    assert result.stderr.splitlines() == ["Epoch 1 train:  33%", (
        "error: a training process was killed by SIGKILL from outside the trainer (the kernel's out-of-memory killer "
        "sends it when the host's memory runs out); --resume auto continues from the last checkpoint published, if "
        "any")]


# The launcher's signal handling around training processes that take their time to save (they ignore SIGTERM):
# a stand-in for DeepSpeed's launcher that has started a training process, or (SPAWNING) not yet, which ends
# SECONDS after it says so.
FORWARDER = ("import sys; from deepspeed_image_trainer.cli.launch import run_and_forward_signals; "
             "sys.exit(run_and_forward_signals([sys.executable, '-c', 'import signal, subprocess, sys, time; "
             "SPAWNING or subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(60)\"]); "
             "signal.signal(signal.SIGTERM, signal.SIG_IGN); "  # after the spawn: the child keeps SIGTERM's default
             "print(1, flush=True); time.sleep(SECONDS)'], 0))")


@pytest.mark.slow
@pytest.mark.parametrize("signals, gap, status, message", [
    (["SIGINT"], 0, None, "Stopping: once training has started, it saves a checkpoint"),
    (["SIGINT", "SIGINT"], 1, 128 + 9, "error: the training processes were killed (a second Ctrl-C or SIGTERM); "),
    # `timeout 1h launch_deepspeed.py ...`: timeout's SIGTERM reaches the launcher twice, to it and to its group
    (["SIGTERM", "SIGTERM"], 0, None, "Stopping: once training has started, it saves a checkpoint"),
], ids=["one Ctrl-C", "two Ctrl-C", "timeout's SIGTERM"])
def test_a_second_ctrl_c_kills_the_training_and_says_so(signals, gap, status, message):
    import signal
    import subprocess

    forwarder = FORWARDER.replace("SPAWNING", "False").replace("SECONDS", "30")
    launcher = subprocess.Popen([sys.executable, "-c", forwarder], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        assert launcher.stdout.readline().strip() == "1"  # the "training" runs
        for name in signals:
            launcher.send_signal(getattr(signal, name))
            time.sleep(gap)
        time.sleep(0.5)
        if status is None:  # one Ctrl-C: the training saves as long as it needs
            with pytest.raises(subprocess.TimeoutExpired):
                launcher.wait(timeout=2)
            assert launcher.stderr.readline().startswith(message)
            return
        assert launcher.wait(timeout=30) == status
        assert launcher.stderr.read().strip().splitlines()[-1].startswith(message)
    finally:  # the stand-in ignores SIGTERM, which the launcher's death sends it: killed with it
        import psutil

        if launcher.poll() is None:
            for process in [*psutil.Process(launcher.pid).children(recursive=True), launcher]:
                process.kill()
        launcher.wait()


FINISHED_THEN_SIGNALLED = (
    "import sys; from deepspeed_image_trainer.cli.launch import run_and_forward_signals; "
    "sys.exit(run_and_forward_signals([sys.executable, '-c', 'import os, signal, subprocess, sys, time; "
    "subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(60)\"]); "
    "open(os.environ[\"TRAINER_FINISHED_FILE\"], \"w\").write(\"finished\\\\n\"); "  # as rank 0 does at the end
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(1)); "  # DeepSpeed's launcher's status once signalled
    "print(1, flush=True); time.sleep(30)'], 0))")


@pytest.mark.slow
def test_a_signal_after_the_run_finished_stops_nothing():
    """`timeout` expiring in the teardown of a finished run: the launcher said it stopped the run to save, and
    exited 143."""
    import signal
    import subprocess

    launcher = subprocess.Popen([sys.executable, "-c", FINISHED_THEN_SIGNALLED], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().strip() == "1"
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 0
    assert launcher.stderr.read().strip() == "The run had finished when SIGTERM came"


# DeepSpeed's per-node launcher as it ends a run: its rank exits, and it looks again only a while later
SLOW_TO_NOTICE = ("import subprocess, sys, time; "
                  "subprocess.Popen([sys.executable, '-c', 'pass']); time.sleep(60); sys.exit(3)")


def test_a_finished_runs_launcher_is_not_waited_for_once_its_ranks_have_exited(tmp_path):
    """DeepSpeed's launcher noticed its ranks' exit up to a second late and slept a second more: each run ended
    about 2 s after its last line. Once rank 0 has said the run finished and no rank is left, it is ended;
    before that, its own status counts."""
    import subprocess

    from deepspeed_image_trainer.cli.launch import wait_for_launcher

    marker = tmp_path / "finished"
    marker.write_text("")
    unfinished = subprocess.Popen([sys.executable, "-c", SLOW_TO_NOTICE.replace("60", "1")])
    assert wait_for_launcher(unfinished, str(marker)) == 3
    marker.write_text("finished\n")
    launcher = subprocess.Popen([sys.executable, "-c", SLOW_TO_NOTICE])
    started = time.monotonic()
    assert wait_for_launcher(launcher, str(marker)) == 0 and launcher.returncode == -9
    assert time.monotonic() - started < 30
    no_marker = subprocess.Popen([sys.executable, "-c", SLOW_TO_NOTICE.replace("60", "1")])
    assert wait_for_launcher(no_marker, None) == 3  # another launcher's ranks are not its children


def test_a_rank_that_died_of_a_signal_is_named_with_its_status(capsys):
    """DeepSpeed's launcher exits with a rank's -N: a rank killed by SIGBUS (the decoded-image cache truncated
    under its memory map) ended the run with 249 and no line."""
    from deepspeed_image_trainer.cli.launch import run_and_forward_signals

    assert run_and_forward_signals([sys.executable, "-c", "import sys; sys.exit(-7)"], time.time()) == 135
    assert capsys.readouterr().err.strip() == (
        "error: a training process died of SIGBUS (a memory-mapped file cut short under it: the decoded-image cache "
        "truncated while the run read it?); --resume auto continues from the last checkpoint published, if any")
    assert run_and_forward_signals([sys.executable, "-c", "import sys; sys.exit(3)"], time.time()) == 3


@pytest.mark.slow
def test_ctrl_c_while_the_launcher_imports_ends_it_without_a_traceback(tiny_data, tmp_path):
    import signal
    import subprocess

    launcher = subprocess.Popen([sys.executable, str(ROOT / "launch_deepspeed.py"), *data_args(tiny_data)],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # in torch's import
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGINT and "Traceback" not in err, err
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_a_stop_before_the_training_starts_is_one_line(tiny_data, tmp_path):
    """Ctrl-C or SIGTERM in the launcher's checks, in a training process's imports, or while it builds the run:
    128 + the signal, one line, and the folders it had taken given back."""
    import os
    import signal
    import subprocess

    said = "before the training started: nothing to save"
    folders = ["--checkpoint_dir", str(tmp_path / "ck"), "--log_dir", str(tmp_path / "logs")]
    for script, signum in (("launch_deepspeed.py", signal.SIGINT), ("src/train_deepspeed.py", signal.SIGTERM)):
        process = subprocess.Popen([sys.executable, str(ROOT / script), *data_args(tiny_data), *folders],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # importing
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 128 + signum, err[-2000:]
        assert err.strip() == f"Stopped by {signal.Signals(signum).name} {said}" and not out
    assert not any(tmp_path.iterdir())
    # DeepSpeed's launcher still importing, no training process started yet: the launcher says it
    launcher = subprocess.Popen([sys.executable, "-c", FORWARDER.replace("SPAWNING", "True").replace("SECONDS", "5")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().strip() == "1"
    launcher.send_signal(signal.SIGINT)
    launcher.wait(timeout=30)
    assert launcher.stderr.read().strip() == f"Stopped by SIGINT {said}"
    building = ("import os, signal, time; from deepspeed_image_trainer.engine.interrupt import stopped_at_once\n"
                "with stopped_at_once(on_stop=lambda: print('given back', flush=True)):\n"
                "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)")
    result = subprocess.run([sys.executable, "-c", building], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert result.returncode == 143 and result.stdout == "given back\n"
    assert result.stderr.strip() == f"Stopped by SIGTERM {said}"


@pytest.mark.slow  # starts processes
def test_a_second_ctrl_c_kills_a_training_process_run_without_the_launcher():
    """The first Ctrl-C asks for a stop after the step (and a save); a second one, as the launcher's does, kills."""
    import os
    import subprocess

    code = ("import os, signal, time, torch; from deepspeed_image_trainer.engine.interrupt import StopOnSignal\n"
            "with StopOnSignal(torch.device('cpu'), 1) as stop:\n"
            "    os.kill(os.getpid(), signal.SIGINT); print(stop.requested(), flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGINT); time.sleep(30)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert result.returncode == 137 and result.stdout == "True\n"
    assert result.stderr.strip() == ("error: killed by a second Ctrl-C; --resume auto continues from the last "
                                     "checkpoint published, if any")
