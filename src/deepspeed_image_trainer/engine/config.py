"""Flags + an optional base JSON -> the DeepSpeed config. Pure: no DeepSpeed, no processes, no GPUs."""
import copy
import difflib
import importlib.util
import json
import math
import sys
from pathlib import Path

from ..models.names import BLOCKS, DEFAULT_MODEL, WITHOUT_BLOCKS
from ..models.timm_models import LEAF_BLOCKS as TIMM_LEAF_BLOCKS, is_timm
from ..utils.failures import UsageError, check_name_lengths, check_writable
from ..utils.files import parse_json
from ..utils.text import digits, error_line

AUTO = "auto"
# torchvision's ResNet18 without its classifier; the classifier adds 512 weights and a bias per class.
RESNET18_BACKBONE_PARAMETERS = 11_176_512

DEFAULT_FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
OFFLOAD_TO_CPU = {"device": "cpu", "pin_memory": True}
# What "auto" means for ZeRO settings that no flag controls: DeepSpeed's own defaults.
ZERO_AUTO_DEFAULTS = {
    "allgather_bucket_size": 500_000_000,
    "reduce_bucket_size": 500_000_000,
    "sub_group_size": 1_000_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_gather_16bit_weights_on_model_save": False,
}
AUTOCAST_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
# --lr_schedule -> DeepSpeed scheduler type and the params no flag sets. WarmupCosineLR takes ratios of
# the optimizer's lr; the other two take absolute lrs ("auto": 0 and --learning_rate).
LR_SCHEDULES = {
    "cosine": ("WarmupCosineLR", {"warmup_type": "linear", "warmup_min_ratio": 0.0, "cos_min_ratio": 0.01}),
    "linear": ("WarmupDecayLR", {"warmup_type": "linear", "warmup_min_lr": AUTO, "warmup_max_lr": AUTO}),
    "constant": ("WarmupLR", {"warmup_type": "linear", "warmup_min_lr": AUTO, "warmup_max_lr": AUTO}),
}
# The names DeepSpeed's data_types accept for fp32 (its DtypeEnum).
FP32_NAMES = ("fp32", "float32", "float", "torch.float32")
# --tensorboard / --csv_monitor -> DeepSpeed's monitor sections; files go to <output_path>/<job_name>/.
MONITORS = ("tensorboard", "csv_monitor")
MONITOR_JOB_NAME = "train"
# The names DeepSpeed accepts for torch_autocast's dtype.
AUTOCAST_DTYPE_NAMES = {name: half for half, names in
                        (("fp16", ("float16", "fp16", "half", "torch.float16")),
                         ("bf16", ("bfloat16", "bf16", "torch.bfloat16"))) for name in names}


# DeepSpeed's configs nest 4 levels; at about 450 copying the config ended in a RecursionError traceback.
MAX_CONFIG_DEPTH = 100


def load_base_config(path):
    """The user's JSON as a dict; {} when no path is given."""
    if not path:
        return {}
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--deepspeed_config {path}: " + ("a folder, not a JSON file" if path.is_dir() else
                                                           "not a regular file (a FIFO or a device)"
                                                           if path.exists() else "file not found"))
    try:
        config = parse_json(path.read_text(), max_depth=MAX_CONFIG_DEPTH)
    except OSError as err:
        raise UsageError(f"--deepspeed_config {path}: cannot read it ({err.strerror or err})") from None
    except ValueError as err:  # not JSON, not UTF-8, or a whole number of more than 4300 digits
        raise UsageError(f"--deepspeed_config {path}: not valid JSON ({error_line(err)})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--deepspeed_config {path}: expected a JSON object ({{...}}), got {type(config).__name__}")
    for key, value in _non_finite(config):  # json reads 1e999 as inf, and NaN and Infinity as given
        raise UsageError(f"--deepspeed_config {path}: {key} is {value}, not a finite number")
    return config


def _non_finite(value, where=""):
    """(dotted key, value) of each inf or nan in a JSON value, and of each whole number no float holds (DeepSpeed
    writes its config out as floats in every rank: OverflowError)."""
    if isinstance(value, float) and not math.isfinite(value):
        yield where, value
    elif isinstance(value, int) and abs(value) > sys.float_info.max:
        yield where, f"a whole number of {digits(value)} digits"
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _non_finite(item, f"{where}[{index}]")


def _check_types(config):
    """Refuse a base JSON value of the wrong type now: DeepSpeed would fail on it later, with a traceback."""
    def fail(where, expected, value):
        raise UsageError(f"{where} in the DeepSpeed config must be {expected}, got {json.dumps(value)}")

    # the sections the trainer reads itself (check_trainer_support, check_monitor_support): a number there was an
    # AttributeError traceback
    for key in ("fp16", "bf16", "torch_autocast", "zero_optimization", "optimizer", "scheduler", "data_types",
                "checkpoint", "tensor_parallel", "flops_profiler", *MONITORS, *MONITOR_PACKAGES):
        if not isinstance(config.get(key, {}), dict):
            fail(key, "a JSON object", config[key])
    for section, key in (("optimizer", "params"), ("scheduler", "params"),
                         ("zero_optimization", "offload_optimizer"), ("zero_optimization", "offload_param")):
        if not isinstance(config.get(section, {}).get(key, {}), dict):
            fail(f"{section}.{key}", "a JSON object", config[section][key])
    for section in ("fp16", "bf16", "torch_autocast"):  # read here before DeepSpeed sees them
        if config.get(section, {}).get("enabled", AUTO) not in (True, False, AUTO):
            fail(f"{section}.enabled", 'true, false or "auto"', config[section]["enabled"])
    for section in ("optimizer", "scheduler"):
        if not isinstance(config.get(section, {}).get("type", ""), str):
            fail(f"{section}.type", "a name", config[section]["type"])
    for section in MONITORS:  # DeepSpeed's monitors take names: a number or a list was a TypeError in a path join
        for key in ("output_path", "job_name"):
            if not isinstance(config.get(section, {}).get(key, ""), str):
                fail(f"{section}.{key}", "a string", config[section][key])
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = config.get(key, AUTO)
        if value != AUTO and (type(value) is not int or value < 1):
            fail(key, 'a positive integer or "auto"', value)
    numbers = {"gradient_clipping": config.get("gradient_clipping", AUTO),
               **{f"optimizer.params.{key}": config.get("optimizer", {}).get("params", {}).get(key, AUTO)
                  for key in ("lr", "weight_decay", "eps")}}
    for where, value in numbers.items():
        if value != AUTO and (type(value) not in (int, float) or not value >= 0):
            fail(where, 'a non-negative number or "auto"', value)
    # DeepSpeed multiplies each gradient by 1 / it before the all-reduce: 0 ended the first backward in a
    # ZeroDivisionError, a word in a TypeError
    predivide = config.get("gradient_predivide_factor", 1.0)
    if type(predivide) not in (int, float) or not predivide > 0:
        fail("gradient_predivide_factor", "a number above 0 (1, the default, or the number of ranks)", predivide)


def num_parameters(num_classes):
    """ResNet18Animals90's parameter count, which sizes DeepSpeed's buckets, without building the model:
    the launcher then needs no torchvision."""
    return RESNET18_BACKBONE_PARAMETERS + (512 + 1) * num_classes


def steps_per_epoch(num_train_images, world_size, micro_batch_size, gradient_accumulation_steps):
    """Optimizer steps per epoch: each rank gets an equal shard and drops its last partial micro-batch."""
    micro_batches = num_train_images // world_size // micro_batch_size
    return micro_batches // gradient_accumulation_steps


