"""Decoded images kept on disk between runs: each split of a dataset decoded once, as uint8 squares in one
file that every later run (and every rank of a run) memory-maps instead of decoding again.

An entry is a folder named by a hash of what its pixels depend on: each file's absolute path, size and
modification time, the resize and crop, the decoder and this format's version. A changed, added or removed
image changes the key, so the whole split is decoded again into a new entry, and the entry it replaces (the
same folder with the same settings) is deleted. Entries are written into a temporary folder and renamed into
place once complete: a run killed while filling leaves only the temporary folder, which the next fill of
that key removes. Files that do not decode are zeros in the file and named in the entry's meta.json, so that
every run leaves them out without decoding them again. An entry whose file was cut short or changed since
(its size, and a fingerprint of its first and last MiB, checked at each open) is filled again. Runs that need the same entry at once take turns on a
lock file (fcntl, where there is one): the first fills it, the others wait and read it. Elsewhere two runs
may both fill it; the first rename wins and the other's copy is dropped.
"""
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..utils.failures import UsageError, check_no_broken_link, check_writable
from ..utils.files import (as_open_would, check_regular, fingerprint, parse_json, regular_text,
                           write_json_atomic)

VERSION = 1
IMAGES_FILE, META_FILE = "images.u8", "meta.json"
OFF = "off"


def default_root():
    """Under $TRAINER_CACHE_DIR, by default ~/.cache/deepspeed-image-trainer (the data check's cache too)."""
    from .check import cache_base

    return cache_base() / "decoded"


def cache_root(setting):
    """--cache_dir: a folder, 'off' (None: decode every run), or None for the default folder."""
    if setting == OFF:
        return None
    return Path(setting) if setting else default_root()


def check_usable(args):
    """--data_on_device cache asks for the cache: a --cache_dir that cannot hold it (a file, a read-only place)
    stops the run here, where the run would otherwise go on without one. On every tier, a cache folder that is
    (or lies below) a link to nothing or a link loop stops it too, before the data check reads its results there."""
    from .check import cache_place

    check_no_broken_link(*cache_place())
    if args.cache_dir not in (None, OFF):
        check_no_broken_link(args.cache_dir, "--cache_dir")
    if args.data_on_device != "cache":
        return
    try:
        check_writable(cache_root(args.cache_dir), "--cache_dir")
    except UsageError as err:
        raise UsageError(f"--data_on_device cache needs the decoded-image cache: {err}, or --data_on_device on or "
                         "off") from None


def entry_key(paths, resize, crop, decoder, records=None):
    """The name of the entry holding `paths` decoded (Resize(resize), CenterCrop(crop)) by `decoder`.
    `records` (path -> the data check's record, whose "stat" is [size, mtime_ns]) spare a stat a file."""
    digest = hashlib.sha256(json.dumps([VERSION, decoder, resize, crop]).encode())
    for path in paths:
        record = records.get(path) if records else None
        if record and record.get("stat"):
            size, mtime = record["stat"]
        else:
            stat = os.stat(path)
            size, mtime = stat.st_size, stat.st_mtime_ns
        # surrogatepass: a name that is not UTF-8 (its bytes kept as surrogates) gets a key of its own; a
        # UTF-8 name gets the bytes .encode() gave, so entries filled before stay found
        digest.update(f"\0{os.path.abspath(path)}\0{size}\0{mtime}".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]


def open_entry(folder, count, crop):
    """(images, unreadable): the entry's images as a read-only-in-effect (N, 3, crop, crop) uint8 tensor mapped
    from its file and {index: why} of the files that did not decode (zeros there); None when the entry is
    missing or not the one expected."""
    try:
        meta = parse_json(regular_text(Path(folder) / META_FILE))  # a FIFO: filled again
        path = Path(folder) / IMAGES_FILE
        size = count * 3 * crop * crop
        if (meta.get("version"), meta.get("count"), meta.get("crop")) != (VERSION, count, crop) \
                or path.stat().st_size != size or meta.get("fingerprint") != fingerprint(path):
            return None  # another version's, cut short, or changed since it was filled: filled again
        unreadable = {int(index): str(why) for index, why in meta.get("unreadable", [])}
        if not all(0 <= index < count for index in unreadable):
            return None  # an edited record: filled again
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    if size == 0:
        return torch.empty((0, 3, crop, crop), dtype=torch.uint8), unreadable
    # shared=False maps the file privately: pages are read on first touch, and nothing is written back
    images = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8).view(count, 3, crop, crop)
    return images, unreadable


@contextlib.contextmanager
def _lock(path):
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): the rename below still keeps entries whole
        yield
        return
    check_regular(path)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_or_fill(paths, resize, crop, decoder, root, fill, records=None, source=None):
    """(images, unreadable, filled): the (N, 3, crop, crop) uint8 images of `paths` mapped from the entry under
    `root`, filling it first if there is none (`fill(f)` writes each image's bytes, in order, to the binary
    file f, and returns {index: why} of the files it could not decode), those files, and whether this call
    filled it. `source` (the split's folder) names what an entry replaces."""
    root = Path(root)
    key = entry_key(paths, resize, crop, decoder, records)
    entry = root / key
    found = open_entry(entry, len(paths), crop)
    if found is not None:
        return *found, False
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{key}.lock"):
        found = open_entry(entry, len(paths), crop)
        if found is not None:  # another run filled it while this one waited
            return *found, False
        for stale in root.glob(f".{key}.*.partial"):  # left by a run killed while filling
            shutil.rmtree(stale, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}.", suffix=".partial"))
        as_open_would(partial, folder=True)  # a cache folder others share reads their entries too
        try:
            with open(partial / IMAGES_FILE, "wb") as f:
                unreadable = fill(f)
                f.flush()
                os.fsync(f.fileno())
            write_json_atomic(partial / META_FILE, {
                "version": VERSION, "count": len(paths), "resize": resize, "crop": crop, "decoder": decoder,
                "source": os.path.abspath(source) if source else None,
                "fingerprint": fingerprint(partial / IMAGES_FILE),
                "unreadable": sorted([index, why] for index, why in (unreadable or {}).items())})
            shutil.rmtree(entry, ignore_errors=True)  # an entry open_entry refused (another version, cut short)
            try:
                os.rename(partial, entry)
            except OSError:  # another run's copy got there first (no lock on this system)
                if open_entry(entry, len(paths), crop) is None:
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        _remove_replaced(root, key, {"resize": resize, "crop": crop, "decoder": decoder}, source)
        # Unlinked while held: a run waiting on it, or one that makes a new one, finds the entry once it has it.
        (root / f".{key}.lock").unlink(missing_ok=True)
    return *open_entry(entry, len(paths), crop), True


def _remove_replaced(root, key, settings, source):
    """Delete the entries of the same folder with the same settings that this one replaces (its files
    changed). A run still reading one keeps its mapping (POSIX); elsewhere it stays until the next fill."""
    if not source:
        return
    for folder in root.iterdir():
        if folder.name == key or folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            meta = parse_json(regular_text(folder / META_FILE))
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict):  # damaged: not this trainer's; left to the next fill of its own key
            continue
        if meta.get("source") == os.path.abspath(source) and all(meta.get(k) == v for k, v in settings.items()):
            shutil.rmtree(folder, ignore_errors=True)
            (root / f".{folder.name}.lock").unlink(missing_ok=True)
