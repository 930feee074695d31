"""Train a torchvision classifier (ResNet18Animals90 by default) with DeepSpeed.

    deepspeed --num_gpus=1 src/train_deepspeed.py --train_dir data/train --val_dir data/val
    python launch_deepspeed.py --num_gpus 2 --bf16          # builds the config and runs the line above
"""
import time

PROCESS_STARTED = time.time()  # before the imports below: the startup timing counts them

import os  # noqa: E402
import signal  # noqa: E402


def stopped_while_importing(signum, frame):
    """SIGINT/SIGTERM during the imports (seconds; a launcher's Ctrl-C reaches its ranks as SIGTERM): nothing
    of the run exists yet. One line, from rank 0, instead of a silent end."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"Stopped by {signal.Signals(signum).name} before the training started: nothing to save\n"
                 .encode())
    os._exit(128 + signum)


for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, stopped_while_importing)

from deepspeed_image_trainer.cli.options import run_cli  # noqa: E402
from deepspeed_image_trainer.cli.train import get_args_parser, main as train  # noqa: E402,F401
from deepspeed_image_trainer.engine.distributed import exit_now  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)  # the run itself decides what a stop does
signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv=None):
    return train(argv, process_started=PROCESS_STARTED)


if __name__ == "__main__":
    exit_now(run_cli(main))  # history, checkpoints and monitors are written by now
