"""Files that readers see whole or not at all: written to a temporary name beside them, then renamed."""
import json
import os
import tempfile
from pathlib import Path


def write_json_atomic(path, data):
    """Write JSON so that readers see the old file or the new one, never a partial one. The temporary name
    is unique to this writer: every node's launcher may write the same file into one shared folder, and
    containers often give their processes the same PID."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full disk leaves no half-written temporary file behind
        raise
