"""Seeding, and the RNG state a resumed run restores."""
import random

import numpy as np
import torch


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seed_step(seed, rank, epoch, step):
    """Seed torch's generators (the CPU's and every GPU's) for one micro-batch, so that what the model draws
    (dropout, drop path) depends on (seed, rank, epoch, step) alone: a resumed run draws what the run that
    never stopped did."""
    torch.manual_seed(hash((seed, rank, epoch, step)) % 2**63)


def rng_state():
    """Only tensors and plain Python values, so a checkpoint holding it still loads with
    torch.load's default weights_only=True."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state):
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # a run resumed on fewer GPUs than it was saved from
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
