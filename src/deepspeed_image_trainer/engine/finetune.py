"""Fine-tuning controls: a learning rate for the pretrained body scaled against the new head's
(--backbone_lr_scale), and the head alone for the first epochs (--freeze_backbone_epochs).

Both work through the optimizer's parameter groups, head first (its learning rate is the one the history
logs), body second with a scale applied after every scheduler step: DeepSpeed's schedulers set every
group to the same value, and ZeRO 1-3 and offload keep groups as they are. A frozen body has scale 0: its
gradients are still computed (ZeRO's buffers are built for every parameter at setup, so requires_grad
cannot change afterwards), but AdamW moves no weight whose learning rate is 0, weight decay included.
"""
from torch import nn


def head_module(model, num_classes):
    """The layer that produces the logits: the last Linear or Conv2d (SqueezeNet) with num_classes outputs."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == num_classes
              or isinstance(m, nn.Conv2d) and m.out_channels == num_classes]
    return layers[-1]


def fine_tuning(args):
    """Whether the run keeps head and body in parameter groups of their own (only when the flags ask for it:
    the optimizer's state is cut by group, so a resumed run must do as the run it continues did)."""
    return args.backbone_lr_scale != 1 or args.freeze_backbone_epochs > 0


def whole_run_frozen(args):
    """A line when the body stays frozen for the whole run (a linear probe: allowed, but likely a slip), or None."""
    if args.freeze_backbone_epochs >= args.epochs:
        return (f"--freeze_backbone_epochs {args.freeze_backbone_epochs} covers the whole run (--epochs "
                f"{args.epochs}): only the classifier head trains")
    return None


def parameter_groups(model, num_classes):
    """[head group, body group] for the optimizer."""
    head = {id(p) for p in head_module(model, num_classes).parameters()}
    return [{"params": [p for p in model.parameters() if id(p) in head], "lr_scale": 1.0},
            {"params": [p for p in model.parameters() if id(p) not in head], "lr_scale": 1.0}]


class BodyLearningRate:
    """Scales the body group's learning rate after each step of `engine`'s scheduler, which it wraps in
    engine.lr_scheduler (None: a fixed rate); set_epoch chooses the scale."""

    def __init__(self, engine, backbone_lr_scale, freeze_backbone_epochs):
        self.optimizer, self.scale, self.frozen_epochs = engine.optimizer, backbone_lr_scale, freeze_backbone_epochs
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
        for group in self.optimizer.param_groups:
            group["lr"] = group["unscaled_lr"] * group["lr_scale"]

    def set_epoch(self, epoch):
        """The body's scale for `epoch` (counted from 1): 0 while frozen, then --backbone_lr_scale."""
        self.optimizer.param_groups[1]["lr_scale"] = 0.0 if epoch <= self.frozen_epochs else self.scale
        self._apply()

    def body_scale(self):
        """The body's scale this epoch: its learning rate over the head's."""
        return self.optimizer.param_groups[1]["lr_scale"]


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
