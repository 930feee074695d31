"""timm's models, as --model timm:NAME: built by timm.create_model, their weights read from the Hugging Face hub
cache (HF_HOME) and loaded through timm's own loader (its checkpoint filters, a new head for another class
count), their preprocessing from the weights' pretrained_cfg. timm is imported only when one is asked for: it
takes seconds, which the torchvision path does not pay."""
import contextlib
import difflib
import re
from pathlib import Path

import torch
from torch import nn

from ..utils.failures import UsageError

PREFIX = "timm:"
# The blocks ZeRO-3 gathers and releases whole (as models/names.py's BLOCKS are torchvision's), per timm family
LEAF_BLOCKS = tuple(f"timm.models.{name}" for name in (
    "vision_transformer.Block", "vision_transformer.ParallelScalingBlock", "eva.EvaBlock", "eva.EvaBlockPostNorm", "beit.Block",
    "convnext.ConvNeXtBlock", "_efficientnet_blocks.InvertedResidual", "_efficientnet_blocks.DepthwiseSeparableConv",
    "_efficientnet_blocks.EdgeResidual", "_efficientnet_blocks.UniversalInvertedResidual", "resnet.BasicBlock",
    "resnet.Bottleneck", "swin_transformer.SwinTransformerBlock", "swin_transformer_v2.SwinTransformerV2Block",
    "maxxvit.MaxxVitBlock", "byobnet.BottleneckBlock", "regnet.Bottleneck"))
# The weights files timm looks for in a hub repository, in its order (safetensors first)
HUB_FILES = ("model.safetensors", "pytorch_model.bin")


def is_timm(name):
    return isinstance(name, str) and name.startswith(PREFIX)


def _timm():
    try:
        import timm
    except ImportError:
        raise UsageError("timm's models need timm: pip install timm") from None
    return timm


def arch(name):
    """timm's name of the model (timm:vit_base_patch16_224 -> vit_base_patch16_224)."""
    return name[len(PREFIX):]


def check_name(name):
    timm = _timm()
    model = arch(name)
    if ":" in model or "/" in model:  # timm's hf-hub:/local-dir: forms: a name and a tag here, weights by tag
        named, _, tag = model.replace(":", "/").rsplit("/", 1)[-1].partition(".")
        raise UsageError(f"--model {name}: name the model as timm lists it, and its weights with --pretrained: "
                         f"--model {PREFIX}{named}" + (f" --pretrained {tag}" if tag else "") +
                         " (read from the Hugging Face cache)")
    if "." in model:
        raise UsageError(f"--model {name}: give the weights' tag with --pretrained {model.split('.', 1)[1]} and the "
                         f"model as --model {PREFIX}{model.split('.', 1)[0]}")
    if not timm.is_model(model):
        close = difflib.get_close_matches(model, timm.list_models(), n=3)
        raise UsageError(f"--model {name}: not a timm model" + (f" (did you mean {', '.join(PREFIX + c for c in close)}"
                         "?)" if close else "") + "; python launch_deepspeed.py --list_models timm lists them")


def tags(name):
    """The tags of the model's pretrained weights (augreg_in21k_ft_in1k, ...), timm's default first."""
    return [full.split(".", 1)[1] for full in _timm().list_pretrained(f"{arch(name)}.*")]


def _cfg(name, tag=None):
    """timm's pretrained_cfg of weights `tag` (None: the default's) as a dict, empty where the model has none."""
    cfg = _timm().models.get_pretrained_cfg(arch(name) if tag in (None, "DEFAULT") else f"{arch(name)}.{tag}")
    return cfg.to_dict() if cfg is not None else {}


def is_tag(name, choice):
    return choice == "DEFAULT" or choice in tags(name)


