"""Turn flags into a DeepSpeed config and run src/train_deepspeed.py under the `deepspeed` launcher.

    python launch_deepspeed.py --num_gpus 2 --fp16
    python launch_deepspeed.py --zero_stage 3 --offload_param --offload_optimizer --bf16 --dry_run
"""
import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "src"))

from checkpoints import check_resumable, find_checkpoint  # noqa: E402
from data import image_folder  # noqa: E402
from ds_config import build_ds_config, check_device_support, load_base_config  # noqa: E402
from options import UsageError, add_training_args, parse_args, run_cli  # noqa: E402

TRAIN_SCRIPT = ROOT / "src" / "train_deepspeed.py"
LAUNCHER_FLAGS = {"num_gpus", "num_nodes", "hostfile", "master_port", "dry_run"}


def get_args_parser():
    parser = argparse.ArgumentParser(description="Build a DeepSpeed config from flags and launch training.")
    launch = parser.add_argument_group("Launcher")
    launch.add_argument("--num_gpus", type=int, default=None,
                        help="GPUs per node (default: all visible GPUs; 1 without GPUs)")
    launch.add_argument("--num_nodes", type=int, default=1)
    launch.add_argument("--hostfile", default=None, help="DeepSpeed hostfile for multi-node runs")
    launch.add_argument("--master_port", type=int, default=None,
                        help="rendezvous port (default: a free one on a single node, DeepSpeed's 29500 otherwise)")
    launch.add_argument("--dry_run", action="store_true",
                        help="print the resolved DeepSpeed config and the command, then exit")
    return add_training_args(parser)


def default_num_gpus():
    import torch

    return torch.cuda.device_count() or 1


def forwarded_args(args, config_path):
    """The training script's arguments: the resolved config plus every training flag the user gave."""
    argv = ["--deepspeed_config", str(config_path)]
    for name in sorted(args.explicit - LAUNCHER_FLAGS - {"deepspeed_config"}):
        value = getattr(args, name)
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no-{name}")
        else:
            argv += [f"--{name}", str(value)]
    return argv


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_command(args, num_gpus, config_path):
    if os.name == "nt":
        # The deepspeed launcher needs pdsh/NCCL-style multi-process support that Windows lacks.
        return [sys.executable, str(TRAIN_SCRIPT), *forwarded_args(args, config_path)]
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_gpus)]
    if args.num_nodes != 1:
        command += ["--num_nodes", str(args.num_nodes)]
    if args.hostfile:
        command += ["--hostfile", args.hostfile]
    if args.master_port:
        command += ["--master_port", str(args.master_port)]
    elif args.num_nodes == 1 and not args.hostfile:
        # DeepSpeed's fixed default (29500) makes two runs on one machine collide.
        command += ["--master_port", str(free_port())]
    return command + [str(TRAIN_SCRIPT), *forwarded_args(args, config_path)]


def main(argv=None):
    args = parse_args(get_args_parser, argv)
    num_gpus = args.num_gpus if args.num_gpus is not None else default_num_gpus()
    if num_gpus < 1 or args.num_nodes < 1:
        raise UsageError("--num_gpus and --num_nodes must be at least 1")
    if os.name == "nt" and num_gpus * args.num_nodes > 1:
        raise UsageError("on Windows DeepSpeed runs on a single GPU only (no NCCL): use --num_gpus 1")
    if args.pretrained and not Path(args.pretrained).is_file():
        raise UsageError(f"--pretrained {args.pretrained}: file not found")
    num_train_images = len(image_folder(args.train_dir))
    image_folder(args.val_dir)
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    config = build_ds_config(args, num_gpus * args.num_nodes, num_train_images,
                             base=load_base_config(args.deepspeed_config), device_type=device_type)
    check_device_support(config, device_type)
    resume_from = find_checkpoint(args.resume, args.checkpoint_dir) if args.resume else None
    if resume_from is not None:
        check_resumable(resume_from, num_gpus * args.num_nodes, config["zero_optimization"]["stage"])
    config_path = Path(args.log_dir) / "ds_config.json"
    command = build_command(args, num_gpus, config_path)
    if args.dry_run:
        print(json.dumps(config, indent=2))
        print(shlex.join(command))
        return 0
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    print(f"DeepSpeed config written to {config_path}\n$ {shlex.join(command)}", flush=True)
    return run_and_forward_signals(command)


def run_and_forward_signals(command):
    """Run `command` in its own process group; SIGINT/SIGTERM reach every process of it as SIGTERM.

    The training ranks then finish their step, save a resumable checkpoint and exit; this waits for
    all of them (the `deepspeed` runner alone would exit first) and returns the runner's status.
    """
    child = subprocess.Popen(command, start_new_session=True)

    def forward(signum, frame):
        try:
            os.killpg(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    status = child.wait()
    status = 128 - status if status < 0 else status  # killed by a signal: the shell's convention
    while True:  # the group outlives the runner while ranks save
        try:
            os.killpg(child.pid, 0)
        except (ProcessLookupError, PermissionError):
            return status
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(run_cli(main))
