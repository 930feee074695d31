"""The trainer's models: any torchvision classifier by name (ResNet18 as ResNet18Animals90, with today's
state_dict keys), normalisation layers that compute in fp32 under DeepSpeed's half-precision weights
(batch norm optionally synchronised over ranks), and ImageNet weights through torchvision's weights API."""
import collections
import copy
import contextlib
import difflib
import urllib.error
import warnings
from pathlib import Path
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from ..utils.failures import UsageError
from ..utils.loading import load_checked, tensors_by_name, unloadable_tensor
from ..utils.text import error_line
from . import timm_models
from .checkpointing import checkpoint_blocks
from .names import DEFAULT_MODEL, architecture
from .norms import FP32_NORMS, BatchNorm2dFP32, fp32_norms
from .timm_models import is_timm


def plain_norms(model):
    """`model` with torch's own normalisation layers back in place of the fp32 ones (the same for fp32 weights),
    for an exporter: TorchScript cannot compile their rank synchronisation."""
    plain = {fp32: torch_class for torch_class, fp32 in FP32_NORMS.items()}
    for module in model.modules():
        if type(module) in plain:
            module.__class__ = plain[type(module)]
    return timm_models.plain_norms(model)


class ResNet18Animals90(ResNet):
    """torchvision's ResNet18 (same state_dict keys) with fp32 batch norm and `num_classes` outputs.

    `pretrained` is False, a weights name (DEFAULT, IMAGENET1K_V1) or the path of a torchvision ResNet18
    weights file, or True for DEFAULT (see load_pretrained).
    """

    def __init__(self, num_classes=90, pretrained=False):
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, norm_layer=BatchNorm2dFP32)
        if pretrained:
            load_pretrained(self, DEFAULT_MODEL, "DEFAULT" if pretrained is True else pretrained, num_classes)


def with_versions(state_dict, versions):
    """A copy of `state_dict` carrying the module versions `versions` (`_metadata`, as model.state_dict() has
    them): an export (a plain dict, or safetensors) has none, and MNASNet's loader refuses a state without."""
    state_dict = collections.OrderedDict(state_dict)
    state_dict._metadata = versions
    return state_dict


def load_weights(model, state_dict, source):
    """model.load_state_dict(state_dict), strict; keys or shapes that do not fit are a UsageError naming `source`."""
    try:
        model.load_state_dict(with_versions(state_dict, model.state_dict()._metadata))  # ours: today's versions
    except RuntimeError as err:  # torch's first line only names the model; the next says what did not fit
        detail = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err).strip())
        raise UsageError(f"{source}: not a {type(model).__name__} state_dict ({detail[:300]})") from None


def model_names():
    """Every classifier of torchvision.models, by the name --model takes."""
    return torchvision.models.list_models(module=torchvision.models)


def check_saved_model(name, source):
    """`name` as read from `source` (a checkpoint's extra_info.json, an export's sidecar) is a model we build."""
    if is_timm(name):
        try:
            timm_models.check_name(name)
        except UsageError as err:
            raise UsageError(f"{source} names the model {name!r}: {err}") from None
    elif not isinstance(name, str) or architecture(name) not in model_names():
        raise UsageError(f"{source} names the model {name!r}, which is not a torchvision classifier; use a file "
                         "this trainer wrote")
    return name


def check_model_name(name):
    if is_timm(name):
        return timm_models.check_name(name)
    if architecture(name) not in model_names():
        close = difflib.get_close_matches(name, model_names(), n=3)
        raise UsageError(f"--model {name}: not a torchvision classifier" + (f" (did you mean {', '.join(close)}?)"
                         if close else "") + "; python launch_deepspeed.py --list_models lists them (timm's: "
                         "--model timm:NAME)")


def construction_args(name, image_size):
    """What some models need at construction: the input size (ViT, MaxViT); no auxiliary heads for GoogLeNet
    and Inception V3 (their training-mode tuple outputs are not logits)."""
    if name.startswith("vit_"):
        return {"image_size": image_size}
    if name == "maxvit_t":
        return {"input_size": (image_size, image_size)}
    if name in ("googlenet", "inception_v3"):  # transform_input: the input scaling their ImageNet weights expect
        return {"aux_logits": False, "init_weights": True, "transform_input": True}
    return {}


# Their builders set stochastic_depth_prob themselves (passing it too is a TypeError): build_model scales the blocks'
SCALED_DROP_PATH = ("swin_", "maxvit_")