def build_ds_config(args, world_size, num_train_images, base=None, device_type="cpu", num_params=None,
                    resumed_stage=None, resumed_precision=None):
    """The DeepSpeed config for this run.

    `base` (the user's JSON) is the starting point; flags in `args.explicit` override it; flag values
    fill whatever it leaves out; every "auto" is resolved here, so DeepSpeed never sees one.
    `device_type` ("cuda" or "cpu") picks how --fp16/--bf16 run when --precision_mode is auto.
    `num_params`, the model's parameter count, caps the ZeRO buckets the config leaves unset.
    `resumed_stage`, the ZeRO stage of the checkpoint a run resumes from, is what an "auto" stage becomes;
    `resumed_precision` (e.g. "autocast-bf16") the form an "auto" --precision_mode takes for the same half.
    """
    config = copy.deepcopy(base or {})
    _check_types(config)
    micro = _pick(config, "train_micro_batch_size_per_gpu", args, "batch_size")
    accumulation = _pick(config, "gradient_accumulation_steps", args, "gradient_accumulation_steps")
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = accumulation
    declared = config.get("train_batch_size", AUTO)
    config["train_batch_size"] = micro * accumulation * world_size
    if declared not in (AUTO, config["train_batch_size"]):
        raise UsageError(
            f"train_batch_size {declared} in the DeepSpeed config is not micro-batch {micro} x {accumulation} "
            f"accumulation step(s) x {world_size} rank(s) = {config['train_batch_size']}: set it to \"auto\" "
            f"(or leave it out), or change --batch_size, --gradient_accumulation_steps or --num_gpus to match")
    steps = steps_per_epoch(num_train_images, world_size, micro, accumulation)
    if steps < 1:
        lower = ["--batch_size"] * (micro > 1) + ["--gradient_accumulation_steps"] * (accumulation > 1)
        if num_train_images < world_size:  # no batch size helps: some rank would have no image at all
            advice = "use fewer ranks (--num_gpus, --num_nodes)"
        else:
            advice = "lower " + " or ".join(lower) + (", or use fewer ranks" if world_size > 1 else "")
        raise UsageError(f"the training set has {num_train_images} images: too few for {world_size} rank(s) x "
                         f"micro-batch {micro} x {accumulation} accumulation step(s); {advice}")

    _resolve_zero(config, args, num_params, world_size, resumed_stage)
    _resolve_precision(config, args, device_type, num_params, resumed_precision)
    _plain_linear_with_half_weights(config)
    _resolve_optimizer(config, args, device_type)
    config["scheduler"] = resolve_scheduler(base or {}, args, config["optimizer"]["params"]["lr"], steps)
    _resolve_monitors(config, args)
    # Always written: a config without it would get DeepSpeed's default of 1.0, not --clip_grad's 0.
    config["gradient_clipping"] = _pick(config, "gradient_clipping", args, "clip_grad", missing=args.clip_grad)
    _skip_unused_grad_norm(config)
    _refuse_fp32_accumulation_with_offload(config)
    _refuse_ema_with_nvme(config, args)
    config.setdefault("steps_per_print", 1_000_000)  # the progress bar reports; keep DeepSpeed's log quiet
    # DeepSpeed's throughput timer synchronises the device at the start and the end of every step, for a
    # figure it only logs every steps_per_print steps; the trainer times its epochs itself.
    config.setdefault("timers", {"throughput": {"enabled": False}})

    leftover = _auto_paths(config)
    if leftover:
        raise UsageError(f"cannot resolve \"auto\" for {', '.join(leftover)}: set a value in the JSON")
    return config


def _resolve_precision(config, args, device_type, num_params=None, resumed_precision=None):
    """fp16/bf16 from the flags or the base, run either as DeepSpeed's torch_autocast section (fp32
    weights, half-precision compute) or as its fp16/bf16 modes (half-precision weights). Needs the
    resolved zero_optimization section (offload)."""
    autocast = config.get("torch_autocast", {})
    base_autocast = _autocast_half(autocast)
    enabled = {name: _pick(config.get(name, {}), "enabled", args, name, missing=base_autocast == name)
               for name in ("fp16", "bf16")}
    if base_autocast and any(config.get(name, {}).get("enabled") is True for name in ("fp16", "bf16")):
        raise UsageError("torch_autocast cannot be combined with fp16/bf16 in the DeepSpeed config")
    # An explicit precision flag replaces the other precision of the base config.
    if "fp16" in args.explicit and args.fp16 and "bf16" not in args.explicit:
        enabled["bf16"] = False
    if "bf16" in args.explicit and args.bf16 and "fp16" not in args.explicit:
        enabled["fp16"] = False
    if enabled["fp16"] and enabled["bf16"]:
        raise UsageError("fp16 and bf16 are both enabled: choose one (--fp16 or --bf16; --no-fp16 / --no-bf16 "
                         "switch off what the DeepSpeed config enables)")
    half = "fp16" if enabled["fp16"] else "bf16" if enabled["bf16"] else None

    mode = args.precision_mode
    if mode == "auto" and "precision_mode" not in args.explicit and not {"fp16", "bf16"} & args.explicit and half:
        mode = "autocast" if base_autocast else "half_weights"  # the form the base config chose
    if mode == "auto":
        mode = "autocast" if device_type == "cuda" else "half_weights"
        if mode == "autocast" and half == "bf16" and (num_params or 0) >= HALF_WEIGHTS_OFFLOAD_PARAMS and any(
                _offloads(config["zero_optimization"], key) for key in ("offload_optimizer", "offload_param")):
            mode = "half_weights"
        if half and resumed_precision in (half, f"autocast-{half}"):  # the checkpoint's form, as it was saved
            mode = "autocast" if resumed_precision.startswith("autocast") else "half_weights"
    for name, default in (("fp16", DEFAULT_FP16), ("bf16", {"enabled": True})):
        on = enabled[name] and mode == "half_weights"
        if name in config:
            config[name]["enabled"] = on
        elif on:
            config[name] = dict(default)
    if half and mode == "autocast":
        config["torch_autocast"] = {**autocast, "enabled": True, "dtype": AUTOCAST_DTYPES[half]}
    elif "torch_autocast" in config:
        config["torch_autocast"]["enabled"] = False


# With offload, DeepSpeed's bf16 weights move half the bytes of autocast's fp32 weights over PCIe and hold
# half on the GPU. Measured on an H100 held to 8 GiB (benchmarks/results/capacity_8gib), they fit a larger
# micro-batch for every model and run faster from vit_l_16 (303 M parameters) up: 2.0x its images/s with
# optimizer offload; for vit_b_16 (86 M) with optimizer offload and ResNet18 (11 M), fp32 weights run faster.
HALF_WEIGHTS_OFFLOAD_PARAMS = 200_000_000


def _autocast_half(section):
    """'fp16' or 'bf16' when a torch_autocast section is enabled, else None."""
    if section.get("enabled") is not True:
        return None
    dtype = str(section.get("dtype", "bfloat16"))
    if dtype not in AUTOCAST_DTYPE_NAMES:
        raise UsageError(f"torch_autocast dtype must be float16 or bfloat16, got {dtype!r}")
    return AUTOCAST_DTYPE_NAMES[dtype]


