"""Command-line flags shared by launch_deepspeed.py and src/train_deepspeed.py, and the CLI error edge."""
import argparse
import difflib
import gc
import json
import math
import multiprocessing
import os
import signal
import sys
import traceback
from pathlib import Path

from ..data.recipe import (AUTO_AUGMENT_POLICIES, DROP_PATH_FAMILIES, RECIPE_DEFAULTS, RECIPE_RANGES,
                           check_val_size_flags)
from ..engine.config import OPTIMIZERS
from ..models.names import DEFAULT_MODEL, WITHOUT_BLOCKS, architecture
from ..utils.failures import (WORKERS_PER_CPU, CliError, UsageError, check_name_lengths, check_num_workers,
                              first_rank_of_node, path_argument)
from ..utils.streams import outlive_closed_output
from ..utils.text import error_line


def zero_stage(value):
    if value == "auto":
        return value
    if value not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from auto, 0, 1, 2, 3)")
    return int(value)


def add_training_args(parser):
    parser.add_argument("--config", type=path_argument, default=None, metavar="FILE",
                        help="a recipe: flag values in YAML or JSON ({flag: value}, as a run's <log_dir>/args.yaml "
                             "writes them); flags given on the command line override it")
    data = parser.add_argument_group("Dataset")
    data.add_argument("--train_dir", type=path_argument, default="data/train",
                      help="ImageFolder root of the training set")
    data.add_argument("--val_dir", type=path_argument, default="data/val",
                      help="ImageFolder root of the validation set")
    data.add_argument("--image_size", type=int, default=224, help="side of the square crops fed to the model")
    data.add_argument("--num_workers", type=int, default=2,
                      help=f"DataLoader worker processes per rank (at most {WORKERS_PER_CPU} per CPU the process "
                           "may use)")
    data.add_argument("--data_on_device", choices=["auto", "on", "cache", "off"], default="auto",
                      help="on: decode every image once, keep the dataset as uint8 on the training device "
                           "and crop/flip/normalise there per batch; cache: the same, but the decoded dataset "
                           "stays in the decoded-image cache on disk (memory-mapped) and each batch is copied "
                           "over; off: DataLoader workers decode and augment every epoch; auto: on for a GPU "
                           "with room for it, else cache where the cache's disk has room, off on CPU")
    data.add_argument("--val_resize_size", type=int, default=None, metavar="PX",
                      help="validation: resize the shorter side to this (default: --val_crop_size / 0.875, or by "
                           "the pretrained weights' own ratio: 232 for 224 with ResNet50's IMAGENET1K_V2)")
    data.add_argument("--val_crop_size", type=int, default=None, metavar="PX",
                      help="validation: the centre crop the model sees (default: --image_size; torchvision's v2 "
                           "recipe trains at 176 and validates at 224)")
    data.add_argument("--cache_dir", default=None, metavar="DIR",
                      help="where decoded images are kept between runs, so that a dataset is decoded once "
                           "(default: decoded/ under $TRAINER_CACHE_DIR or ~/.cache/deepspeed-image-trainer; "
                           "delete it at any time); off: decode at every start and keep nothing")
    data.add_argument("--device_train_size", type=int, default=None, metavar="PX",
                      help="with the dataset on the device: side of the stored training squares that crops are "
                           "cut from (default: image_size / 0.875, 256 for 224); larger keeps more of the detail "
                           "that small crops enlarge, at the square of the memory")

    train = parser.add_argument_group("Training")
    train.add_argument("--model", default=DEFAULT_MODEL,
                       help="any torchvision classifier by name (resnet50, efficientnet_b0, convnext_tiny, vit_b_16, "
                            "...; python launch_deepspeed.py --list_models lists them; resnet18 is ResNet18Animals90), "
                            "or timm's as timm:NAME (timm:vit_base_patch16_224; --list_models timm [FILTER])")
    train.add_argument("--epochs", type=int, default=50)
    train.add_argument("--batch_size", type=int, default=16, help="micro-batch per GPU (per rank)")
    train.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                       help="adamw, sgd (torch's, with --momentum and --nesterov), lamb or lion (DeepSpeed's: "
                            "FusedLamb and FusedLion on a GPU, CPU Lion with --offload_optimizer)")
    train.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum (torchvision's default)")
    train.add_argument("--nesterov", action="store_true", help="SGD with Nesterov momentum")
    train.add_argument("--learning_rate", type=float, default=0.001, help="peak learning rate")
    train.add_argument("--weight_decay", type=float, default=0.05, help="the optimizer's weight decay")
    train.add_argument("--clip_grad", type=float, default=0.0,
                       help="clip the global gradient norm to this value (0: no clipping, as in torchvision's "
                            "and timm's references; costs a GPU sync per step)")
    train.add_argument("--warmup_epochs", type=float, default=1.0,
                       help="linear LR warmup before the --lr_schedule decay, in epochs")
    train.add_argument("--lr_schedule", choices=["cosine", "linear", "constant"], default="cosine",
                       help="after warmup: cosine decay to 1%% (WarmupCosineLR), linear decay to 0 (WarmupDecayLR) "
                            "or constant (WarmupLR)")
    train.add_argument("--backbone_lr_scale", type=float, default=1.0, metavar="S",
                       help="the learning rate of everything but the classifier head, as a fraction of "
                            "--learning_rate (fine-tuning pretrained weights: 0.1, say)")
    train.add_argument("--freeze_backbone_epochs", type=int, default=0, metavar="N",
                       help="train the classifier head alone for the first N epochs (the body's learning rate is 0)")
    train.add_argument("--grad_checkpointing", action="store_true",
                       help="activation checkpointing: each block's activations recomputed in the backward pass "
                            "instead of kept (timm's set_grad_checkpointing; for torchvision's models, each "
                            "family's repeated block)")
    train.add_argument("--layer_decay", type=float, default=None, metavar="R",
                       help="timm's layer-wise learning-rate decay: the head at --learning_rate, each block below "
                            "it R times the one above (ViT, Swin, MaxViT, ConvNeXt, EfficientNet and other models "
                            "of repeated blocks; 0.65-0.75 for ViT fine-tuning)")
    train.add_argument("--norm_weight_decay", type=float, default=None, metavar="WD",
                       help="weight decay of normalisation layers' weights and biases (torchvision's recipes: 0)")
    train.add_argument("--bias_weight_decay", type=float, default=None, metavar="WD",
                       help="weight decay of every bias (before --norm_weight_decay)")
    train.add_argument("--transformer_embedding_decay", type=float, default=None, metavar="WD",
                       help="weight decay of class tokens, position embeddings and relative position bias tables")
    train.add_argument("--model_ema", action="store_true",
                       help="keep an exponential moving average of the weights (each rank its own part of them, "
                            "where the optimizer keeps its fp32 weights), validate it every epoch beside the "
                            "weights, and save it in every checkpoint (export_model.py --ema)")
    train.add_argument("--model_ema_decay", type=float, default=0.99998, metavar="D",
                       help="the average's decay, adjusted as torchvision's reference does: 1 - (1 - D) x global "
                            "batch x --model_ema_steps / --epochs")
    train.add_argument("--model_ema_steps", type=int, default=32, metavar="N",
                       help="update the average after every N-th optimizer step of an epoch (its first included); "
                            "during the warmup it is a copy of the weights")
    train.add_argument("--best_on", choices=["ema", "raw"], default=None,
                       help="what best_model and --early_stopping_patience follow: the average's validation "
                            "accuracy (ema, the default with --model_ema) or the weights' (raw)")
    train.add_argument("--label_smoothing", type=float, default=0.0,
                       help="label smoothing of the training loss, in [0, 1); validation loss stays plain "
                            "cross-entropy")
    recipe = parser.add_argument_group("Augmentation (torchvision's reference recipes)")
    recipe.add_argument("--auto_augment", choices=AUTO_AUGMENT_POLICIES, default=None,
                        help="an augmentation policy per training image (every data tier), after the crop "
                             "and flip: RandAugment (ra), TrivialAugmentWide (ta_wide), AugMix (augmix) or "
                             "AutoAugment's imagenet, cifar10 or svhn policy (torchvision's transforms.v2 classes)")
    recipe.add_argument("--ra_magnitude", type=int, default=RECIPE_DEFAULTS["ra_magnitude"],
                        help="RandAugment's magnitude, 0-30")
    recipe.add_argument("--ra_num_ops", type=int, default=RECIPE_DEFAULTS["ra_num_ops"],
                        help="RandAugment's operations per image, 1-14")
    recipe.add_argument("--augmix_severity", type=int, default=RECIPE_DEFAULTS["augmix_severity"],
                        help="AugMix's severity, 1-10")
    recipe.add_argument("--random_erase", type=float, default=RECIPE_DEFAULTS["random_erase"], metavar="P",
                        help="erase a random rectangle of a training image with this probability, after "
                             "normalisation (torchvision's RandomErasing; every data tier)")
    recipe.add_argument("--ra_reps", type=int, default=1, metavar="N",
                        help="repeated augmentation (torchvision's RASampler, DeiT's): each image N times in an epoch, "
                             "each time augmented anew, the repeats on different ranks; the epoch keeps its length, "
                             "so it sees 1/N of the images (every data tier; 1: off)")
    recipe.add_argument("--mixup_alpha", type=float, default=0.0, metavar="A",
                        help="mix each training batch with itself shifted by one image, in a Beta(A, A) share "
                             "(torchvision's MixUp, on every data tier); trained on the mixed labels")
    recipe.add_argument("--cutmix_alpha", type=float, default=0.0, metavar="A",
                        help="paste a box of the next image into each (torchvision's CutMix); with --mixup_alpha, "
                             "one of the two per batch")
    recipe.add_argument("--drop_path", type=float, default=None, metavar="P",
                        help="stochastic depth: the probability of skipping the last residual block, the earlier "
                             "ones less (torchvision's stochastic_depth_prob; default: the model's own, 0.1-0.5); "
                             "ConvNeXt, EfficientNet (V1, V2), Swin (V1, V2), MaxViT")
    train.add_argument("--early_stopping_patience", type=int, default=0, metavar="N",
                       help="stop when val accuracy has not improved for N epochs (0: never)")
    train.add_argument("--max_nonfinite_steps", type=int, default=20, metavar="N",
                       help="stop (exit status 3, nothing saved) when the loss is NaN/inf for N steps in a row "
                            "or the validation loss is (0: never stop); checked every 10 steps and at the end of "
                            "each epoch, so the stop can come up to 10 steps (on a GPU 20) later")
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--pretrained", metavar="WEIGHTS|PATH", default=None,
                       help="start from torchvision's weights of --model: DEFAULT or a name such as IMAGENET1K_V1 "
                            "(read from the torch hub cache, TORCH_HOME, downloaded there when missing), or a "
                            "state_dict file (./DEFAULT for a file of a weights name); the classifier head is new "
                            "when the class count differs")

    ds = parser.add_argument_group("DeepSpeed")
    ds.add_argument("--zero_stage", type=zero_stage, default="auto", metavar="{auto,0,1,2,3}",
                    help="auto: 0 on one rank (nothing to partition: ZeRO-1/2 there only add an fp32 copy and "
                         "buckets, and slow each step), 2 on several, 2 or 3 when offloading; or a resumed "
                         "checkpoint's stage")
    ds.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=False,
                    help="fp16 compute with dynamic loss scaling (GPU only)")
    ds.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False, help="bf16 compute")
    ds.add_argument("--precision_mode", choices=["auto", "autocast", "half_weights"], default="auto",
                    help="how --fp16/--bf16 run: autocast keeps fp32 weights and computes under torch.autocast "
                         "(DeepSpeed's torch_autocast, the fast path on GPU); half_weights uses DeepSpeed's "
                         "fp16/bf16 modes (half-precision weights, fp32 master copy); auto: autocast on GPU "
                         "but half_weights for --bf16 with offload and 200 M parameters or more (faster there), "
                         "half_weights on CPU")
    ds.add_argument("--offload_optimizer", action=argparse.BooleanOptionalAction, default=False,
                    help="keep optimizer state on the CPU (ZeRO 1-3)")
    ds.add_argument("--offload_param", action=argparse.BooleanOptionalAction, default=False,
                    help="keep parameters on the CPU (ZeRO 3)")
    ds.add_argument("--gradient_accumulation_steps", type=int, default=1)
    ds.add_argument("--coalesce_grad_reduction", choices=["auto", "on", "off"], default="auto",
                    help="with gradient accumulation at ZeRO 1-3: sum an optimizer step's micro-batch gradients on "
                         "the GPU and reduce (and offload) them once, through DeepSpeed's coalesce_grad_reduction, "
                         "instead of after every micro-batch; holds one more copy of the gradients on the GPU. "
                         "auto: on with --offload_optimizer at ZeRO 1-2 (several times faster there), else off")
    ds.add_argument("--sync_bn", action=argparse.BooleanOptionalAction, default=False,
                    help="batch-norm statistics over all ranks' micro-batches (like SyncBatchNorm); without it "
                         "each rank normalises with its own and the running statistics are averaged over "
                         "ranks before every validation and save")
    ds.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="torch.compile the model through DeepSpeed (engine.compile); the first steps are slower")
    ds.add_argument("--deepspeed_config", metavar="PATH", default=None,
                    help="base DeepSpeed JSON; flags given explicitly override it")

    out = parser.add_argument_group("Output")
    out.add_argument("--checkpoint_dir", type=path_argument, default="checkpoints_deepspeed")
    out.add_argument("--log_dir", type=path_argument, default="logs")
    out.add_argument("--save_every", type=int, default=10, help="save epoch_N every this many epochs (0: never)")
    out.add_argument("--save_last_every", type=int, default=1,
                     help="refresh the rolling `last` checkpoint every this many epochs (0: never)")
    out.add_argument("--keep_last", type=int, default=0, help="keep only the newest K epoch_N checkpoints (0: all)")
    out.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=False,
                     help="DeepSpeed's TensorBoard monitor: per-step and per-epoch scalars in <log_dir>/tensorboard "
                          "(needs `pip install tensorboard`)")
    out.add_argument("--csv_monitor", action=argparse.BooleanOptionalAction, default=False,
                     help="DeepSpeed's CSV monitor: one CSV file per scalar in <log_dir>/csv_monitor")
    out.add_argument("--resume", metavar="auto|PATH", default=None,
                     help="auto: continue from the newest checkpoint in --checkpoint_dir (or start fresh); "
                          "PATH: a checkpoint folder or a name in --checkpoint_dir (last, best, epoch_N)")
    out.add_argument("--overwrite", action="store_true",
                     help="start a new run over an earlier run's checkpoints and history in --checkpoint_dir and "
                          "--log_dir, which go once the new run's first checkpoint is published (without it such a "
                          "run stops: --resume auto continues it)")
    return parser


