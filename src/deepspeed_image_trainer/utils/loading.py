"""Loading files a user hands over (checkpoints, weights, exports) without running code from them.

torch.load with weights_only=True rebuilds only tensors, containers and plain values, and here also the
few DeepSpeed classes its checkpoints hold; a file naming anything else is refused before any of it runs.
DeepSpeed's own loaders that unpickle everything (zero_to_fp32 in export_model.py) are reached only after
each file of the checkpoint passed here; a resumed run's engine loads every file through here.
"""
import contextlib
import os
import pickle
import re
import sys
import warnings
import zipfile
from pathlib import Path

import torch

from .failures import UsageError
from .files import fingerprint
from .text import error_line


def deepspeed_checkpoint_classes():
    """The classes DeepSpeed pickles into its checkpoints' optimizer states (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO 1-3 checkpoints, fp16 and bf16)."""
    # DeepSpeed logs on stdout, which may carry JSON (predict.py --json); its logger binds the stream on import.
    with contextlib.redirect_stdout(sys.stderr), _cpu_named():
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
        from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, OffloadDeviceEnum, fragment_address]


@contextlib.contextmanager
def _cpu_named():
    """Without a GPU DeepSpeed warns at import that it found none and takes its CPU accelerator; named (for the
    import alone) it says nothing, so a refusal before any rank starts stays one line."""
    name = "DS_ACCELERATOR"
    if "deepspeed" in sys.modules or name in os.environ or torch.cuda.is_available():
        yield
        return
    os.environ[name] = "cpu"
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _torchscript(path):
    """Whether `path` is a TorchScript archive: a torch zip file with the constants.pkl that torch.jit.save
    writes (torch.load's own test)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/constants.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def load_checked(path, map_location="cpu", mmap=False, deepspeed_classes=True):
    """torch.load(path) of tensors and plain values only (and DeepSpeed's checkpoint classes); a file that is
    damaged, not a torch file, or names other Python objects stops with a UsageError naming it."""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO's open() waits for a writer for good
        raise UsageError(f"{path} is not a regular file (a folder, FIFO or device), where a torch file should be")
    allowed = deepspeed_checkpoint_classes() if deepspeed_classes else []
    mmap = mmap and zipfile.is_zipfile(path)  # torch's legacy format (before 1.6) cannot be memory-mapped
    if _torchscript(path):  # torch.load warned (two lines) and named its weights_only default's history
        raise UsageError(f"{path} is a TorchScript archive (torch.jit.save), not a state_dict: save the model's "
                         "state_dict (torch.save(model.state_dict(), path)) and give that")
    try:
        # A plain pickle (not torch.save's) makes torch warn about its protocol before it fails: one line, below.
        with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            # torch's note that it checks a sparse tensor's indices as it loads one (refused after, in one line)
            warnings.filterwarnings("ignore", message="Validating sparse tensor invariants")
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        refused = _refused_global(err)
        if refused is None:
            raise UsageError(f"{path} is damaged or not a torch file ({_detail(err)})") from None
        raise UsageError(f"{path} holds Python objects other than tensors ({refused}): not loaded, since loading "
                         "it could run any code; use a file this trainer or torchvision wrote") from None
    except OSError as err:
        if Path(path).is_file() and os.access(path, os.R_OK):  # opened, then failed: cut short (mmap's EINVAL)
            raise UsageError(f"{path} is damaged or not a torch file (OSError: {err.strerror or error_line(err)})") \
                from None
        raise UsageError(f"{path}: {err.strerror or error_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - a damaged file fails in zip, pickle or tensor code, each its own way
        detail = f"{type(err).__name__}: {error_line(err)}" if str(err).strip() else type(err).__name__
        raise UsageError(f"{path} is damaged or not a torch file ({detail})") from None


# What DeepSpeed's loaders take from each kind of a checkpoint's files (a KeyError in every rank without it)
CHECKPOINT_FILE_KEYS = {"model_states.pt": "module", "optim_states.pt": "optimizer_state_dict"}


def check_checkpoint_files(folder, tag):
    """Every file of a DeepSpeed checkpoint's tag folder, through load_checked (memory-mapped), holding what
    DeepSpeed reads from it; no two ranks' optimizer shards the same file (a copy trained on silently)."""
    files = sorted(Path(folder, tag).glob("*.pt"))
    if not files:
        raise UsageError(f"{Path(folder, tag)} holds no checkpoint files (*.pt)")
    shards, states = {}, {}
    for path in files:
        state = states[path] = load_checked(path, mmap=True)
        key = next((key for suffix, key in CHECKPOINT_FILE_KEYS.items() if path.name.endswith(suffix)), None)
        if key is not None and not (isinstance(state, dict) and isinstance(state.get(key), dict)):
            raise UsageError(f"{path} is not a DeepSpeed checkpoint file (it holds no {key!r})")
        if key == "optimizer_state_dict":
            same = shards.setdefault(fingerprint(path), path)
            if same != path:
                raise UsageError(f"{path} is the same file as {same.name}, where each rank's shard holds its own part "
                                 "of the optimizer")
    _check_shard_order(states)


def _check_shard_order(states):
    """ZeRO-1/2's shards hold consecutive parts of each parameter group, rank 0's first (param_slice_mappings: the
    parameters each holds, in the model's order, as the model-states file's param_shapes lists them): shards
    renamed into other ranks' places (trained on silently) start out of that order."""
    model = next((state for path, state in states.items() if path.name.endswith("model_states.pt")), None)
    groups = model.get("param_shapes") if isinstance(model, dict) else None
    ranked = sorted((int(found[1]), path, state["optimizer_state_dict"]) for path, state in states.items()
                    if (found := re.match(r".*zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$", path.name)))
    if not isinstance(groups, list) or len(ranked) < 2:
        return
    for index, group in enumerate(groups):
        order = {name: position for position, name in enumerate(group)} if isinstance(group, dict) else {}
        firsts = []
        for rank, path, optimizer in ranked:
            mappings = optimizer.get("param_slice_mappings")
            if not (isinstance(mappings, list) and len(mappings) > index and isinstance(mappings[index], dict)
                    and mappings[index] and next(iter(mappings[index])) in order):
                return  # not ZeRO-1/2's layout (ZeRO-3 shards, an older DeepSpeed): nothing to compare
            firsts.append((order[next(iter(mappings[index]))], rank, path))
        for (before, _, _), (after, rank, path) in zip(firsts, firsts[1:]):
            if after < before:
                raise UsageError(f"{path} holds parameters that come before rank {rank - 1}'s: the shards are not in "
                                 "their ranks' places (renamed or copied from another checkpoint)")


def _lines(err):
    """torch's weights-only message without its boilerplate: the lines that say what it met."""
    return [line.strip().removeprefix("WeightsUnpickler error:").strip() for line in str(err).splitlines()
            if line.strip() and not line.startswith(("Weights only load failed", "Please file an issue", "Check the"))]


def _refused_global(err):
    """The global torch's weights-only unpickler refused ("GLOBAL posix.system"), or None."""
    line = next((line for line in _lines(err) if "GLOBAL" in line), None)
    if line is None:
        return None
    named = re.search(r"GLOBAL (\S+)", line)  # not torch's advice to allow it, which follows
    return f"GLOBAL {named[1]}" if named else line


def _detail(err):
    return next((line for line in _lines(err) if line), error_line(err))


def tensors_by_name(state):
    """Whether `state` is a state_dict: tensors by name (a key that is no name failed in the loader)."""
    return isinstance(state, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items())


def unloadable_tensor(state):
    """The first entry of state_dict `state` no model's weights can take, as "<key> is a ... tensor; ..."; None
    when every tensor is dense, real-valued and holds values (a meta-device tensor holds none)."""
    for key, value in state.items():
        if value.is_meta:
            return f"{key} is a meta-device tensor, which holds no values; save the weights of a built model"
        if value.is_nested or value.layout != torch.strided or value.is_quantized or value.is_complex():
            kind = "nested" if value.is_nested else value.layout
            return (f"{key} is a {kind} {value.dtype} tensor; give dense real-valued weights (tensor.to_dense(), "
                    ".dequantize())")
    return None