# DeepSpeed allocates these buffers at their full size whatever the model: ZeRO-1/2 with contiguous
# gradients (the trainer keeps them under offload and overlap_comm) two reduce buckets of 5e8 elements,
# 3.7 GiB in fp32 for ResNet18's 11 M parameters, allocated in the backward pass, where memory peaks. A
# bucket larger than the model buys nothing, and one larger than DeepSpeed's own stage-3 prefetch bucket
# (5e7 elements, 191 MiB in fp32; PyTorch DDP's buckets are 25 MiB) buys no bandwidth, so unset ones are
# capped at both.
BUCKETS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")
BUCKET_CAP = 50_000_000
# ZeRO-1/2 assert allgather_bucket_size % 2 == 0 (nccl_start_alignment_factor: 4 bytes of fp16), and a
# model-sized bucket is odd for every odd class count (ResNet18: 11,176,512 + 513 x classes).
BUCKET_ALIGNMENT = 2


# DeepSpeed's earlier names for the offload sections, which it still reads (deprecated): their offload escaped every
# check made of offload_optimizer/offload_param (ZeRO-0 offload, ZeRO-2 without the grad norm it then needs)
LEGACY_OFFLOAD_KEYS = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
                       "cpu_offload_use_pin_memory": "offload_optimizer.pin_memory (or offload_param.pin_memory)"}


def _resolve_zero(config, args, num_params=None, world_size=1, resumed_stage=None):
    zero = config.setdefault("zero_optimization", {})
    legacy = next((key for key in LEGACY_OFFLOAD_KEYS if key in zero), None)
    if legacy is not None:
        raise UsageError(f"zero_optimization.{legacy} is DeepSpeed's old name, which it still reads but this trainer "
                         f"does not: use {LEGACY_OFFLOAD_KEYS[legacy]} ({{\"device\": \"cpu\"}}), or "
                         f"--{LEGACY_OFFLOAD_KEYS[legacy].split('.')[0]}")
    stage = _pick(zero, "stage", args, "zero_stage")
    for key, flag in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        if flag in args.explicit:
            if getattr(args, flag):
                zero[key] = {**OFFLOAD_TO_CPU, **zero.get(key, {}), "device": "cpu"}
            else:
                zero.pop(key, None)
        elif key not in zero and getattr(args, flag):
            zero[key] = dict(OFFLOAD_TO_CPU)
    if stage == AUTO:
        stage = resumed_stage if resumed_stage is not None else auto_stage(world_size, zero)
    if type(stage) is not int or stage not in (0, 1, 2, 3):  # true/2.0 compare equal to 1/2 and name no stage
        raise UsageError(f"ZeRO stage must be 0, 1, 2 or 3, got {json.dumps(stage)}")
    zero["stage"] = stage
    if num_params:
        for key in BUCKETS:
            if zero.get(key, AUTO) == AUTO:
                zero[key] = min(ZERO_AUTO_DEFAULTS[key], _round_up(num_params, BUCKET_ALIGNMENT), BUCKET_CAP)
    for key, value in ZERO_AUTO_DEFAULTS.items():
        if zero.get(key) == AUTO:
            zero[key] = value
    model = getattr(args, "model", DEFAULT_MODEL)
    # ZeRO-1/2's contiguous gradients (DeepSpeed's default) copy every gradient into the reduce bucket and again
    # into the partition, per parameter, in Python hooks; without them the bucket is flattened once for its
    # reduction. Measured on an H100 (benchmarks/zero3_settings.py): vit_b_16 ZeRO-2 at micro-batch 64 0.71x of
    # plain PyTorch with them, 1.02x without, at a lower peak. DeepSpeed turns them back on under optimizer
    # offload; with overlap_comm, its path without them synchronises the whole device before every bucket.
    if stage in (1, 2) and zero.get("contiguous_gradients", AUTO) == AUTO:
        zero["contiguous_gradients"] = _offloads(zero, "offload_optimizer") or zero.get("overlap_comm") is True
    # DeepCompile (benchmarks/zero3_settings.py; the trainer refuses it, check_trainer_support) gathers ZeRO-3's
    # parameters inside the compiled graph and removes ZeRO-3's hooks, but not the leaf modules' gradient hooks,
    # in which the first backward then fails (DeepSpeed 0.19.8: KeyError torch.float32).
    deepcompile = stage == 3 and uses_deepcompile(config, args)
    # ZeRO-3 gathers and releases parameters in Python hooks around every module, each step: hundreds for a
    # torchvision model, and on a GPU the step waits on the host. Each family's repeated block as a leaf module
    # is gathered and released whole, no hooks inside: the fastest ZeRO-3 setting measured for ResNet18 and
    # vit_l_16 (docs/performance.md, from benchmarks/zero3_settings.py).
    if stage == 3 and "leaf_module" not in zero and not deepcompile and not model.startswith(WITHOUT_BLOCKS):
        zero["leaf_module"] = {"classes": list(TIMM_LEAF_BLOCKS if is_timm(model) else BLOCKS)}
    if stage == 3 and zero.get("stage3_module_granularity_threshold", AUTO) == AUTO:
        zero["stage3_module_granularity_threshold"] = 0  # DeepSpeed's: the leaf modules make the units
    allgather = zero.get("allgather_bucket_size")
    if stage in (1, 2) and isinstance(allgather, int) and allgather % BUCKET_ALIGNMENT:
        raise UsageError(f"zero_optimization.allgather_bucket_size must be a multiple of {BUCKET_ALIGNMENT} "
                         f"(DeepSpeed's alignment), got {allgather}")
    if _offloads(zero, "offload_param") and stage != 3:
        raise UsageError(f"offload_param needs ZeRO stage 3 (this run uses stage {stage})")
    if _offloads(zero, "offload_optimizer") and stage == 0:
        raise UsageError("offload_optimizer needs ZeRO stage 1, 2 or 3 (this run uses stage 0)")
    if "offload_param" in zero and stage != 3:
        zero.pop("offload_param")


def uses_deepcompile(config, args):
    """Whether DeepSpeed's DeepCompile runs: compile.deepcompile in the config, and --compile to call it."""
    section = config.get("compile")
    return bool(getattr(args, "compile", False)) and isinstance(section, dict) and section.get("deepcompile") is True


def auto_stage(world_size, zero):
    """ZeRO-0 on one rank, where partitioning keeps everything and adds an fp32 copy of the weights and
    the buckets (2 CPU cores: a ResNet18 epoch took 19-22 s at ZeRO-2 against 17 s at ZeRO-0 and 17 s for
    plain PyTorch); ZeRO-2 on several ranks; the lowest stage that offloads what the config offloads."""
    if _offloads(zero, "offload_param"):
        return 3
    return 2 if world_size > 1 or _offloads(zero, "offload_optimizer") else 0


