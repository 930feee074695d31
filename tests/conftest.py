import atexit
import hashlib
import json
import multiprocessing
import multiprocessing.managers
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers share the cores: one thread each, and each run they start
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
# The data check's cache goes to a folder of the test session's own, for the tests and every process they start:
# made once per pytest process (the processes tests spawn import this too, and left one folder each behind) and
# removed when it ends.
if not os.environ.get("TRAINER_TEST_CACHE_DIR"):
    os.environ["TRAINER_TEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="test-cache-")
    atexit.register(shutil.rmtree, os.environ["TRAINER_TEST_CACHE_DIR"], ignore_errors=True)
os.environ["TRAINER_CACHE_DIR"] = os.environ["TRAINER_TEST_CACHE_DIR"]
# The package, for the Python processes the tests start from scripts of their own (the project's scripts find it).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))

from deepspeed_image_trainer.data.prepare import make_sample_dataset  # noqa: E402

# spawn_ranks' processes fork from a server that imported these once (spawned, each rank imported them again: 5 s
# of a CPU). Not from the test's process: a fork after an autograd backward there cannot run autograd. Spawned
# where there is a GPU: the server's imports ask the CUDA driver for its devices, and CUDA does not survive a fork.
START_METHOD = "spawn" if torch.cuda.is_available() else "forkserver"
multiprocessing.set_forkserver_preload(["torch", "torchvision", "deepspeed", "deepspeed_image_trainer.cli.train"])


# The devices a data-path test runs on: the GPU's case is marked `gpu` (-m gpu on a GPU machine) and skipped without one.
DEVICES = [pytest.param(torch.device("cpu"), id="cpu"),
           pytest.param(torch.device("cuda"), id="cuda", marks=[
               pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")])]

TINY_CLASSES = 3  # odd: ResNet18's parameter count is then odd too (a ZeRO-1/2 bucket alignment bug hid there)
TINY_TRAIN_IMAGES = 48
TINY_VAL_PER_CLASS = 5
TINY_VAL_IMAGES = TINY_CLASSES * TINY_VAL_PER_CLASS  # 15: an odd count, which two ranks cannot split evenly


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A tiny generated image folder: 3 classes, 16 train and 5 val images each, 32 px."""
    root = tmp_path_factory.mktemp("tiny_data")
    make_sample_dataset(root, num_classes=TINY_CLASSES, train_per_class=TINY_TRAIN_IMAGES // TINY_CLASSES,
                        val_per_class=TINY_VAL_PER_CLASS, image_size=32, seed=0)
    return root


# Training runs several tests read: trained once per session (`trained`), 2 epochs each.
TRAINED_EPOCHS = 2
TRAINED_RUNS = {
    "zero0": ["--zero_stage", "0"],
    # optimizer offload with accumulation: the gradient reduction coalesced (--coalesce_grad_reduction auto); in
    # fp32 (bf16 with offload and accumulation is test_end_to_end's reference-config run: a CPU without oneDNN's
    # bf16 kernels spends ~0.27 s an image on ResNet18's bf16 backward)
    "zero1-offload-accumulation": ["--zero_stage", "1", "--offload_optimizer", "--gradient_accumulation_steps", "2"],
    # and the weights' average, which best_model then follows
    "zero2-2ranks": ["--zero_stage", "2", "--num_gpus", "2", "--sync_bn", "--model_ema", "--model_ema_steps", "1"],
    "zero3": ["--zero_stage", "3"],
}
# The runs whose checks include the launcher's part (its timing phases and line, its config copy, its process
# tree): trained through the launcher. The others' subject is the trainer (ZeRO-3's checkpoints and exports, the
# coalesced reduction): the training script in spawn_ranks ranks (train_ranks), ~10 s of start-up less each.
LAUNCHED_RUNS = ("zero0", "zero2-2ranks")


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tiny_data):
    """trained(name) -> (workdir, result) of the TRAINED_RUNS run `name`, run on first use: the launcher's
    CompletedProcess for LAUNCHED_RUNS, train_ranks' (CompletedProcess-like) for the others."""
    finished = {}

    def get(name):
        if name not in finished:
            workdir = tmp_path_factory.mktemp(name)
            args = data_args(tiny_data) + ["--epochs", str(TRAINED_EPOCHS), "--batch_size", "4", "--image_size", "32",
                                           "--save_every", "1", "--num_workers", "1"] + TRAINED_RUNS[name]
            result = launch(args, workdir) if name in LAUNCHED_RUNS else train_ranks(args, workdir)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            finished[name] = (workdir, result)
        return finished[name]

    return get


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    """The suite runs on two workers (pytest-xdist, --dist loadgroup in pytest.ini): tests that read one trained
    run or module fixture go to one worker together, which then computes it once."""
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        shared = [name for name, fixture in (defs.name2fixturedefs.items() if defs else ())
                  if fixture[-1].scope in ("session", "module") and name not in ("tiny_data", "tmp_path_factory")]
        if "trained" in shared:
            item.add_marker(pytest.mark.xdist_group("trained"))
        elif shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


class Payload:
    """Unpickling this runs code: it creates the file named `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def spawn_ranks(fn, nprocs=1, *args):
    """fn(rank, port, results, *args) in `nprocs` fresh processes, as the ranks of one process group (real
    engines need one, and a process of their own); the dict `results` they filled."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from deepspeed_image_trainer.engine.distributed import free_port

    manager = multiprocessing.managers.SyncManager()
    manager.start(_end_with_the_tests_process)  # a killed pytest leaves no manager behind either
    with manager:
        results = manager.dict()
        try:
            mp.start_processes(_as_rank, args=(fn, free_port(), results, args, dict(os.environ)),
                               nprocs=nprocs, join=True, start_method=START_METHOD)
        except ProcessException as err:
            # spawn names the first rank to end; the one that failed first may be another, its peers aborting after
            raise AssertionError("\n".join([str(err), *(results.get(("traceback", rank), f"rank {rank}: no exception")
                                                        for rank in range(nprocs))])) from None
        return dict(results)


def _end_with_the_tests_process():
    """SIGKILLs this process when the test's process ends, however it ends."""
    parent = multiprocessing.parent_process()
    threading.Thread(target=lambda: (parent.join(), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()


def _as_rank(rank, fn, port, results, args, environ):
    import traceback

    # A rank's parent is the fork server, which outlives the test's process: torch's parent-death signal would
    # not come, and a rank waiting in gloo would go on to DeepSpeed's timeout; it watches the test's process.
    _end_with_the_tests_process()
    # The test's environment (multiprocessing already moved to its folder). What the server's imports read from
    # its own environment stays (DeepSpeed's DEEPSPEED_TIMEOUT and accelerator, the thread counts of OpenMP): no
    # spawn_ranks caller sets those.
    os.environ.clear()
    os.environ.update(environ)

    from deepspeed_image_trainer.engine.distributed import exit_now, shut_down

    try:
        fn(rank, port, results, *args)
    except BaseException:
        results[("traceback", rank)] = f"rank {rank}: {traceback.format_exc()}"
        raise
    finally:  # together: a rank leaving gloo while another still works can abort in its teardown
        shut_down()
    exit_now()  # its results are with the manager; the trainer's ranks leave the same way


def train_ranks(argv, cwd, nprocs=1, before=None, script=None):
    """The training script's run_cli(main) on `nprocs` spawn_ranks ranks in folder `cwd`, as the `deepspeed`
    launcher starts them (RANK, WORLD_SIZE, MASTER_PORT...), each rank's file descriptors 1 and 2 captured: for a
    test whose subject is the run, not the launcher (a launcher run adds ~10 s of process start-up). Returns a
    CompletedProcess-like namespace: returncode (rank 0's exit status; `statuses`: every rank's) and stdout and
    stderr (the ranks' in rank order, as the launcher would pass them on). `before`: a module-level function each
    rank calls first (what a launch's preexec_fn would do in its processes). `script`: another script's file whose
    main(argv) runs so instead of the training script's (loaded from that file in the rank: by its module's name
    the rank's import path may find another file, as src/memory_profile.py forwards to benchmarks/'s)."""
    import types

    outputs = Path(tempfile.mkdtemp(prefix="rank-output-"))
    try:
        results = spawn_ranks(_train_with_output, nprocs, str(cwd), list(argv), str(outputs), nprocs, before,
                              script and str(script))
        read = {name: "".join((outputs / f"{rank}.{name}").read_text(errors="replace") for rank in range(nprocs))
                for name in ("stdout", "stderr")}
    finally:
        shutil.rmtree(outputs, ignore_errors=True)
    statuses = [results[rank] for rank in range(nprocs)]
    return types.SimpleNamespace(returncode=statuses[0], statuses=statuses, args=list(argv), **read)


def _train_with_output(rank, port, results, cwd, argv, outputs, nprocs, before, script):
    import runpy

    from deepspeed_image_trainer.cli import train
    from deepspeed_image_trainer.cli.options import run_cli

    main = train.main
    if script is not None:
        sys.path.insert(0, str(Path(script).parent))  # its sibling modules, as running it would find them
        main = runpy.run_path(script, run_name=Path(script).stem)["main"]

    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(nprocs))
    for fd, name in ((1, "stdout"), (2, "stderr")):  # everything the process writes, C code and loggers included
        with open(Path(outputs) / f"{rank}.{name}", "w") as f:
            os.dup2(f.fileno(), fd)
    if before is not None:
        before()
    try:
        results[rank] = run_cli(main, argv) or 0
    except SystemExit as exited:
        results[rank] = exited.code or 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def tiny_engine(model, parameters=None, *, micro_batch=4, lr=1e-3, optimizer=None, zero=None, **sections):
    """deepspeed.initialize over `model` (or its `parameters`, groups included) with a small config: torch's AdamW
    (as the trainer picks on a CPU: DeepSpeed's CPUAdam or FusedAdam would compile first, a minute each on a
    fresh machine) at `lr` plus `optimizer`'s params (or `optimizer` itself when it has a type), ZeRO `zero`
    (default stage 0), and the other `sections` as given (scheduler, bf16, gradient_clipping, ...). Every rank of
    the process group calls this."""
    import deepspeed

    optimizer = optimizer or {}
    config = {"train_micro_batch_size_per_gpu": micro_batch,
              "optimizer": optimizer if "type" in optimizer else
              {"type": "AdamW", "params": {"lr": lr, "torch_adam": True, **optimizer}},
              "zero_optimization": zero or {"stage": 0}, **sections}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters() if parameters is None
                                      else parameters, config=config)
    return engine


def join_process_group(rank, port, world_size=1):
    """In a spawn_ranks process: join the group as the trainer does (gloo on a CPU)."""
    from deepspeed_image_trainer.engine.distributed import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    init_distributed()


def built_instead(builders, monkeypatch=None):
    """torchvision.models.get_model(name) without weights builds builders[name](num_classes=...) instead, for the
    names it has: a model's own class at a size a CPU test can afford. For the rest of the process (a spawned
    one), or the test with pytest's `monkeypatch`."""
    import torchvision

    full = torchvision.models.get_model

    def get_model(name, weights=None, **kwargs):
        if name in builders and weights is None:
            return builders[name](**kwargs)
        return full(name, weights=weights, **kwargs)

    if monkeypatch:
        monkeypatch.setattr(torchvision.models, "get_model", get_model)
    else:
        torchvision.models.get_model = get_model


def slim_timm(monkeypatch=None):
    """timm.create_model builds the transformers the tests use with two blocks (ConvNeXt with one a stage): their
    own classes, at a size a CPU test can afford. For the rest of the process (a spawned one), or the test with
    pytest's `monkeypatch`."""
    import timm

    full = timm.create_model
    slim = {"vit_tiny_patch16_224": {"depth": 2}, "eva02_tiny_patch14_224": {"depth": 2},
            "convnext_atto": {"depths": (1, 1, 1, 1)}}

    def create_model(name, *args, **kwargs):
        return full(name, *args, **{**slim.get(name.split(".")[0], {}), **kwargs})

    if monkeypatch:
        monkeypatch.setattr(timm, "create_model", create_model)
    else:
        timm.create_model = create_model


def history_of(workdir):
    """The training history a run in `workdir` wrote (its default --log_dir)."""
    return json.loads((Path(workdir) / "logs/training_history.json").read_text())


def digests(folder):
    """{relative path: sha256} of every file under `folder` but the lock files (each run writes its PID there)."""
    from deepspeed_image_trainer.outputs.run_folders import LOCK_FILES

    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(Path(folder).rglob("*")) if path.is_file() and path.name not in LOCK_FILES}


def split_dry_run(stdout):
    """Dry-run output: the config as JSON, then the command on the last line."""
    *config_lines, command = stdout.strip().splitlines()
    return json.loads("\n".join(config_lines)), shlex.split(command)


def run(command, cwd, timeout=600, **popen):
    """Run a command of the project the way a user would; return the CompletedProcess."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **popen)


def launch(args, cwd, timeout=600, **popen):
    return run([sys.executable, str(ROOT / "launch_deepspeed.py"), *args], cwd, timeout, **popen)


def data_args(data_root):
    return ["--train_dir", str(data_root / "train"), "--val_dir", str(data_root / "val")]


def unblock_later(fifo, seconds=10):
    """End the reads of the FIFO `fifo` that would wait for a writer for good, from `seconds` on for as long again:
    a test of code that must not open it fails when it does, instead of hanging. Returns an Event, set once a
    read was ended."""
    ended = threading.Event()

    def unblock():
        time.sleep(seconds)
        for _ in range(seconds * 10):
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # opens only while a reader waits
                ended.set()
                os.close(writer)  # the reader sees the end of the file
            except OSError:  # no reader now (ENXIO), or the FIFO has gone
                pass
            time.sleep(0.1)

    threading.Thread(target=unblock, daemon=True).start()
    return ended


def assert_usage_error_in_process(main, argv, capsys, message):
    """assert_usage_error for a command's main() run in this process; returns (stdout, stderr)."""
    from deepspeed_image_trainer.cli.options import run_cli

    with pytest.raises(SystemExit) as exited:
        run_cli(main, argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 2, err[-2000:]
    assert err.startswith("error: ") and err.count("\n") == 1, err[-2000:]
    assert message in err
    return out, err


def assert_usage_error(result, message):
    """The process failed the way bad input must: exit status 2 and one line on stderr naming the problem."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert message in lines[0]
