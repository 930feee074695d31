"""The optimizer's parameter groups: a learning rate for the pretrained body scaled against the new head's
(--backbone_lr_scale), the head alone for the first epochs (--freeze_backbone_epochs), timm's layer-wise
learning-rate decay (--layer_decay) and torchvision's weight decay by kind of parameter (--norm_weight_decay,
--bias_weight_decay, --transformer_embedding_decay).

All work through the optimizer's parameter groups, head first (its learning rate is the one the history
logs), each with a scale applied after every scheduler step: DeepSpeed's schedulers set every group to the
same value, and ZeRO 1-3 and offload keep groups as they are. A frozen body has scale 0: its
gradients are still computed (ZeRO's buffers are built for every parameter at setup, so requires_grad
cannot change afterwards), but AdamW moves no weight whose learning rate is 0, weight decay included.
"""
from torch import nn

from ..models.timm_models import layer_ids as timm_layer_ids
from ..utils.failures import UsageError


def head_module(model, num_classes):
    """The layer that produces the logits: the last Linear or Conv2d (SqueezeNet) with num_classes outputs."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == num_classes
              or isinstance(m, nn.Conv2d) and m.out_channels == num_classes]
    return layers[-1]


def fine_tuning(args):
    """Whether the run keeps head and body in parameter groups of their own (only when the flags ask for it:
    the optimizer's state is cut by group, so a resumed run must do as the run it continues did)."""
    return args.backbone_lr_scale != 1 or args.freeze_backbone_epochs > 0


# The flags that cut the parameters into groups of their own weight decay (torchvision's set_weight_decay)
DECAY_FLAGS = ("norm_weight_decay", "bias_weight_decay", "transformer_embedding_decay")
# The parameters --transformer_embedding_decay takes, by name: torchvision's keys, and ViT's own name for its
# position embedding (pos_embedding), which torchvision's "position_embedding" does not match
EMBEDDING_NAMES = ("class_token", "position_embedding", "pos_embedding", "relative_position_bias_table")
# Normalisation layers whose parameters --norm_weight_decay takes (torchvision's norm_classes; LayerNorm2d and the
# trainer's fp32 layers are subclasses)
NORM_CLASSES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
                nn.LocalResponseNorm)


def grouping(args):
    """What the run's parameter groups are cut by: None (one group, as without any of these flags), else the
    flags' values, which a resumed run must share (its optimizer's state is cut the same way)."""
    decays = {name: getattr(args, name, None) for name in DECAY_FLAGS}
    layer_decay = getattr(args, "layer_decay", None)
    if not fine_tuning(args) and layer_decay is None and all(value is None for value in decays.values()):
        return None
    return {"head_and_body": fine_tuning(args), **decays, "layer_decay": layer_decay}


def groups_setting(args):
    """The groups as a run's record keeps them: fine_tuning(args), a bool, as runs recorded it before the layer
    and weight-decay groups (their checkpoints then resume as before), unless those cut them: grouping(args)."""
    cut = grouping(args)
    if cut is None or (cut["layer_decay"] is None and all(cut[name] is None for name in DECAY_FLAGS)):
        return fine_tuning(args)
    return cut


def whole_run_frozen(args):
    """A line when the body stays frozen for the whole run (a linear probe: allowed, but likely a slip), or None."""
    if args.freeze_backbone_epochs >= args.epochs:
        return (f"--freeze_backbone_epochs {args.freeze_backbone_epochs} covers the whole run (--epochs "
                f"{args.epochs}): only the classifier head trains")
    return None


def layer_ids(model, block_classes):
    """{parameter name: layer} for timm's layer-wise decay: the repeated blocks (modules of `block_classes`, the
    outermost) numbered 1..L in the model's order, what comes before the first block (stem, embeddings) 0, what
    lies between two blocks (a downsampling layer) the next block's number, what follows the last (the final
    norm, the head) L + 1. None when the model has no such block."""
    blocks = {}
    for name, module in model.named_modules():
        if isinstance(module, block_classes) and not any(name.startswith(f"{outer}.") for outer in blocks):
            blocks[name] = len(blocks) + 1
    if not blocks:
        return None
    names = [name for name, _ in model.named_parameters()]
    owner = [next((number for block, number in blocks.items() if name.startswith(f"{block}.")), None)
             for name in names]
    ids, following = {}, len(blocks) + 1
    for name, number in reversed(list(zip(names, owner))):  # from the end: the next block's number is known
        following = number if number is not None else following
        ids[name] = number if number is not None else following
    first = next(i for i, number in enumerate(owner) if number is not None)
    return {**ids, **{name: 0 for name in names[:first]}}


def repeated_blocks():
    """The classes of torchvision's repeated blocks (ZeRO-3's leaf modules): the layers of --layer_decay."""
    import importlib

    from ..models.names import BLOCKS

    return tuple(getattr(importlib.import_module(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1])
                 for path in BLOCKS)