def coalesces_grad_reduction(mode, config):
    """Whether the training loop runs each optimizer step's micro-batches inside DeepSpeed's
    engine.coalesce_grad_reduction() (engine/loop.py, GradientAccumulation), for --coalesce_grad_reduction `mode`.

    With optimizer offload, DeepSpeed's ZeRO-1/2 otherwise copy every micro-batch's gradients to the CPU
    through per-parameter hooks (docs/memory.md, "Offload with gradient accumulation"); coalesced, the
    micro-batches sum them on the GPU, which holds one more copy of them. Without offload the gain is not
    measured: auto leaves it off."""
    zero = config["zero_optimization"]
    if mode == "on":
        if zero["stage"] == 0:
            raise UsageError("--coalesce_grad_reduction on needs --zero_stage 1, 2 or 3: DeepSpeed coalesces the "
                             "reduction of ZeRO's gradient partitions")
        # DeepSpeed wraps this combination in its BF16_Optimizer, which coalesce_grad_reduction() does not support
        if (zero["stage"] == 1 and precision(config) == "bf16" and not _offloads(zero, "offload_optimizer")
                and config.get("data_types", {}).get("grad_accum_dtype") in FP32_NAMES):
            raise UsageError("--coalesce_grad_reduction on: DeepSpeed does not coalesce ZeRO-1 with bf16 weights and "
                             "data_types.grad_accum_dtype fp32; use --zero_stage 2 or drop grad_accum_dtype")
    if mode == "off" or zero["stage"] == 0 or config["gradient_accumulation_steps"] == 1:
        return False
    return mode == "on" or (zero["stage"] in (1, 2) and _offloads(zero, "offload_optimizer"))


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def _refuse_fp32_accumulation_with_offload(config):
    """DeepSpeed 0.19.8's ZeRO-1/2 with optimizer offload and fp16/bf16 weights keep an fp32 gradient buffer
    on the GPU under data_types.grad_accum_dtype "fp32", and do not clear it after a step skipped for inf/nan
    gradients: every later step is skipped too, and the run stops learning without a word
    (tests/test_deepspeed_overrides.py pins it)."""
    zero, data_types = config["zero_optimization"], config.get("data_types")
    if (isinstance(data_types, dict) and data_types.get("grad_accum_dtype") in FP32_NAMES and zero["stage"] in (1, 2)
            and _offloads(zero, "offload_optimizer") and precision(config) in ("fp16", "bf16")):
        raise UsageError("data_types.grad_accum_dtype fp32 with offload_optimizer and fp16/bf16 weights at ZeRO-1/2: "
                         "DeepSpeed then skips every step after the first one with inf/nan gradients; remove "
                         "data_types.grad_accum_dtype, or the offload")


def _skip_unused_grad_norm(config):
    """ZeRO-1/2 compute the global gradient norm every step even when nothing clips with it, and with
    fp32 weights (fp32, torch_autocast) they then check it on the host: a GPU sync per step. Skip it
    where DeepSpeed allows (no clipping, no optimizer offload, fp32 weights)."""
    zero = config["zero_optimization"]
    if (zero["stage"] in (1, 2) and not config.get("gradient_clipping") and not _offloads(zero, "offload_optimizer")
            and precision(config) in ("fp32", "autocast-fp16", "autocast-bf16")):
        zero.setdefault("compute_grad_norm", False)


# The moment estimates' settings each of DeepSpeed's optimizers takes (lower-case type): filled in when the
# JSON leaves them out; an optimizer not named takes neither (SGD's constructor refuses them). DeepSpeed 0.19
# has no 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) any more: check_with_deepspeed refuses them.
ADAM_SETTINGS = {"betas": [0.9, 0.999], "eps": 1e-8}
# --optimizer -> the type DeepSpeed's engine builds: torch's AdamW and SGD, DeepSpeed's Lamb and Lion
OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD", "lamb": "Lamb", "lion": "Lion"}
MAX_LR = 1e6
OPTIMIZER_SETTINGS = {**dict.fromkeys(("adam", "adamw", "lamb"), ("betas", "eps")),
                      "lion": ("betas",), "adagrad": ("eps",)}


def _refuse_ema_with_nvme(config, args):
    """The weights' average lives beside the fp32 weights (engine/ema.py), which NVMe offload swaps out to disk
    between steps."""
    if getattr(args, "model_ema", False):
        for section in ("offload_optimizer", "offload_param"):
            if (config["zero_optimization"].get(section) or {}).get("device") == "nvme":
                raise UsageError(f"--model_ema averages the fp32 weights in memory, and zero_optimization.{section} "
                                 "keeps them on NVMe: offload to the CPU (device: cpu) or drop --model_ema")


def _resolve_optimizer(config, args, device_type):
    kind = OPTIMIZERS[getattr(args, "optimizer", "adamw")]
    optimizer = config.setdefault("optimizer", {"type": kind, "params": {}})
    optimizer.setdefault("type", kind)  # a JSON's optimizer section that gives params only
    if "optimizer" in args.explicit and str(optimizer["type"]).lower() != kind.lower():
        raise UsageError(f"--optimizer {args.optimizer} and the JSON's optimizer.type {optimizer['type']}: give one "
                         "(the JSON's params are for its own optimizer)")
    params = optimizer.setdefault("params", {})
    if str(optimizer["type"]).lower() == "sgd":
        for key in ("momentum", "nesterov"):
            if key not in params or key in args.explicit:
                params[key] = getattr(args, key, {"momentum": 0.9, "nesterov": False}[key])
    else:
        for name in ("momentum", "nesterov"):  # where the optimizer is known: --optimizer's, or a JSON's
            if name in args.explicit:
                raise UsageError(f"--{name} is SGD's, and this run's optimizer is {optimizer['type']}: use "
                                 "--optimizer sgd (or the JSON's optimizer.type SGD)")
    json_lr = params.get("lr", AUTO) != AUTO  # the JSON's own number, before the flags fill in "auto"
    takes = OPTIMIZER_SETTINGS.get(str(optimizer.get("type", "")).lower(), ())
    auto_values = {"lr": args.learning_rate, "weight_decay": args.weight_decay,
                   **{key: value for key, value in ADAM_SETTINGS.items() if key in takes or params.get(key) == AUTO}}
    for key, value in auto_values.items():
        flag = {"lr": "learning_rate", "weight_decay": "weight_decay"}.get(key)
        if params.get(key, AUTO) == AUTO or (flag and flag in args.explicit):
            params[key] = value
    lr = params.get("lr")
    if _number(lr) and lr > MAX_LR:
        said = ("the JSON's optimizer.params.lr" if json_lr and "learning_rate" not in args.explicit
                else "--learning_rate")
        raise UsageError(f"{said} {lr:g} is larger than any learning rate that trains (at most {MAX_LR:g}; the "
                         "optimizers' fp32 update overflows near 1e37)")
    scale = getattr(args, "backbone_lr_scale", 1.0)
    if _number(lr) and _number(scale) and lr * scale > MAX_LR:
        raise UsageError(f"--backbone_lr_scale {scale:g} makes the body's learning rate {lr * scale:g}, larger than any "
                         f"that trains (at most {MAX_LR:g})")
    if str(optimizer.get("type", "")).lower() == "lamb" and (
            config["zero_optimization"]["stage"] or precision(config) == "bf16"):
        said = f"--optimizer {args.optimizer}" if "optimizer" in args.explicit else f"optimizer.type {optimizer['type']}"
        raise UsageError(f"{said}: LAMB scales each layer's step by its own trust ratio, and ZeRO 1-3 (and "
                         "DeepSpeed's bf16 weights) hand FusedLamb each rank's parameters flattened into one tensor: "
                         "one ratio for them all, not LAMB; use --zero_stage 0 with fp32 weights, --fp16 or "
                         "--precision_mode autocast")
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        # ZeRO partitions any torch optimizer's state, but DeepSpeed stops on one it has not listed (SGD among
        # them) unless this is set: the optimizer the JSON names is the user's choice.
        config.setdefault("zero_allow_untested_optimizer", True)
    offloaded = _offloads(config["zero_optimization"], "offload_optimizer")
    if (optimizer.get("type", "").lower() in ("adam", "adamw") and "torch_adam" not in params
            and (not offloaded or device_type == "cpu")):
        # torch's AdamW needs no compiled extension; DeepSpeed's CPUAdam, the fast path for a GPU's optimizer
        # offloaded to the CPU, costs a CPU-only machine a one-minute compile on first use for nothing.
        params["torch_adam"] = True
        if device_type == "cpu" and not {"foreach", "fused", "differentiable"} & set(params):
            # torch's fused CPU kernel: one pass over each tensor where the default runs an op per step of the
            # update, each a pass over memory (ResNet18: 7 times as fast, nearly half of a step on one core)
            params["fused"] = True


