"""Process-group setup and the rank-0 helper every piece of rank-0-only I/O goes through."""
import contextlib
import datetime
import functools
import gc
import os
import signal
import socket
import sys
import threading
import warnings

import torch
import torch.distributed as dist

from ..utils.failures import CliError, UsageError


# Seconds a rank waits for the others to join before it says so (a node started by hand before the others).
JOIN_NOTE_AFTER = 10


def init_distributed(on_stop=lambda: None):
    """Join the process group the launcher set up (deepspeed, torchrun), or form a group of one. While a rank
    waits for the others, Ctrl-C or SIGTERM ends it after on_stop().

    NCCL on Linux GPUs; gloo elsewhere (CPU, Windows), which is what DeepSpeed's CPU accelerator uses.
    """
    checked_world_size()  # before DeepSpeed's import, which reads DEEPSPEED_TIMEOUT
    import deepspeed

    # DeepSpeed's ZeRO gathers with torch's all_gather_into_tensor, which torch now deprecates: its warning, once a
    # rank, is about DeepSpeed's code, not the run.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    use_nccl = torch.cuda.is_available() and os.name != "nt"
    _skip_shared_memory_op()
    world, where = int(os.environ["WORLD_SIZE"]), f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if world == 1:
        try:
            deepspeed.init_distributed(dist_backend="nccl" if use_nccl else "gloo", verbose=False)
        except dist.DistError as err:
            if port_taken(err):
                raise UsageError(port_in_use(os.environ["MASTER_PORT"], "MASTER_PORT")) from None
            raise
    else:
        with _said_if_waiting(world, where), _ended_by_signals(on_stop):
            try:
                deepspeed.init_distributed(dist_backend="nccl" if use_nccl else "gloo", verbose=False)
            except dist.DistError as err:  # torch's rendezvous gave up: a C++ message, no traceback needed
                if port_taken(err):  # rank 0 could not listen
                    raise UsageError(port_in_use(os.environ["MASTER_PORT"], "MASTER_PORT")) from None
                reason = str(err).splitlines()[0].rstrip(".")
                raise CliError(f"the {world} ranks (WORLD_SIZE) did not all join at {where} (MASTER_ADDR, "
                               f"MASTER_PORT) within DeepSpeed's timeout, DEEPSPEED_TIMEOUT="
                               f"{os.environ.get('DEEPSPEED_TIMEOUT', 10)} minutes: {reason}; start every rank with "
                               "the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE") from None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), dist.get_world_size()


MAX_RANKS = 2 ** 31 - 1


def checked_world_size():
    """WORLD_SIZE, after checking it, RANK, LOCAL_RANK and MASTER_PORT as a launcher sets them (a group of one
    where none did): whole numbers, the rank below the world size (a RANK of 3 in a WORLD_SIZE of 1 waited for
    good, for peers that cannot come), a port a socket can take; and DEEPSPEED_TIMEOUT where it is set."""
    if os.environ.get("WORLD_SIZE", "1").strip() == "1" and "MASTER_PORT" not in os.environ:
        # a group of one that no launcher started: a free port, as the launcher takes (a second such run, or any
        # process on DeepSpeed's 29500, was refused with advice to leave out the port it never gave)
        os.environ["MASTER_PORT"] = str(free_port())
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, value)
    values = {}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        try:
            values[key] = int(os.environ[key])
        except ValueError:
            raise UsageError(f"{key}={os.environ[key]!r} in the environment is not a whole number") from None
    if values["WORLD_SIZE"] > MAX_RANKS:  # torch's rendezvous store takes a C++ int: a TypeError traceback there
        raise UsageError(f"WORLD_SIZE={values['WORLD_SIZE']} in the environment is more ranks than torch's process "
                         f"group can hold (at most {MAX_RANKS})")
    if values["LOCAL_RANK"] < 0:  # named on its own: the message below named RANK and WORLD_SIZE, as defaulted
        raise UsageError(f"LOCAL_RANK={values['LOCAL_RANK']} in the environment: a rank's index on its node is 0 or more")
    if values["WORLD_SIZE"] < 1 or not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise UsageError(f"RANK={values['RANK']} and WORLD_SIZE={values['WORLD_SIZE']} in the environment: the ranks "
                         "are 0 .. WORLD_SIZE - 1")
    if not 0 < values["MASTER_PORT"] < 65536:
        raise UsageError(f"MASTER_PORT={values['MASTER_PORT']} in the environment is not a port: use 1 .. 65535")
    check_timeout()
    check_address(os.environ["MASTER_ADDR"], "MASTER_ADDR in the environment")
    return values["WORLD_SIZE"]


# DEEPSPEED_TIMEOUT's minutes: torch's rendezvous gave up at once at 0 (a group of one too) and from about 1.5e8
# (now + the timeout in nanoseconds overflows its clock)
TIMEOUT_MINUTES = (1, 10**8)


