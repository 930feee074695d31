"""Multi-node launching: the exact `deepspeed` commands (dry runs), their errors, and a real two-node run
started by hand (--launcher none) with both "nodes" on this machine."""
import os
import signal
import subprocess
import sys

import pytest

from deepspeed_image_trainer.cli import launch as launch_deepspeed
from deepspeed_image_trainer.cli.options import run_cli
from deepspeed_image_trainer.engine.distributed import free_port

from conftest import ROOT, TINY_VAL_IMAGES, data_args, history_of, split_dry_run

RUNNER = [sys.executable, "-m", "deepspeed.launcher.runner"]
TRAIN_SCRIPT = str(ROOT / "src/train_deepspeed.py")


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# two nodes, 4 GPUs each\nworker-1 slots=4\nworker-2 slots=4\n")
    return path


def launch_in_process(argv, capsys):
    """launch_deepspeed.py's CLI in this process (a dry run spawns nothing): (exit status, stdout, stderr)."""
    try:
        status = run_cli(launch_deepspeed.main, argv)
    except SystemExit as stop:
        status = stop.code
    out, err = capsys.readouterr()
    return status, out, err


def dry_run(tiny_data, capsys, *extra):
    status, out, err = launch_in_process(data_args(tiny_data) + ["--dry_run", "--batch_size", "2", *extra], capsys)
    assert status == 0, err
    config, command = split_dry_run(out)
    return config, command[:command.index(TRAIN_SCRIPT)], command[command.index(TRAIN_SCRIPT) + 1:]


def test_pdsh_over_every_host_of_the_hostfile(tiny_data, capsys, hostfile):
    config, launcher, script_args = dry_run(tiny_data, capsys, "--hostfile", str(hostfile))
    assert launcher == RUNNER + ["--hostfile", str(hostfile), "--num_nodes", "2"]
    assert config["train_batch_size"] == 2 * 8  # micro-batch x 2 nodes x 4 slots
    assert "--hostfile" not in script_args and "--num_nodes" not in script_args


@pytest.mark.parametrize("launcher_name", ["openmpi", "slurm"])
def test_other_launchers_and_gpus_per_node(tiny_data, capsys, hostfile, launcher_name):
    config, launcher, _ = dry_run(tiny_data, capsys, "--hostfile", str(hostfile), "--launcher", launcher_name,
                                  "--num_gpus", "2", "--master_addr", "10.0.0.1", "--master_port", "29600")
    assert launcher == RUNNER + ["--num_gpus", "2", "--hostfile", str(hostfile), "--num_nodes", "2",
                                 "--launcher", launcher_name, "--master_addr", "10.0.0.1", "--master_port", "29600"]
    assert config["train_batch_size"] == 2 * 4


def test_each_node_started_by_hand(tiny_data, capsys, hostfile):
    config, launcher, _ = dry_run(tiny_data, capsys, "--hostfile", str(hostfile), "--launcher", "none",
                                  "--node_rank", "1", "--master_addr", "10.0.0.1")
    assert launcher == RUNNER + ["--hostfile", str(hostfile), "--num_nodes", "2", "--no_ssh", "--node_rank", "1",
                                 "--master_addr", "10.0.0.1"]
    assert config["train_batch_size"] == 2 * 8


