"""Runs that must stop: a loss that turns NaN, a checkpoint that cannot be written, the GPU out of memory.
Each stops with one `error:` line and its own exit status, and leaves what earlier epochs wrote intact."""
import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from deepspeed_image_trainer.cli.options import add_training_args, parse_args
from deepspeed_image_trainer.engine.config import build_ds_config
from deepspeed_image_trainer.engine.memory import out_of_memory_advice, zero3_note

from conftest import ROOT, assert_usage_error, data_args, digests, history_of, launch, train_ranks

TINY_RUN = ["--batch_size", "4", "--image_size", "32", "--num_workers", "0"]


@pytest.fixture
def earlier_run(trained, tmp_path):
    """tmp_path holding a finished two-epoch ZeRO-0 run's logs and checkpoints, and their digests."""
    workdir, _ = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    return tmp_path, digests(tmp_path / "checkpoints_deepspeed"), (tmp_path / "logs/training_history.json").read_bytes()


def error_lines(result):
    """The error lines as a log file holds them: lines end at newlines only (a progress bar's carriage returns
    do not start one, and grep '^error:' must find them)."""
    return [line for line in result.stderr.split("\n") if line.startswith("error: ")]


@pytest.mark.slow
def test_a_loss_that_turns_nan_stops_the_run_and_keeps_the_earlier_outputs(earlier_run, tiny_data):
    # A NaN weight in the checkpoint resumed from makes every loss of the third epoch NaN. The history lacks
    # the last epoch, as after a stop between a checkpoint's publication and its history line: the resumed
    # run writes it again before anything else, so it is complete though this run ends in failure.
    workdir, _, history = earlier_run
    complete = json.loads(history)["epochs"]
    (workdir / "logs/training_history.json").write_text(json.dumps({**json.loads(history), "epochs": complete[:-1]}))
    states = workdir / "checkpoints_deepspeed/last/last/mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)
    saved["module"]["fc.weight"][0, 0] = float("nan")
    torch.save(saved, states)
    checkpoints = digests(workdir / "checkpoints_deepspeed")
    # the training script in a spawn_ranks rank (the stop is the trainer's; the launcher passes a rank's status on:
    # test_launcher), without a launcher's ~10 s of start-up
    result = train_ranks(data_args(tiny_data) + TINY_RUN + ["--zero_stage", "0", "--epochs", "3", "--resume", "auto",
                                                            "--max_nonfinite_steps", "3"], workdir)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [line] = error_lines(result)  # reported once, by rank 0
    assert "the training loss was NaN or inf for" in line and "(by epoch 3, step" in line
    assert "--max_nonfinite_steps 3" in line and "checkpoints and history of earlier epochs, if any, are intact" \
        in line
    # only advice a resume accepts goes with --resume auto (it keeps the learning rate and the precision)
    assert ("Continue from them with --resume auto and --clip_grad 1, or start again (--overwrite) with a lower "
            "--learning_rate or --bf16") in line
    assert digests(workdir / "checkpoints_deepspeed") == checkpoints
    restored = history_of(workdir)["epochs"]
    measured_after_the_checkpoint = ("checkpoint_s", "epoch_wall_s")  # not in the checkpoint's copy
    assert [{k: v for k, v in e.items() if k not in measured_after_the_checkpoint} for e in restored] == \
        [{k: v for k, v in e.items() if k not in measured_after_the_checkpoint} for e in complete]


def limit_file_size():
    """In the child: files can grow to 1 MiB, and a larger write fails with EFBIG (as on a full disk)
    instead of killing the process; both settings are inherited by the training processes."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_keeps_the_earlier_ones(earlier_run, tiny_data):
    workdir, checkpoints, history = earlier_run
    # the training script in a spawn_ranks rank, its files limited there (a launcher's ~10 s of start-up saved)
    result = train_ranks(data_args(tiny_data) + TINY_RUN + ["--zero_stage", "0", "--epochs", "3", "--save_every", "1",
                                                            "--resume", "auto"], workdir, before=limit_file_size)
    assert result.returncode == 4, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resumed from" in result.stdout and "Traceback" not in result.stderr
    [line] = error_lines(result)
    # torch.save's zip writer names no OS error: the line quotes the first one it raised
    assert line.startswith("error: cannot write the checkpoint: torch.save failed (") and "iostream error" in line
    assert "The files written before are intact" in line and "--resume auto" in line
    published = {name: digest for name, digest in digests(workdir / "checkpoints_deepspeed").items()
                 if not name.startswith(".")}  # the failed save leaves only its staging folder behind
    assert published == checkpoints
    assert json.loads((workdir / "checkpoints_deepspeed/last/extra_info.json").read_text())["epoch"] == 2
    assert (workdir / "logs/training_history.json").read_bytes() == history


def without_permission_override():
    """In the child: permissions hold even for root, who keeps every other power. Drops
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the capability bounding set, which the training
    processes inherit."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2):
            if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


PR_CAPBSET_DROP = 24