def parse_args(make_parser, argv=None):
    """Parse argv with make_parser() and record in `args.explicit` the flags the user actually gave, a --config
    recipe's flags among them (read as if given before the command line's, which override them)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser()
    given = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    given.add_argument("--config", action="append", type=path_argument, default=[])
    known, _ = given.parse_known_args(argv)
    config = known.config[-1] if known.config else None
    if config is not None:
        argv = recipe_argv(parser, config) + argv
    args = parser.parse_args(argv)
    if args.config != config:  # an abbreviation (--conf) that the pre-parse did not take for --config
        raise UsageError(f"give --config in full (read {args.config} as --config)")
    bare = make_parser()
    for action in bare._actions:
        action.default = argparse.SUPPRESS
    args.explicit = set(vars(bare.parse_args(argv))) - {"config"}
    check_values(args)
    return args


# What a recipe cannot set: itself, and what is not a training setting
NOT_IN_RECIPES = ("config", "help", "dry_run", "list_models", "launch_token", "launcher_flags", "local_rank")
# The launcher's flags a recipe may hold (args.yaml records them): the training script, started by `deepspeed`,
# takes its world from that command and passes them over
LAUNCHER_SETTINGS = ("num_gpus", "num_nodes", "hostfile", "launcher", "master_addr")


def resolved_flags(args):
    """{"given": the flags the run was given (on the command line or by its recipe), "defaults": the other flags'
    values}: the given ones as a recipe trains this run again, the defaults staying defaults (a --deepspeed_config's
    values win over a default, not over a flag); a resume or an overwrite is the command line's to ask for."""
    skipped = (*NOT_IN_RECIPES, "explicit", "resume", "overwrite")
    values = {name: list(value) if isinstance(value, tuple) else value for name, value in vars(args).items()
              if name not in skipped}
    launcher = json.loads(args.launcher_flags) if getattr(args, "launcher_flags", None) else {}
    return {"given": {**launcher, **{name: value for name, value in values.items() if name in args.explicit}},
            "defaults": {name: value for name, value in values.items() if name not in args.explicit}}


