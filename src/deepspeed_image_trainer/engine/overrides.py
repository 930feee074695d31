"""The one place where the trainer replaces DeepSpeed code: host synchronisations per parameter in the
ZeRO-1/2 optimizer-offload path, which stall the GPU once for every parameter of every step (or micro-batch),
and host work per module in ZeRO-3 (below).

- `update_offload_overflow_tracker` runs in the backward hook of each parameter and tests its gradient with
  `if self._has_inf_or_nan(grad)`: a device-to-host copy per parameter, even where nothing reads the result
  (the overflow check is off: fp32 weights under `torch_autocast`). Here the flag stays on the device and is
  read once a step, in `has_overflow`, and is not computed at all without the overflow check.
- `complete_grad_norm_calculation_for_cpu_offload` sums the per-parameter norms with `.item()` on each;
  here they are summed on the device (in float64, as the Python float sum was) and read once.
- `async_accumulate_grad_in_cpu_via_gpu` (gradient accumulation) first waits on the host for the previous
  parameter's copies to the CPU: DeepSpeed's guard for pageable CPU buffers, which a copy to the GPU may read
  before the GPU has written them. The trainer pins them (`pin_memory: true`), and copies from pinned memory
  run in stream order, so where the buffer it reads is pinned (or not made yet) and every pending copy is on
  the current stream it does not wait. The host reads those buffers only in step(), whose wait still sees them.

And three in ZeRO-3's per-module work, which sets the pace of its step (benchmarks/zero3_settings.py: the host,
not the GPU, holds it back), each a few percent of that host time and together about a fifth of timm's ViT-G/14
step on two H100s:

- `iter_params` (the parameters ZeRO-3 gathers and releases for a module) walks the module's tree through
  `named_parameters` each time, several times per module and step; here each module's list is made once
  (DeepSpeed's own `__params_to_release` caches on the same assumption: a module's parameters stay its own).
- `print_rank_0` of the ZeRO-3 modules asks the process group for the rank before it looks whether there is
  anything to print (there is not, without debug or force): here it looks first.
- Each ZeRO-3 function DeepSpeed marks with `instrument_w_nvtx` pushes and pops an NVTX range, a call into
  CUDA's tools library each, used only under a profiler such as Nsight Systems: off here (keep this group
  out, through TRAINER_DEEPSPEED_OVERRIDES below, to see them in a profile).

After every optimizer step ZeRO-3 gathers its persistent parameters (those under
`stage3_param_persistence_threshold`, kept whole on every rank: biases and norms) again, with one collective
per parameter (`_allgather_params_coalesced` launches them all, then waits): several hundred for timm's ViT-G/14,
each a launch on the host. Here they go as one collective over their partitions laid end to end, and one copy
puts each parameter's pieces together, as FSDP2 gathers a block's parameters.

And one under every stage on a GPU: DeepSpeed asks the CUDA accelerator for the current stream several times per
parameter and step (around each gradient's copy and reduction), and torch.cuda.current_stream() without a device
finds the current device through torch.cuda.is_available() and the environment each time (~5,000 calls a step
of ViT-G/14 at ZeRO-3); here the accelerator passes the current device's index, which torch returns as it is.

And one in ZeRO-3 with optimizer offload and half-precision weights: after each optimizer step DeepSpeed copies
the updated fp32 weights, which it keeps in pageable host memory, into the GPU's bf16/fp16 ones with one copy_,
which converts them into a pageable buffer the driver then copies through its own small pinned ones; here they
pass through a pinned buffer of 128 MB, a piece at a time, each converted on the host as before (the 7 B ViT's
step on one H200: docs/training.md#fine-tuning-a-7-b-vit).

Results are the same as DeepSpeed's (tests/test_deepspeed_overrides.py trains with and without them; on the
CPU, which records no copy events, the accumulation wait has nothing to skip: a unit test checks its logic).
The replacements are installed only over the exact DeepSpeed source they were written against (a hash of
each replaced function); another DeepSpeed keeps its own code, and the guard test fails so the change is
read. TRAINER_DEEPSPEED_OVERRIDES=0 keeps DeepSpeed's code (benchmarks measure both ways); a comma-separated
list of GROUPS' names installs those only.
"""
import hashlib
import importlib
import inspect
import itertools
import os
import weakref

import torch

from ..utils.failures import UsageError