def resolve_scheduler(base, args, lr, optimizer_steps):
    """The scheduler section for `optimizer_steps` optimizer steps per epoch and peak learning rate `lr`:
    --lr_schedule's unless `base` (the user's JSON) names one, an explicit --lr_schedule of another type
    replacing the base's, every "auto" resolved. Built from `base` each time, so that the training script can
    size it again on the steps that run (the decode may leave out images the data check counted) while the
    numbers the JSON gives stay as given."""
    kind, defaults = LR_SCHEDULES[args.lr_schedule]
    scheduler = copy.deepcopy(base.get("scheduler"))
    if scheduler is not None and "type" not in scheduler:  # the JSON's params, for --lr_schedule's type
        scheduler = {"type": kind, "params": {**dict(defaults), **(scheduler.get("params") or {})}}
    if scheduler is None or "lr_schedule" in args.explicit and scheduler.get("type") != kind:
        scheduler = {"type": kind, "params": dict(defaults)}
    params = scheduler.setdefault("params", {})
    warmup_steps = round(args.warmup_epochs * optimizer_steps)
    auto_values = {"total_num_steps": args.epochs * optimizer_steps, "warmup_num_steps": max(1, warmup_steps),
                   "warmup_min_lr": 0.0, "warmup_max_lr": lr}
    # Without these DeepSpeed would fall back to its own step counts (and WarmupDecayLR to lr 0.001).
    if scheduler.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        params.setdefault("total_num_steps", AUTO)
    if scheduler.get("type") in ("WarmupCosineLR", "WarmupDecayLR", "WarmupLR"):
        params.setdefault("warmup_num_steps", AUTO)
    if scheduler.get("type") in ("WarmupDecayLR", "WarmupLR"):
        params.setdefault("warmup_min_lr", AUTO)
        params.setdefault("warmup_max_lr", AUTO)
    if warmup_steps == 0 and params.get("warmup_num_steps") == AUTO:
        # DeepSpeed's schedulers warm up for 2 steps at least, from the minimum (WarmupCosineLR: lr 0, whatever
        # the ratio): a one-step run would not train. Started past step 0 (the optimizer's lr, the peak) with a
        # log ramp (the peak at step 1), every step is at the schedule's peak or after it.
        params.update(warmup_type="log", last_batch_iteration=0)
    for key, value in auto_values.items():
        if params.get(key) == AUTO:
            params[key] = value
    return scheduler


def _resolve_monitors(config, args):
    """--tensorboard / --csv_monitor switch DeepSpeed's monitors on or off (a base JSON's section is kept
    unless the flag is given); an enabled one writes under --log_dir unless the JSON names a place."""
    for name in MONITORS:
        enabled = _pick(config.get(name, {}), "enabled", args, name)
        if not enabled and name not in config:
            continue
        section = config[name] = {**config.get(name, {}), "enabled": enabled}
        for key, value in (("output_path", str(Path(args.log_dir) / name)), ("job_name", MONITOR_JOB_NAME)):
            if section.get(key, AUTO if enabled else None) == AUTO:
                section[key] = value


def _pick(section, key, args, flag, missing=AUTO):
    """The flag's value if it was given explicitly or the base says "auto", else the base's value;
    a key the base lacks counts as `missing`."""
    value = section.get(key, missing)
    return getattr(args, flag) if flag in args.explicit or value == AUTO else value


def _plain_linear_with_half_weights(config):
    """ZeRO-3 with half-precision weights and no parameter offload: torch's own linear layers, not DeepSpeed's
    memory_efficient_linear (an autograd Function per nn.Linear call that binds its arguments through
    inspect.signature, adds the bias in a kernel of its own and saves the weight to gather it again). With the
    weights in bf16 torch's saves the parameter itself, so there is no copy to spare: measured on two H100s
    (benchmarks/zero3_settings.py), timm's ViT-G/14 at ZeRO-3 ran 1.3x faster without it at 4% more peak memory.
    Under autocast it does save memory (torch's linear would keep each weight's cast copy until the backward), and
    with parameter offload memory comes first: left on there, and wherever the config sets it."""
    zero = config["zero_optimization"]
    if (zero["stage"] == 3 and precision(config) in ("fp16", "bf16") and not _offloads(zero, "offload_param")
            and zero.get("memory_efficient_linear", AUTO) == AUTO):
        zero["memory_efficient_linear"] = False


def _offloads(zero, key):
    return zero.get(key, {}).get("device", "none") not in ("none", None)


def _auto_paths(node, path=""):
    if node == AUTO:
        return [path]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _auto_paths(v, f"{path}[{i}]")]
    return []


def precision(config):
    """'fp16', 'bf16', 'autocast-fp16', 'autocast-bf16' or 'fp32': how the engine configured by `config` computes."""
    for name in ("fp16", "bf16"):
        if config.get(name, {}).get("enabled"):
            return name
    half = _autocast_half(config.get("torch_autocast", {}))
    return f"autocast-{half}" if half else "fp32"


def lr_schedule(config):
    """'cosine', 'linear' or 'constant' (the --lr_schedule choice), or the scheduler type of a base JSON."""
    kind = config.get("scheduler", {}).get("type")
    return next((name for name, (known, _) in LR_SCHEDULES.items() if known == kind), kind)


# DeepSpeed's monitors, by their section of the JSON: the package each needs (none of them a dependency here)
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def _as_read(value):
    """`value` as DeepSpeed's config models read a boolean (pydantic: 0, "no", "off" are false; 1, "true", "on"
    true); None for one they refuse, or that is left out."""
    if value is None or isinstance(value, bool):
        return value
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return None


def monitor_enabled(section):
    """Whether a monitor's section of the config switches it on, as DeepSpeed reads its `enabled`."""
    return bool(_as_read(section.get("enabled")))


def check_monitor_support(config):
    """A monitor whose package is missing, or whose output_path cannot be written, failed in deepspeed.initialize
    in every rank; a job_name that is not a folder name wrote outside its output_path."""
    for section, package in MONITOR_PACKAGES.items():
        if monitor_enabled(config.get(section, {})) and importlib.util.find_spec(package) is None:
            raise UsageError(f"the {section} monitor needs the {package} package: pip install {package.replace('_', '-')}"
                             " (or use --csv_monitor)")
    for section in MONITORS:
        monitor = config.get(section, {})
        job_name = monitor.get("job_name")
        # DeepSpeed writes into os.path.join(output_path, job_name): "../x" or "/x" wrote outside output_path
        if monitor_enabled(monitor) and isinstance(job_name, str) and (
                job_name in (".", "..") or any(character in job_name for character in "/\\\0")):
            raise UsageError(f"{section}.job_name {job_name!r}: the monitor writes in output_path/job_name, so it "
                             "must be a folder name, without '/' or '\\' and not '.' or '..' (\"\" writes in "
                             "output_path itself)")
        # DeepSpeed makes os.path.join("", job_name): job_name "" failed at its start (os.makedirs('')), another
        # wrote in whatever folder the rank started in
        if monitor_enabled(monitor) and monitor.get("output_path") == "":
            raise UsageError(f"{section}.output_path is empty: give a folder, or leave output_path out (the monitor "
                             f"then writes in --log_dir's {section})")
        if monitor_enabled(monitor) and monitor.get("output_path"):
            check_writable(monitor["output_path"], f"{section}.output_path")
        # a job_name longer than the file system allows failed every rank in csvMonitor.setup_log_dir (Errno 36)
        if monitor_enabled(monitor) and isinstance(job_name, str) and job_name:
            check_name_lengths(Path(monitor.get("output_path") or ".", job_name), f"{section}.job_name")