MAX_RECIPE_BYTES = 1 << 20


def recipe_argv(parser, path):
    """The command-line arguments a --config file's {flag: value} stand for (`parser`'s flags only), in the file's
    order: argparse then checks each value as given on the command line."""
    from ..utils.files import check_regular, parse_json

    where = f"--config {path}"
    try:
        check_regular(path)
        if os.path.getsize(path) > MAX_RECIPE_BYTES:
            raise UsageError(f"{where}: larger than {MAX_RECIPE_BYTES >> 20} MiB; a recipe is a short list of flags")
        with open(path, "rb") as f:
            text = f.read()
    except OSError as err:
        raise UsageError(f"{where}: cannot read it ({err.strerror or err})") from None
    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise UsageError(f"{where}: expected a .yaml, .yml or .json file")
    try:
        if suffix == ".json":
            values = parse_json(text)
        else:
            import yaml

            values = yaml.safe_load(text)  # plain data only: no Python objects from the file
    except Exception as err:  # noqa: BLE001 - each parser's own errors (yaml.YAMLError, ValueError, RecursionError)
        raise UsageError(f"{where}: not valid {'JSON' if suffix == '.json' else 'YAML'} ({error_line(err)})") from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UsageError(f"{where}: expected a mapping of flags to values (learning_rate: 0.001), got "
                         f"{type(values).__name__}")
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    argv = []
    for key, value in values.items():
        name = str(key).replace("-", "_").lstrip("_")
        action = actions.get(name)
        if action is None and name in LAUNCHER_SETTINGS:  # the training script's world is its launcher's
            continue
        if action is None or name in NOT_IN_RECIPES:
            close = difflib.get_close_matches(name, [n for n in actions if n not in NOT_IN_RECIPES], n=1)
            raise UsageError(f"{where}: {key!r} is not a flag a recipe can set"
                             + (f" (did you mean {close[0]}?)" if close else ""))
        flag = f"--{name}"
        if value is None:  # the flag's default
            continue
        if isinstance(action, argparse._StoreTrueAction) or isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise UsageError(f"{where}: {name} takes true or false, got {_described(value)}")
            if value or isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else f"--no-{name}")
        elif action.nargs in ("+", "*"):
            items = value if isinstance(value, list) else [value]
            if not all(isinstance(item, (str, int, float)) and not isinstance(item, bool) for item in items):
                raise UsageError(f"{where}: {name} takes a list of values, got {_described(value)}")
            argv += [flag, *map(str, items)]
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            argv += [flag, str(value)]
        else:
            raise UsageError(f"{where}: {name} takes one value, got {_described(value)}")
    return argv