@pytest.mark.parametrize("extra, message", [
    (["--num_nodes", "2"], "--num_nodes 2 needs a --hostfile listing the nodes"),
    (["--hostfile", "HOSTFILE", "--num_nodes", "3"], "lists 2 host(s)"),
    (["--hostfile", "missing"], "missing: No such file or directory"),
    (["--hostfile", "BAD"], "bad line 'worker-1 gpus=4'"),
    (["--hostfile", "HOSTFILE", "--launcher", "none", "--node_rank", "2", "--master_addr", "10.0.0.1"],
     "--node_rank 2 is outside 0..1"),
    (["--node_rank", "0"], "--node_rank is for starting each node by hand: add --launcher none"),
    (["--hostfile", "HOSTFILE", "--launcher", "none", "--node_rank", "0"], "give --hostfile, --master_addr"),
    (["--launcher", "slurm"], "--launcher slurm starts several nodes: give the --hostfile"),
])
def test_bad_multi_node_flags(tiny_data, tmp_path, capsys, hostfile, extra, message):
    bad = tmp_path / "bad_hostfile"
    bad.write_text("worker-1 gpus=4\n")
    extra = [{"HOSTFILE": str(hostfile), "BAD": str(bad), "missing": str(tmp_path / "missing")}.get(arg, arg)
             for arg in extra]
    status, out, err = launch_in_process(data_args(tiny_data) + ["--dry_run", *extra], capsys)
    assert (status, out) == (2, "")
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_two_nodes_started_by_hand_train_as_one_run(tiny_data, tmp_path):
    """Both nodes write into one checkpoint and log folder, as on a shared filesystem."""
    (tmp_path / "hostfile").write_text("node-a slots=1\nnode-b slots=1\n")
    port = str(free_port())
    nodes = [subprocess.Popen(
        [sys.executable, str(ROOT / "launch_deepspeed.py"), *data_args(tiny_data), "--hostfile", "hostfile",
         "--launcher", "none", "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", port,
         "--num_gpus", "1", "--epochs", "1", "--batch_size", "8", "--image_size", "32", "--num_workers", "0"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    history = history_of(tmp_path)
    assert history["config"]["world_size"] == 2
    assert history["epochs"][0]["val_images"] == TINY_VAL_IMAGES
    assert "Epoch 1/1" in outputs[0] and "Epoch 1/1" not in outputs[1]  # rank 0 reports
    shards = sorted(p.name for p in (tmp_path / "checkpoints_deepspeed/last/last").glob("*optim_states.pt"))
    assert len(shards) == 2 and "rank_0" in shards[0] and "rank_1" in shards[1], shards  # both nodes' ZeRO shards


# The training script with DeepSpeed's rendezvous timeout at one second: DEEPSPEED_TIMEOUT counts whole minutes, one
# at least (0 gave up at once, in a group of one too)
TIMEOUT_IN_A_SECOND = ("import datetime, functools, os, runpy, sys, deepspeed; "
                       "deepspeed.init_distributed = functools.partial(deepspeed.init_distributed, "
                       "timeout=datetime.timedelta(seconds=1)); "
                       "sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); "
                       "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.slow
def test_a_rank_waiting_for_the_others_says_so_stops_on_ctrl_c_and_gives_up_in_one_line(tiny_data, tmp_path):
    """The training script started by hand as rank 0 of 2, the other rank never started: it says that it waits,
    Ctrl-C ends it at once (torch's rendezvous waits in C++, where Python's handlers do not run), and when
    DeepSpeed's timeout passes it ends in one line; either way the folders it made are gone."""
    def start(workdir, prelude=(), **env):
        workdir.mkdir()
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), **env}
        process = subprocess.Popen([sys.executable, *prelude, TRAIN_SCRIPT, *data_args(tiny_data), "--epochs", "1",
                                    "--batch_size", "4", "--image_size", "32", "--num_workers", "0"], cwd=workdir,
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return process, env["MASTER_PORT"]

    (waiting, port), (timed_out, _) = start(tmp_path / "waiting"), start(tmp_path / "timed_out",
                                                                         ["-c", TIMEOUT_IN_A_SECOND],
                                                                         DEEPSPEED_TIMEOUT="1")
    try:
        line = next((line for line in waiting.stderr if "waiting" in line), None)
        assert line == (f"rank 0 of 2: waiting for the other ranks to join at 127.0.0.1:{port} (MASTER_ADDR, "
                        "MASTER_PORT); Ctrl-C stops\n")
        waiting.send_signal(signal.SIGINT)
        rest = waiting.communicate(timeout=60)[1]
        assert waiting.returncode == 130, rest
        assert rest.strip().splitlines()[-1] == ("Stopped by SIGINT while waiting for the other ranks; nothing was "
                                                 "trained")
        err = timed_out.communicate(timeout=300)[1]
        assert timed_out.returncode == 1 and "Traceback" not in err, err[-3000:]
        assert err.strip().splitlines()[-1].startswith("error: the 2 ranks (WORLD_SIZE) did not all join at "
                                                       "127.0.0.1:"), err[-3000:]
        assert "DEEPSPEED_TIMEOUT=1 minutes" in err and "start every rank with the same MASTER_ADDR" in err
    finally:
        waiting.kill()
        timed_out.kill()
    assert [list((tmp_path / run).iterdir()) for run in ("waiting", "timed_out")] == [[], []]  # no folder left