def check_timeout():
    """Refuse a DEEPSPEED_TIMEOUT, DeepSpeed's timeout in minutes, that DeepSpeed cannot read (int() as it is
    imported: a ValueError in every rank, after the launcher had written the run's config) or torch cannot wait."""
    value = os.environ.get("DEEPSPEED_TIMEOUT")
    if value is None:
        return
    low, high = TIMEOUT_MINUTES
    try:
        minutes = int(value)
    except ValueError:
        raise UsageError(f"DEEPSPEED_TIMEOUT={value!r} in the environment is not a whole number of minutes: use "
                         f"{low} .. {high} (DeepSpeed's default is 10)") from None
    if not low <= minutes <= high:
        raise UsageError(f"DEEPSPEED_TIMEOUT={minutes} in the environment is outside {low} .. {high} minutes, where "
                         "torch's rendezvous gives up at once: use a value in that range (DeepSpeed's default is 10)")


def check_address(address, named):
    """Refuse a rendezvous address that resolves to nothing: torch's store retried it for DeepSpeed's whole
    timeout (10 minutes), without the line that says the rank is waiting."""
    try:
        socket.getaddrinfo(address, None)
    except (socket.gaierror, UnicodeError) as err:
        reason = err.strerror if isinstance(err, socket.gaierror) else "not a host name"
        raise UsageError(f"{named} {address!r} is not an address this machine can find ({reason}): give the first "
                         "node's host name or IP address") from None


@contextlib.contextmanager
def _said_if_waiting(world, where):
    """A line on stderr when the others have not joined within JOIN_NOTE_AFTER seconds."""
    joined = threading.Event()

    def note():
        if not joined.wait(JOIN_NOTE_AFTER):
            print(f"rank {os.environ['RANK']} of {world}: waiting for the other ranks to join at {where} (MASTER_ADDR, "
                  "MASTER_PORT); Ctrl-C stops", file=sys.stderr, flush=True)

    threading.Thread(target=note, daemon=True).start()
    try:
        yield
    finally:
        joined.set()


@contextlib.contextmanager
def _ended_by_signals(on_stop):
    """SIGINT and SIGTERM end the process, after on_stop(), even while the main thread waits inside torch's C++
    rendezvous, where Python runs no signal handler until it returns (minutes later): the signal's number,
    written to a pipe as it arrives (signal.set_wakeup_fd), wakes a thread that ends the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda *_: None) for signum in stops}
    previous_fd = signal.set_wakeup_fd(write_end)

    def watch():
        signum = os.read(read_end, 1)[0]
        if signum in stops:
            print(f"Stopped by {signal.Signals(signum).name} while waiting for the other ranks; nothing was "
                  "trained", file=sys.stderr, flush=True)
            on_stop()
            os._exit(128 + signum)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.write(write_end, b"\0")  # not a signal: the watcher returns
        watcher.join()
        os.close(read_end)
        os.close(write_end)


def _skip_shared_memory_op():
    """Keep DeepSpeed from building its CPU shared-memory all-reduce op at init: only its inference all-reduce
    uses it, yet building it took a CPU machine's first run 25 s, and each run then left one 64 MiB
    /dev/shm file per rank that nothing removed (memory lost until reboot)."""
    import importlib

    # Not `import deepspeed.comm.torch as ...`: deepspeed.comm's `torch` attribute is the torch package.
    deepspeed_comm = importlib.import_module("deepspeed.comm.torch")
    if not torch.cuda.is_available():  # a rename in DeepSpeed shows in the tests: the /dev/shm files come back
        deepspeed_comm.build_shm_op = lambda: None


def local_device():
    """This rank's device: its GPU (LOCAL_RANK), or the CPU."""
    return torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")


def check_port_free(port, named):
    """Refuse a rendezvous port another process listens on (rank 0's store could not bind it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store: a port in TIME_WAIT is free
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            raise UsageError(port_in_use(port, named, err.strerror)) from None


def port_taken(err):
    """Whether torch's rendezvous failed because rank 0's store could not listen on its port."""
    return any(text in str(err) for text in ("EADDRINUSE", "address already in use", "code: -98"))


def port_in_use(port, named, reason="address already in use"):
    return f"{named} {port}: the port is taken on this machine ({reason}); choose another, or leave it out for a free one"


def free_port():
    """A TCP port free on this machine now, for a rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_on_free_port(start, tries=3):
    """start(port) -> CompletedProcess of a process that rendezvouses on `port`; started again on another port
    when another process took the port between free_port() and the bind (EADDRINUSE), as concurrent runs can."""
    for _ in range(tries):
        result = start(free_port())
        if result.returncode == 0 or "EADDRINUSE" not in (result.stdout or "") + (result.stderr or ""):
            break
    return result


def rank() -> int:
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def is_main_process() -> bool:
    return rank() == 0


