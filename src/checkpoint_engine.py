"""Checkpoint files written in the background, through DeepSpeed's checkpoint-engine interface."""
import copy
from concurrent.futures import ThreadPoolExecutor

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine


def to_host(item):
    """A copy of `item` the training cannot change: tensors copied to host memory, dicts and lists copied
    (their types kept), everything else shared. DeepSpeed's clone_tensors_for_torch_save would do but for
    turning every tuple subclass into a tuple: ZeRO-3's param_shapes hold torch.Size, which zero_to_fp32 needs."""
    if torch.is_tensor(item):
        return item.detach().clone() if item.device.type == "cpu" else item.detach().to("cpu")
    if isinstance(item, dict):
        copied = copy.copy(item)
        for key, value in item.items():
            copied[key] = to_host(value)
        return copied
    if isinstance(item, list):
        return [to_host(value) for value in item]
    if type(item) is tuple:
        return tuple(to_host(value) for value in item)
    return item


class BackgroundCheckpointEngine(CheckpointEngine):
    """torch.save on a writer thread: save() returns once the state is copied to host memory (to_host),
    so the training may change the live tensors at once.

    The writer thread also runs whatever `after()` queues behind the files, in order. Once a task has
    failed, nothing queued later runs (no checkpoint is marked complete after a failed file) and
    `on_failure()` runs instead, once; `wait()` raises the error.
    """

    def __init__(self, on_failure=None):
        super().__init__()
        self.name = "BackgroundCheckpointEngine"
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self.queued = []
        self.failed = None
        self.on_failure = on_failure

    def create(self, info):
        pass

    def save(self, state_dict, path):
        self.after(torch.save, to_host(state_dict), path)

    def load(self, path, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info):
        return True

    def after(self, fn, *args):
        """Run fn(*args) on the writer thread once everything queued before it is done."""
        self.queued.append(self.writer.submit(self._run, fn, *args))

    def _run(self, fn, *args):
        if self.failed is not None:
            return
        try:
            fn(*args)
        except BaseException as err:
            self.failed = err
            if self.on_failure is not None:
                self.on_failure()
            raise

    def wait(self):
        """Block until the queue is empty; raise the error a queued task raised."""
        queued, self.queued = self.queued, []
        for task in queued:
            task.result()
        if self.failed is not None:
            raise self.failed