def build_model(name, num_classes, image_size=224, pretrained=None, drop_path=None, grad_checkpointing=False):
    """The model `name` (a torchvision classifier) with `num_classes` outputs and fp32 normalisation layers;
    `pretrained`: None, a weights name of the model (DEFAULT, IMAGENET1K_V1, ...) or a state_dict file;
    `drop_path`: its stochastic_depth_prob (None: the builder's default; the options check which take it);
    `grad_checkpointing`: activation checkpointing on, timm's own or each torchvision family's repeated block (the
    options check the model has blocks)."""
    name = architecture(name)
    check_model_name(name)
    if is_timm(name):
        model = timm_models.build(name, num_classes, image_size, drop_path, *timm_weights(name, pretrained))
        return timm_models.checkpointing(model, name) if grad_checkpointing else model
    if name == DEFAULT_MODEL:
        model = ResNet18Animals90(num_classes=num_classes)
    else:
        passed = drop_path is not None and not name.startswith(SCALED_DROP_PATH)
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes,
                                             **construction_args(name, image_size),
                                             **({"stochastic_depth_prob": drop_path} if passed else {}))
        if drop_path is not None and not passed:
            scale_drop_path(model, drop_path)
        fp32_norms(model)
        for module in model.modules():
            if hasattr(module, "cpb_mlp"):  # Swin V2: an fp32 coordinate table goes through half-precision weights
                module.cpb_mlp.register_forward_pre_hook(_in_weights_dtype)
    if pretrained:
        load_pretrained(model, name, pretrained, num_classes)
    if grad_checkpointing:
        checkpoint_blocks(model)
    return model


def scale_drop_path(model, drop_path):
    """Swin's and MaxViT's blocks' stochastic depth as their builders give it for stochastic_depth_prob
    `drop_path`: each block's probability is that times a fraction rising to 1 at the last block, so the built
    ones are scaled from the builder's own value (the last block's)."""
    blocks = [module for module in model.modules() if isinstance(module, torchvision.ops.StochasticDepth)]
    built = max(block.p for block in blocks)
    for block in blocks:
        block.p = block.p * drop_path / built


def _in_weights_dtype(module, inputs):
    """Inputs cast to the module's weights' dtype (DeepSpeed's fp16/bf16 modes cast parameters, not buffers)."""
    dtype = next(module.parameters()).dtype
    return tuple(x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)