@pytest.mark.slow
def test_a_read_only_checkpoint_dir_is_refused_before_training_and_left_as_it_was(earlier_run, tiny_data):
    workdir, checkpoints, history = earlier_run
    read_only = workdir / "checkpoints_deepspeed"
    for path in (read_only, *read_only.rglob("*")):
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        result = launch(data_args(tiny_data) + TINY_RUN + ["--epochs", "3", "--resume", "auto"], workdir,
                        preexec_fn=without_permission_override)
    except subprocess.SubprocessError as err:  # root without the right to drop capabilities
        pytest.skip(f"cannot make a folder read-only for this user: {err}")
    finally:
        for path in (read_only, *read_only.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert_usage_error(result, "--checkpoint_dir checkpoints_deepspeed: checkpoints_deepspeed is not writable; "
                               "fix its permissions or choose another --checkpoint_dir")
    assert digests(read_only) == checkpoints
    assert (workdir / "logs/training_history.json").read_bytes() == history


def config_of(*argv, world_size=1):
    parser = add_training_args(__import__("argparse").ArgumentParser())
    args = parse_args(lambda: parser, list(argv))
    return build_ds_config(args, world_size, num_train_images=10_000, device_type="cuda")


@pytest.mark.parametrize("argv, advice", [
    (["--batch_size", "64", "--bf16", "--zero_stage", "0"],
     "try, in this order: 1) --batch_size 32 --gradient_accumulation_steps 2 (the same global batch of 64); "
     "2) --data_on_device off (frees the GPU copy of the dataset); 3) --offload_optimizer --zero_stage 2; "
     "4) --zero_stage 3 --offload_param"),
    (["--batch_size", "9", "--zero_stage", "3", "--offload_optimizer"],
     "1) --batch_size 3 --gradient_accumulation_steps 3 (the same global batch of 9); 2) --bf16 (or --fp16); "
     "3) --data_on_device off (frees the GPU copy of the dataset); 4) --offload_param"),
])
def test_out_of_memory_advice_names_the_next_flags(argv, advice):
    detail = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 7.6 GiB"
    line = out_of_memory_advice(config_of(*argv), data_on_device=True, detail=detail)
    assert line.startswith(f"out of GPU memory (tried to allocate 2.00 gib) at micro-batch {argv[1]} per GPU; ")
    assert line.endswith(advice)


def test_out_of_memory_advice_offers_to_stop_coalescing_before_offloading_parameters():
    config = config_of("--batch_size", "1", "--bf16", "--zero_stage", "2", "--offload_optimizer",
                       "--gradient_accumulation_steps", "8")
    assert out_of_memory_advice(config, coalesced=True).endswith(
        "1) --coalesce_grad_reduction off (frees the GPU copy of the summed gradients; slower); "
        "2) --zero_stage 3 --offload_param")


def test_zero3_on_a_model_every_gpu_holds_says_zero2_is_faster():
    """ResNet18 (11.7 M parameters) on two 80 GB GPUs at ZeRO-3: a line; not for one GPU, ZeRO-2, parameter
    offload, or a model whose 16 bytes a parameter take over a quarter of the GPU."""
    gpu = 80 * 2**30
    zero3 = config_of("--zero_stage", "3", "--bf16", world_size=2)
    assert zero3_note(zero3, 2, 11_700_000, gpu) == (
        "note: ZeRO-3 shards 11.7 M parameters whose unpartitioned states (0.17 GiB) fit every GPU (0.2% of one): "
        "it gathers each layer's weights in every forward and backward, which costs more than the memory it saves; "
        "--zero_stage 2 is faster here")
    assert zero3_note(zero3, 1, 11_700_000, gpu) is None
    assert zero3_note(config_of("--zero_stage", "2", world_size=2), 2, 11_700_000, gpu) is None
    assert zero3_note(config_of("--zero_stage", "3", "--offload_param", world_size=2), 2, 11_700_000, gpu) is None
    assert zero3_note(zero3, 2, 632_000_000, 8 * 2**30) is None  # vit_h_14 on 8 GiB cards


def test_out_of_memory_with_nothing_left_to_try():
    config = config_of("--batch_size", "1", "--bf16", "--zero_stage", "3", "--offload_optimizer", "--offload_param")
    assert out_of_memory_advice(config).startswith("out of GPU memory at micro-batch 1 with every offload on")


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("CUDA error: out of memory")])
def test_out_of_memory_in_any_form_becomes_the_advice(error):
    from deepspeed_image_trainer.engine.memory import advise_on_out_of_memory
    from deepspeed_image_trainer.utils.failures import OutOfMemory

    with pytest.raises(OutOfMemory, match=r"out of GPU memory.* at micro-batch 64 per GPU; try, in this order"):
        with advise_on_out_of_memory(config_of("--batch_size", "64", "--bf16"), data_on_device=False):
            raise error
    with pytest.raises(RuntimeError, match="something else"):  # other errors keep their traceback
        with advise_on_out_of_memory(config_of("--batch_size", "64", "--bf16"), data_on_device=False):
            raise RuntimeError("something else")


