"""Why a training run stops before its last epoch, and what to do about it.

Each cause is one exception with its own exit status, reported by `run_cli` as one line on stderr:

    2  bad input (UsageError, checked before anything starts)
    3  the loss stayed NaN/inf (Diverged)
    4  a checkpoint or the history could not be written (WriteFailed)
    5  the GPU ran out of memory (OutOfMemory)
"""
import argparse
import contextlib
import os
import tempfile
from pathlib import Path


class CliError(Exception):
    """A reason to stop that the user can act on: one line on stderr, no traceback, exit status `exit_status`
    (reported by options.run_cli)."""
    exit_status = 1
    every_rank = False  # True: every rank raises it at the same point, and rank 0 alone reports it
    # True: raised before the ranks can talk, from what a node's ranks all read alike (flags, environment, files):
    # the node's first rank alone reports it
    every_local_rank = False


class UsageError(CliError):
    """Bad input from the user: reported as one line on stderr with exit status 2, no traceback."""
    exit_status = 2


class Diverged(CliError):
    exit_status = 3
    every_rank = True  # the ranks agree on the step, so rank 0 alone reports it


class WriteFailed(CliError):
    exit_status = 4


class OutOfMemory(CliError):
    exit_status = 5


# A resume keeps the learning rate and precision (outputs/record.py): those call for a new run.
DIVERGED_ADVICE = ("The run stopped without saving: the checkpoints and history of earlier epochs, if any, are "
                   "intact. Continue from them with --resume auto and --clip_grad 1, or start again (--overwrite) "
                   "with a lower --learning_rate or --bf16 rather than --fp16 (--max_nonfinite_steps 0 never stops)")