@contextlib.contextmanager
def _no_initialisation():
    """torch.nn.init's functions as no-ops: a model built only for its shapes skips seconds of random numbers."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def model_for_weights(name, num_classes, image_size):
    """The model `name` built without initialisation, for a strict load of every weight (an export, a
    checkpoint's): the random numbers it skips took ViT-B/16 0.6 s on 2 CPU cores."""
    with _no_initialisation():
        return build_model(name, num_classes, image_size)


def shape_model(name, num_classes=1000, image_size=224):
    """The model on the meta device: its shapes without its memory or initialisation."""
    try:
        with torch.device("meta"):
            return build_model(name, num_classes, image_size)
    except NotImplementedError:  # RegNet computes its widths with tensors, which meta ones cannot give back
        with _no_initialisation():
            return build_model(name, num_classes, image_size).to("meta")


def check_image_size(name, num_classes, image_size, batch_size=2, sync_bn=True):
    """Stop before anything starts when `name` cannot take `image_size` px (too small for its downsampling,
    not a multiple of its patch or window), or a micro-batch of `batch_size` (one image where a batch norm
    layer then sees one value per channel; `sync_bn`: whether the caller has --sync_bn to suggest): forward
    passes on the meta device. Returns that meta model."""
    try:
        model = shape_model(name, num_classes, image_size)
    except (ValueError, AssertionError) as err:  # ViT and MaxViT check the size at construction
        raise UsageError(f"--model {name} cannot take --image_size {image_size}: {error_line(err)}") from None
    try:
        model(torch.zeros(2, 3, image_size, image_size, device="meta"))
    except (RuntimeError, ValueError, AssertionError) as err:
        raise UsageError(f"--model {name} cannot take --image_size {image_size} ({error_line(err)}); use a larger "
                         "or rounder size, such as 224") from None
    if batch_size == 1:
        try:
            model(torch.zeros(1, 3, image_size, image_size, device="meta"))
        except ValueError as err:  # "Expected more than 1 value per channel when training"
            synced = sync_bn and not timm_models.unsynced_batch_norms(model)  # --sync_bn reaches torch's only
            raise UsageError(f"--batch_size 1 at --image_size {image_size}: a batch norm layer of {name} then sees "
                             f"one value per channel ({error_line(err)}); use --batch_size 2 or more"
                             + (", a larger --image_size, or --sync_bn on several ranks" if synced
                                else " or a larger --image_size")) from None
    return model


def check_val_crop(name, num_classes, image_size, val_crop_size):
    """Stop when the model built for `image_size` cannot validate on crops of `val_crop_size` (ViT's input size is
    fixed when it is built; a CNN's is not): a forward pass on the meta device."""
    if val_crop_size in (None, image_size):
        return
    try:
        shape_model(name, num_classes, image_size).eval()(torch.zeros(2, 3, val_crop_size, val_crop_size,
                                                                      device="meta"))
    except (RuntimeError, ValueError, AssertionError) as err:
        raise UsageError(f"--val_crop_size {val_crop_size}: --model {name} built for --image_size {image_size} "
                         f"cannot take it ({error_line(err)}); use --val_crop_size {image_size}, or another size it "
                         "takes") from None


def checked_model(name, num_classes, image_size, batch_size, pretrained, val_crop_size=None, micro_batch=None):
    """The training script's checks of the model, on the meta device before anything starts: the image size
    and micro-batch it can take (check_image_size; `batch_size` the images a batch norm layer sees, all ranks'
    with --sync_bn, `micro_batch` a rank's, which timm's own batch norm layers see), the validation crop too when
    it differs, and the --pretrained weights, downloaded here when missing. Returns the meta model."""
    shapes = check_image_size(name, num_classes, image_size, batch_size)
    if micro_batch == 1 and batch_size > 1 and timm_models.unsynced_batch_norms(shapes):
        try:
            check_image_size(name, num_classes, image_size, 1)
        except UsageError:
            raise UsageError(f"--batch_size 1 at --image_size {image_size}: {name}'s batch norm layers of timm's own "
                             "classes (BatchNormAct2d), which --sync_bn does not reach, then see one value per "
                             "channel; use --batch_size 2 or more, or a larger --image_size") from None
    check_val_crop(name, num_classes, image_size, val_crop_size)
    if pretrained and is_timm(name):  # timm's loader, on the meta device (the weights' keys and shapes)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            timm_models.build(name, num_classes, image_size, None, *timm_weights(name, pretrained, mmap=True))
    elif pretrained:  # loaded as a rank loads them, for the modules' own checks (into a copy: they may change it)
        state = pretrained_state(shapes, name, pretrained, num_classes, mmap=True)
        with warnings.catch_warnings():  # torch's, on copying into meta parameters (one per parameter)
            warnings.simplefilter("ignore")
            _load_state(copy.deepcopy(shapes), state, pretrained)
    return shapes


def default_image_size(name):
    """The input size of the model's DEFAULT weights (224 for most)."""
    if is_timm(name):
        return timm_models.default_image_size(name)
    weights = torchvision.models.get_model_weights(architecture(name)).DEFAULT
    return weights.transforms.keywords.get("crop_size", 224)


def list_models(source=None, pattern=None):
    """One line per classifier: name, parameters, input size of its default weights, its weights; timm's
    (`source` timm) by `pattern`, a wildcard."""
    if source == "timm":
        return timm_models.list_models(pattern)
    lines = [f"{'model':<22} {'params':>9}  {'input':>5}  weights (--pretrained)"]
    for name in model_names():
        params = sum(p.numel() for p in shape_model(name).parameters())
        weights = torchvision.models.get_model_weights(name)
        lines.append(f"{name:<22} {params / 1e6:8.1f}M  {default_image_size(name):>4}px  "
                     + " ".join(["DEFAULT", *(w.name for w in weights)]))
    return "\n".join(lines)


def _weights(name, choice):
    """torchvision's weights enum member `choice` (or DEFAULT) of model `name`, or None when it names none."""
    weights = torchvision.models.get_model_weights(name)
    if choice == "DEFAULT":
        return weights.DEFAULT
    return weights.__members__.get(choice)


def preprocessing(name, pretrained):
    """How images become input for `name` started from `pretrained`: torchvision's weights bring their mean,
    std, resize and interpolation (data/folders.py, DEFAULT_PREPROCESSING, for anything else)."""
    from ..data.folders import DEFAULT_PREPROCESSING

    check_model_name(architecture(name))
    if is_timm(name):
        return timm_models.preprocessing(name, pretrained) or dict(DEFAULT_PREPROCESSING)
    weights = _weights(architecture(name), pretrained) if isinstance(pretrained, str) else None
    if weights is None:
        return dict(DEFAULT_PREPROCESSING)
    preset = weights.transforms()
    return {"mean": list(preset.mean), "std": list(preset.std),
            "resize_ratio": preset.resize_size[0] / preset.crop_size[0], "interpolation": preset.interpolation.value}


def weights_file(name, choice):
    """The local file of `choice`: the weights `choice` of model `name` in the torch hub cache (TORCH_HOME),
    downloaded there when missing, or a path as given. A weights name wins over a file of that name here, as
    it does for the preprocessing (./DEFAULT names the file)."""
    weights = _weights(name, choice)
    if weights is None:
        return given_file(choice, ", ".join(["DEFAULT", *(w.name for w in torchvision.models.get_model_weights(name))]),
                          name)
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    path = folder / Path(urlparse(weights.url).path).name
    if path.is_file():
        return path
    if path.is_symlink() and not path.exists():
        raise UsageError(f"--pretrained {choice}: {path} is a link to nothing (its target is missing or a link loop), "
                         "where the weights file should be; remove it (it is downloaded again) or give the file's path")
    if path.exists():  # a folder (or FIFO) by that name: a download would fail on it with a misleading reason
        kind = "a folder" if path.is_dir() else "not a regular file (a FIFO or a device)"
        raise UsageError(f"--pretrained {choice}: {path} is {kind}, where the weights file should be; remove it "
                         "(it is downloaded again) or give the file's path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(weights.url, str(path), hash_prefix=path.stem.rsplit("-", 1)[-1])
    except (urllib.error.URLError, OSError, RuntimeError) as err:
        reason = getattr(err, "reason", None) or err
        raise UsageError(f"--pretrained {choice}: {path.name} is not in {folder} and could not be downloaded "
                         f"from {weights.url} ({reason}); download it into that folder (TORCH_HOME sets where "
                         "it is), or give the file's path") from None
    return path


def given_file(choice, names, name):
    """--pretrained `choice`, not a weights name of model `name` (whose are `names`): a file."""
    if Path(choice).is_file():
        return Path(choice)
    if Path(choice).is_dir():
        raise UsageError(f"--pretrained {choice}: a folder; give a state_dict file (export_model.py writes one) "
                         "or a weights name")
    if Path(choice).exists():
        raise UsageError(f"--pretrained {choice}: not a regular file (a FIFO or a device); give a state_dict file")
    raise UsageError(f"--pretrained {choice}: no such file, and not a weights name of {name} ({names})")


def timm_weights(name, choice, mmap=False):
    """(state_dict, its head's class count for a file, the tag) of --pretrained `choice` for timm's model `name`:
    a tag or DEFAULT from the hub cache, or a file; checked as torchvision's are (checked_state). (None, None,
    None) without weights."""
    if not choice:
        return None, None, None
    tag = choice if timm_models.is_tag(name, choice) else None
    if tag is None:
        shown = timm_models.tags(name)
        path = given_file(choice, ", ".join(["DEFAULT", *shown[:8]]) + (", ..." if len(shown) > 8 else "")
                          if shown else "it has none", name)
    else:
        path = timm_models.hub_file(name, choice)
    state = checked_state(path, mmap)
    return state, None if tag else timm_models.head_classes(name, state), tag


def not_downloaded(name, choice):
    """The torch hub cache's file for weights name `choice` of model `name` where it is not there yet (a run
    downloads it into that path); None for a file, or weights already there."""
    if is_timm(name):
        return timm_models.not_downloaded(name, choice)
    weights = _weights(architecture(name), choice) if isinstance(choice, str) else None
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name if weights else None
    return path if path is not None and not path.exists() and not path.is_symlink() else None


AUXILIARY_HEADS = ("aux1.", "aux2.", "AuxLogits.")  # GoogLeNet's and Inception V3's, left out (see above)


def checked_state(path, mmap=False):
    """The tensors of weights file `path`, checked before anything is built from them: read without running its
    pickled code (utils/loading.py), tensors by name, dense, finite in fp32, no negative variance."""
    try:
        state = load_checked(path, mmap=mmap, deepspeed_classes=False)
    except UsageError as err:
        raise UsageError(f"--pretrained {err}") from None
    if not tensors_by_name(state):
        nested = [key for key, value in state.items() if isinstance(value, dict)] if isinstance(state, dict) else []
        raise UsageError(f"--pretrained {path} is not a state_dict (tensors by name)"
                         + ("; for a checkpoint of this trainer, export it first with export_model.py"
                            if "module" in nested else
                            f"; its tensors are under '{nested[0]}': save that dict alone (torch.save(state"
                            f"['{nested[0]}'], path))" if nested else ""))
    odd = unloadable_tensor(state)
    if odd is not None:  # the model's own tensors are dense and real: these would fail in a rank, or lose values
        raise UsageError(f"--pretrained {path}: {odd}")
    # as the model holds them (fp32): float64 values beyond fp32's range are infinite there
    broken = next((k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v.float()).all()), None)
    if broken is not None:  # else the run would stop on a NaN loss, blaming the learning rate
        raise UsageError(f"--pretrained {path}: {broken} holds NaN or infinite values (in fp32, as the model holds "
                         "them); these weights cannot train")
    # a variance below 0 is the square root of a negative number in every normalisation: NaN the same way
    negative = next((k for k, v in state.items() if k.endswith("running_var") and v.is_floating_point()
                     and (v < 0).any()), None)
    if negative is not None:
        raise UsageError(f"--pretrained {path}: {negative} holds negative variances; these weights cannot train")
    return state


def pretrained_state(model, name, choice, num_classes, mmap=False):
    """The state_dict of weights `choice` (a weights name or a file, see weights_file) to load into `model`, a
    `name` with `num_classes` outputs (on the meta device too: only shapes are compared). The classifier
    head is left out when the class count differs."""
    path = weights_file(name, choice)
    state = checked_state(path, mmap)
    own = model.state_dict()
    versions = getattr(state, "_metadata", None)  # the file's module versions (MNASNet's stem depends on them)
    if not (isinstance(versions, dict) and all(isinstance(v, dict) for v in versions.values())):
        versions = own._metadata
    if any(type(v.get("version", 0)) is not int for v in versions.values()):  # the modules' loaders compare them
        raise UsageError(f"--pretrained {path}: its module versions (_metadata) are not whole numbers; save the "
                         "state_dict of a built model")
    state = {k: v for k, v in state.items() if not k.startswith(AUXILIARY_HEADS)}
    if name.startswith("vit_") and "encoder.pos_embedding" in state and "encoder.pos_embedding" in own:
        from torchvision.models.vision_transformer import interpolate_embeddings

        if state["encoder.pos_embedding"].shape != own["encoder.pos_embedding"].shape:  # another --image_size
            state = interpolate_embeddings(model.image_size, model.patch_size, state)
    head = {k for k, v in state.items() if k in own and v.shape != own[k].shape and v.ndim == own[k].ndim
            and own[k].ndim and own[k].shape[0] == num_classes and v.shape[1:] == own[k].shape[1:]}
    kept = {k: v for k, v in state.items() if k not in head}
    unexpected = [k for k in kept if k not in own]
    # batch norm's loader fills in num_batches_tracked, which weights saved before torch 0.4.1 lack
    missing = [k for k in own if k not in kept and k not in head and not k.endswith(".num_batches_tracked")]
    mismatched = [k for k, v in kept.items() if k in own and v.shape != own[k].shape]
    if unexpected or missing or mismatched:
        what = "; ".join(f"{label} {', '.join(keys[:3])}" for label, keys in
                         (("missing", missing), ("unexpected", unexpected), ("other shapes", mismatched)) if keys)
        raise UsageError(f"--pretrained {path} is not a {name} state_dict ({what})")
    # load_state_dict casts: integer or boolean values into floating weights lose their fractions without a word
    cast = next((k for k, v in kept.items() if own[k].is_floating_point() and not v.is_floating_point()), None)
    if cast is not None:
        raise UsageError(f"--pretrained {path}: {cast} is a {kept[cast].dtype} tensor where {name} holds "
                         f"{own[cast].dtype} values; save the weights of a trained model")
    return with_versions(kept, versions)


def load_pretrained(model, name, choice, num_classes):
    """Load weights `choice` into `model` (see pretrained_state)."""
    _load_state(model, pretrained_state(model, name, choice, num_classes), choice)


def _load_state(model, state, choice):
    try:
        model.load_state_dict(state, strict=False)
    except ValueError as err:  # a module's own check of its saved version (MNASNet)
        raise UsageError(f"--pretrained {choice}: {err}") from None
    except RuntimeError as err:  # a saved version that rebuilds a module in other shapes (MNASNet's version 1)
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise UsageError(f"--pretrained {choice}: its module versions (_metadata) do not fit the model "
                         f"({lines[1] if len(lines) > 1 else lines[0] if lines else type(err).__name__})") from None