def _described(value):
    """A recipe's value in a message: short (YAML's aliases nest a 262-byte file into a list of 43 million items,
    whose repr was a 157 MB line)."""
    if isinstance(value, (list, dict)):
        return f"a {'list' if isinstance(value, list) else 'mapping'} of {len(value)} item(s)"
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def memory_gib():
    """This machine's memory in GiB (None where the OS does not say)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30 if hasattr(os, "sysconf") else None


def check_input_fits(batch_size, image_size, device_train_size=None):
    """Refuse an --image_size whose fp32 micro-batch of input images alone is larger than this machine's memory,
    and a --device_train_size whose one stored uint8 square is."""
    memory = memory_gib()
    batch_gib = batch_size * 3 * image_size ** 2 * 4 / 2**30
    if memory is not None and batch_gib > memory:
        raise UsageError(f"--image_size {image_size}: a micro-batch of {batch_size} input images alone is "
                         f"{batch_gib:,.0f} GiB, more than this machine's memory")
    square_gib = 3 * (device_train_size or 0) ** 2 / 2**30
    if memory is not None and square_gib > memory:
        raise UsageError(f"--device_train_size {device_train_size}: one stored training image alone is "
                         f"{square_gib:,.0f} GiB, more than this machine's memory")


def check_values(args):
    """Values argparse lets through but no run can use: a UsageError (one line, exit status 2)."""
    for name in ("epochs", "batch_size", "image_size", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1")
    for name in ("learning_rate", "weight_decay", "warmup_epochs", "clip_grad", "backbone_lr_scale"):
        if not math.isfinite(getattr(args, name)):
            raise UsageError(f"--{name} must be a finite number, got {getattr(args, name)}")
    for name in ("num_workers", "save_every", "save_last_every", "keep_last", "clip_grad",
                 "early_stopping_patience", "max_nonfinite_steps", "weight_decay", "warmup_epochs",
                 "backbone_lr_scale", "freeze_backbone_epochs"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must not be negative, got {getattr(args, name)}")
    check_num_workers(args.num_workers)
    if args.learning_rate <= 0:
        raise UsageError(f"--learning_rate must be positive, got {args.learning_rate}")
    for name in ("norm_weight_decay", "bias_weight_decay", "transformer_embedding_decay"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{name} must be a finite number >= 0, got {value}")
    if args.layer_decay is not None and not 0 < args.layer_decay <= 1:
        raise UsageError(f"--layer_decay must be in (0, 1] (each layer's rate that times the one above), "
                         f"got {args.layer_decay}")
    if not 0 < args.model_ema_decay < 1:
        raise UsageError(f"--model_ema_decay must be in (0, 1), got {args.model_ema_decay}")
    if args.model_ema_steps < 1:
        raise UsageError(f"--model_ema_steps must be at least 1, got {args.model_ema_steps}")
    if args.best_on == "ema" and not args.model_ema:
        raise UsageError("--best_on ema follows the weights' average, which only --model_ema keeps: add --model_ema")
    if args.best_on is None:
        args.best_on = "ema" if args.model_ema else "raw"
    if not 0 <= args.momentum < 1:  # at 1 or more SGD's velocity never decays: the updates grow without bound
        raise UsageError(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.nesterov and args.momentum == 0:
        raise UsageError("--nesterov needs a momentum: --momentum 0 makes it plain SGD")
    # flags that take a word as well as a path; those that take a path alone refuse "" in argparse (path_argument)
    for name, what in (("pretrained", "a weights name (DEFAULT, IMAGENET1K_V1, ...) or a file"),
                       ("cache_dir", "a folder, or off"), ("deepspeed_config", "a JSON file"),
                       ("resume", "auto or a checkpoint")):
        if getattr(args, name, None) == "":  # an unset shell variable, most likely: not the default said quietly
            raise UsageError(f"--{name} is empty: give {what}, or leave the flag out")
        if getattr(args, name, None):  # a name too long for the file system: an OSError traceback where it is read
            check_name_lengths(getattr(args, name), f"--{name}")
    if args.data_on_device == "cache" and args.cache_dir == "off":
        raise UsageError("--data_on_device cache needs the decoded-image cache: drop --cache_dir off")
    check_val_size_flags(args)
    crop = args.val_crop_size or args.image_size
    if args.val_resize_size is not None and args.val_resize_size < crop:  # the centre crop would pad with black
        raise UsageError(f"--val_resize_size {args.val_resize_size} is smaller than the validation crop {crop} "
                         "(--val_crop_size, default --image_size): the crop would pad the image; resize to at least "
                         "the crop")
    if args.device_train_size is not None and args.device_train_size < 1:
        raise UsageError(f"--device_train_size must be at least 1, got {args.device_train_size}")
    if args.device_train_size is not None and args.data_on_device == "off":
        raise UsageError("--device_train_size sizes the images kept on the device, and --data_on_device off keeps "
                         "none: drop one of them")
    check_input_fits(args.batch_size, args.image_size, args.device_train_size)
    if not 0 <= args.label_smoothing < 1:
        raise UsageError(f"--label_smoothing must be in [0, 1), got {args.label_smoothing}")
    check_recipe(args)
    if args.overwrite and args.resume:
        raise UsageError("--overwrite starts a new run over the old one's results, --resume continues it: "
                         "give one of them")
    if not 0 <= args.seed < 2**32:  # numpy's and the samplers' seeds are unsigned 32-bit
        raise UsageError(f"--seed must be in 0 .. {2**32 - 1}, got {args.seed}")
    if args.warmup_epochs > args.epochs:
        raise UsageError(f"--warmup_epochs {args.warmup_epochs:g} is longer than the run (--epochs {args.epochs})")
    # Batch norm in training needs two values per channel; ResNet's last stage sees ceil(size / 32)² per image.
    # (Other models, and --sync_bn's batch over the ranks, are checked by a forward pass on the meta device:
    # models/build.py's check_image_size.)
    if args.batch_size == 1 and args.image_size <= 32 and architecture(args.model) == DEFAULT_MODEL \
            and not args.sync_bn:
        raise UsageError(f"--batch_size 1 at --image_size {args.image_size}: ResNet18's last batch-norm layers then "
                         "see one value per channel, which they cannot normalise; use --batch_size 2 or more, "
                         "--image_size 33 or more, or --sync_bn on several ranks")


def norm_batch_size(batch_size, sync_bn, world_size):
    """The images a batch-norm layer normalises over in training: a rank's micro-batch, or with --sync_bn
    every rank's."""
    return batch_size * world_size if sync_bn else batch_size