def build(name, num_classes, image_size, drop_path=None, state=None, state_classes=None, tag=None):
    """timm's model `name` with `num_classes` outputs, built for `image_size` px where its input size is fixed
    (ViT, EVA, Swin), with stochastic depth `drop_path` (None: timm's default); with `state`, a checked
    state_dict of weights `tag` (None: a file) with `state_classes` outputs, loaded by timm's loader."""
    timm = _timm()
    check_name(name)
    kwargs = {"num_classes": num_classes}
    if _cfg(name).get("fixed_input_size"):
        kwargs["img_size"] = image_size
    if drop_path is not None:
        kwargs["drop_path_rate"] = drop_path
    if state is not None and not state:  # timm would take it as no weights: the hub's, or random ones (round 25)
        raise UsageError(f"--pretrained: no weights of {name} in it (0 tensors)")
    if state is not None:  # timm's loader: its filter (positions resampled, original layouts converted), the head
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"state_dict": state, **(
            {"num_classes": state_classes} if state_classes else {})})
    full = arch(name) if tag in (None, "DEFAULT") else f"{arch(name)}.{tag}"
    loads = []
    try:
        with _recorded(loads), _quiet("timm"):
            model = timm.create_model(full, **kwargs)
    except TypeError as err:
        if "drop_path_rate" in str(err):
            raise UsageError(f"--drop_path: --model {name} has no stochastic depth that timm lets set "
                             "(drop_path_rate)") from None
        raise
    except RuntimeError as err:  # load_state_dict's, strict: the keys that did not fit, or a shape
        if state is None:
            raise
        text = str(err)
        missing, unexpected = (re.findall(r'"([^"]+)"', text.partition(f"{kind} key(s) in state_dict:")[2]
                                          .partition("key(s) in state_dict:")[0].partition("size mismatch")[0])
                               for kind in ("Missing", "Unexpected"))
        if missing or unexpected:
            raise _not_weights(name, missing, unexpected) from None
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        raise UsageError(f"--pretrained: not weights of {name} ({(lines[1:] or lines or ['?'])[0][:300]})") from None
    except (KeyError, IndexError, ValueError) as err:  # a family's checkpoint filter on another model's keys
        if state is None:
            raise
        kwargs.pop("pretrained_cfg_overlay")
        with _quiet("timm"):  # the model itself builds (else its own error): the weights are not its
            own = timm.create_model(arch(name), **{**kwargs, "pretrained": False}).state_dict()
        missing, unexpected = [key for key in own if key not in state], [key for key in state if key not in own]
        if missing or unexpected:
            raise _not_weights(name, missing, unexpected) from None
        raise UsageError(f"--pretrained: not weights of {name} (timm's loader: {type(err).__name__} "
                         f"{str(err)[:200]})") from None
    if loads:  # timm loads leniently where it drops the head (another class count): what it left out, checked
        result, cast = loads[-1]
        heads = _cfg(name, tag).get("classifier") or "head"
        heads = (heads,) if isinstance(heads, str) else tuple(heads)
        missing = [key for key in result.missing_keys if not key.startswith(tuple(f"{h}." for h in heads))]
        if missing or result.unexpected_keys:
            raise _not_weights(name, missing, result.unexpected_keys)
        if cast:  # load_state_dict casts: integer or boolean values into floating weights lose their fractions
            key, given, held = cast[0]
            raise UsageError(f"--pretrained: {key} is a {given} tensor where {name} holds {held} values; save the "
                             "weights of a trained model")
    fp32_norms(model)
    model.register_forward_pre_hook(_buffers_in_weights_dtype)
    return model


def _not_weights(name, missing, unexpected):
    left = [*missing, *unexpected]
    return UsageError(f"--pretrained: not weights of {name} ({len(missing)} of its tensors missing, "
                      f"{len(unexpected)} not its own: {', '.join(left[:3])})")


@contextlib.contextmanager
def _recorded(loads):
    """Each load_state_dict's (result: its missing and unexpected keys, [(key, the file's dtype, the model's)] of
    integer or boolean values given for floating tensors) appended to `loads`."""
    original = nn.Module.load_state_dict

    def load_state_dict(module, state_dict, *args, **kwargs):
        own = module.state_dict()
        cast = [(key, value.dtype, own[key].dtype) for key, value in state_dict.items()
                if key in own and torch.is_tensor(value) and own[key].is_floating_point()
                and not value.is_floating_point()]
        loads.append((original(module, state_dict, *args, **kwargs), cast))
        return loads[-1][0]

    nn.Module.load_state_dict = load_state_dict
    try:
        yield
    finally:
        nn.Module.load_state_dict = original


@contextlib.contextmanager
def _quiet(logger):
    """The library's log lines below errors held: timm's on the keys its lenient load left out (build checks them
    and says what did not fit in one line), huggingface_hub's on each retry (hub_file's error says it once)."""
    import logging

    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _buffers_in_weights_dtype(model, inputs):
    """The floating buffers outside the normalisation layers (EVA's rotary embedding and fixed key bias) in the
    weights' dtype: DeepSpeed's bf16/fp16 modes cast parameters only, and a bias or embedding left in fp32 then
    meets half-precision activations in one op, which fails. Once per dtype."""
    dtype = next(model.parameters()).dtype
    if getattr(model, "_buffers_dtype", torch.float32) == dtype:
        return
    from .norms import FP32_NORMS

    floating_buffers_to(model, dtype, keep=lambda module: isinstance(module, _FP32)
                        or type(module) in FP32_NORMS.values())
    model._buffers_dtype = dtype


