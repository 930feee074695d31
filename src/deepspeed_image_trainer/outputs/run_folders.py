"""One run at a time in --checkpoint_dir and --log_dir, and never over another run's results unasked.

- Two locks in each folder (fcntl.flock: the OS releases one however its holder dies), so that a second run
  into the same folders stops at once, naming the first, before it writes anything there:
  `.launch.lock`, held by the run's owner from before it writes into the folders: the launcher, from the end
  of its checks to its exit (its rank 0 is told the launcher's token, --launch_token), or rank 0 of a run
  started without it; and `.lock`, held by rank 0 for its whole life, which keeps the next run out while the
  ranks of a killed launcher still save.
- A new run (no --resume) into folders that hold an earlier run's checkpoints or history stops before
  anything starts: --resume auto continues it, --overwrite replaces it. The earlier run's checkpoints, history
  and CSV rows go only once the new run's first checkpoint is published (EarlierRun), so a new run that fails
  before that leaves them as they were. --resume auto that finds nothing to resume there stops the same way.
- What an interrupted save left (the staging folder, `.ready-*`, `.old-*` of a swap) is tidied up under
  the lock: a swap cut between its two renames is completed or undone.
"""
import os
import secrets
import shutil
import socket
from pathlib import Path

from ..data.cache import OFF
from ..data.check import cache_place, check_cache_outside_data
from ..engine.config import MONITORS, monitor_enabled
from ..utils.failures import UsageError, check_no_broken_link, check_not_taken, check_outside_checkpoints
from .checkpoints import BEST, EXTRA_INFO, LAST, STAGING, read_info, readable
from .history import ARGS_FILE, HISTORY_FILE
from .universal import UNIVERSAL

LOCK_FILE = ".lock"  # rank 0's
LAUNCH_LOCK_FILE = ".launch.lock"  # the run's owner: its launcher, or rank 0 of a run started without one
LOCK_FILES = (LOCK_FILE, LAUNCH_LOCK_FILE)
DS_CONFIG = "ds_config.json"  # in --log_dir: the launcher's resolved config, for the user to read
# an --overwrite launch's, until the run it starts replaces the earlier one's (EarlierRun.retire)
NEXT_DS_CONFIG = ".ds_config.next.json"
_held = []  # open lock files: closing one releases its lock
_made = []  # folders made only to lock them, until the run has them all: a refused run removes them again


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
            state = f"an {EXTRA_INFO} this trainer cannot use"
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


def _in_use(folder, flag, name=LOCK_FILE):
    try:
        holder = ((Path(folder) / name).read_text().splitlines() or ["another run"])[0]
    except OSError:
        holder = "another run"
    return UsageError(f"{flag} {folder} is in use by {holder}: wait for it to finish or stop it (a run stopped by "
                      f"Ctrl-C or SIGTERM saves, and continues with --resume auto)")


