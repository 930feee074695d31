"""One training epoch and one evaluation pass over a DeepSpeed engine; metrics are plain dicts. Also the
engine's LR scheduler built again for the steps that run."""
import contextlib
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..data.folders import batch_memory_format
from .distributed import all_reduce, average_buffers, every_ranks_buffers, is_main_process
from .numerics import StepHealth
from .rng import seed_step

INPUT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16,
                "autocast-fp16": torch.float16, "autocast-bf16": torch.bfloat16}
PROGRESS_EVERY = 10  # steps between progress-bar updates


def input_dtype(precision):
    """DeepSpeed's fp16/bf16 modes hold half-precision weights, so images must match; under autocast the
    first convolution casts its input anyway, so sending it in half precision saves a cast."""
    return INPUT_DTYPES.get(precision, torch.float32)


def to_device(images, labels, device, dtype):
    """A batch on the device, in the input dtype and layout the model wants there."""
    return (images.to(device, dtype=dtype, memory_format=batch_memory_format(device), non_blocking=True),
            labels.to(device, non_blocking=True))


class RunningTotals:
    """Loss and accuracy sums kept on the device, so that a step never waits for the GPU to report.

    `carried` holds the sums over all ranks that an interrupted run had reached in this epoch.
    """

    def __init__(self, device, carried=None):
        carried = carried if carried and is_main_process() else {}  # counted once, on rank 0
        self.loss = torch.tensor(carried.get("loss", 0.0), dtype=torch.float64, device=device)
        self.correct = torch.tensor(int(carried.get("correct", 0)), dtype=torch.int64, device=device)
        self.count = int(carried.get("count", 0))

    def add(self, loss_sum, logits, labels):
        self.loss += loss_sum.detach().double()
        self.correct += (logits.argmax(dim=1) == labels).sum()
        self.count += labels.numel()

    def summed_over_ranks(self, device):
        return all_reduce({"loss": self.loss.item(), "correct": self.correct.item(), "count": self.count}, device)