# sha256 of inspect.getsource of each replaced method, DeepSpeed 0.19.8
CHECKED_SOURCES = {
    "update_offload_overflow_tracker": "0cb67c0a3f669a354cd71a18f8a4c04e5ecc48394e9000b6cb9196bf7c6b4834",
    "has_overflow": "cadc27a13cb7e9775093993e15b41aaebb2ff98d48bd86a271b8558914d05d2d",
    "complete_grad_norm_calculation_for_cpu_offload":
        "7051c8064246f3254081bb35ed8620c440234fc782139a56f774ed7ef676e211",
    "async_accumulate_grad_in_cpu_via_gpu": "8d3c25962356b40e71db7a1ffe4ccc99b6d9a6700a1a8787a5dfa8cdaca22e27",
    # not replaced: what the replacement above relies on
    "_wait_for_offload_copies": "e509dd0ad7458a37cb44ca56850b9f99a22d2dde0e74ca13e68fea177675567c",
    "_record_offload_copy": "8467947f2bbabdfdefff9db72363306cc800cc36e65ad4fb553e5ba2956e24db",
}
# The same for functions by module (under deepspeed.) and name, a class's by module.Class.name
MODULE_SOURCES = {
    "runtime.zero.partition_parameters.print_rank_0":
        "bdf0d39499da2560d1e54e09360c3ebd27ab5594a5eee6e45c62c664fd355b23",
    "runtime.zero.stage3.print_rank_0": "1fb35018bdb409f1f00f4c097b26bf29445894a2cf6ea6dfa474378cdeb098f1",
    "runtime.zero.linear.print_rank_0": "08eae8eeb95830a33f820b66b95816ddccd8903faa70be912e50172f401644dc",
    "runtime.zero.partitioned_param_coordinator.iter_params":
        "594f9e285a48be132af85a833e31343017f0d8bfe8d26f297ee22962fa459057",
    # not replaced: what the replacements rely on (the parameters iter_params adds, the flag NVTX ranges read)
    "runtime.zero.partitioned_param_coordinator.get_all_parameters":
        "859e0b924ea8fbbcb189c4809be924edaef30c477c771f9436d6ff903d0301ca",
    "runtime.zero.partition_parameters._init_external_params":
        "5ab2c1ed81e47263c45ac37da79547967df42d7dee2f5f9f0f6dd05fe2f6f874",
    "utils.nvtx.instrument_w_nvtx": "c538ccdda7c8ea15459a22f1cc6ee0328eac835c7c562e347d5f358c8efeb689",
    "accelerator.cuda_accelerator.CUDA_Accelerator.current_stream":
        "39ad951b1301beeba46b0886eddce2a04fd0e2dd3276f43d6983f73be6f8f605",
    "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters":
        "af7b449bee8786ec0b8b4c1e27c22bdca2b79186b3888a8c7a9df6bb9c2e8f35",
    "runtime.zero.partition_parameters.Init._allgather_params_coalesced":
        "774cce0650d208bb2e82699aae9953c697764b6fc7f226379aed4fb8aa0ddbd3",
    # not replaced: what calls it (one partition group at a time) and what it leaves as DeepSpeed's
    "runtime.zero.partition_parameters.Init._all_gather":
        "24e484914416ddf78633955c6363dc59974c300adef590ec7019a17cb6f1fb6a",
    # not replaced: what that replacement calls as DeepSpeed's code does
    "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3._unflatten_partitioned_parameters":
        "00cc8a3f65af736fd5e513e270951e6913b4146b4bbdf3fa0b74610eeb349ee1",
}
GROUPS = {"overflow_on_device": ("update_offload_overflow_tracker", "has_overflow"),
          "grad_norm_on_device": ("complete_grad_norm_calculation_for_cpu_offload",),
          "pinned_accumulation_without_wait": ("async_accumulate_grad_in_cpu_via_gpu",),
          "zero3_cached_module_parameters": (),
          "zero3_quiet_debug_messages": (),
          "zero3_no_nvtx_ranges": (),
          "cuda_current_stream_by_index": (),
          "zero3_offload_weights_through_pinned": (),
          "zero3_persistent_parameters_in_one_gather": ()}
# the modules whose print_rank_0 (their own, or partition_parameters' imported) the quiet one replaces
PRINTING_MODULES = ("partition_parameters", "partitioned_param_coordinator", "parameter_offload", "stage3", "linear")
_module_originals = {}  # (module or class, name) -> DeepSpeed's object, while the replacements stand