def rank_zero_only(fn):
    """Run `fn` on rank 0 only; other ranks get None."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) if is_main_process() else None
    return wrapper


def _initialized():
    return dist.is_available() and dist.is_initialized()


def all_reduce(values, device, op=dist.ReduceOp.SUM, group=None):
    """Reduce a dict of numbers over all ranks (sum by default; over `group`'s, default all)."""
    if not _initialized():
        return dict(values)
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return dict(zip(keys, tensor.tolist()))


def differing(values, device):
    """{key: (lowest, highest)} of the numbers of the dict `values` that are not the same on every rank; every
    rank calls this."""
    low, high = (all_reduce(values, device, op) for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX))
    return {key: (low[key], high[key]) for key in sorted(values) if low[key] != high[key]}


@torch.no_grad()
def average_buffers(module):
    """Average floating-point buffers (batch-norm running statistics) over all ranks.

    Each rank updates its statistics from its own shard, and DeepSpeed saves rank 0's; averaging
    makes every rank validate the same model and the checkpoint hold the statistics validated with.
    """
    if not _initialized() or dist.get_world_size() == 1:
        return
    for buffer in module.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer)
            buffer /= dist.get_world_size()


def every_ranks_buffers(module):
    """Each rank's floating-point buffers (its own batch-norm running statistics, before average_buffers), on the
    CPU, one list per rank: an interrupted epoch's checkpoint keeps them, so that a resume on as many ranks goes
    on from each rank's own, as the run that never stopped does (going on from their average differed from it
    by rounding, which bf16 validation made 1e-3 of the loss). None on one rank."""
    if not _initialized() or dist.get_world_size() == 1:
        return None
    ranks = [[] for _ in range(dist.get_world_size())]
    for buffer in module.buffers():
        if buffer.is_floating_point():
            gathered = [torch.empty_like(buffer) for _ in ranks]
            dist.all_gather(gathered, buffer.contiguous())
            for own, value in zip(ranks, gathered):
                own.append(value.cpu())
    return ranks


def restore_own_buffers(module, saved):
    """Put back this rank's buffers of every_ranks_buffers(), where the run has as many ranks as saved them and
    the buffers are those (else the checkpoint's averaged ones stay)."""
    buffers = [buffer for buffer in module.buffers() if buffer.is_floating_point()]
    if not saved or not _initialized() or len(saved) != dist.get_world_size():
        return
    own = saved[dist.get_rank()]
    if len(own) == len(buffers) and all(value.shape == buffer.shape for value, buffer in zip(own, buffers)):
        with torch.no_grad():
            for buffer, value in zip(buffers, own):
                buffer.copy_(value)


def barrier():
    if _initialized():
        dist.barrier()


# How long a rank waits for another's long piece of work (a node's decode of the whole dataset): the default
# group's collectives give up after DeepSpeed's timeout (10 minutes, DEEPSPEED_TIMEOUT).
PATIENT_TIMEOUT = datetime.timedelta(days=1)


def patient_group(timeout=PATIENT_TIMEOUT):
    """A gloo group of every rank whose collectives wait `timeout`; None without a process group. Every rank
    calls this (creating a group is collective), before the work it is to wait for."""
    return dist.new_group(backend="gloo", timeout=timeout) if _initialized() else None


def any_rank(flag, group=None):
    """Whether `flag` is true on any rank (of `group`, a gloo one such as a patient_group); every rank calls
    this."""
    return bool(all_reduce({"flag": bool(flag)}, torch.device("cpu"), dist.ReduceOp.MAX, group)["flag"])


def agreed(fn):
    """fn()'s result, or the UsageError fn raised on any rank (the lowest's) raised on every rank, for rank 0
    alone to report: a rank that stopped alone would leave the others waiting in their next collective, and
    each rank's own line would interleave with the others'. Every rank calls this."""
    try:
        result, failure = fn(), None
    except UsageError as err:
        result, failure = None, str(err)
    if _initialized() and dist.get_world_size() > 1:
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        error = UsageError(failure)
        error.every_rank = True
        raise error
    return result


@contextlib.contextmanager
def alike_on_each_node():
    """For checks before the process group exists, which a rank cannot tell the others of: a UsageError raised
    inside comes from what every rank of a node reads alike, so the node's first rank alone reports it (one
    line, not one per rank); the ranks of another node, which may lack a folder, report their own."""
    try:
        yield
    except UsageError as err:
        err.every_local_rank = True
        raise


def from_rank_zero(value):
    """Rank 0's `value` (pickled: this process's own objects only) on every rank; every rank calls this."""
    if not _initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shut_down():
    """Leave the process group together: a rank that exits while another still works (rank 0 writing a
    report) can abort in the communication backend's teardown ("terminate called without an active
    exception", seen with gloo on CPU)."""
    if _initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_now(status=0):
    """Leave without the interpreter's teardown, once everything is written and shut_down() has run: there a
    rank of a finished 2-rank ZeRO-3 run aborted in gloo (SIGABRT after its last line, seen in CI; gloo
    worker threads releasing tensors as the interpreter goes), which failed the whole run."""
    gc.collect()  # DataLoader workers of frames already left go down now, not in the exit handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)