class LaggingReadout:
    """The running sums for the progress bar, read without waiting for the GPU: each read starts an
    asynchronous copy and returns the values of the last copy that has landed (None before the first)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(2, dtype=torch.float64, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending, self.shown = None, None

    def read(self, totals):
        """(loss sum, correct, count) as of some earlier step."""
        if not self.cuda:
            return totals.loss.item(), totals.correct.item(), totals.count
        if self.pending is not None and self.event.query():
            self.shown = (self.host[0].item(), self.host[1].item(), self.pending)
            self.pending = None
        if self.pending is None:
            self.host.copy_(torch.stack([totals.loss, totals.correct.double()]), non_blocking=True)
            self.event.record()
            self.pending = totals.count
        return self.shown


class GradientAccumulation:
    """Each micro-batch's backward and step() through DeepSpeed. Micro-batch by micro-batch, DeepSpeed reduces
    the gradients after every backward and steps the optimizer at the accumulation boundary. `coalesced`: an
    optimizer step's micro-batches run inside DeepSpeed's engine.coalesce_grad_reduction(), which sums their
    gradients on the device without ZeRO's per-parameter hooks and reduces them once as it ends; step() once
    after it (config.coalesces_grad_reduction says when)."""

    def __init__(self, engine, coalesced=False):
        self.engine, self.coalesced = engine, coalesced
        self.block, self.inside = contextlib.ExitStack(), False

    def backward(self, loss, ends_step):
        """engine.backward(loss) for a micro-batch; `ends_step`: the last of its optimizer step."""
        if self.coalesced:
            if not self.inside:
                self.block.enter_context(self.engine.coalesce_grad_reduction())
                self.inside = True
            self.engine.set_gradient_accumulation_boundary(ends_step)
        self.engine.backward(loss)

    def step(self, ends_step):
        if not self.coalesced:
            self.engine.step()
        elif ends_step:
            self.close()
            # The block's exit put back the boundary it found: step() must be told this is one, or it steps nothing.
            self.engine.set_gradient_accumulation_boundary(True)
            self.engine.step()
            self.engine.set_gradient_accumulation_boundary(None)  # DeepSpeed's own count again

    def close(self):
        """End an open block: its gradients are reduced, and no step taken (an epoch cut short mid-step)."""
        self.block.close()
        self.inside = False


def train_one_epoch(engine, loader, epoch, dtype, micro_batches, *, start_step=0, carried=None, stop=None,
                    label_smoothing=0.0, health=None, on_first_step=None, coalesced=False, mixing=None,
                    step_seed=None, ema=None):
    """Train micro-batches start_step .. micro_batches-1 of `loader`; return metrics summed over ranks
    (the loss is the one trained on, label smoothing included).

    When `stop` asks for it (SIGINT/SIGTERM), stop at the next optimizer-step boundary and return
    {"interrupted": True, "step": ..., "carried": ...} instead, for a checkpoint to carry on from.
    `health` (a numerics.StepHealth kept across epochs) counts non-finite losses and skipped fp16 steps,
    and raises Diverged when the loss stays non-finite. `on_first_step(device)` is called after the
    epoch's first step. `coalesced`: see GradientAccumulation. `mixing` (data/mixing.py's BatchMixing): mixup or
    cutmix of each micro-batch, trained on the soft targets; the training accuracy is then the dominant label's.
    `step_seed` (seed, rank): each micro-batch's model randomness seeded from it (rng.seed_step). `ema`
    (ema.WeightEMA): told of each optimizer step.
    """
    engine.train()
    health = health or StepHealth(engine, max_nonfinite_steps=0)
    health.start_epoch(carried)
    accumulation = engine.gradient_accumulation_steps()
    totals = RunningTotals(engine.device, carried)
    earlier_s = (carried or {}).get("time_s", 0.0)  # time the interrupted run spent on this epoch
    data_wait_s = (carried or {}).get("data_wait_s", 0.0)
    lr = engine.get_lr()[0]
    start = time.perf_counter() - earlier_s
    progress = tqdm(total=micro_batches, initial=start_step, desc=f"Epoch {epoch} train",
                    disable=not is_main_process(), dynamic_ncols=True, leave=True)
    step = start_step
    readout = LaggingReadout(engine.device)
    batches = iter(loader)
    steps = GradientAccumulation(engine, coalesced)
    while step < micro_batches:
        waiting = time.perf_counter()
        batch = next(batches, None)
        data_wait_s += time.perf_counter() - waiting
        if batch is None:
            break
        images, labels = to_device(*batch, engine.device, dtype)
        targets = labels
        if step_seed is not None:
            seed_step(*step_seed, epoch, step)
        if mixing is not None:
            images, targets = mixing(images, labels, epoch, step)
            labels = targets.argmax(dim=1)  # the dominant label, for the training accuracy
        logits = engine(images)
        loss = F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)
        lr = engine.get_lr()[0]
        health.observe(loss)
        ends_step = (step + 1) % accumulation == 0
        steps.backward(loss, ends_step)
        health.before_step()
        steps.step(ends_step)
        health.after_step()
        if ema is not None and ends_step:
            ema.after_step(epoch, step // accumulation)
        totals.add(loss * labels.numel(), logits, labels)
        if on_first_step is not None and step == start_step:
            on_first_step(engine.device)
        step += 1
        progress.update()
        diverged = health.check(epoch, step) if step % PROGRESS_EVERY == 0 else None
        if diverged:
            progress.close()  # the error line then starts on a line of its own
            raise diverged
        shown = readout.read(totals) if progress.n % PROGRESS_EVERY == 0 else None
        if shown is not None:
            loss_sum, correct, seen = shown
            elapsed = time.perf_counter() - start
            progress.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{correct / seen:.3f}",
                                 img_s=f"{totals.count / elapsed:.1f}", data=f"{data_wait_s / elapsed:.0%}",
                                 lr=f"{lr:.2e}")
        if stop is not None and step % accumulation == 0 and step < micro_batches and stop.requested():
            break
    steps.close()  # a loader that ran out mid-step
    del batches  # its DataLoader workers shut down here, inside the epoch's time rather than after it
    progress.close()
    counts = health.end_epoch(epoch, step)  # nonfinite_steps, skipped_steps
    own_buffers = every_ranks_buffers(engine.module) if step < micro_batches else None
    average_buffers(engine.module)  # one model to validate and save, also when stopped mid-epoch
    if step < micro_batches:
        summed = totals.summed_over_ranks(engine.device)
        return {"interrupted": True, "step": step,
                "carried": {**summed, **counts, "time_s": time.perf_counter() - start, "data_wait_s": data_wait_s,
                            "rank_buffers": own_buffers}}
    summed = totals.summed_over_ranks(engine.device)
    elapsed = time.perf_counter() - start
    return {"loss": summed["loss"] / summed["count"], "acc": summed["correct"] / summed["count"],
            "lr": lr, "time_s": elapsed, "images_per_s": summed["count"] / elapsed,
            "data_wait_s": data_wait_s, "compute_s": elapsed - data_wait_s, **counts}


@torch.no_grad()
def evaluate(engine, loader, dtype):
    """Loss and top-1 accuracy over the whole validation set (every rank's shard)."""
    engine.eval()
    totals = RunningTotals(engine.device)
    # Only on a terminal: a bar that clears itself leaves a log file's next line (an error) after a carriage return
    for images, labels in tqdm(loader, desc="  validate", disable=not is_main_process() or not sys.stderr.isatty(),
                               dynamic_ncols=True, leave=False):
        images, labels = to_device(images, labels, engine.device, dtype)
        logits = engine(images).float()
        totals.add(F.cross_entropy(logits, labels, reduction="sum"), logits, labels)
    summed = totals.summed_over_ranks(engine.device)
    count = max(summed["count"], 1)
    return {"loss": summed["loss"] / count, "acc": summed["correct"] / count, "images": int(summed["count"])}


def peak_gpu_memory_gib(device):
    """Peak GPU memory allocated by PyTorch on any rank since the last call, in GiB; None on CPU."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return all_reduce({"peak": peak}, device, op=torch.distributed.ReduceOp.MAX)["peak"]


def no_single_rank_allreduce(engine, config):
    """On one rank at ZeRO-0, DeepSpeed still copies every gradient into flat buffers, "all-reduces" them over
    the one rank and copies them back after each step's backward (on a CPU a fifth of a ResNet18 step): turned
    off there, where it changes no value (a configured communication_data_type, which would round, keeps it)."""
    if (engine.world_size == 1 and engine.zero_optimization_stage() == 0
            and "communication_data_type" not in config):
        engine.enable_backward_allreduce = False


def replace_lr_scheduler(engine, section, lr):
    """Give `engine` the scheduler the config's `section` describes, built as deepspeed.initialize builds its
    own, before any step. DeepSpeed's schedulers save only their position (state_dict: last_batch_iteration), so
    a resumed run goes on with these step counts."""
    from deepspeed.runtime import lr_schedules

    # The scheduler built by deepspeed.initialize has set each group's rate to its start (WarmupCosineLR: 0),
    # and WarmupCosineLR takes its peak from the groups: they get the optimizer's rate back first.
    groups = lr_schedules.get_torch_optimizer(engine.optimizer).param_groups
    lr_schedules.update_lr(groups, [lr] * len(groups))
    engine.lr_scheduler = getattr(lr_schedules, section["type"])(engine.optimizer, **section["params"])