def source_hash(function):
    """sha256 of `function`'s source; of the function itself where DeepSpeed's instrument_w_nvtx wraps it (the
    wrapper's source is the same for every function it wraps)."""
    code = getattr(function, "__code__", None)
    if code is not None and "func" in code.co_freevars and code.co_name == "wrapped_fn":
        function = function.__closure__[code.co_freevars.index("func")].cell_contents
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def changed_sources():
    """Names of the replaced DeepSpeed methods whose source is not the one the replacements were checked
    against (empty when the overrides apply)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    originals = getattr(DeepSpeedZeroOptimizer, "_trainer_originals", {})
    changed = [name for name, expected in CHECKED_SOURCES.items()
               if source_hash(originals.get(name, getattr(DeepSpeedZeroOptimizer, name))) != expected]
    for path, expected in MODULE_SOURCES.items():
        module, name = _deepspeed_attribute(path)
        if source_hash(_module_originals.get((module, name), getattr(module, name))) != expected:
            changed.append(path)
    return changed


def _deepspeed_attribute(path):
    """(the module or class that holds it, its name) for MODULE_SOURCES' path."""
    *owner, name = path.split(".")
    if owner[-1][:1].isupper():  # a class: module.Class.name
        return getattr(importlib.import_module("deepspeed." + ".".join(owner[:-1])), owner[-1]), name
    return importlib.import_module("deepspeed." + ".".join(owner)), name


def enabled():
    """The names of GROUPS to install (TRAINER_DEEPSPEED_OVERRIDES: unset or 1 all, 0 none, or a list)."""
    value = os.environ.get("TRAINER_DEEPSPEED_OVERRIDES", "").strip() or "1"
    if value in ("1", "0"):
        return set(GROUPS) if value == "1" else set()
    names = {name.strip() for name in value.split(",") if name.strip()}
    if names - set(GROUPS):
        raise UsageError(f"TRAINER_DEEPSPEED_OVERRIDES: unknown {', '.join(sorted(names - set(GROUPS)))}; "
                         f"known: 0, 1, {', '.join(GROUPS)}")
    return names


