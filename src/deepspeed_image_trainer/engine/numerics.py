"""Non-finite losses and skipped fp16 steps, counted on the device so that no step waits for the GPU."""
import math

import torch
import torch.distributed as dist

from ..utils.failures import DIVERGED_ADVICE, Diverged


def autocast_grad_scaler(engine):
    """The GradScaler behind DeepSpeed's torch_autocast fp16 (on the engine at ZeRO-0, on the ZeRO
    optimizer otherwise), or None: its skipped steps do not reach engine.skipped_steps."""
    if engine.zero_optimization_stage() == 0:
        return engine.torch_autocast_z0_gradscaler
    return engine.optimizer.torch_autocast_gradscaler


def back_off(scaler):
    """What GradScaler.update() does after a step with inf/NaN gradients: the scale times backoff_factor
    and the count of steps towards the next growth restarted."""
    state = scaler.state_dict()
    scaler.load_state_dict({**state, "scale": state["scale"] * state["backoff_factor"], "_growth_tracker": 0})


class StepHealth:
    """Per epoch: micro-batches whose loss was NaN/inf, and optimizer steps skipped on an fp16 overflow.

    DeepSpeed's fp16 mode counts its skipped steps in engine.skipped_steps; under torch_autocast fp16 a
    GradScaler skips them silently, seen here as a drop of its scale. A run whose loss stays non-finite
    for `max_nonfinite_steps` micro-batches in a row is stopped (Diverged); 0 never stops.
    """

    def __init__(self, engine, max_nonfinite_steps):
        self.engine = engine
        self.limit = max_nonfinite_steps
        device = engine.device
        self.streak = torch.zeros((), dtype=torch.int64, device=device)  # non-finite losses in a row, now
        self.longest = torch.zeros_like(self.streak)  # the longest such run so far
        self.nonfinite = torch.zeros_like(self.streak)
        self.scaler = autocast_grad_scaler(engine)
        self.scaler_skipped = torch.zeros_like(self.streak)
        self._scale_before = None
        self._engine_skipped_before = 0
        self.engine_skipped_start = 0
        self.carried = {}
        # On a GPU a check reads what the check before it copied to the host: the copy has long landed,
        # so nothing waits, and every rank reads the same all-reduced value, so they stop together.
        self.lagging = device.type == "cuda"
        self._host = torch.zeros((), dtype=torch.int64, pin_memory=self.lagging)
        self._event = torch.cuda.Event() if self.lagging else None
        self._copied = False

    def start_epoch(self, carried=None):
        """Reset the epoch's counts; `carried` holds those of an interrupted run's part of this epoch."""
        self.nonfinite.zero_()
        self.scaler_skipped.zero_()
        self.engine_skipped_start = self.engine.skipped_steps
        self.carried = {key: int((carried or {}).get(key, 0)) for key in ("nonfinite_steps", "skipped_steps")}

    def observe(self, loss):
        bad = ~torch.isfinite(loss.detach())
        self.streak.add_(1).mul_(bad)
        torch.maximum(self.longest, self.streak, out=self.longest)
        self.nonfinite.add_(bad)

    def before_step(self):
        self._engine_skipped_before = self.engine.skipped_steps
        if self.scaler is not None and self.scaler._scale is not None:
            self._scale_before = self.scaler._scale.clone()

    def after_step(self):
        if self._scale_before is not None:
            self.scaler_skipped.add_(self.scaler._scale < self._scale_before)  # the scale drops only on a skip
            self._scale_before = None
        if self.scaler is not None and self.engine.skipped_steps > self._engine_skipped_before:
            # ZeRO-1/2/3 skipped the step on its own overflow check (a gradient norm of inf) before the
            # GradScaler's step()/update() ran, so nothing lowered the scale and the next step overflowed
            # too: 149 of the first 428 steps with fp16 + optimizer offload on an H200.
            back_off(self.scaler)

    def _longest_over_ranks(self):
        longest = self.longest.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        return longest

    def check(self, epoch, step):
        """Diverged (to raise) when the loss has been non-finite for `limit` steps in a row, else None.
        Every rank must call this at the same steps; on a GPU it sees the counts as of its previous call."""
        if not self.limit:
            return None
        if not self.lagging:
            return self._diverged(int(self._longest_over_ranks()), epoch, step)
        longest = 0
        if self._copied:
            self._event.synchronize()
            longest = int(self._host)
        self._host.copy_(self._longest_over_ranks(), non_blocking=True)
        self._event.record()
        self._copied = True
        return self._diverged(longest, epoch, step)

    def end_epoch(self, epoch, step):
        """The epoch's counts (the most any rank saw); raises Diverged like `check`, without the lag."""
        counts = torch.stack([self.longest, self.nonfinite, self.scaler_skipped])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        longest, nonfinite, scaler_skipped = counts.tolist()
        diverged = self._diverged(longest, epoch, step)
        if diverged:
            raise diverged
        engine_skipped = self.engine.skipped_steps - self.engine_skipped_start
        return {"nonfinite_steps": nonfinite + self.carried["nonfinite_steps"],
                "skipped_steps": engine_skipped + scaler_skipped + self.carried["skipped_steps"]}

    def _diverged(self, longest, epoch, step):
        if not self.limit or longest < self.limit:
            return None
        return Diverged(f"the training loss was NaN or inf for {longest} steps in a row (by epoch {epoch}, "
                           f"step {step}; --max_nonfinite_steps {self.limit}). " + DIVERGED_ADVICE)

    def check_validation(self, val_loss, epoch):
        """A non-finite validation loss means the weights themselves are broken: stop before saving them."""
        if self.limit and not math.isfinite(val_loss):
            raise Diverged(f"the validation loss after epoch {epoch} is {val_loss}: the weights are no longer "
                           f"finite. " + DIVERGED_ADVICE)