def check_run(config, args, device_type):
    """The checks of a run's resolved config that the launcher and each rank make before anything starts, one
    place for both; returns whether the run coalesces its gradient reduction (refusing what DeepSpeed cannot)."""
    check_device_support(config, device_type)
    check_monitor_support(config)
    check_trainer_support(config, args)
    return coalesces_grad_reduction(args.coalesce_grad_reduction, config)


def check_trainer_support(config, args):
    """Refuse what DeepSpeed takes but the trainer's run cannot get through."""
    if config.get("checkpoint", {}).get("writer") is not None:
        raise UsageError("checkpoint.writer: DeepSpeed's checkpoint writers (decoupled, fast) fail at the engine's "
                         "start in this data-parallel run (benchmarks/checkpoint_engines.py); remove it: the trainer "
                         "publishes each checkpoint itself")
    # true made DeepSpeed load the trainer's own checkpoints as universal ones: --resume auto ended in an
    # AttributeError in engine.load_checkpoint (outputs/universal.py sets it where a resume needs it)
    if "load_universal" in config.get("checkpoint", {}):
        raise UsageError("checkpoint.load_universal: the trainer sets it itself, for a resume that needs it (a "
                         "ZeRO-1/2/3 checkpoint resumed on another number of ranks, through DeepSpeed's universal "
                         "checkpoint); remove it")
    # DeepSpeed's engine casts every input to fp16 whenever fp16.auto_cast is set, fp16 on or not: with fp32 or
    # bf16 weights the first forward failed on the dtypes
    if config.get("fp16", {}).get("auto_cast") and precision(config) != "fp16":
        raise UsageError("fp16.auto_cast casts the inputs to fp16, which only fp16 weights take (fp16.enabled, "
                         f"--fp16); this run computes in {precision(config)}: remove it")
    # random-LTD drops tokens inside the layers DeepSpeed's convert_to_random_ltd converted, a language model's:
    # on an image classifier it failed at the engine's start, or with every key given changed nothing
    data_efficiency = config.get("data_efficiency") if isinstance(config.get("data_efficiency"), dict) else {}
    routing = data_efficiency.get("data_routing") if isinstance(data_efficiency.get("data_routing"), dict) else {}
    if isinstance(routing.get("random_ltd"), dict) and routing["random_ltd"].get("enabled"):
        raise UsageError("data_efficiency.data_routing.random_ltd: DeepSpeed's random layerwise token dropping "
                         "works on a language model's layers, converted for it, which no image classifier here "
                         "is; remove it")
    if config.get("tensor_parallel", {}).get("autotp_size") not in (None, 0, 1):
        raise UsageError("tensor_parallel.autotp_size: DeepSpeed's automatic tensor parallelism is for language "
                         "models; an image classifier's run is data-parallel (leave the section out)")
    untested = str(config["optimizer"].get("type", "")).lower() not in ZERO_TESTED_OPTIMIZERS
    if config["zero_optimization"]["stage"] and untested and _as_read(config.get("zero_allow_untested_optimizer")) is False:
        raise UsageError(f"zero_allow_untested_optimizer false: DeepSpeed's ZeRO then refuses optimizer "
                         f"{config['optimizer']['type']} at its start; remove it (the trainer sets it true for "
                         "optimizers DeepSpeed has not listed)")
    zero = config["zero_optimization"]
    predivide = config.get("gradient_predivide_factor", 1.0)
    # ZeRO-3 asserts the same at its start as ZeRO-2 (stage3.py), also with reduce_scatter on by default
    if zero["stage"] in (2, 3) and _as_read(zero.get("reduce_scatter", True)) is not False and (
            _number(predivide) and predivide != 1 or _as_read(config.get("prescale_gradients"))):
        raise UsageError(f"gradient_predivide_factor other than 1 and prescale_gradients: DeepSpeed's "
                         f"ZeRO-{zero['stage']} refuses them at its start with reduce_scatter, its default; remove "
                         "them, or set zero_optimization.reduce_scatter false")
    profiler = config.get("flops_profiler", {})
    if _as_read(profiler.get("enabled")) and profiler.get("output_file"):  # DeepSpeed opens it, making no folder
        output = Path(profiler["output_file"])
        check_name_lengths(output, "flops_profiler.output_file")  # is_dir raised on a name too long
        if output.is_dir() or not output.parent.is_dir():
            raise UsageError(f"flops_profiler.output_file {output}: " + (
                "a folder; give a file name" if output.is_dir() else f"{output.parent} is not a folder that exists"))
        check_writable(output.parent, "flops_profiler.output_file")
    autotuning = config.get("autotuning")
    # read as DeepSpeed's engine reads it (any true value): it then times a few steps and calls exit(), status 0
    if isinstance(autotuning, dict) and autotuning.get("enabled"):
        raise UsageError("autotuning.enabled: DeepSpeed's engine then times a few steps and exits, training nothing "
                         "and writing no checkpoint; autotuning is DeepSpeed's own launcher's (deepspeed --autotuning "
                         "tune ...), not a training run: remove it or set it false")
    if config.get("sequence_parallel_size", 1) != 1:
        raise UsageError("sequence_parallel_size is for splitting a language model's sequence over ranks; an image "
                         "classifier's run uses 1 (leave it out)")
    if uses_deepcompile(config, args):
        raise UsageError("DeepCompile (compile.deepcompile with --compile) is not supported: on a GPU it trained "
                         "ZeRO-3 but its compiled model failed in validation, and it needs CUDA; pass --no-compile "
                         "or remove compile.deepcompile from the DeepSpeed config")


# The optimizers DeepSpeed's ZeRO lists as tested (runtime/zero/utils.py, ZERO_SUPPORTED_OPTIMIZERS), by name
ZERO_TESTED_OPTIMIZERS = ("adam", "adamw", "adagrad", "lion")


def check_device_support(config, device_type):
    if device_type == "cpu" and precision(config) in ("fp16", "autocast-fp16"):
        raise UsageError("fp16 needs a GPU: DeepSpeed's CPU accelerator supports bf16 only "
                         "(pass --bf16, or --no-fp16 for fp32)")
    zero = config["zero_optimization"]
    for key, what in (("zero_quantized_weights", "weight"), ("zero_quantized_nontrainable_weights", "weight"),
                      ("zero_quantized_gradients", "gradient")):
        # ZeRO++'s quantizers are CUDA ops: on the CPU the engine's start (weights) or the first backward
        # (gradients) failed in every rank
        if device_type == "cpu" and zero["stage"] == 3 and _as_read(zero.get(key)):
            raise UsageError(f"zero_optimization.{key} needs a GPU: ZeRO++'s {what} quantization is a CUDA op "
                             "(remove it to train on the CPU)")


