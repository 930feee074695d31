"""Export one plain fp32 state_dict for ResNet18Animals90 from a DeepSpeed checkpoint of any ZeRO stage:
deepspeed_image_trainer.inference.export, whose --help shows how."""
from deepspeed_image_trainer.utils.startup import quiet_interrupt_while_importing

with quiet_interrupt_while_importing(__name__ == "__main__"):  # torch's import takes seconds
    from deepspeed_image_trainer.inference.export import get_args_parser, main  # noqa: F401 (the parser: to extend)
    from deepspeed_image_trainer.cli.options import run_cli


if __name__ == "__main__":
    run_cli(main)
