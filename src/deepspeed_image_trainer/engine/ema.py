"""An exponential moving average of the weights (--model_ema), kept where the optimizer keeps its fp32 master
weights: each rank averages its own partition of them (ZeRO 1-3, DeepSpeed's bf16 optimizer), on the device or,
with the optimizer offloaded, in host memory; at ZeRO-0 without one every rank holds the whole model, as the
optimizer does. The floating buffers (batch norm's statistics) are averaged too, from their mean over the ranks.

torchvision's semantics (references/classification/train.py): after every --model_ema_steps-th optimizer step of
an epoch (its first included), averaged = decay x averaged + (1 - decay) x weights, with 1 - decay adjusted for the
global batch and the steps between updates (1 - decay) x batch x steps / epochs; during the warmup the average is a
copy of the weights.

Validation swaps the average into the master partitions and lets the optimizer copy them to the model's weights
(gathering them, as after a step), then swaps back. Each rank writes its part to the checkpoint's tag folder as
ema_rank<r>.safetensors, each tensor named by its parameter and where in it the part starts: read back on any
number of ranks, and consolidated by export_model.py --ema.
"""
import contextlib
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from ..utils.failures import UsageError
from .distributed import rank as this_rank, world_size

EMA_FILE = "ema_rank{}.safetensors"
BUFFER = "buffer:"  # the averaged buffers' tensor names in the file: BUFFER + the buffer's name


def _fragment_key(name, start):
    return f"{name}@{start}"


def master_fragments(engine):
    """This rank's fp32 master weights as [(parameter name, first element, 1-D view)], each view the part of the
    tensor the optimizer steps that holds those elements of the (flattened) parameter; and whether every rank holds
    all of them (no partition: one rank's file is the whole average)."""
    optimizer, module = engine.optimizer, engine.module
    named = list(module.named_parameters())
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3: each parameter split over the ranks
        rank = dist.get_rank(group=optimizer.dp_process_group)  # ZeRO-3 runs in a process group
        fragments = []
        for name, param in named:
            position = optimizer.grad_position.get(optimizer.get_param_id(param)) if hasattr(param, "ds_id") else None
            if position is None:
                continue
            group, offset, _ = position
            start = rank * param.partition_numel()
            count = min(param.partition_numel(), param.ds_numel - start)  # the last rank's part ends in padding
            if count > 0:
                fragments.append((name, start, optimizer.fp32_partitioned_groups_flat[group].narrow(0, offset, count)))
        return fragments, False
    if hasattr(optimizer, "single_partition_of_fp32_groups") or hasattr(optimizer, "fp32_groups_flat_partition"):
        # ZeRO 1-2 and DeepSpeed's bf16 optimizer: DeepSpeed's own map of each parameter to the rank's partition
        return [(name, param._hp_mapping.lp_fragment_address.start, param._hp_mapping.hp_fragment)
                for name, param in named if getattr(param, "_hp_mapping", None) is not None], False
    ids = {id(param): name for name, param in named}
    if hasattr(optimizer, "fp32_groups_flat"):  # fp16 at ZeRO-0: one fp32 copy of each group, flat
        fragments = []
        for flat, params in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups):
            offset = 0
            for param in params:
                fragments.append((ids[id(param)], 0, flat.narrow(0, offset, param.numel())))
                offset += param.numel()
        return fragments, True
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):  # fp16 at ZeRO-0, LAMB's
        return [(ids[id(param)], 0, master.view(-1)) for masters, params in
                zip(optimizer.fp32_groups, optimizer.fp16_groups) for master, param in zip(masters, params)], True
    # ZeRO-0 in fp32 or under autocast: the optimizer steps the model's own weights
    stepped = {id(param) for group in optimizer.param_groups for param in group["params"]}
    return [(name, 0, param.data.view(-1)) for name, param in named if id(param) in stepped], True


