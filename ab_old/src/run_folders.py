"""One run at a time in --checkpoint_dir and --log_dir, and never over another run's results unasked.

- Rank 0 holds a lock on a `.lock` file in each folder for the whole run (fcntl.flock: the OS releases it
  however the holder dies), so a second run into the same folders stops at once, naming the first.
- A new run (no --resume) into folders that hold an earlier run's checkpoints or history stops before
  anything starts: --resume auto continues it, --overwrite replaces it (its checkpoints and history are
  removed once the lock is held). --resume auto that finds nothing to resume there stops the same way.
- What an interrupted save left (the staging folder, `.ready-*`, `.old-*` of a swap) is tidied up under
  the lock: a swap cut between its two renames is completed or undone.
"""
import os
import shutil
import socket
from pathlib import Path

from checkpoints import BEST, EXTRA_INFO, LAST, STAGING, UNIVERSAL, read_info, readable
from failures import UsageError
from history import HISTORY_FILE

LOCK_FILE = ".lock"
_held = []  # open lock files: closing one releases its lock


def _not_in_children():
    """A forked child (a loader worker) closes its copies: a flock lives while any copy is open, so a worker
    outliving a killed rank 0 by the seconds it takes to notice would keep the next run out."""
    for f in _held:
        os.close(f.fileno())
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_not_in_children)


def _checkpoint_names(checkpoint_dir):
    """Published checkpoint folders under checkpoint_dir (with or without their extra_info.json)."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(p.name for p in checkpoint_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and (p.name in (LAST, BEST) or p.name.startswith("epoch_") or (p / EXTRA_INFO).exists()
                       or (p / "latest").exists()))


def earlier_results(checkpoint_dir, log_dir):
    """What an earlier run left in these folders, one phrase per item (empty when nothing)."""
    checkpoint_dir, history = Path(checkpoint_dir), Path(log_dir) / HISTORY_FILE
    found = []
    for name in _checkpoint_names(checkpoint_dir):
        folder = readable(checkpoint_dir / name)
        if folder is not None:
            state = f"epoch {read_info(folder)['epoch']}"
        elif (checkpoint_dir / name / EXTRA_INFO).exists():
            state = f"unreadable {EXTRA_INFO}"
        else:
            state = f"no {EXTRA_INFO}: damaged"
        found.append(f"{checkpoint_dir / name} ({state})")
    if history.exists():
        found.append(str(history))
    return found


def check_new_run(args, resume_from):
    """Stop a run that would overwrite an earlier run's results without --overwrite."""
    if resume_from is not None or args.overwrite:
        return
    found = earlier_results(args.checkpoint_dir, args.log_dir)
    if not found:
        return
    what = "; ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    if args.resume:
        raise UsageError(f"--resume auto found no checkpoint to continue from, but these hold an earlier run's "
                         f"results: {what}; --resume PATH picks a checkpoint, --overwrite replaces them")
    raise UsageError(f"an earlier run's results are here: {what}; continue it with --resume auto, replace it "
                     f"with --overwrite, or choose another --checkpoint_dir and --log_dir")


def _locked(f):
    """Take the lock of open file `f` now; False when another process holds it."""
    import fcntl

    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _in_use(folder, flag):
    try:
        holder = (Path(folder) / LOCK_FILE).read_text().strip() or "another run"
    except OSError:
        holder = "another run"
    return UsageError(f"{flag} {folder} is in use by {holder}: wait for it to finish or stop it (a run stopped by "
                      f"Ctrl-C or SIGTERM saves, and continues with --resume auto)")


def lock(folder, flag):
    """Hold `folder`'s lock until this process ends; stop with a message naming the holder when it is held."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / LOCK_FILE, "a+")
    if not _locked(f):
        f.close()
        raise _in_use(folder, flag)
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _held.append(f)


def release():
    """Give the folders back: the run in them is over (its process may go on, to start another)."""
    for f in _held:
        f.close()
    _held.clear()


def check_unlocked(folder, flag):
    """Stop when a run holds `folder`'s lock now; creates nothing (the launcher's early check)."""
    path = Path(folder) / LOCK_FILE
    if path.is_file():
        with open(path) as f:
            if not _locked(f):
                raise _in_use(folder, flag)


def tidy(checkpoint_dir):
    """Remove what an interrupted save or conversion left; finish or undo a swap cut between its renames."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return
    for leftover in checkpoint_dir.iterdir():
        if leftover.name in (STAGING, UNIVERSAL) or leftover.name.startswith(".ready-"):
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.name.startswith(".old-"):
            published = checkpoint_dir / leftover.name.removeprefix(".old-")
            if (published / EXTRA_INFO).is_file():
                shutil.rmtree(leftover, ignore_errors=True)
            elif not published.exists():
                os.rename(leftover, published)


def remove_results(checkpoint_dir, log_dir):
    """--overwrite: the earlier run's checkpoints and history go, so that none of them is taken for this run's."""
    for name in _checkpoint_names(Path(checkpoint_dir)):
        shutil.rmtree(Path(checkpoint_dir) / name)
    (Path(log_dir) / HISTORY_FILE).unlink(missing_ok=True)


def take(args):
    """Rank 0, before anything reads the checkpoints: lock both folders for this run and tidy them."""
    if os.name == "posix":  # fcntl; elsewhere keeping two runs out of one folder is the user's part
        lock(args.checkpoint_dir, "--checkpoint_dir")
        if Path(args.log_dir).resolve() != Path(args.checkpoint_dir).resolve():
            lock(args.log_dir, "--log_dir")
    tidy(args.checkpoint_dir)


def start(args, resume_from):
    """Rank 0, with the folders taken: refuse to overwrite an earlier run unasked; with --overwrite, clear it."""
    check_new_run(args, resume_from)
    if args.overwrite:
        remove_results(args.checkpoint_dir, args.log_dir)


def check_launch(args, resume_from):
    """The launcher's early check, before any process starts; changes nothing."""
    if os.name == "posix":
        check_unlocked(args.checkpoint_dir, "--checkpoint_dir")
        check_unlocked(args.log_dir, "--log_dir")
    check_new_run(args, resume_from)
