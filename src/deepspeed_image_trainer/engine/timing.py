"""Where a run's wall time goes before its first optimizer step, for the history and the first epoch line.

The launcher passes the moments it started and it spawned the `deepspeed` runner to the training
processes, so the startup counts from the command a user typed; run directly (`deepspeed ...`,
`torchrun`, `python`), it counts from the training process's own start.
"""
import os
import time

LAUNCHED_AT_ENV = "TRAINER_LAUNCHED_AT"
SPAWNED_AT_ENV = "TRAINER_SPAWNED_AT"


def _moment(name):
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


class StartupClock:
    """Laps from the launcher's start to the end of the first optimizer step, in seconds of wall time."""

    def __init__(self, process_started):
        launched, spawned = _moment(LAUNCHED_AT_ENV), _moment(SPAWNED_AT_ENV)
        self.started = launched or process_started
        self.phases = {}
        if launched and spawned:
            self.phases["launcher_s"] = spawned - launched  # its imports, the data check, the config
            self.phases["deepspeed_launcher_s"] = process_started - spawned  # runner and launch.py
        self.last = process_started
        self.done = False

    def lap(self, name):
        now = time.time()
        self.phases[f"{name}_s"] = now - self.last
        self.last = now

    def first_step(self, device):
        """End the startup after the first optimizer step (waiting for the GPU to finish it)."""
        if self.done:
            return
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        self.lap("first_step")
        self.done = True

    def summary(self):
        return {"startup_s": round(self.last - self.started, 3),
                "phases": {name: round(seconds, 3) for name, seconds in self.phases.items()}}

    def since_start(self):
        return time.time() - self.started

    def line(self):
        summary = self.summary()  # the figures the history records, so the two never round apart
        phases = ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {seconds:.1f}"
                           for name, seconds in summary["phases"].items())
        return f"First optimizer step {summary['startup_s']:.1f} s after the start ({phases})"