# What gloo and NCCL raise in a rank whose peer has gone (killed, or ended on an error of its own).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")


def run_cli(main, argv=None):
    """Run main(argv); a CliError becomes one line on stderr and its exit status (UsageError: 2), any other
    exception its traceback and status 1. Output whose reader has gone (`| head`) is dropped from then on."""
    outlive_closed_output()
    try:
        return main(argv)
    except CliError as err:
        message, status = f"error: {err}", err.exit_status
        quiet = (err.every_rank and os.environ.get("RANK", "0") != "0"
                 or err.every_local_rank and not first_rank_of_node())
    except KeyboardInterrupt:  # a tool's Ctrl-C (training stops by its own handlers): a line, not a traceback
        message, status, quiet = "error: stopped by Ctrl-C (SIGINT); what it had not finished was not written", 130, \
            False
    except Exception as err:  # a bug: its traceback, printed here so that the frames can go before the exit
        message, status, quiet = traceback.format_exc().rstrip(), 1, False
        if isinstance(err, RuntimeError) and any(text in str(err) for text in PEER_LOST) \
                and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # not a bug here: the other process's end
            message = ("error: lost the connection to another training process (it ended or was killed; its own "
                       "error, if any, is above); --resume auto continues from the last checkpoint published")
    # Out of the except block the traceback is gone; collecting the frames it held shuts their DataLoader
    # workers down now. Left to the exit handlers, which stop workers with SIGTERM, a run stopped mid-epoch
    # or crashed would wait forever for workers that ignore it (see data/folders.py, ignore_stop_signals);
    # workers whose loader something still holds (a crash inside a worker) are killed, without torch's
    # handler that reports a killed worker. Without children there is nothing to shut down (a collection took a
    # process holding many objects a fifth of a second).
    if multiprocessing.active_children():
        gc.collect()
    if not quiet:
        print(message, file=sys.stderr, flush=True)
    if multiprocessing.active_children():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in multiprocessing.active_children():
            child.kill()
    sys.exit(status)


def check_recipe(args):
    for name, (low, high) in RECIPE_RANGES.items():
        value = getattr(args, name)
        if value is not None and not low <= value <= high:  # NaN too
            raise UsageError(f"--{name} must be in {low} .. {high}, got {value}")
    for name in ("mixup_alpha", "cutmix_alpha"):  # torchvision keeps alpha in float32: 1e-300 became 0, then failed
        if 0 < getattr(args, name) < 1e-6:
            raise UsageError(f"--{name} must be 0 (off) or at least 1e-6, got {getattr(args, name)}")
    if args.grad_checkpointing and architecture(args.model).startswith(WITHOUT_BLOCKS):
        raise UsageError(f"--grad_checkpointing: --model {args.model} has no repeated blocks to recompute (AlexNet "
                         "and VGG keep their activations)")
    if args.drop_path is not None and not architecture(args.model).startswith(DROP_PATH_FAMILIES + ("timm:",)):
        raise UsageError(f"--drop_path: --model {args.model} has no stochastic depth that torchvision lets set; "
                         "ConvNeXt (convnext_*), EfficientNet (efficientnet_*, efficientnet_v2_*), Swin (swin_*) and "
                         "MaxViT (maxvit_t) have")
