"""Train a torchvision classifier (ResNet18Animals90 by default) with DeepSpeed.

    deepspeed --num_gpus=1 src/train_deepspeed.py --train_dir data/train --val_dir data/val
    python launch_deepspeed.py --num_gpus 2 --bf16          # builds the config and runs the line above
"""
import time

PROCESS_STARTED = time.time()  # before the imports below: the startup timing counts them

from deepspeed_image_trainer.cli.options import run_cli  # noqa: E402
from deepspeed_image_trainer.cli.train import get_args_parser, main as train  # noqa: E402,F401
from deepspeed_image_trainer.engine.distributed import exit_now  # noqa: E402


def main(argv=None):
    return train(argv, process_started=PROCESS_STARTED)


if __name__ == "__main__":
    exit_now(run_cli(main))  # history, checkpoints and monitors are written by now
