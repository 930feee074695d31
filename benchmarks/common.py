"""What every benchmark shares: the machine and versions behind a measurement, the command as a user
would type it, and the earlier results an --update run adds to."""
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from machine import environment as run_environment, shown  # noqa: E402,F401 (shown: for the benchmarks)

# The keys of the environment that must match for measurements to share one JSON.
MACHINE = ("gpu", "torch", "torchvision", "deepspeed", "cuda")


def environment():
    return run_environment(shown([sys.executable, *sys.argv]))


def earlier_results(path, env, args=None, settings=()):
    """(results, commands) of the JSON at `path` for --update; refused if another GPU or versions measured it,
    or other values of `args`' `settings` (the flags every row of the JSON must share)."""
    if not path.exists():
        return {}, []
    earlier = json.loads(path.read_text())
    differs = [key for key in MACHINE if earlier["environment"].get(key) != env.get(key)]
    differs += [f"--{key}" for key in settings if earlier["settings"].get(key) != getattr(args, key)]
    if differs:
        sys.exit(f"error: --update: {path} was measured with another {', '.join(differs)}; "
                 f"write to another --output_dir")
    return earlier["results"], earlier.get("commands", [earlier["environment"]["command"]])


def peak_memory(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def fmt(value):
    return "-" if value is None else f"{value:.2f}"


def run_trainer(flags, keep_output=False):
    """launch_deepspeed.py with `flags`, its logs and checkpoints in a temporary folder, as a user runs it:
    {"command", "wall_s", "history"} (and "output" with keep_output), or {"command", "error"}."""
    from deepspeed_image_trainer.engine.distributed import run_on_free_port

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        command = [sys.executable, str(ROOT / "launch_deepspeed.py"), *flags,
                   "--log_dir", str(tmp / "logs"), "--checkpoint_dir", str(tmp / "checkpoints")]
        started = time.perf_counter()
        result = run_on_free_port(lambda port: subprocess.run(command + ["--master_port", str(port)],
                                                              capture_output=True, text=True))
        wall_s = round(time.perf_counter() - started, 2)
        if result.returncode != 0:
            return {"command": shown(command), "error": (result.stdout + result.stderr)[-2000:]}
        history = json.loads((tmp / "logs" / "training_history.json").read_text())
    return {"command": shown(command), "wall_s": wall_s, "history": history,
            **({"output": result.stdout + result.stderr} if keep_output else {})}


def draw_sample_data(folder):
    """The built-in sample dataset at `folder`, as `prepare_data.py sample` draws it (kept when already there)."""
    subprocess.run([sys.executable, str(ROOT / "src" / "prepare_data.py"), "sample", "--output", str(folder)],
                   check=True, stdout=subprocess.DEVNULL)
