"""Plot training curves from logs/training_history.json, or compare several runs on one figure.

    python src/utils.py --history logs/training_history.json --output curves.png
    python src/utils.py --history a/logs/training_history.json b/logs/training_history.json --labels A B
"""
import json
import math
import sys
from pathlib import Path

from ..utils.failures import CliParser, UsageError, check_output_file, path_argument
from ..utils.files import parse_json
from ..utils.text import digits, drawable, error_line


def load_history(path):
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path} is a folder: give its training_history.json")
    if not path.is_file():
        raise UsageError(f"{path}: not a regular file (a FIFO or a device); give a training_history.json"
                         if path.exists() else f"history file not found: {path}")
    try:
        history = parse_json(path.read_text())
    except ValueError as err:  # not JSON, not UTF-8 (a binary file), a whole number beyond 4300 digits
        raise UsageError(f"{path} is not a training history file ({error_line(err)})") from None
    if not isinstance(history, dict) or "epochs" not in history:
        raise UsageError(f"{path} is not a training history file (no \"epochs\" in it)")
    epochs = history["epochs"]
    if not isinstance(epochs, list) or not all(isinstance(e, dict) for e in epochs):
        raise UsageError(f"{path} is not a training history file (its epochs are not a list of records)")
    if not epochs:
        raise UsageError(f"{path} holds no completed epoch yet")
    for index, epoch in enumerate(epochs):
        for key in ("epoch", *REQUIRED, *OPTIONAL):
            value = epoch.get(key)
            if (key in REQUIRED or key == "epoch") and key not in epoch:
                raise UsageError(f"{path} is not a training history file (epochs[{index}] has no {key})")
            if (key in REQUIRED or key == "epoch" or value is not None) and not _number(value):
                raise UsageError(f"{path} is not a training history file (epochs[{index}].{key} is "
                                 f"{json.dumps(value)}, not a number)")
            if _number(value) and MAX_PLOTTED < abs(value) < math.inf:  # an axis from -1e308 to 1e308 fails,
                raise UsageError(f"{path} is not a training history file (epochs[{index}].{key} is "  # and 10**400
                                 f"{_shown(value)}, beyond any figure a run records)")
            if _number(value) and (value < 0 or key.endswith("_acc") and value > 1):  # no run records these
                raise UsageError(f"{path} is not a training history file (epochs[{index}].{key} is {_shown(value)}, "
                                 f"{'not an accuracy' if key.endswith('_acc') else 'below 0'})")
    best = history.get("best")
    best_acc = best.get("val_acc") if isinstance(best, dict) else None
    if best_acc is not None and not (_number(best_acc) and 0 <= best_acc <= 1):  # plotted as the star
        raise UsageError(f"{path} is not a training history file (best.val_acc is {_shown(best_acc) if _number(best_acc) else json.dumps(best_acc)}, not an accuracy)")
    # the star at best's epoch needs both; config names the run in the title (null: an AttributeError)
    if best is not None and not (isinstance(best, dict) and (best.get("epoch") is None or (
            _number(best.get("epoch")) and best_acc is not None))):
        raise UsageError(f"{path} is not a training history file (best is {json.dumps(best)[:80]}, not its epoch "
                         "and val_acc)")
    if not isinstance(history.get("config", {}), dict):
        raise UsageError(f"{path} is not a training history file (config is {json.dumps(history['config'])[:80]}, "
                         "not an object)")
    return history


# What each epoch's record must hold as numbers, and may (older histories, CPU runs).
REQUIRED = ("train_loss", "val_loss", "train_acc", "val_acc")
OPTIONAL = ("ema_val_loss", "ema_val_acc", "lr", "images_per_s", "epoch_wall_s", "epoch_time_s", "peak_gpu_memory_gib",
            "skipped_steps")


MAX_PLOTTED = 1e300  # matplotlib's axis limits overflow (a singular transform) on values near float's range


def _shown(value):
    return f"{value:g}" if isinstance(value, float) or abs(value) <= sys.float_info.max else (
        f"a whole number of {digits(value)} digits")  # inf and nan are floats: digits() has no answer for them


def plain(text):
    """`text` drawn as it is: drawable, and its $ signs not taken for the start of matplotlib's maths ($\\frac$
    in a run's name was a ParseSyntaxException)."""
    return drawable(text).replace("$", r"\$")


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# (history key, title, y-axis label); the last three only when a history records them (skipped steps:
# when there were any).
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")  # matplotlib writes each without extras
PANELS = (("loss", "Loss", "cross-entropy"), ("acc", "Top-1 accuracy", "accuracy"),
          ("lr", "Learning rate (last step of the epoch)", "learning rate"),
          ("images_per_s", "Training throughput", "images / s"),
          ("epoch_wall_s", "Time per epoch (dashed: training loop)", "seconds"),
          ("peak_gpu_memory_gib", "Peak GPU memory (max over ranks)", "GiB"),
          ("skipped_steps", "Optimizer steps skipped (fp16 overflow)", "steps"))