def first_rank_of_node():
    """Whether this process is its node's first rank (LOCAL_RANK 0), or not one of a launcher's ranks (a LOCAL_RANK
    left in a shell without a WORLD_SIZE above 1 keeps a script's refusals printed)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" or os.environ.get("WORLD_SIZE", "1").strip() in ("", "1")


class CliParser(argparse.ArgumentParser):
    """argparse's parser whose refusals (an unknown flag, a value of the wrong type) are one `error:` line and exit
    status 2, as every other refusal is, rather than the usage text."""

    def error(self, message):
        # a node's ranks parse the same flags: its first rank alone says so (CliError.every_local_rank)
        self.exit(2, f"error: {message} (--help lists the flags)\n" if first_rank_of_node() else None)


def path_argument(value):
    """argparse `type=` of a file or folder argument: "" (an unset shell variable, most likely) is refused, where
    os.scandir("") failed in a traceback and Path("") read or wrote the current folder; so is a path with a name
    longer than its file system allows (too_long_name)."""
    if value == "":
        raise argparse.ArgumentTypeError("empty: give a path ('' names no file or folder)")
    problem = too_long_name(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def name_max(path):
    """The longest name (bytes) the file system of `path`'s nearest existing folder allows; 255 where it does not
    say."""
    folder = Path(path).absolute()
    for candidate in (folder, *folder.parents):
        if os.path.isdir(candidate):  # isdir: False, not an OSError, for a name too long itself
            try:
                return os.pathconf(candidate, "PC_NAME_MAX")
            except (OSError, ValueError, AttributeError):  # no pathconf (Windows) or no limit said
                break
    return 255


def shortened(path, keep=20):
    """`path` with each name longer than 2 * `keep` characters cut to its first `keep` ones, for a message."""
    return os.sep.join(part if len(part) <= 2 * keep else f"{part[:keep]}...({len(os.fsencode(part))} bytes)"
                       for part in str(path).split(os.sep))


def too_long_name(path):
    """What to say of a path with a name in it longer than its file system allows, or None: every open or
    makedirs of it failed in an OSError [Errno 36] traceback (or a write's 'free disk space')."""
    longest = max((len(os.fsencode(part)) for part in Path(path).parts), default=0)
    if longest <= 14:  # POSIX's least NAME_MAX: no file system to ask
        return None
    limit = name_max(path)
    if longest > limit:
        return f"{shortened(path)}: a name in it is longer than the file system allows ({limit} bytes)"
    return None


def check_name_lengths(path, flag):
    """UsageError for a path with a name longer than its file system allows (too_long_name)."""
    problem = too_long_name(path)
    if problem:
        raise UsageError(f"{flag} {problem}")


def check_no_broken_link(folder, flag, given=None):
    """Refuse an output folder that is, or lies below, a link to nothing or a link loop: taken for a folder yet to
    make, it passed the checks and its mkdir failed in a traceback (after the work, in evaluate and memory_profile)."""
    folder = Path(folder)
    broken = next((p for p in (folder, *folder.absolute().parents) if p.is_symlink() and not p.exists()), None)
    if broken is not None:
        raise UsageError(f"{flag} {given or folder}: {broken} is a link to nothing or a link loop; remove it or "
                         f"choose another {flag}")


def check_writable(folder, flag):
    """Refuse an output folder that cannot be created or written, before any training; leaves nothing."""
    check_name_lengths(folder, flag)  # Path.exists raised on it
    folder = Path(folder)
    check_no_broken_link(folder, flag)
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{flag} {folder}: {existing} is not a folder; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {folder}: {existing} is not writable; fix its permissions or choose another {flag}")
    try:  # what the permission bits do not tell (root on a read-only mount, /proc): a file made and gone again
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UsageError(f"{flag} {folder}: cannot write in {existing} ({err.strerror or err}); choose another "
                         f"{flag}") from None


def check_counts(args, **minimums):
    """Refuse a flag below its minimum (--batch_size 0, --num_workers -1) before any work."""
    for name, minimum in minimums.items():
        if getattr(args, name) < minimum:
            raise UsageError(f"--{name} must be at least {minimum}, got {getattr(args, name)}")


def usable_cores():
    """The cores this process may run on (taskset): on a host shared by several runs, not every core."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# DataLoader workers are processes, each with its own copy of the dataset: --num_workers 100000 passed every check
# and a run would fork them until the machine ground to a halt or fork failed in a traceback.
WORKERS_PER_CPU = 8


def check_num_workers(num_workers):
    """Refuse more DataLoader workers (per rank) than WORKERS_PER_CPU per CPU this process may use."""
    cpus = usable_cores()
    if num_workers > WORKERS_PER_CPU * cpus:
        raise UsageError(f"--num_workers {num_workers} is more than {WORKERS_PER_CPU} DataLoader worker processes per "
                         f"CPU this process may use ({cpus} CPU(s)): use at most {WORKERS_PER_CPU * cpus}")


def check_output_file(path, flag, suffixes):
    """Refuse an output file name that is taken by what is not a regular file (check_not_taken), has a suffix other
    than `suffixes`, or cannot be written, or is inside a checkpoint folder."""
    check_name_lengths(path, flag)
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        raise UsageError(f"{flag} {path}: use a file name ending in " + ", ".join(suffixes))
    check_not_taken(path, flag)
    check_outside_checkpoints(path.parent, flag, path)  # first: check_writable makes a file in the folder
    check_writable(path.parent, flag)


def check_not_taken(path, flag, folder=None):
    """Refuse an output file's name taken by what is not a regular file, before any work: the write over a folder,
    a FIFO or socket (savefig seeks) or a link into a missing folder ended in a traceback, and a device took it whole.
    `folder`: the value of `flag` when it names the folder and the tool the file in it (evaluate's report.json)."""
    path = Path(path)
    if not os.path.lexists(path) or path.is_file():
        return
    what = "a folder" if path.is_dir() else "not a regular file (a FIFO, a socket, a device or a link to nothing)"
    if folder is not None:
        raise UsageError(f"{flag} {folder}: {path} is {what}: move it away or choose another {flag}")
    raise UsageError(f"{flag} {path} is {what}: " + ("give a file name inside it" if path.is_dir()
                                                     else "move it away or give another file name"))


CHECKPOINT_DESCRIPTION = "extra_info.json"  # the file that makes a folder a checkpoint of this trainer


# Where a run stages a checkpoint inside its --checkpoint_dir (a save, a conversion, a swap cut short): what is
# found there at the run's next save or start is removed (outputs/run_folders.tidy)
SCRATCH_NAMES, SCRATCH_PREFIXES = (".staging", ".universal"), (".ready-", ".old-")
LOCK_NAMES = (".lock", ".launch.lock")  # a run's folders hold one of these (outputs/run_folders.py)


def _checkpoint_folder(folder):
    """Whether `folder` is a run's --checkpoint_dir: it holds a run's lock or a published checkpoint."""
    try:
        return any((folder / name).is_file() for name in LOCK_NAMES) or any(
            (child / CHECKPOINT_DESCRIPTION).is_file() for child in folder.iterdir())
    except OSError:
        return False


def check_outside_checkpoints(folder, flag, given=None):
    """Refuse an output in (or below) a checkpoint folder, which its run replaces whole when it saves that
    checkpoint again: the next save removed an export, an evaluation or a plot written there; and one in a run's
    scratch folder (.staging, .universal, .ready-*, .old-*), which its next save or start removes."""
    check_no_broken_link(folder, flag, given)  # first: resolve() raises RuntimeError on a link loop
    resolved = Path(folder).resolve()
    inside = next((f for f in (resolved, *resolved.parents) if (f / CHECKPOINT_DESCRIPTION).is_file()), None)
    if inside is not None:
        raise UsageError(f"{flag} {given or folder} is inside the checkpoint {inside}, which a run replaces whole "
                         "when it saves it again: write it elsewhere")
    scratch = next((f for f in (resolved, *resolved.parents) if (f.name in SCRATCH_NAMES or f.name.startswith(
        SCRATCH_PREFIXES)) and _checkpoint_folder(f.parent)), None)
    if scratch is not None:
        raise UsageError(f"{flag} {given or folder} is inside {scratch}, where a run stages its checkpoints and "
                         "which it removes at its next save or start: write it elsewhere")


# torch.save reports a failed write from its C++ zip writer as a RuntimeError, not an OSError.
TORCH_WRITE_ERRORS = ("PytorchStreamWriter", "iostream error", "unexpected pos", "file write failed")


def _write_error_detail(err):
    """The OS error's text, or for torch.save's RuntimeErrors the first one raised (the later ones only
    say the zip file ended early); None when `err` is not a failed write."""
    if isinstance(err, OSError):
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    chain = [err]
    while isinstance(chain[-1].__context__, RuntimeError):
        chain.append(chain[-1].__context__)
    if not any(marker in str(e) for e in chain for marker in TORCH_WRITE_ERRORS):
        return None
    return f"torch.save failed ({str(chain[-1]).splitlines()[0].strip()})"


@contextlib.contextmanager
def stop_on_write_error(what, folder_flag, retry="run again (--resume auto continues from the last checkpoint)"):
    """Turn a failed write (disk full, permissions) into WriteFailed naming the file and the OS error.

    Usable as a decorator. Checkpoints and the history are published with renames, so what an earlier
    epoch wrote stays valid whatever broke.
    """
    try:
        yield
    except (OSError, RuntimeError) as err:
        detail = _write_error_detail(err)
        if detail is None:
            raise
        raise WriteFailed(f"cannot write the {what}: {detail}. The files written before are intact; free disk "
                          f"space or fix the permissions (or choose another {folder_flag}) and {retry}") from None
