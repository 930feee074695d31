"""Out of GPU memory: the flags to try next, worked out from the run's resolved DeepSpeed config."""
import contextlib
import re

from ..utils.failures import OutOfMemory
from .config import _offloads, precision


def _smallest_factor(n):
    return next(f for f in range(2, n + 1) if n % f == 0)


def out_of_memory_advice(ds_config, data_on_device=False, detail="", coalesced=False):
    """The flags to try next after the GPU ran out of memory, from the run's resolved DeepSpeed config
    (`coalesced`: whether it coalesces the gradient reduction): one line, cheapest change first, with the
    numbers worked out."""
    micro = ds_config["train_micro_batch_size_per_gpu"]
    accumulation = ds_config["gradient_accumulation_steps"]
    zero = ds_config["zero_optimization"]
    stage = zero["stage"]
    offloads = {key for key in ("offload_optimizer", "offload_param")
                if zero.get(key, {}).get("device", "none") not in ("none", None)}
    steps = []
    if micro > 1:
        factor = _smallest_factor(micro)  # keeps micro-batch x accumulation, so the global batch stays
        steps.append(f"--batch_size {micro // factor} --gradient_accumulation_steps {accumulation * factor} "
                     f"(the same global batch of {ds_config['train_batch_size']})")
    if precision(ds_config) == "fp32":
        steps.append("--bf16 (or --fp16)")
    if data_on_device:
        steps.append("--data_on_device off (frees the GPU copy of the dataset)")
    if coalesced:
        steps.append("--coalesce_grad_reduction off (frees the GPU copy of the summed gradients; slower)")
    if "offload_optimizer" not in offloads:
        steps.append("--offload_optimizer" + (" --zero_stage 2" if stage == 0 else ""))
    if "offload_param" not in offloads:
        steps.append("--zero_stage 3 --offload_param" if stage != 3 else "--offload_param")
    match = re.search(r"Tried to allocate [\d.]+ \w+", detail)
    tried = f" ({match[0].lower()})" if match else ""
    if not steps:
        return (f"out of GPU memory{tried} at micro-batch 1 with every offload on: use GPUs with more memory "
                f"or a smaller --image_size")
    return (f"out of GPU memory{tried} at micro-batch {micro} per GPU; try, in this order: "
            + "; ".join(f"{i}) {step}" for i, step in enumerate(steps, 1)))


# ZeRO-3 is said to be slower where every rank can hold the model's unpartitioned states (weights, gradients and
# Adam's, 16 bytes a parameter) in this share of its GPU.
ZERO2_FITS_SHARE = 0.25


def state_bytes_per_gpu(ds_config, world_size, num_params):
    """About the bytes of the model's states on each GPU (fp32 weights, gradients and AdamW's two moments, 16 a
    parameter): what ZeRO shards split over the ranks, what is offloaded left out."""
    zero = ds_config["zero_optimization"]
    stage, shards = zero["stage"], max(world_size, 1)
    weights, grads, moments = 4.0, 4.0, 8.0
    if stage >= 1:
        moments /= shards
    if stage >= 2:
        grads /= shards
    if stage == 3:
        weights /= shards
    if _offloads(zero, "offload_optimizer"):  # the moments, and from ZeRO-2 on the gradients' partitions
        moments = 0.0
        grads = 0.0 if stage >= 2 else grads
    if _offloads(zero, "offload_param"):
        weights = 0.0
    return int((weights + grads + moments) * num_params)


def zero3_note(ds_config, world_size, num_params, gpu_bytes):
    """A line for ZeRO-3 without parameter offload on several GPUs for a model whose states fit every GPU
    (None otherwise): ZeRO-2 is faster there (measured: docs/performance.md, Several GPUs)."""
    zero = ds_config["zero_optimization"]
    states = 16 * num_params
    if (zero["stage"] != 3 or world_size < 2 or _offloads(zero, "offload_param") or not gpu_bytes
            or states > ZERO2_FITS_SHARE * gpu_bytes):
        return None
    return (f"note: ZeRO-3 shards {num_params / 1e6:.1f} M parameters whose unpartitioned states ({states / 2**30:.2f} "
            f"GiB) fit every GPU ({states / gpu_bytes:.1%} of one): it gathers each layer's weights in every forward "
            f"and backward, which costs more than the memory it saves; --zero_stage 2 is faster here")


@contextlib.contextmanager
def advise_on_out_of_memory(ds_config, data_on_device, coalesced=False):
    """Stop with the next flags to try, instead of a traceback, when the GPU runs out of memory."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as err:
        raise OutOfMemory(out_of_memory_advice(ds_config, data_on_device, str(err), coalesced)) from None
    except RuntimeError as err:  # DeepSpeed's own allocations and CUDA calls report it as a plain RuntimeError
        if "out of memory" not in str(err).lower():
            raise
        raise OutOfMemory(out_of_memory_advice(ds_config, data_on_device, str(err), coalesced)) from None