def test_a_crash_with_data_workers_running_exits_with_its_traceback(tmp_path):
    """An exception that is not the trainer's own (a bug, in DeepSpeed or here) while DataLoader workers run:
    the process prints its traceback and exits 1. The workers ignore SIGTERM, which Python's exit handlers
    stop them with, so left to those the process would wait for them forever."""
    script = tmp_path / "crash.py"
    script.write_text(
        "import torch\n"
        "from deepspeed_image_trainer.data.folders import ignore_stop_signals\n"
        "from deepspeed_image_trainer.cli.options import run_cli\n"
        "def main(argv):\n"
        "    batches = iter(torch.utils.data.DataLoader(range(64), num_workers=2, worker_init_fn=ignore_stop_signals))\n"
        "    next(batches)\n"
        "    raise AttributeError('no such thing')\n"
        "run_cli(main)\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" in result.stderr and result.stderr.rstrip().endswith("AttributeError: no such thing")


def test_a_rank_whose_peer_died_says_so_in_one_line(monkeypatch, capsys):
    """What rank 0 of two raises when rank 1 is killed mid-step: one line, not gloo's traceback."""
    from deepspeed_image_trainer.cli.options import run_cli

    def lost(argv):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                           "[127.0.0.1]:6873")

    for world_size, expected in (("2", "error: lost the connection to another training process"),
                                 ("1", "Traceback (most recent call last)")):  # alone, it is a bug
        monkeypatch.setenv("WORLD_SIZE", world_size)
        with pytest.raises(SystemExit) as exited:
            run_cli(lost, [])
        err = capsys.readouterr().err
        assert exited.value.code == 1 and err.startswith(expected), err
        assert world_size == "1" or err.count("\n") == 1


CRASH_IN_A_WORKER = """
import torch
from torch.utils.data import DataLoader, Dataset
from deepspeed_image_trainer.cli.options import run_cli
from deepspeed_image_trainer.data.folders import ignore_stop_signals

class Broken(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 5:
            raise OverflowError("a bug in a DataLoader worker")
        return torch.zeros(1)

held = []

def main(argv):
    batches = iter(DataLoader(Broken(), batch_size=1, num_workers=2, worker_init_fn=ignore_stop_signals))
    held.append(batches)  # still held when the run ends, as a crashed rank's loader was
    for _ in batches:
        pass

run_cli(main)
"""


@pytest.mark.slow  # starts processes
def test_a_crash_in_a_dataloader_worker_ends_the_process_with_its_traceback():
    """The workers ignore SIGTERM (the training process stops them itself), which is how the interpreter's exit
    handlers stop them: a crashed rank whose loader was still held waited for them for good."""
    result = subprocess.run([sys.executable, "-c", CRASH_IN_A_WORKER], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert result.returncode == 1 and result.stderr.rstrip().endswith("OverflowError: a bug in a DataLoader worker")


def test_a_tool_whose_output_lost_its_reader_ends_quietly(tiny_data):
    """`tool | true`: the reader is gone before the tool writes; the tool neither ends in a BrokenPipeError
    traceback nor fails (output it cannot write is dropped, as a training run's is: utils/streams.py)."""
    import subprocess

    process = subprocess.Popen([sys.executable, str(ROOT / "src" / "prepare_data.py"), "--check", str(tiny_data)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    assert process.wait(timeout=120) == 0
    assert b"Traceback" not in process.stderr.read()


def test_a_closed_standard_output_is_no_failure(tiny_data):
    """`launch_deepspeed.py ... >&-`: sys.stdout was None, and flushing it at the exit raised AttributeError (a
    finished run and a dry run exited 1)."""
    result = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, str(ROOT / "launch_deepspeed.py"),
                              "--train_dir", str(tiny_data / "train"), "--val_dir", str(tiny_data / "val"),
                              "--dry_run"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr


def test_output_that_cannot_be_written_goes_nowhere_and_later_output_too():
    import os

    from deepspeed_image_trainer.utils.streams import OutlivesReader

    read_end, write_end = os.pipe()
    stream = OutlivesReader(os.fdopen(write_end, "w"))
    os.close(read_end)
    assert stream.write("x" * 100_000) == 100_000 and stream.flush() is None  # no BrokenPipeError
    stream.write("more")
    stream.flush()
    assert os.readlink(f"/proc/self/fd/{stream.fileno()}") == os.devnull


def test_a_learning_rate_the_optimizers_overflow_on_is_refused_before_anything_starts():
    """1e308 passed the finite check and ended in AdamW's first step with a RuntimeError traceback."""
    from deepspeed_image_trainer.utils.failures import UsageError

    with pytest.raises(UsageError, match=r"^--learning_rate 1e\+308 is larger than any learning rate that trains"):
        config_of("--learning_rate", "1e308")
    assert config_of("--learning_rate", "1e6")["optimizer"]["params"]["lr"] == 1e6
    with pytest.raises(UsageError, match=r"^--backbone_lr_scale 10 makes the body's learning rate 1e\+07"):
        config_of("--learning_rate", "1e6", "--backbone_lr_scale", "10")