def copy_masters_to_model(engine):
    """After the masters changed: the model's weights (half-precision copies, other ranks' parts) from them, as the
    optimizer's step leaves them."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        # Weights a forward pass gathered whole stay so after validation's passes (no backward releases them),
        # and the small ones ZeRO-3 keeps whole for good: all released, the next pass gathers the new values.
        optimizer.empty_partition_cache()
        for group in range(len(optimizer.fp32_partitioned_groups_flat)):
            optimizer._reassign_or_swap_out_partitioned_parameters(group)
    elif hasattr(optimizer, "update_lp_params"):  # ZeRO 1-2, bf16: the rank's part, then gathered
        optimizer.update_lp_params()
    elif hasattr(optimizer, "fp32_groups_flat"):
        for half, full in zip(optimizer.fp16_groups_flat, optimizer.fp32_groups_flat):
            half.data.copy_(full.data)
    elif hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
        for masters, params in zip(optimizer.fp32_groups, optimizer.fp16_groups):
            for master, param in zip(masters, params):
                param.data.copy_(master.data)


def ema_alpha(decay, global_batch, every, epochs):
    """torchvision's weight of the new weights in each update: (1 - decay) adjusted for the batch and the steps
    between updates, at most 1."""
    return min(1.0, (1.0 - decay) * global_batch * every / epochs)


class WeightEMA:
    def __init__(self, engine, *, decay, every, global_batch, epochs, warmup_steps, steps_per_epoch):
        self.engine = engine
        self.every, self.warmup_steps, self.steps_per_epoch = every, warmup_steps, steps_per_epoch
        self.alpha = ema_alpha(decay, global_batch, every, epochs)
        fragments, self.replicated = master_fragments(engine)
        self.names = [(name, start) for name, start, _ in fragments]
        self.masters = [view for _, _, view in fragments]
        self.averages = [view.detach().clone() for view in self.masters]
        self.buffer_names = [name for name, b in engine.module.named_buffers() if b.is_floating_point()]
        self.buffers = [b.detach().float().clone() for b in self._model_buffers()]
        # every weight's and buffer's shape, as the files record them (a ZeRO-3 weight's own, not its placeholder's)
        self.shapes = {name: list(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                       for name, p in engine.module.named_parameters()}
        self.shapes.update({BUFFER + name: list(b.shape) for name, b in zip(self.buffer_names, self.buffers)})
        self.n_averaged = 0  # 0: the next update copies (torchvision's AveragedModel)

    def after_step(self, epoch, step):
        """After optimizer step `step` (0-based) of `epoch` (1-based): update every `every` steps of the epoch."""
        if step % self.every:
            return
        with torch.no_grad():
            # pairs of lists, none empty: torch's foreach ops refuse empty ones (a ViT has no floating buffer)
            pairs = [(a, b) for a, b in ((self.averages, self.masters), (self.buffers, self._rank_mean_buffers())) if a]
            for averages, current in pairs:
                if self.n_averaged == 0:
                    torch._foreach_copy_(averages, current)
                else:
                    torch._foreach_lerp_(averages, current, self.alpha)
        self.n_averaged += 1
        if (epoch - 1) * self.steps_per_epoch + step + 1 <= self.warmup_steps:
            self.n_averaged = 0  # torchvision: a copy of the weights until the warmup ends

    def _rank_mean_buffers(self):
        current = [b.detach().float() for b in self._model_buffers()]
        world = world_size()
        if world == 1 or not current:
            return current
        flat = torch.cat([b.reshape(-1) for b in current])
        dist.all_reduce(flat)
        flat /= world
        return [part.view_as(b) for part, b in zip(torch.split(flat, [b.numel() for b in current]), current)]

    def _model_buffers(self):
        return [b for _, b in self.engine.module.named_buffers() if b.is_floating_point()]

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holds the averaged weights and buffers inside the block, its own again after it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self):
        for average, master in zip(self.averages, self.masters):  # one tensor's room at a time
            held = master.clone()
            master.copy_(average)
            average.copy_(held)
        for average, buffer in zip(self.buffers, self._model_buffers()):
            held = buffer.float().clone()
            buffer.copy_(average)
            average.copy_(held)
        copy_masters_to_model(self.engine)

    def files(self):
        """How many ranks' files a checkpoint holds: one when every rank holds the whole average."""
        return 1 if self.replicated else world_size()

    def state(self, saved_at):
        """(tensors, metadata) of this rank's file, copied to host memory now; None for a rank that writes none.
        `saved_at`: the checkpoint's (its extra_info.json's), which its files must name to be read with it."""
        rank = this_rank()
        if self.replicated and rank:
            return None
        tensors = {_fragment_key(name, start): average.detach().to("cpu", copy=True).contiguous()
                   for (name, start), average in zip(self.names, self.averages)}
        if rank == 0:
            tensors.update({BUFFER + name: b.detach().to("cpu", copy=True).contiguous()
                            for name, b in zip(self.buffer_names, self.buffers)})
        return tensors, {"n_averaged": self.n_averaged, "files": self.files(), "rank": rank, "saved_at": saved_at,
                         "shapes": self.shapes}

    def load(self, tag_dir, info=None):
        """This rank's part of the average from the files of the checkpoint whose extra_info.json is `info`,
        written by any number of ranks."""
        saved = read_files(tag_dir, info)
        needed = [name for name, _ in self.names] + [BUFFER + name for name in self.buffer_names]
        differ = [name for name in needed if saved.metadata["shapes"].get(name) != self.shapes[name]]
        if differ:
            raise UsageError(f"{tag_dir}: the weights' average does not fit this model ({differ[0]}: "
                             f"{saved.metadata['shapes'].get(differ[0])} there, {self.shapes[differ[0]]} here)")
        self.n_averaged = saved.metadata["n_averaged"]
        with torch.no_grad():
            for (name, start), average in zip(self.names, self.averages):
                saved.fill(average, name, start)
            for name, average in zip(self.buffer_names, self.buffers):
                average.copy_(saved.tensor(BUFFER + name))