def run_labels(paths):
    """Legend names for several runs: the parts of their history paths that differ."""
    parts = [Path(p).with_suffix("").parts for p in paths]
    head = tail = 0
    while all(len(p) > head + 1 for p in parts) and len({p[head] for p in parts}) == 1:
        head += 1
    while all(len(p) > head + tail + 1 for p in parts) and len({p[-1 - tail] for p in parts}) == 1:
        tail += 1
    labels = ["/".join(p[head:len(p) - tail]) for p in parts]
    return labels if len(set(labels)) == len(labels) else [str(p) for p in paths]


def _recorded(histories, key):
    return any(e.get(key) not in (None, 0) for h in histories for e in h["epochs"])


def _values(epochs, key):
    return [math.nan if e.get(key) is None else e[key] for e in epochs]


def curves_figure(histories, labels=None):
    """Loss and accuracy (train dashed, val solid, the weights' average's val dotted), learning rate, and images/s, the time per epoch (whole
    and training loop), peak GPU memory and skipped fp16 steps when the histories record them (memory is
    null on CPU), per epoch; one colour per run; a star and a
    dotted line at each run's best epoch. Returns the matplotlib figure (close it when done)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    labels = [label and plain(label) for label in labels] if labels else [None] * len(histories)
    panels = [panel for panel in PANELS if panel[0] in ("loss", "acc", "lr") or _recorded(histories, panel[0])]
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), constrained_layout=True,
                             squeeze=False)
    for unused in grid.flat[len(panels):]:
        fig.delaxes(unused)
    axes = {key: ax for (key, _, _), ax in zip(panels, grid.flat)}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    for index, (history, label) in enumerate(zip(histories, labels)):
        colour = colours[index % len(colours)]
        prefix = f"{label}: " if label else ""
        epochs = history["epochs"]
        x = [e["epoch"] for e in epochs]
        for key in ("loss", "acc"):
            axes[key].plot(x, [e[f"train_{key}"] for e in epochs], "o--", color=colour, markersize=3,
                           label=f"{prefix}train")
            axes[key].plot(x, [e[f"val_{key}"] for e in epochs], "s-", color=colour, markersize=3,
                           label=f"{prefix}val")
            if _recorded([history], f"ema_val_{key}"):  # --model_ema
                axes[key].plot(x, _values(epochs, f"ema_val_{key}"), "^:", color=colour, markersize=4,
                               label=f"{prefix}val, weights' average")
        for key in ("lr", "images_per_s", "epoch_wall_s", "peak_gpu_memory_gib", "skipped_steps"):
            if key in axes:
                axes[key].plot(x, _values(epochs, key), "o-", color=colour, markersize=3, label=label)
        if "epoch_wall_s" in axes:
            axes["epoch_wall_s"].plot(x, _values(epochs, "epoch_time_s"), "o--", color=colour, markersize=3)
        best = history.get("best") or {}
        if best.get("epoch") is not None:
            for ax in axes.values():
                ax.axvline(best["epoch"], color=colour, linestyle=":", alpha=0.6)
            axes["acc"].plot([best["epoch"]], [best["val_acc"]], "*", color=colour, markersize=14,
                             label=f"{prefix}best {best['val_acc']:.3f} (epoch {best['epoch']})")

    for key, title, ylabel in panels:
        ax = axes[key]
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if key in ("loss", "acc") or any(labels):
            ax.legend(fontsize="small")
    axes["acc"].set_ylim(0, 1.02)
    axes["lr"].ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    if len(histories) == 1:
        config = histories[0].get("config", {})
        fig.suptitle(plain(f"{labels[0] or config.get('model', 'model')}: {config.get('precision', '')} "
                           f"ZeRO-{config.get('zero_stage', '?')}, {config.get('world_size', '?')} rank(s)"))
    else:
        fig.suptitle(f"{len(histories)} runs: " + ", ".join(str(label) for label in labels))
    return fig


def plot_history(histories, output, labels=None):
    """curves_figure(histories, labels) as a PNG at `output`; returns its path."""
    import matplotlib.pyplot as plt

    fig = curves_figure(histories, labels)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def get_args_parser():
    parser = CliParser(
        description="Plot loss, accuracy, learning rate, images/s and peak GPU memory per epoch, of one run "
                    "or of several on one figure.")
    parser.add_argument("--history", type=path_argument, nargs="+",
                        default=["logs/training_history.json"], metavar="JSON",
                        help="training_history.json of each run")
    parser.add_argument("--labels", nargs="+", metavar="NAME",
                        help="a legend name per --history file (default: the parts of their paths that differ)")
    parser.add_argument("--output", type=path_argument, default="training_curves.png")
    return parser


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    check_output_file(args.output, "--output", PLOT_SUFFIXES)
    if args.labels and len(args.labels) != len(args.history):
        raise UsageError(f"--labels gives {len(args.labels)} name(s) for {len(args.history)} --history file(s)")
    histories = [load_history(path) for path in args.history]
    labels = args.labels or (run_labels(args.history) if len(histories) > 1 else None)
    print(f"curves written to {plot_history(histories, args.output, labels)}")