def install():
    """Replace the methods on DeepSpeed's ZeRO-1/2 optimizer class and the module functions (ZeRO-3's, the CUDA
    accelerator's current stream), once per process; returns whether they are in place. Call before
    deepspeed.initialize."""
    from deepspeed.runtime.zero import stage_1_and_2
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if hasattr(DeepSpeedZeroOptimizer, "_trainer_originals"):
        return True
    groups = enabled()
    if not groups or changed_sources():
        return False
    _install_module_replacements(groups)
    originals = {name: getattr(DeepSpeedZeroOptimizer, name) for name in CHECKED_SOURCES}
    has_inf_or_nan, dist = stage_1_and_2.has_inf_or_nan, stage_1_and_2.dist

    def update_offload_overflow_tracker(self, grad):
        if grad is None or not self.check_grad_overflow:  # only has_overflow reads it, under the check
            return
        found = has_inf_or_nan(grad.data)
        self.local_overflow = found if self.local_overflow is False else self.local_overflow | found

    def has_overflow(self, partition_gradients=True):
        if self.cpu_offload and torch.is_tensor(self.local_overflow):  # without offload there is none
            self.local_overflow = bool(self.local_overflow)  # the step's one host read
        return originals["has_overflow"](self, partition_gradients)

    def complete_grad_norm_calculation_for_cpu_offload(self, params):
        norms = []
        for p in params:
            if hasattr(p, stage_1_and_2.PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue
            if stage_1_and_2.is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
                param_id = self.get_param_id(p)
                if param_id in self.norm_for_param_grads:
                    norms.append(self.norm_for_param_grads[param_id])
                else:
                    assert self.ignore_unused_parameters, (
                        "a parameter was not used in producing the loss: set zero_optimization."
                        "ignore_unused_parameters, or use every trainable parameter in forward")
        device = stage_1_and_2.get_accelerator().current_device_name()
        total = (torch.stack([norm.to(device, torch.float64) for norm in norms]).square().sum() if norms
                 else torch.zeros((), dtype=torch.float64, device=device))
        total_dev_norm = total.float().reshape(1)
        dist.all_reduce(total_dev_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_dev_norm, op=dist.ReduceOp.SUM)
        total_norm = total_dev_norm[0].item() ** 0.5
        if total_norm in (float("inf"), -float("inf")) or total_norm != total_norm:
            total_norm = -1.0
        return torch.tensor(total_norm, device=self.device, dtype=torch.float)

    def async_accumulate_grad_in_cpu_via_gpu(self, param):
        current = stage_1_and_2.get_accelerator().current_stream()
        source = self.accumulated_grads_in_cpu.get(self.get_param_id(param))  # what its copy to the GPU reads
        pinned = source is None or source.is_pinned()  # none yet: made here, not written by the GPU before
        if not (pinned and all(stream == current for stream in self._pending_offload_events)):
            return originals["async_accumulate_grad_in_cpu_via_gpu"](self, param)
        pending, self._pending_offload_events = self._pending_offload_events, {}  # nothing for its wait to wait on
        try:
            return originals["async_accumulate_grad_in_cpu_via_gpu"](self, param)
        finally:  # this copy's event, recorded after the earlier ones on the same stream, stands for them all
            self._pending_offload_events = {**pending, **self._pending_offload_events}

    replacements = {"update_offload_overflow_tracker": update_offload_overflow_tracker, "has_overflow": has_overflow,
                    "complete_grad_norm_calculation_for_cpu_offload": complete_grad_norm_calculation_for_cpu_offload,
                    "async_accumulate_grad_in_cpu_via_gpu": async_accumulate_grad_in_cpu_via_gpu}
    for group in groups:
        for name in GROUPS[group]:
            setattr(DeepSpeedZeroOptimizer, name, replacements[name])
    DeepSpeedZeroOptimizer._trainer_originals = originals
    return True


def _install_module_replacements(groups):
    replacements = {}  # as MODULE_SOURCES names them -> the replacement
    if "zero3_cached_module_parameters" in groups:
        module, name = _deepspeed_attribute("runtime.zero.partitioned_param_coordinator.iter_params")
        deepspeeds_iter_params = getattr(module, name)
        known = (weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary())  # by recurse: module -> its parameters

        def iter_params(module, recurse=False):
            external = module.__dict__.get("_external_params")  # DeepSpeed's registry, read each time as it does
            if external is None:  # not a module DeepSpeed registered: its own code (and its error)
                return deepspeeds_iter_params(module, recurse)
            params = known[bool(recurse)].get(module)
            if params is None:
                params = known[bool(recurse)][module] = tuple(p for _, p in module.named_parameters(recurse=recurse))
            return itertools.chain(params, external.values()) if external else iter(params)

        for module in ("partitioned_param_coordinator", "parameter_offload"):
            replacements[f"runtime.zero.{module}.iter_params"] = iter_params
    if "zero3_quiet_debug_messages" in groups:
        for path in (f"runtime.zero.{module}.print_rank_0" for module in PRINTING_MODULES):
            module, name = _deepspeed_attribute(path)
            if hasattr(module, name):
                replacements[path] = _quiet(getattr(module, name))
    if "zero3_no_nvtx_ranges" in groups:
        replacements["utils.nvtx.enable_nvtx"] = False
    if "cuda_current_stream_by_index" in groups:
        def current_stream(self, device_index=None):
            return torch.cuda.current_stream(torch.cuda.current_device() if device_index is None else device_index)

        replacements["accelerator.cuda_accelerator.CUDA_Accelerator.current_stream"] = current_stream
    if "zero3_offload_weights_through_pinned" in groups:
        path = "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters"
        deepspeeds_reassign = inspect.getattr_static(*_deepspeed_attribute(path))

        from deepspeed.utils.nvtx import instrument_w_nvtx

        @instrument_w_nvtx  # as DeepSpeed's is: its range in a profile
        def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
            half = self.fp16_partitioned_groups_flat[sub_group_id]
            full = self.fp32_partitioned_groups_flat[sub_group_id]
            if not through_pinned(half, full):
                return deepspeeds_reassign(self, sub_group_id)
            staging = self._trainer_pinned_weights = staging_buffer(
                getattr(self, "_trainer_pinned_weights", None), half, pin_memory=True)
            copy_through(half.data.view(-1), full.data.view(-1), staging)
            self._unflatten_partitioned_parameters(sub_group_id)

        replacements[path] = _reassign_or_swap_out_partitioned_parameters
    if "zero3_persistent_parameters_in_one_gather" in groups:
        path = "runtime.zero.partition_parameters.Init._allgather_params_coalesced"
        deepspeeds_gather = inspect.getattr_static(*_deepspeed_attribute(path))

        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator

        def _allgather_params_coalesced(self, param_list, hierarchy=0, quantize=False):
            if (quantize or len(param_list) < 2 or not self.use_all_gather_into_tensor
                    or len({p.ds_tensor.dtype for p in param_list}) > 1
                    or any(self._partition_world_size(p) == 1 for p in param_list)):
                return deepspeeds_gather(self, param_list, hierarchy, quantize)
            world_size = self._partition_world_size(param_list[0])  # _all_gather passes one group's
            group = self.get_partition_dp_group(param_list[0])
            for params in gather_chunks(param_list, world_size):
                sizes = [p.ds_tensor.ds_numel for p in params]
                local = torch.cat([p.ds_tensor.to(get_accelerator().device_name()).view(-1) for p in params])
                gathered = torch.empty(world_size * local.numel(), dtype=local.dtype, device=self.local_device)
                dist.all_gather_into_tensor(gathered, local, group=group)
                # rank-major (each rank's partitions end to end) into parameter-major: each parameter whole
                wholes = torch.empty_like(gathered).split([world_size * size for size in sizes])
                torch.split_with_sizes_copy(gathered.view(world_size, -1), sizes, dim=1,
                                            out=[whole.view(world_size, size) for whole, size in zip(wholes, sizes)])
                for param, whole in zip(params, wholes):
                    param.data = whole.narrow(0, 0, param.ds_numel).view(param.ds_shape).data
            if not get_accelerator().resolves_data_dependency():  # as DeepSpeed's ends
                get_accelerator().synchronize()

        replacements[path] = _allgather_params_coalesced
    for path, replacement in replacements.items():
        module, name = _deepspeed_attribute(path)
        _module_originals[(module, name)] = inspect.getattr_static(module, name)  # a class's own, as defined
        setattr(module, name, replacement)


# elements gathered in one collective: the persistent parameters are a few million, but a whole model gathered
# at once (GatheredParameters for an export) holds its gathered copy and its parameters' whole ones together
GATHER_CHUNK = 2**26


def gather_chunks(params, world_size):
    """`params` in order, in runs of at most GATHER_CHUNK gathered elements (a larger parameter alone)."""
    chunk, elements = [], 0
    for param in params:
        size = world_size * param.ds_tensor.ds_numel
        if chunk and elements + size > GATHER_CHUNK:
            yield chunk
            chunk, elements = [], 0
        chunk.append(param)
        elements += size
    if chunk:
        yield chunk


# elements of the pinned buffer the updated weights pass through (128 MB in bf16): the host's memory is what a
# one-GPU run of a giant model runs short of, so one sub-group's size (DeepSpeed's default: 1e9) is not pinned
PINNED_CHUNK = 64 * 2**20


def through_pinned(half, full):
    """Whether ZeRO-3's updated weights `full` (DeepSpeed's fp32 master copy) go to the GPU's `half` through a
    pinned buffer: a half-precision sub-group on the GPU, its master copy in pageable host memory. Otherwise
    (no such sub-group, weights kept on the CPU, fp32 weights that are the master copy, a pinned master copy
    from NVMe swapping) DeepSpeed's own copy."""
    return (half is not None and half.device.type == "cuda" and full.device.type == "cpu"
            and half.dtype != full.dtype and not full.is_pinned())


def staging_buffer(buffer, half, pin_memory):
    """`buffer` if it serves sub-group `half` (its dtype, and as long as PINNED_CHUNK or `half`), else a new one:
    sub-groups differ in size (the first may be a small parameter group's)."""
    size = max(1, min(PINNED_CHUNK, half.numel()))
    if buffer is None or buffer.dtype != half.dtype or buffer.numel() < size:
        buffer = torch.empty(size, dtype=half.dtype, pin_memory=pin_memory)
    return buffer


def copy_through(destination, source, staging):
    """destination.copy_(source) for 1-D tensors, `staging` (a buffer of destination's dtype) at a time: each
    piece converted into it on the host, then copied from it. From pinned memory a copy to the GPU runs at the
    link's speed; DeepSpeed's one copy_ from its unpinned fp32 weights converts into pageable memory, which the
    driver copies through its own small pinned buffers, more slowly. Each copy is synchronous, so the
    buffer is free again for the next piece."""
    if destination.numel() != source.numel():  # as copy_ would refuse them
        raise RuntimeError(f"copy_through: {source.numel()} elements into {destination.numel()}")
    for start in range(0, source.numel(), staging.numel()):
        piece = source[start:start + staging.numel()]
        staged = staging[:piece.numel()]
        staged.copy_(piece)
        destination[start:start + piece.numel()].copy_(staged)


def _quiet(print_rank_0):
    """DeepSpeed's print_rank_0(message, debug=False, force=False), asking for the rank only where it may print."""
    def quiet(message, debug=False, force=False):
        if debug or force:
            print_rank_0(message, debug, force)
    return quiet


def uninstall():
    """Put DeepSpeed's methods back (tests compare both)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for (module, name), original in _module_originals.items():
        setattr(module, name, original)
    _module_originals.clear()

    originals = DeepSpeedZeroOptimizer.__dict__.get("_trainer_originals")
    if originals is not None:
        for name, method in originals.items():
            setattr(DeepSpeedZeroOptimizer, name, method)
        del DeepSpeedZeroOptimizer._trainer_originals