# DeepSpeed's config models, by the section of the JSON each reads.
DEEPSPEED_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16",
                      "DeepSpeedBF16Config": "bf16", "DeepSpeedTorchAutocastConfig": "torch_autocast",
                      "DeepSpeedMonitorConfig": "monitor", "DeepSpeedActivationCheckpointingConfig":
                      "activation_checkpointing", "DeepSpeedFlopsProfilerConfig": "flops_profiler",
                      "CommsConfig": "comms_logger", "DeepSpeedCheckpointConfig": "checkpoint"}


def check_with_deepspeed(config, path, device_type, run_steps=None, parameter_groups=1):
    """DeepSpeed's own checks of a config built on a user's --deepspeed_config (its pydantic config models,
    and the optimizer and scheduler names it accepts), so that a bad value stops before any rank starts;
    `parameter_groups`: the run's optimizer's (a scheduler's per-group lists must have as many values)."""
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig, DtypeEnum
    from pydantic import ValidationError

    where = f"--deepspeed_config {path}"
    optimizer = config["optimizer"]["type"]
    if optimizer.lower() not in DEEPSPEED_OPTIMIZERS and not hasattr(torch.optim, optimizer):
        raise UsageError(f"{where}: optimizer.type {optimizer!r} is neither one of DeepSpeed's optimizers "
                         f"({', '.join(DEEPSPEED_OPTIMIZERS)}) nor a torch.optim class")
    scheduler = config["scheduler"]["type"]
    torch_scheduler = getattr(torch.optim.lr_scheduler, scheduler, None)
    if scheduler not in lr_schedules.VALID_LR_SCHEDULES and not (
            isinstance(torch_scheduler, type) and issubclass(torch_scheduler, torch.optim.lr_scheduler.LRScheduler)):
        raise UsageError(f"{where}: scheduler.type {scheduler!r} is neither one of DeepSpeed's schedulers "
                         f"({', '.join(lr_schedules.VALID_LR_SCHEDULES)}) nor a torch.optim.lr_scheduler class")
    data_types = config.get("data_types", {})  # an object: _check_types
    if "grad_accum_dtype" in data_types and data_types["grad_accum_dtype"] is not None:
        try:
            accumulation = DtypeEnum(data_types["grad_accum_dtype"])  # what the engine reads it with, at its start
        except (ValueError, TypeError):
            names = ", ".join(name for dtype in DtypeEnum for name in dtype._all_values[1:])
            raise UsageError(f"{where}: data_types.grad_accum_dtype {data_types['grad_accum_dtype']!r} is not one of "
                             f"DeepSpeed's dtype names ({names})") from None
        # Without ZeRO, DeepSpeed's engine accumulates only in the weights' own dtype (NotImplementedError at its start)
        weights = precision(config) if precision(config) in ("fp16", "bf16") else "fp32"
        if config["zero_optimization"]["stage"] == 0 and accumulation != DtypeEnum(weights):
            raise UsageError(f"{where}: data_types.grad_accum_dtype {data_types['grad_accum_dtype']!r} at ZeRO stage 0: "
                             f"DeepSpeed accumulates there in the weights' dtype only ({weights}); remove it or use "
                             "--zero_stage 1, 2 or 3")
    _check_top_level_keys(config, where)
    # Checked here against one rank, DeepSpeed would refuse the global batch of several; it was checked above.
    checked = {key: value for key, value in config.items() if key != "train_batch_size"}
    try:
        DeepSpeedConfig(checked)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join([DEEPSPEED_SECTIONS.get(err.title, err.title), *map(str, first["loc"])])
        raise UsageError(f"{where}: {key}: {first['msg']} (got {json.dumps(first.get('input'), default=str)})") \
            from None
    except Exception as err:  # noqa: BLE001 - DeepSpeed reports other config problems as assertions and plain errors
        raise UsageError(f"{where}: DeepSpeed rejects it ({error_line(err)})") from None
    steps_per_print = config.get("steps_per_print", 1)
    if not isinstance(steps_per_print, int) or isinstance(steps_per_print, bool) or steps_per_print < 1:
        raise UsageError(f"{where}: steps_per_print must be a whole number of steps, got {steps_per_print!r}")
    for section in ("offload_param", "offload_optimizer"):
        offload = config["zero_optimization"].get(section) or {}
        if offload.get("device") == "nvme" and not offload.get("nvme_path"):
            raise UsageError(f"{where}: zero_optimization.{section} to nvme needs its nvme_path (a folder on the "
                             "NVMe drive)")
        if offload.get("device") == "nvme":
            try:
                check_writable(offload["nvme_path"], f"zero_optimization.{section}.nvme_path")
            except UsageError as err:
                raise UsageError(f"{where}: {err}") from None
            from deepspeed.ops.op_builder import AsyncIOBuilder

            if not AsyncIOBuilder().is_compatible(verbose=False):  # else the engine's start fails in a traceback
                raise UsageError(f"{where}: zero_optimization.{section} to nvme needs DeepSpeed's async_io op, which "
                                 "cannot be built on this machine (it needs libaio: apt install libaio-dev); offload "
                                 "to the CPU instead (device: cpu)")
    check_scheduler(config, built_optimizer(config, where, device_type, parameter_groups), where, run_steps)


# Top-level sections DeepSpeed reads that its constants module does not name.
OTHER_SECTIONS = ("zero_optimization", "optimizer", "scheduler", "wandb", "comet", "aio", "compression_training",
                  "data_efficiency", "elasticity", "autotuning", "nebula", "sparse_attention", "pipeline", "amp",
                  "curriculum_learning", "progressive_layer_drop", "eigenvalue", "quantize_training", "hybrid_engine",
                  "compile", "weight_quantization", "timers", *MONITORS, *DEEPSPEED_SECTIONS.values())


