import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
# The data check's cache goes to a folder of the test session's own, for the tests and every process they start.
os.environ["TRAINER_CACHE_DIR"] = tempfile.mkdtemp(prefix="test-cache-")

from prepare_data import make_sample_dataset  # noqa: E402

TINY_CLASSES = 3  # odd: ResNet18's parameter count is then odd too (a ZeRO-1/2 bucket alignment bug hid there)
TINY_TRAIN_IMAGES = 48
TINY_VAL_PER_CLASS = 5
TINY_VAL_IMAGES = TINY_CLASSES * TINY_VAL_PER_CLASS  # 15: an odd count, which two ranks cannot split evenly


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A tiny generated image folder: 3 classes, 16 train and 5 val images each, 32 px."""
    root = tmp_path_factory.mktemp("tiny_data")
    make_sample_dataset(root, num_classes=TINY_CLASSES, train_per_class=TINY_TRAIN_IMAGES // TINY_CLASSES,
                        val_per_class=TINY_VAL_PER_CLASS, image_size=32, seed=0)
    return root


def run(command, cwd, timeout=600, **popen):
    """Run a command of the project the way a user would; return the CompletedProcess."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **popen)


def launch(args, cwd, timeout=600, **popen):
    return run([sys.executable, str(ROOT / "launch_deepspeed.py"), *args], cwd, timeout, **popen)


def data_args(data_root):
    return ["--train_dir", str(data_root / "train"), "--val_dir", str(data_root / "val")]


def assert_usage_error_in_process(main, argv, capsys, message):
    """assert_usage_error for a command's main() run in this process; returns (stdout, stderr)."""
    from options import run_cli

    with pytest.raises(SystemExit) as exited:
        run_cli(main, argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 2, err[-2000:]
    assert err.startswith("error: ") and err.count("\n") == 1, err[-2000:]
    assert message in err
    return out, err


def assert_usage_error(result, message):
    """The process failed the way bad input must: exit status 2 and one line on stderr naming the problem."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert message in lines[0]