def parameter_groups(model, num_classes, args=None):
    """The optimizer's parameter groups, head first (its learning rate is the one the history logs): without
    `args`, [head, body]; with them, cut by head or body (when fine-tuning), by layer (--layer_decay over the
    model's repeated_blocks) and by weight decay (--norm_weight_decay, --bias_weight_decay,
    --transformer_embedding_decay, as torchvision's set_weight_decay: a bias by its name before a norm layer's).
    Each group: params, weight_decay where a flag sets it, and layer_scale, the layer decay's factor on its
    learning rate, and body, whether --backbone_lr_scale applies (both read by GroupLearningRates)."""
    head = {id(p) for p in head_module(model, num_classes).parameters()}
    cut = grouping(args) if args is not None else {"head_and_body": True, "layer_decay": None}
    layers = None
    if cut.get("layer_decay") is not None:
        layers = (timm_layer_ids(model) if type(model).__module__.startswith("timm.")
                  else layer_ids(model, repeated_blocks()))
        if layers is None:
            raise UsageError(f"--layer_decay: {type(model).__name__} has no repeated blocks to count layers by "
                             "(AlexNet, VGG): leave it out")
    groups, seen = {}, set()
    for module_name, module in model.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:  # shared by two modules: one group
                continue
            seen.add(id(parameter))
            decay = None
            if cut.get("bias_weight_decay") is not None and name == "bias":
                decay = cut["bias_weight_decay"]
            elif cut.get("transformer_embedding_decay") is not None and name in EMBEDDING_NAMES:
                decay = cut["transformer_embedding_decay"]
            elif cut.get("norm_weight_decay") is not None and isinstance(module, NORM_CLASSES):
                decay = cut["norm_weight_decay"]
            is_head = id(parameter) in head and cut["head_and_body"]
            layer = layers[f"{module_name}.{name}" if module_name else name] if layers else None
            groups.setdefault((not is_head, layer, decay), []).append(parameter)
    top = max((layer for _, layer, _ in groups if layer is not None), default=0)
    ordered = sorted(groups, key=lambda key: (key[0], -1 if key[1] is None else top - key[1],
                                              -1 if key[2] is None else key[2]))
    return [{"params": groups[key], **({"weight_decay": key[2]} if key[2] is not None else {}),
             "layer_scale": 1.0 if key[1] is None else cut["layer_decay"] ** (top - key[1]),
             "body": key[0] and cut["head_and_body"]} for key in ordered]


class GroupLearningRates:
    """Sets each parameter group's learning rate after each step of `engine`'s scheduler, which it wraps in
    engine.lr_scheduler (None: a fixed rate): the scheduler's rate x the group's layer scale x, for the body,
    the body's scale (0 while frozen, then --backbone_lr_scale), which set_epoch chooses. The scales are the
    groups' as built, in their order: a resumed optimizer's groups are the saved ones, and carry what the run
    that saved them set (older runs' groups have neither key)."""

    def __init__(self, engine, groups, backbone_lr_scale, freeze_backbone_epochs):
        self.optimizer, self.scale, self.frozen_epochs = engine.optimizer, backbone_lr_scale, freeze_backbone_epochs
        self.layer_scales = [group.get("layer_scale", 1.0) for group in groups]
        self.body = [group.get("body", index > 0) for index, group in enumerate(groups)]
        self.body_lr_scale = 1.0
        for group in self.optimizer.param_groups:
            group.setdefault("unscaled_lr", group["lr"])
        if engine.lr_scheduler is not None:
            engine.lr_scheduler = ScaledSteps(engine.lr_scheduler, self)

    def before_step(self):
        # torch's chainable schedulers (StepLR) go on from the rate they find: the body's scaled one compounded
        # the scale at every step (a frozen body stayed at 0 for good).
        for group in self.optimizer.param_groups:
            group["lr"] = group["unscaled_lr"]

    def after_step(self):
        for group in self.optimizer.param_groups:
            group["unscaled_lr"] = group["lr"]
        self._apply()

    def _apply(self):
        for group, layer_scale, body in zip(self.optimizer.param_groups, self.layer_scales, self.body):
            group["lr"] = group["unscaled_lr"] * layer_scale * (self.body_lr_scale if body else 1.0)

    def set_epoch(self, epoch):
        """The body's scale for `epoch` (counted from 1): 0 while frozen, then --backbone_lr_scale."""
        self.body_lr_scale = 0.0 if epoch <= self.frozen_epochs else self.scale
        self._apply()

    def body_scale(self):
        """The body's scale this epoch: its learning rate over the head's (before any layer decay)."""
        return self.body_lr_scale


class ScaledSteps:
    """A scheduler whose steps the body's scale follows; state_dict and load_state_dict are the scheduler's own.
    A wrapper rather than a `step` replaced on the scheduler: torch's schedulers save their whole __dict__, where
    a function cannot be pickled (nor loaded by the weights-only checks of a resume)."""

    def __init__(self, scheduler, body_lr):
        self.scheduler, self.body_lr = scheduler, body_lr

    def step(self, *args, **kwargs):
        self.body_lr.before_step()
        result = self.scheduler.step(*args, **kwargs)
        self.body_lr.after_step()
        return result

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        return self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name):  # get_last_lr, get_lr and the rest, as the scheduler has them
        return getattr(self.scheduler, name)