def _check_top_level_keys(config, where):
    """DeepSpeed ignores a top-level key it does not read: refuse one that is a near miss of one it reads
    ("zero_optimisation" would run ZeRO-0), and leave others alone (sections of DeepSpeed's features)."""
    from deepspeed.runtime import constants

    known = {value for name, value in vars(constants).items() if name.isupper() and isinstance(value, str)}
    known.update(OTHER_SECTIONS)
    for key in config:
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.85) if key not in known else None
        if near:
            raise UsageError(f"{where}: {key!r} is not a key DeepSpeed reads (did you mean {near[0]!r}?)")


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def built_optimizer(config, where, device_type, parameter_groups=1):
    """The optimizer DeepSpeed's engine builds from `config` (engine._configure_basic_optimizer), on a stand-in
    of one parameter in each of `parameter_groups` groups, so that parameters it cannot take stop here: torch's
    optimizers are built; DeepSpeed's compiled ones (FusedAdam, CPUAdam, Lamb, Lion, CPU Adagrad), whose op
    compiles on first use, are checked against their constructor's signature. Returns a torch optimizer for the
    scheduler's check."""
    import importlib.util
    import inspect

    import torch

    kind = config["optimizer"]["type"]
    params = {key: value for key, value in config["optimizer"].get("params", {}).items()
              if key not in ("torch_adam", "adam_w_mode", "fp32_optimizer_states")}  # DeepSpeed takes these out
    stand_in = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(parameter_groups)]
    offloaded = _offloads(config["zero_optimization"], "offload_optimizer")
    name = kind.lower()
    if name == "muon":  # DeepSpeed 0.19.8 orthogonalises every weight of 2 or more dimensions as a matrix
        raise UsageError(f"{where}: optimizer {kind}: DeepSpeed's Muon fails in its first step on convolution weights "
                         "(4-D), which every torchvision classifier has (its stem); use AdamW, SGD or Lion")
    if name in ("muadam", "muadamw", "musgd") and importlib.util.find_spec("mup") is None:
        raise UsageError(f"{where}: optimizer {kind} needs the mup package (pip install mup)")
    torch_adam = config["optimizer"].get("params", {}).get("torch_adam")
    fused = {"lamb": "FusedLamb", "lion": None if offloaded else "FusedLion",
             "adam": None if offloaded or torch_adam else "FusedAdam"}
    if device_type == "cpu" and fused.get("adam" if name == "adamw" else name):
        raise UsageError(f"{where}: optimizer {kind} is DeepSpeed's {fused.get('adam' if name == 'adamw' else name)}, "
                         "a CUDA op: it needs a GPU" + (" (with --offload_optimizer DeepSpeed's CPU Lion runs here)"
                                                        if name == "lion" else ""))
    torch_classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
                     "adagrad": torch.optim.Adagrad}
    if name in ("adam", "adamw") and torch_adam:  # DeepSpeed builds torch's class then, offloaded or not
        built = torch_classes[name]
    elif name in ("sgd", "adagrad") and not (name == "adagrad" and offloaded):
        built = torch_classes[name]
    elif hasattr(torch.optim, kind) and name not in DEEPSPEED_OPTIMIZER_CLASSES:
        built = getattr(torch.optim, kind)
    else:
        built = None
    try:
        if built is not None:
            # torch.optim's add_param_group is wrapped to keep torch.compile out, and the wrapper imports
            # torch._dynamo on its first call: a second of the launcher's start. The method itself checks the same.
            unwrapped = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
            if unwrapped is not None:
                built = type(built.__name__, (built,), {"add_param_group": unwrapped})
            return built(stand_in, **params)
        module, cls = DEEPSPEED_OPTIMIZER_CLASSES.get(name, (None, None))
        if module is not None:
            constructor = getattr(importlib.import_module(module), cls)
            inspect.signature(constructor).bind(stand_in, **params)
    except Exception as err:  # noqa: BLE001 - each constructor refuses its own way (betas [0.9]: IndexError)
        raise UsageError(f"{where}: optimizer {kind} cannot be built from optimizer.params ({error_line(err)})") \
            from None
    return torch.optim.AdamW(stand_in)  # for the scheduler: an optimizer with betas, as DeepSpeed's compiled ones


# DeepSpeed's compiled optimizers, by their name in the config: checked against their signature, not built.
DEEPSPEED_OPTIMIZER_CLASSES = {"adam": ("deepspeed.ops.adam", "FusedAdam"),
                               "adamw": ("deepspeed.ops.adam", "FusedAdam"),
                               "lamb": ("deepspeed.ops.lamb", "FusedLamb"),
                               "lion": ("deepspeed.ops.lion", "FusedLion"),
                               "adagrad": ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad")}


# Step counts of DeepSpeed's schedulers that only a positive number makes sense of.
STEP_COUNTS = ("total_num_steps", "warmup_num_steps", "cycle_first_step_size")


# DeepSpeed's schedulers whose rate stays 0 past their total_num_steps
SCHEDULES_WITH_AN_END = ("WarmupCosineLR", "WarmupDecayLR")


def check_scheduler(config, optimizer, where, run_steps=None):
    """Build the LR scheduler DeepSpeed's engine builds from `config` (engine._scheduler_from_config) over
    `optimizer`, a stand-in, and take a few of its steps: one without the parameters it needs, or with values
    it cannot compute with (many are used only from the first step on), stops here; so does one that stops
    stepping before the run's `run_steps` optimizer steps (torch's OneCycleLR raises at the step after its last)."""
    import inspect
    import warnings

    import torch
    from deepspeed.runtime import lr_schedules

    kind, params = config["scheduler"]["type"], config["scheduler"].get("params", {})
    scheduler = getattr(lr_schedules, kind, None) or getattr(torch.optim.lr_scheduler, kind)
    for key, value in params.items():  # a number where the scheduler's own default is one (StepLR's gamma)
        default = getattr(inspect.signature(scheduler).parameters.get(key), "default", None)
        if _number(default) and not _number(value):
            raise UsageError(f"{where}: scheduler.params.{key} of {kind} must be a number, got {value!r}")
        if key in STEP_COUNTS and _number(value) and value < 1:  # a negative total decayed to 0 at once, silently
            raise UsageError(f"{where}: scheduler.params.{key} of {kind} must be at least 1 step, got {value!r}")
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel("ERROR")  # WarmupCosineLR's: a rate asked for before the first step (its constructor does)
    try:
        with warnings.catch_warnings():  # torch's: a scheduler stepped before its optimizer
            warnings.simplefilter("ignore")
            built, rates = scheduler(optimizer, **params), []
            for _ in range(3):
                built.step()
                rates += built.get_last_lr()
    except Exception as err:  # noqa: BLE001 - as with the optimizer: each scheduler refuses its own way
        raise UsageError(f"{where}: scheduler {kind} cannot be built from scheduler.params ({error_line(err)})") \
            from None
    finally:
        logger.setLevel(level)
    _check_rates(rates, kind, where)
    total = getattr(built, "total_steps", None) if isinstance(built, torch.optim.lr_scheduler.OneCycleLR) else None
    if run_steps and isinstance(total, int) and total < run_steps:
        raise UsageError(f"{where}: scheduler {kind} steps {total} times, and this run takes {run_steps:,} optimizer "
                         "steps (it fails at the next); give total_steps (or epochs and steps_per_epoch) for the run")
    total = params.get("total_num_steps") if kind in SCHEDULES_WITH_AN_END else None
    if run_steps and _number(total) and total < run_steps:  # the rest of the run trained at rate 0, silently
        raise UsageError(f"{where}: scheduler {kind}'s total_num_steps is {total}, and this run takes {run_steps:,} "
                         "optimizer steps (the rate is 0 after its last); leave total_num_steps out to fit the run")
    # The rest of the run (up to CHECKED_STEPS): StepLR's gamma -1 went negative at its fourth step, DeepSpeed's
    # OneCycle with decay_lr_rate -0.5 divided by zero in epoch 2
    step = 3
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(4, min(run_steps or 0, CHECKED_STEPS) + 1):
                built.step()
                _check_rates(built.get_last_lr(), kind, where, step)
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - arithmetic in the scheduler's own code
        raise UsageError(f"{where}: scheduler {kind} fails at optimizer step {step:,} of this run "
                         f"({type(err).__name__}: {error_line(err)})") from None


# A scheduler's steps tried before the run (about 3 s a million; ImageNet's 90 epochs are 450,000)
CHECKED_STEPS = 2_000_000


def _check_rates(rates, kind, where, step=None):
    """Refuse a rate that is negative or not a finite number (the first steps' when `step` is None)."""
    wrong = next((rate for rate in rates if not (_number(rate) and 0 <= rate < math.inf)), None)
    if wrong is not None:  # LRRangeTest from lr_range_test_min_lr -1 trained at lr -1 (the loss to 1e15), exit 0
        when = "in its first steps" if step is None else f"at optimizer step {step:,} of this run"
        raise UsageError(f"{where}: scheduler {kind} gives the learning rate {wrong!r} {when}; a rate is a number "
                         "of 0 or more")
