"""Activation checkpointing of torchvision's models (--grad_checkpointing): each family's repeated block
(names.BLOCKS) keeps only its input in the forward pass and is run again in the backward pass, through
torch.utils.checkpoint, as timm's set_grad_checkpointing does for timm's models."""
import contextlib
import functools

import torch
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint

from .names import BLOCKS

_CLASSES = {}  # a block class -> its checkpointed subclass


class _Checkpointed:
    """A block recomputed in the backward pass while it trains. Both runs go through the module's __call__, so
    ZeRO-3's hooks gather its weights for the recomputation (timm's checkpoint_seq calls its blocks so too)."""

    def __call__(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return super().__call__(*args, **kwargs)
        if torch.compiler.is_compiling():  # --compile: the recomputation is the graph's, whose buffer updates
            # are applied once (and torch.compile takes no context_fn but dispatch modes)
            return checkpoint(super().__call__, *args, use_reentrant=False, **kwargs)
        return checkpoint(super().__call__, *args, use_reentrant=False,
                          context_fn=functools.partial(_contexts, self), **kwargs)


def _contexts(block):
    """torch.utils.checkpoint's (forward, recomputation) contexts."""
    return contextlib.nullcontext(), _running_statistics_kept(block)


@contextlib.contextmanager
def _running_statistics_kept(block):
    """The recomputation runs the block's batch norms in training mode a second time: their running statistics
    are put back after it, so that a step updates them once, as it does without checkpointing."""
    buffers = [buffer for module in block.modules() if isinstance(module, _NormBase)
               for buffer in (module.running_mean, module.running_var, module.num_batches_tracked)
               if buffer is not None]
    kept = [buffer.clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, kept):
                buffer.copy_(value)


def checkpoint_blocks(model):
    """Recompute every block of `model` (the outermost of nested ones) in the backward pass; returns how many.
    Each block's class is swapped for a subclass of the same name: DeepSpeed's leaf_module setting finds
    ZeRO-3's leaf blocks by their qualified class names, and state_dict keys stay as they are."""
    count = 0

    def visit(module):
        nonlocal count
        cls = type(module)
        if not isinstance(module, _Checkpointed) and f"{cls.__module__}.{cls.__qualname__}" in BLOCKS:
            if cls not in _CLASSES:
                _CLASSES[cls] = type(cls.__name__, (_Checkpointed, cls),
                                     {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
            module.__class__ = _CLASSES[cls]
        if isinstance(module, _Checkpointed):
            count += 1
            return
        for child in module.children():
            visit(child)

    visit(model)
    return count