class SavedEMA:
    """A checkpoint's ema_rank<r>.safetensors files: the parts of each parameter, read by slices. Checked whole
    when opened: every tensor fp32, a part of a weight the metadata names, the parts of each weight covering it
    exactly once, each buffer in its shape (a ValueError saying what is not)."""

    def __init__(self, tag_dir, handles, metadata):
        self.tag_dir, self.handles, self.metadata = tag_dir, handles, metadata
        shapes = metadata["shapes"]
        self.parts = {}  # parameter name -> [(start, numel, handle, key)], by start
        buffers = set()
        for handle in handles:
            for key in handle.keys():
                part = handle.get_slice(key)
                shape, numel = part.get_shape(), None
                if part.get_dtype() != "F32":
                    raise ValueError(f"{key} is {part.get_dtype()}, not fp32")
                if key.startswith(BUFFER):
                    if shapes.get(key) != list(shape) or key in buffers:
                        raise ValueError(f"{key} is {list(shape)}, its metadata says {shapes.get(key)}")
                    buffers.add(key)
                    continue
                name, _, start = key.rpartition("@")
                if name not in shapes or name.startswith(BUFFER) or not start.isdigit() or len(shape) != 1:
                    raise ValueError(f"{key} is not the part of a weight its metadata names")
                self.parts.setdefault(name, []).append((int(start), shape[0], handle, key))
        if buffers != {key for key in shapes if key.startswith(BUFFER)}:
            raise ValueError("buffers are missing")
        for name, parts in self.parts.items():
            parts.sort(key=lambda part: part[0])
            end = 0
            for start, numel, _, key in parts:
                if start != end:  # a gap or an overlap
                    raise ValueError(f"the parts of {name} do not cover it once ({key})")
                end += numel
            if end != math.prod(shapes[name]):
                raise ValueError(f"the parts of {name} hold {end} of its {math.prod(shapes[name])} elements")

    def fill(self, target, name, start):
        """Copy elements start .. start + target.numel() of parameter `name` into the 1-D `target`."""
        end, covered = start + target.numel(), 0
        for part_start, numel, handle, key in self.parts.get(name, ()):
            low, high = max(start, part_start), min(end, part_start + numel)
            if low < high:
                target[low - start:high - start].copy_(handle.get_slice(key)[low - part_start:high - part_start])
                covered += high - low
        if covered != target.numel():
            raise UsageError(f"{self.tag_dir}: the weights' average holds {covered} of the {target.numel()} "
                             f"elements of {name} this rank needs (its files do not fit this model)")

    def tensor(self, key, shape=None):
        """A buffer, whose shape (the model's `shape`, when given) the files checked against their metadata."""
        if shape is not None and self.metadata["shapes"].get(key) != list(shape):
            raise UsageError(f"{self.tag_dir}: the weights' average gives {key.removeprefix(BUFFER)} the shape "
                             f"{self.metadata['shapes'].get(key)}, and the model {list(shape)}")
        for handle in self.handles:
            if key in handle.keys():
                return handle.get_tensor(key)
        raise UsageError(f"{self.tag_dir}: the weights' average has no {key.removeprefix(BUFFER)} (its files do not "
                         "fit this model)")

    def whole(self, name, shape):
        """Parameter `name`, whole, in `shape` (the model's), which the files must give it too."""
        if list(shape) != self.metadata["shapes"].get(name):
            raise UsageError(f"{self.tag_dir}: the weights' average gives {name} the shape "
                             f"{self.metadata['shapes'].get(name)}, and the model {list(shape)}")
        full = torch.empty(int(torch.Size(shape).numel()), dtype=torch.float32)
        self.fill(full, name, 0)
        return full.view(shape)