def lock(folder, flag, name=LOCK_FILE, note=None):
    """Hold the lock `name` of `folder` until this process ends (or release()); stop with a message naming the
    holder when it is held. The file says who holds it, and `note` on a second line."""
    folder = Path(folder)
    # open() failed on a folder, waited on a FIFO, and followed a link: the file it named was emptied and written
    if os.path.islink(folder / name) or os.path.lexists(folder / name) and not os.path.isfile(folder / name):
        raise UsageError(f"{flag} {folder}: {folder / name}, the lock of the run in it, is not a regular file (a "
                         "folder, FIFO, device or link): remove it")
    missing = [path for path in (folder, *folder.parents) if not path.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    _made.extend(reversed(missing))
    # O_NOFOLLOW: a link made since the check above is refused by the open itself
    f = os.fdopen(os.open(folder / name, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666), "a+")
    if not _locked(f):
        f.close()
        raise _in_use(folder, flag, name)
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n" + (f"{note}\n" if note else ""))
    f.flush()
    _held.append(f)


def release():
    """Give the folders back: the run in them is over (its process may go on, to start another). Those made
    only to lock them for a run refused before it kept them (keep) go again, lock files unlinked while held."""
    for folder in reversed(_made):
        for name in LOCK_FILES:
            (folder / name).unlink(missing_ok=True)
        if not any(folder.iterdir()):
            folder.rmdir()
    _made.clear()
    for f in _held:
        f.close()
    _held.clear()


def keep():
    """The run has started in the folders it holds: a later release leaves them, made for it or not."""
    _made.clear()


def check_unlocked(folder, flag, name=LOCK_FILE):
    """Stop when a run holds `folder`'s lock `name` now; creates nothing."""
    path = Path(folder) / name
    if path.is_file():
        with open(path, "a+") as f:  # for writing: NFS refuses an exclusive flock on a file open for reading
            if not _locked(f):
                raise _in_use(folder, flag, name)


def check_free(args):
    """Stop when a run holds the folders now (its launcher or its rank 0), before anything reads them: a second
    launch read the first run's checkpoint between two of its saves and called it damaged."""
    if os.name == "posix":
        for folder, flag in _folders(args):
            for name in (LAUNCH_LOCK_FILE, LOCK_FILE):
                check_unlocked(folder, flag, name)


def _claimed_for(folder, flag, token):
    """Whether the launcher that started this run holds `folder` for it (its token); stop when another does.
    False when nobody holds it: the launcher has gone, or its folder of that name is on another machine."""
    path = Path(folder) / LAUNCH_LOCK_FILE
    if not path.is_file():
        return False
    with open(path, "a+") as f:  # for writing, as in check_unlocked
        if _locked(f):  # released again as the file closes
            return False
        f.seek(0)
        holder = f.read().splitlines()
    if f"run {token}" not in holder:
        raise _in_use(folder, flag, LAUNCH_LOCK_FILE)
    return True


def _checkpoint_managed(name):
    """Whether the sub-folder `name` of --checkpoint_dir is the run's: a checkpoint, or where a save or a
    conversion stages one."""
    return name in (LAST, BEST, STAGING, UNIVERSAL) or name.startswith(("epoch_", ".old-", ".ready-"))


def check_output_places(args, config):
    """Refuse a log, monitor or cache folder (--cache_dir, or $TRAINER_CACHE_DIR, which holds the data check's
    cache and the default decoded one) in a checkpoint folder, this run's (existing or not) or another's: the
    checkpoint's next save replaced it whole (the CSV monitor's run then ended in a traceback, the cache was gone
    at every run's save), and a log folder made as --checkpoint_dir/last passed for an earlier run's damaged
    checkpoint (the data check's cache file written there did too). And the places of _check_cache_dir,
    _check_json_outputs and _check_checkpoint_dir."""
    places = [(Path(args.log_dir), "--log_dir", None), (*cache_place(), None)]
    if getattr(args, "cache_dir", None) not in (None, OFF):
        places.append((Path(args.cache_dir), "--cache_dir", None))
    for folder, flag, given in places:  # first: resolve() raises RuntimeError on a link loop
        check_no_broken_link(folder, flag, given)
    for folder, flag, given in places[1:]:  # the caches
        check_cache_outside_data(folder, flag, (("--train_dir", args.train_dir), ("--val_dir", args.val_dir)))
    places += _check_json_outputs(args, config)
    own = _check_checkpoint_dir(args)
    for folder, flag, given in places:
        resolved = folder.resolve()
        if own in resolved.parents and _checkpoint_managed(resolved.relative_to(own).parts[0]):
            raise UsageError(f"{flag} {given or folder} is inside --checkpoint_dir {args.checkpoint_dir}'s "
                             f"{resolved.relative_to(own).parts[0]}, which the run replaces whole when it saves: "
                             "write it elsewhere")
        check_outside_checkpoints(folder, flag, given)


def _check_json_outputs(args, config):
    """Refuse a JSON monitor's output_path in another run's log folder (a fresh run replaces the monitor's rows
    there, that run's with them), and a flops profiler report onto a checkpoint's file or a run's history or
    config (its text replaced them); returns the monitors' folders, for the checkpoint checks."""
    places = []
    log_dir = Path(args.log_dir).resolve()
    for section in MONITORS:  # each writes a folder of its job's name into its output_path
        monitor = config.get(section, {})
        if monitor_enabled(monitor) and monitor.get("output_path"):
            places.append((Path(monitor["output_path"]) / str(monitor.get("job_name") or "job"),
                           f"{section}.output_path", monitor["output_path"]))
            resolved = Path(monitor["output_path"]).resolve()
            other = next((folder for folder in (resolved, *resolved.parents) if folder not in (
                log_dir, *log_dir.parents) and (folder / HISTORY_FILE).is_file()), None)
            if other is not None:
                raise UsageError(f"{section}.output_path {monitor['output_path']} is inside {other}, another run's "
                                 "log folder (its history is there), whose monitor files this run would replace: "
                                 "write it elsewhere, or leave output_path out (then under --log_dir)")
    profiler = config.get("flops_profiler", {})
    if monitor_enabled(profiler) and profiler.get("output_file"):
        output = Path(profiler["output_file"])
        check_outside_checkpoints(output.parent, "flops_profiler.output_file", output)
        kept = {HISTORY_FILE: "history", DS_CONFIG: "DeepSpeed config", ARGS_FILE: "flags"}
        if output.name in kept:
            raise UsageError(f"flops_profiler.output_file {output}: a run keeps its {kept[output.name]} under that "
                             "name, which the profiler's report would replace; choose another name")
        check_not_taken(output, "flops_profiler.output_file")  # a FIFO there: the first step waited on it for good
    return places


def _check_checkpoint_dir(args):
    """--checkpoint_dir resolved, after refusing it inside another run's checkpoint (that run's next save replaced
    this run's checkpoints whole, with its own), also where a run holding a folder above will save one, and a
    file (or a link at a scratch name) where the trainer makes its folders: its checkpoints and its scratch (a
    save's staging and swaps, a conversion for another number of ranks), removed and made again; rmtree leaves a
    file or link, and every save, or the resume that needed it, failed."""
    check_no_broken_link(args.checkpoint_dir, "--checkpoint_dir")  # before resolve(), which fails on a loop
    own = Path(args.checkpoint_dir).resolve()
    check_outside_checkpoints(args.checkpoint_dir, "--checkpoint_dir")
    for parent in own.parents:  # the other run's folder before its first save made it a checkpoint
        if (parent / LOCK_FILE).is_file() and _checkpoint_managed(own.relative_to(parent).parts[0]):
            raise UsageError(f"--checkpoint_dir {args.checkpoint_dir} is inside {parent}'s "
                             f"{own.relative_to(parent).parts[0]}, which the run saving its checkpoints in {parent} "
                             "replaces whole when it saves: write it elsewhere")
    for entry in (sorted(own.iterdir()) if own.is_dir() else ()):
        scratch = entry.name.startswith(".")
        if _checkpoint_managed(entry.name) and (not entry.is_dir() or scratch and entry.is_symlink()):
            raise UsageError(f"{Path(args.checkpoint_dir) / entry.name} is a file or a link, where the trainer keeps a "
                             "folder of its own (a checkpoint, or one while it saves or converts one): move it away")
    return own


def check_output_files(args):
    """Refuse a folder, FIFO or device where the run writes its history and DeepSpeed config: the first write by
    rename failed after an epoch of training (status 4), and a resume's read of a FIFO history waited for good."""
    for path, what in ((Path(args.log_dir) / HISTORY_FILE, "history"), (config_path(args), "DeepSpeed config"),
                       (Path(args.log_dir) / ARGS_FILE, "flags")):
        if os.path.lexists(path) and not os.path.isfile(path):
            raise UsageError(f"{path}, where the run writes its {what}, is not a regular file (a folder, FIFO or "
                             "device): remove it, or choose another --log_dir")


def _folders(args):
    folders = [(Path(args.checkpoint_dir), "--checkpoint_dir")]
    if Path(args.log_dir).resolve() != Path(args.checkpoint_dir).resolve():
        folders.append((Path(args.log_dir), "--log_dir"))
    return folders


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


class EarlierRun:
    """The checkpoints and history an earlier run left where an --overwrite run starts: they stay until the new
    run's first checkpoint is published (CheckpointSaver.retire_after_first_save), then go."""

    def __init__(self, checkpoint_dir, log_dir):
        self.checkpoint_dir, self.log_dir = Path(checkpoint_dir), Path(log_dir)
        self.names = _checkpoint_names(self.checkpoint_dir)
        self.history = self.log_dir / HISTORY_FILE

    def retire(self, published):
        """The new run has published its checkpoint under the names `published`: the rest of the earlier run's
        go, and its history, which the new run's replaces."""
        for name in self.names:
            if name not in published and (self.checkpoint_dir / name).exists():
                shutil.rmtree(self.checkpoint_dir / name)
        self.history.unlink(missing_ok=True)
        if (self.log_dir / NEXT_DS_CONFIG).exists():  # the launcher's config of this run
            os.replace(self.log_dir / NEXT_DS_CONFIG, self.log_dir / DS_CONFIG)


def config_path(args):
    """Where the launcher writes its resolved config: ds_config.json, or, where an --overwrite run starts over an
    earlier run's results, beside it until the new run has a checkpoint to put in their place."""
    earlier = args.overwrite and earlier_results(args.checkpoint_dir, args.log_dir)
    return Path(args.log_dir) / (NEXT_DS_CONFIG if earlier else DS_CONFIG)


def claim(args, resume_from):
    """The launcher, after its checks, before it writes anything into the folders: hold them for this run until
    it exits, refuse to overwrite an earlier run unasked. The token it returns tells its rank 0 the folders
    are held for it."""
    token = secrets.token_hex(8)
    try:
        if os.name == "posix":  # fcntl; elsewhere keeping two runs out of one folder is the user's part
            for folder, flag in _folders(args):
                lock(folder, flag, LAUNCH_LOCK_FILE, note=f"run {token}")
                check_unlocked(folder, flag)  # ranks of a run whose launcher was killed, still saving
        check_new_run(args, resume_from)
    except BaseException:
        release()
        raise
    keep()  # the launcher writes its config into them next
    return token


def take(args):
    """Rank 0, before anything reads the checkpoints: hold both folders for this run and tidy them."""
    token = getattr(args, "launch_token", None)
    if os.name == "posix":
        for folder, flag in _folders(args):
            if token is None or not _claimed_for(folder, flag, token):
                lock(folder, flag, LAUNCH_LOCK_FILE)
            lock(folder, flag)
    tidy(args.checkpoint_dir)
    if token is None or not args.overwrite:  # else its launcher just wrote it: a killed --overwrite launch's
        (Path(args.log_dir) / NEXT_DS_CONFIG).unlink(missing_ok=True)


def start(args, resume_from):
    """Rank 0, with the folders taken: refuse to overwrite an earlier run unasked. With --overwrite, the
    EarlierRun to retire once this run's first checkpoint is published."""
    check_new_run(args, resume_from)
    return EarlierRun(args.checkpoint_dir, args.log_dir) if args.overwrite else None