def floating_buffers_to(model, dtype, keep):
    """Every floating buffer of `model` in `dtype`, in place, but those of the modules `keep` is true for."""
    for module in model.modules():
        if not keep(module):
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[key] = buffer.to(dtype)


def head_classes(name, state):
    """The class count of the head in `state` (a file's weights), as the model's pretrained_cfg names the head
    (None when it is not there)."""
    heads = _cfg(name).get("classifier") or "head"
    for head in (heads,) if isinstance(heads, str) else heads:
        weight = state.get(f"{head}.weight")
        if torch.is_tensor(weight) and weight.ndim >= 1:
            return weight.shape[0]
    return None


class _FP32:
    """A timm normalisation layer computing in fp32 under half-precision weights (DeepSpeed's bf16/fp16 modes
    cast parameters, not buffers; a batch norm then refuses its fp32 statistics): the layer's own forward, on
    the input in fp32 and, where it reads its weights, fp32 copies of them (differentiable, so the gradients
    reach the weights); the output cast back. The module's own parameters stay in place: ZeRO-3's hooks, which
    child modules (the activation of BatchNormAct2d) run inside the forward, walk them."""

    def __getattr__(self, name):
        view = self.__dict__.get("_fp32_weights")
        if view is not None and name in view:
            return view[name]
        return super().__getattr__(name)

    def forward(self, x, *args, **kwargs):
        half = {key: value for key, value in self._parameters.items()
                if value is not None and value.is_floating_point() and value.dtype != torch.float32}
        if not half or not torch.is_tensor(x):
            return super().forward(x, *args, **kwargs)
        self.__dict__["_fp32_weights"] = {key: value.float() for key, value in half.items()}
        try:
            with torch.autocast(x.device.type, enabled=False):
                out = super().forward(x.float(), *args, **kwargs)
        finally:
            del self.__dict__["_fp32_weights"]
        return out.to(x.dtype)


_FP32_CLASSES = {}
NORM_BASES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


def fp32_norms(model):
    """Each of `model`'s normalisation layers of timm's own classes (BatchNormAct2d, LayerNorm2d, RmsNorm, ...)
    given the _FP32 forward: its class swapped for a subclass, its state unchanged (torch's own classes take the
    trainer's, models/build.py's fp32_norms)."""
    from .norms import FP32_NORMS, fp32_norms as torch_norms  # torchvision's import: not at the launcher's start

    torch_norms(model)
    swapped = 0
    for module in model.modules():
        cls = type(module)
        if cls in FP32_NORMS.values() or issubclass(cls, _FP32) or cls.__name__.endswith("Fp32"):
            continue
        if isinstance(module, NORM_BASES) or cls.__name__.startswith(("RmsNorm", "SimpleNorm")):
            if cls not in _FP32_CLASSES:
                _FP32_CLASSES[cls] = type(f"{cls.__name__}FP32", (_FP32, cls), {"plain": cls})
            module.__class__ = _FP32_CLASSES[cls]
            swapped += 1
    return swapped


def checkpointing(model, name):
    """`model` with timm's activation checkpointing on: its blocks' activations recomputed in the backward pass
    (each block called again as a module, so ZeRO-3's hooks gather its weights for the recomputation)."""
    try:
        model.set_grad_checkpointing(True)
    except (AssertionError, NotImplementedError, AttributeError) as err:
        raise UsageError(f"--grad_checkpointing: timm's {name} has no activation checkpointing "
                         f"({str(err).strip() or type(err).__name__})") from None
    return model


def unsynced_batch_norms(model):
    """How many of the model's batch norm layers --sync_bn does not reach (timm's BatchNormAct2d)."""
    return sum(isinstance(module, _FP32) and isinstance(module, nn.modules.batchnorm._BatchNorm)
               for module in model.modules())


def plain_norms(model):
    """`model` with timm's normalisation classes back and without the buffers' dtype hook (for the exporters:
    TorchScript compiles hooks, and cannot this one)."""
    for module in model.modules():
        if isinstance(module, _FP32):
            module.__class__ = type(module).plain
    for key, hook in list(model._forward_pre_hooks.items()):
        if hook is _buffers_in_weights_dtype:
            del model._forward_pre_hooks[key]
    return model


def layer_ids(model):
    """{parameter name: layer} for --layer_decay, timm's own (its group_matcher, as its param_groups_layer_decay
    numbers them: stem 0, blocks 1..L, final norm and head L + 1); None for a model without a group_matcher."""
    if not hasattr(model, "group_matcher"):
        return None
    ids = _timm().models.group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    top = max(ids.values(), default=0)  # a parameter its matcher leaves out: the top layer, as timm's own
    return {name: ids.get(name, top) for name, _ in model.named_parameters()}


