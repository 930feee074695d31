"""SIGINT/SIGTERM become a request to stop after the current step, agreed on by every rank; and a process
started by another stops when that one dies."""
import contextlib
import ctypes
import os
import signal
import sys
import threading

import torch

from .distributed import all_reduce

AGREE_EVERY = 10  # checks between the all-reduces that let several ranks stop at the same step
# A file the launcher makes and rank 0 writes into once the run has finished: a signal after that (`timeout`
# expiring in the teardown) stops nothing, and the launcher says the run finished.
FINISHED_ENV = "TRAINER_FINISHED_FILE"


def say_finished():
    """Rank 0, once every rank is through the run's last collective and the results are written."""
    path = os.environ.get(FINISHED_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        try:
            with open(path, "w") as marker:
                marker.write("finished\n")
        except OSError:  # the launcher then reports the signal, as it did before
            pass


def finished(path):
    if path is None:
        return False
    try:
        with open(path) as marker:
            return marker.read() == "finished\n"
    except OSError:
        return False


def stopped_before_training(signum):
    """The line of a stop by `signum` before the training started (the scripts say it too, before their imports)."""
    return f"Stopped by {signal.Signals(signum).name} before the training started: nothing to save"


@contextlib.contextmanager
def stopped_at_once(on_stop):
    """While a run starts (nothing of it is being saved): SIGINT/SIGTERM end the process at once, after
    on_stop(), with 128 + the signal's number and one line from rank 0. The training loop's StopOnSignal
    then saves before it stops."""
    if threading.current_thread() is not threading.main_thread():  # in-process callers' threads: no handlers
        yield
        return

    def stop(signum, frame):
        if os.environ.get("RANK", "0") == "0":
            print(stopped_before_training(signum), file=sys.stderr, flush=True)
        on_stop()
        sys.stdout.flush()
        os._exit(128 + signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class StopOnSignal:
    def __init__(self, device, world_size):
        self.device = device
        self.world_size = world_size
        self.signal = None
        self.checks = 0
        self._previous = {}

    def __enter__(self):
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signal == signal.SIGINT:  # a second Ctrl-C (run without the launcher,
            if os.environ.get("RANK", "0") == "0":                    # which turns Ctrl-C into one SIGTERM)
                print("\nerror: killed by a second Ctrl-C; --resume auto continues from the last checkpoint "
                      "published, if any", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGKILL)
        self.signal = signum

    @property
    def name(self):
        return signal.Signals(self.signal).name if self.signal else None

    def requested(self):
        """Whether to stop now. With several ranks, all must call this at the same steps."""
        if self.world_size == 1:
            return self.signal is not None
        self.checks += 1
        if self.checks % AGREE_EVERY:
            return False
        return self._agreed()

    def requested_after_epoch(self):
        """Whether to stop after the epoch just saved; every rank calls this then. A signal that reached one rank
        during validation or the save (DeepSpeed's launcher signals one rank after the other) stops them all,
        where that rank alone would leave and the others wait for it in the next epoch's first collective."""
        return self._agreed() if self.world_size > 1 else self.signal is not None

    def _agreed(self):
        votes = all_reduce({"signal": self.signal or 0}, self.device, op=torch.distributed.ReduceOp.MAX)
        if votes["signal"] and self.signal is None:
            self.signal = int(votes["signal"])
        return bool(votes["signal"])


PR_SET_PDEATHSIG = 1


def die_with_parent_call(parent_pid):
    """A function for the child side of a fork (subprocess's preexec_fn): from then on the kernel sends the
    child SIGTERM when `parent_pid` dies, even by SIGKILL (Linux; elsewhere it does nothing). libc is loaded
    here, before the fork, where loading it cannot deadlock."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def call():
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # it died before the prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return call
