"""The machine, versions, commit and date a measurement was taken with, for the JSON it is written to."""
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys

import torch

from deepspeed_image_trainer.utils.failures import usable_cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def environment(command):
    """The machine, versions, commit and date behind a measurement, for the JSON it is written to."""
    import deepspeed
    import torchvision

    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None, "cpu_count": usable_cores(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "deepspeed": deepspeed.__version__,
            "cuda": torch.version.cuda if cuda else None, "pycache_prefix": sys.pycache_prefix,
            "commit": source_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "command": command}


def shown(command):
    """The command as a user would type it in the repository root: no paths of the machine it ran on."""
    return shlex.join("python" if part == sys.executable else os.path.relpath(part, ROOT)
                      if part.startswith(ROOT) else part for part in command)


def source_commit():
    """The git commit of the code that runs: $TRAINER_COMMIT where the copy has no .git (a GPU machine's
    copy of the working tree), else git's HEAD, with "+changes" when the tree differs from it."""
    if os.environ.get("TRAINER_COMMIT"):
        return os.environ["TRAINER_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed else "")


def machine_slug(env):
    """The GPU's name (or "cpu") as a file-name part: "NVIDIA H200" -> "nvidia_h200"."""
    return re.sub(r"[^a-z0-9]+", "_", (env["gpu"] or "cpu").lower()).strip("_")
