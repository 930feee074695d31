"""Turn flags into a DeepSpeed config and run src/train_deepspeed.py under the `deepspeed` launcher.

    python launch_deepspeed.py --num_gpus 2 --fp16
    python launch_deepspeed.py --zero_stage 3 --offload_param --offload_optimizer --bf16 --dry_run
"""
import time

LAUNCHED_AT = time.time()  # the training processes count their startup from here (engine/timing.py)

import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402


def stopped_before_training(signum, frame):
    """Ctrl-C or SIGTERM before the training processes start (the checks take seconds): nothing of this run to
    save; one line, the folders given back if this launcher holds them. Once they run, it forwards the signal."""
    folders = sys.modules.get("deepspeed_image_trainer.outputs.run_folders")
    if folders is not None:
        folders.release()
    os.write(2, f"Stopped by {signal.Signals(signum).name} before the training started: nothing to save\n".encode())
    os._exit(128 + signum)


for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, stopped_before_training)

from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # the package, installed or not

from deepspeed_image_trainer.cli.launch import get_args_parser, main as launch  # noqa: E402,F401
from deepspeed_image_trainer.cli.options import run_cli  # noqa: E402
from deepspeed_image_trainer.engine.distributed import exit_now  # noqa: E402


def main(argv=None):
    return launch(argv, launched_at=LAUNCHED_AT)


if __name__ == "__main__":
    exit_now(run_cli(main))  # the training processes are gone: no half second of torch's teardown
