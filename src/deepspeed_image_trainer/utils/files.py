"""Files that readers see whole or not at all: written to a temporary name beside them, then renamed; and JSON
read back (parse_json), where nesting too deep to use is a ValueError like any other damage."""
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path


def parse_json(text, max_depth=None):
    """json.loads, where JSON nested too deeply for Python's parser (a RecursionError, near 1000 levels) or, given
    `max_depth`, deeper than that is a ValueError like any other text that is not JSON: each reader's "not valid
    JSON" message then covers it."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None
    if max_depth is not None:
        level = [value] if isinstance(value, (dict, list)) else []
        for _ in range(max_depth):  # the containers one level further down each time: no recursion of our own
            level = [item for container in level
                     for item in (container.values() if isinstance(container, dict) else container)
                     if isinstance(item, (dict, list))]
        if level:
            raise ValueError(f"nested more than {max_depth} levels deep")
    return value


def write_json_atomic(path, data):
    """Write JSON so that readers see the old file or the new one, never a partial one."""
    write_atomic(path, json.dumps(data, indent=2).encode())


def write_atomic(path, data):
    """Write bytes so that readers see the old file or the new one, never a partial one. The temporary name
    is unique to this writer: every node's launcher may write the same file into one shared folder, and
    containers often give their processes the same PID."""
    tmp = written_beside(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def within(path, folder):
    """Whether `path` is `folder` or lies inside it, links and '..' resolved (a link loop as far as it goes:
    Path.resolve raised RuntimeError on one, a traceback before the check that names it)."""
    path, folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return path == folder or folder in path.parents


def check_regular(path):
    """An OSError, as for a file that cannot be opened, when `path` exists and is not a regular file: opening a
    FIFO waits for its other end for good."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise OSError(errno.EINVAL, "not a regular file: a FIFO, a device, a socket or a folder", str(path))


def regular_text(path):
    """The text of the file `path`; an OSError when it is not a regular file (check_regular)."""
    check_regular(path)
    return Path(path).read_text()


def fingerprint(path, edge=2**20):
    """SHA-256 of a file's size, first and last MiB: tells the files of two exports apart without reading
    gigabytes (their weights differ from the first tensor on)."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(edge))
        f.seek(max(edge, size - edge))
        digest.update(f.read())
    return digest.hexdigest()


def umask():
    """The process's umask, read without changing it (os.umask sets it, racing other threads' files)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def as_open_would(path, folder=False):
    """The permissions open() or mkdir() would have given `path`: tempfile makes its files and folders private
    (0600, 0700), and the renamed results (histories, exports, cache entries) stayed so."""
    try:
        os.chmod(path, (0o777 if folder else 0o666) & ~umask())
    except OSError:  # a file system without permission bits: what it gives stands
        pass


def mkstemp_as_open_would(**kwargs):
    fd, name = tempfile.mkstemp(**kwargs)
    as_open_would(name)
    return fd, name


def written_beside(path, data):
    """`data` (bytes) in a new temporary file beside `path`, written through to the disk: its name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = mkstemp_as_open_would(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full disk leaves no half-written temporary file behind
        raise
    return Path(tmp)


def replace_together(pairs):
    """os.replace(new, final) for each (new, final) in order, as one change: when one fails, the finals
    replaced before it get their earlier files back (or go, when they had none), and the error is raised.
    Two files that belong together (an export and its sidecar) are then never left half old, half new."""
    replaced = []  # (final, its earlier file under a temporary name, or None)
    try:
        for new, final in pairs:
            backup = _backup(Path(final))
            try:
                os.replace(new, final)
            except BaseException:
                _remove_backup(backup)
                raise
            replaced.append((Path(final), backup))
    except BaseException:
        for final, backup in reversed(replaced):
            if backup is not None:
                os.replace(backup, final)
                backup.parent.rmdir()
            else:
                final.unlink(missing_ok=True)
        raise
    for _, backup in replaced:
        _remove_backup(backup)


def _backup(final):
    """A hard link to `final` (a copy where links cannot be made) in a temporary folder beside it, or None."""
    if not final.exists():
        return None
    folder = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        try:
            os.link(final, folder / final.name)
        except OSError:  # no hard links on this file system, or an immutable file (whose replace then fails)
            shutil.copy2(final, folder / final.name)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder / final.name


def _remove_backup(backup):
    if backup is not None:
        backup.unlink(missing_ok=True)
        backup.parent.rmdir()


def save_safetensors(state_dict, path, metadata):
    """safetensors' save_file, whose failed writes (a full disk) raise SafetensorError: as the OSError they are."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(state_dict, str(path), metadata={k: json.dumps(v) for k, v in metadata.items()})
    except SafetensorError as err:  # "Error while serializing: I/O error: File too large (os error 27)"
        code = re.search(r"\(os error (\d+)\)", str(err))
        raise (OSError(int(code[1]), os.strerror(int(code[1]))) if code else OSError(str(err).splitlines()[0])) from err
