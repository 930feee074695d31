"""Command-line flags shared by launch_deepspeed.py and src/train_deepspeed.py, and the CLI error edge."""
import argparse
import sys


class UsageError(Exception):
    """Bad input from the user: reported as one line on stderr with exit status 2, no traceback."""


def add_training_args(parser):
    data = parser.add_argument_group("Dataset")
    data.add_argument("--train_dir", default="data/train", help="ImageFolder root of the training set")
    data.add_argument("--val_dir", default="data/val", help="ImageFolder root of the validation set")
    data.add_argument("--image_size", type=int, default=224, help="side of the square crops fed to the model")
    data.add_argument("--num_workers", type=int, default=2, help="DataLoader worker processes per rank")
    data.add_argument("--data_on_device", choices=["auto", "on", "off"], default="auto",
                      help="on: decode every image once, keep the dataset as uint8 on the training device "
                           "and crop/flip/normalise there per batch; off: DataLoader workers decode and "
                           "augment every epoch; auto: on for a GPU with room for it, off on CPU")

    train = parser.add_argument_group("Training")
    train.add_argument("--epochs", type=int, default=50)
    train.add_argument("--batch_size", type=int, default=16, help="micro-batch per GPU (per rank)")
    train.add_argument("--learning_rate", type=float, default=0.001, help="peak AdamW learning rate")
    train.add_argument("--weight_decay", type=float, default=0.05, help="AdamW weight decay")
    train.add_argument("--clip_grad", type=float, default=0.0,
                       help="clip the global gradient norm to this value (0: no clipping, as in torchvision's "
                            "and timm's references; costs a GPU sync per step)")
    train.add_argument("--warmup_epochs", type=float, default=1.0,
                       help="linear LR warmup before the cosine decay, in epochs")
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--pretrained", metavar="PATH", default=None,
                       help="local torchvision ResNet18 weights file (nothing is downloaded)")

    ds = parser.add_argument_group("DeepSpeed")
    ds.add_argument("--zero_stage", type=int, choices=[0, 1, 2, 3], default=2)
    ds.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=False,
                    help="fp16 compute with dynamic loss scaling (GPU only)")
    ds.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False, help="bf16 compute")
    ds.add_argument("--precision_mode", choices=["auto", "autocast", "half_weights"], default="auto",
                    help="how --fp16/--bf16 run: autocast keeps fp32 weights and computes under torch.autocast "
                         "(DeepSpeed's torch_autocast, the fast path on GPU); half_weights uses DeepSpeed's "
                         "fp16/bf16 modes (half-precision weights, fp32 master copy); auto: autocast on GPU, "
                         "half_weights on CPU")
    ds.add_argument("--offload_optimizer", action=argparse.BooleanOptionalAction, default=False,
                    help="keep optimizer state on the CPU (ZeRO 1-3)")
    ds.add_argument("--offload_param", action=argparse.BooleanOptionalAction, default=False,
                    help="keep parameters on the CPU (ZeRO 3)")
    ds.add_argument("--gradient_accumulation_steps", type=int, default=1)
    ds.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="torch.compile the model through DeepSpeed (engine.compile); the first steps are slower")
    ds.add_argument("--deepspeed_config", metavar="PATH", default=None,
                    help="base DeepSpeed JSON; flags given explicitly override it")

    out = parser.add_argument_group("Output")
    out.add_argument("--checkpoint_dir", default="checkpoints_deepspeed")
    out.add_argument("--log_dir", default="logs")
    out.add_argument("--save_every", type=int, default=10, help="save epoch_N every this many epochs (0: never)")
    out.add_argument("--save_last_every", type=int, default=1,
                     help="refresh the rolling `last` checkpoint every this many epochs (0: never)")
    out.add_argument("--keep_last", type=int, default=0, help="keep only the newest K epoch_N checkpoints (0: all)")
    out.add_argument("--resume", metavar="auto|PATH", default=None,
                     help="auto: continue from the newest checkpoint in --checkpoint_dir (or start fresh); "
                          "PATH: a checkpoint folder or a name in --checkpoint_dir (last, best, epoch_N)")
    return parser


def parse_args(make_parser, argv=None):
    """Parse argv with make_parser() and record in `args.explicit` the flags the user actually gave."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    bare = make_parser()
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    args.explicit = set(vars(bare.parse_args(argv)))
    for name in ("epochs", "batch_size", "image_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    for name in ("num_workers", "save_every", "save_last_every", "keep_last", "clip_grad"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must not be negative")
    return args


def run_cli(main, argv=None):
    """Run main(argv); a UsageError becomes one line on stderr and exit status 2."""
    try:
        return main(argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
