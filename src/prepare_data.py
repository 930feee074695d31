"""Data tool: split a raw Animals-90 download into train/val, draw the built-in sample dataset, or check a dataset:
deepspeed_image_trainer.data.prepare, whose --help shows how."""
from deepspeed_image_trainer.utils.startup import quiet_interrupt_while_importing

with quiet_interrupt_while_importing(__name__ == "__main__"):  # torch's import takes seconds
    from deepspeed_image_trainer.data.prepare import get_args_parser, main  # noqa: F401 (the parser: to extend)
    from deepspeed_image_trainer.cli.options import run_cli


if __name__ == "__main__":
    run_cli(main)