def saved_with_ema(info):
    """Whether the checkpoint whose extra_info.json is `info` holds the weights' average: it counts the files, and
    its settings say the run kept one (also when the count was edited away)."""
    return bool(info.get("model_ema_files") or (info.get("settings") or {}).get("model_ema"))


def _whole(value, low):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**62


def read_files(tag_dir, info=None):
    """The averaged weights in a checkpoint's tag folder (SavedEMA), checked; UsageError naming what is wrong with
    them. `info`: the checkpoint's extra_info.json, whose count of files and time of saving each file must name
    (a file of another checkpoint or rank is refused). safetensors holds tensors and text only: nothing in them is
    unpickled."""
    from safetensors import SafetensorError, safe_open

    tag_dir = Path(tag_dir)

    def opened(rank):
        path = tag_dir / EMA_FILE.format(rank)
        if not path.is_file():  # a FIFO's open waits for a writer for good
            raise ValueError(f"{path.name} is missing or not a regular file")
        handle = safe_open(str(path), framework="pt")
        metadata = {key: json.loads(value) for key, value in (handle.metadata() or {}).items()}
        shapes = metadata.get("shapes")
        shapes_ok = isinstance(shapes, dict) and all(isinstance(shape, list) and len(shape) <= 8
                                                     and all(_whole(n, 0) for n in shape) for shape in shapes.values())
        if not (_whole(metadata.get("files"), 1) and _whole(metadata.get("n_averaged"), 0) and shapes_ok):
            raise ValueError(f"{path.name}'s metadata is not the trainer's")
        if metadata.get("rank") != rank:
            raise ValueError(f"{path.name} is rank {metadata.get('rank')}'s file")
        if info is not None and metadata.get("saved_at") != info.get("saved_at"):
            raise ValueError(f"{path.name} belongs to another checkpoint (saved at {metadata.get('saved_at')}, this "
                             f"one at {info.get('saved_at')})")
        return handle, metadata

    try:
        first, metadata = opened(0)
        files = (info or {}).get("model_ema_files") or metadata["files"]
        if metadata["files"] != files:
            raise ValueError(f"{EMA_FILE.format(0)} names {metadata['files']} file(s), the checkpoint {files}")
        handles = [first]
        for rank in range(1, files):
            handle, other = opened(rank)
            if {**other, "rank": 0} != metadata:
                raise ValueError(f"{EMA_FILE.format(rank)} is not of the same average as {EMA_FILE.format(0)}")
            handles.append(handle)
        return SavedEMA(tag_dir, handles, metadata)
    except (OSError, ValueError, SafetensorError, RecursionError) as err:
        raise UsageError(f"{tag_dir}: the weights' average (--model_ema) cannot be read "
                         f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