def preprocessing(name, pretrained):
    """The mean, std, resize and interpolation of the weights `pretrained` (a tag, DEFAULT, or a file: the
    model's default weights' cfg) from timm's pretrained_cfg; None without weights."""
    if not pretrained:
        return None
    cfg = _cfg(name, pretrained if isinstance(pretrained, str) and is_tag(name, pretrained) else None)
    if not cfg.get("mean"):
        return None
    return {"mean": list(cfg["mean"]), "std": list(cfg["std"]), "resize_ratio": 1 / cfg.get("crop_pct", 0.875),
            "interpolation": cfg.get("interpolation") if cfg.get("interpolation") == "bilinear" else "bicubic"}


def default_image_size(name):
    return (_cfg(name).get("input_size") or (3, 224, 224))[-1]


def _hub_place(name, choice):
    """(repository, revision, the files to look for) of weights `choice` on the Hugging Face hub."""
    cfg = _cfg(name, choice)
    repo = cfg.get("hf_hub_id")
    if not repo and not cfg.get("url"):
        raise UsageError(f"--pretrained {choice}: timm has no pretrained weights of {name}; give a weights file's "
                         "path, or leave --pretrained out")
    if not repo:
        raise UsageError(f"--pretrained {choice}: timm has the weights of {name} only at {cfg['url']} (not on the "
                         "Hugging Face hub); download them and give the file's path")
    repo, _, revision = repo.partition("@")
    return repo, revision or None, (cfg["hf_hub_filename"],) if cfg.get("hf_hub_filename") else HUB_FILES


def cached_file(name, choice):
    """The hub cache's file of weights `choice`, or None when it is not there yet."""
    from huggingface_hub import try_to_load_from_cache

    repo, revision, files = _hub_place(name, choice)
    for filename in files:
        found = try_to_load_from_cache(repo, filename, revision=revision)
        if isinstance(found, str):
            return Path(found)
    return None


def hub_file(name, choice):
    """The local file of weights `choice` (a tag or DEFAULT): in the Hugging Face hub cache (HF_HOME), downloaded
    there when missing."""
    found = cached_file(name, choice)
    if found is not None:
        return found
    import sys

    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    repo, revision, files = _hub_place(name, choice)
    if not constants.HF_HUB_OFFLINE:  # offline the error line below says it all
        print(f"note: --pretrained {choice}: downloading {repo} from the Hugging Face hub into "
              f"{constants.HF_HUB_CACHE}", file=sys.stderr, flush=True)
    reason = "the repository has none of them"
    with _quiet("huggingface_hub"):
        for filename in files:
            try:
                return Path(hf_hub_download(repo, filename, revision=revision))
            except LocalEntryNotFoundError:  # offline, or the hub not answering (after its retries)
                reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
                break
            except EntryNotFoundError:  # the repository has no such file: the next kind
                continue
            except Exception as err:  # refused, no space, ...: huggingface_hub's many kinds, one line here
                reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
                break
    raise UsageError(f"--pretrained {choice}: {repo}'s {files[0]} is not in the Hugging Face cache "
                     f"({constants.HF_HUB_CACHE}) and could not be downloaded ({reason}); download it there "
                     f"(hf download {repo} {files[0]}; HF_HOME sets the folder), or give the file's path")


def not_downloaded(name, choice):
    """Where weights `choice` go in the hub cache when a run downloads them (a dry run does not); None for a file
    or weights already there."""
    if not isinstance(choice, str) or not is_tag(name, choice) or cached_file(name, choice) is not None:
        return None
    from huggingface_hub import constants

    repo, _, files = _hub_place(name, choice)
    return Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / files[0]


def list_models(pattern=None):
    """One line per timm model matching `pattern` (a wildcard, timm's filter): name, input size, weights' tags."""
    timm = _timm()
    names = timm.list_models(pattern or "")
    if not names:
        return f"no timm model matches {pattern!r}"
    by_model = {}
    for full in timm.list_pretrained():
        by_model.setdefault(full.split(".", 1)[0], []).append(full.split(".", 1)[1])
    lines = [f"{'model (--model timm:NAME)':<44} {'input':>5}  weights (--pretrained)"]
    for model in names:
        weights = by_model.get(model, [])
        lines.append(f"{PREFIX + model:<44} {default_image_size(PREFIX + model):>4}px  "
                     + (" ".join(["DEFAULT", *weights]) if weights else "(none)"))
    return "\n".join(lines)
