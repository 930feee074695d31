"""Plot training curves from logs/training_history.json.

    python src/utils.py --history logs/training_history.json --output curves.png
"""
import argparse
import json
from pathlib import Path

from options import UsageError, run_cli


def load_history(path):
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"history file not found: {path}")
    try:
        history = json.loads(path.read_text())
        epochs = history["epochs"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UsageError(f"{path} is not a training history file ({err})") from None
    if not epochs:
        raise UsageError(f"{path} holds no completed epoch yet")
    return history


def plot_history(history, output):
    """Loss, accuracy (train vs val) and learning rate per epoch, side by side, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = history["epochs"]
    x = [e["epoch"] for e in epochs]
    fig, (loss_ax, acc_ax, lr_ax) = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    for ax, key, title in ((loss_ax, "loss", "Loss"), (acc_ax, "acc", "Top-1 accuracy")):
        ax.plot(x, [e[f"train_{key}"] for e in epochs], "o-", label="train")
        ax.plot(x, [e[f"val_{key}"] for e in epochs], "s-", label="val")
        ax.set_title(title)
        ax.legend()
    acc_ax.set_ylim(0, 1)
    best = history.get("best") or {}
    if best.get("epoch") is not None:
        acc_ax.axvline(best["epoch"], color="grey", linestyle=":", label="best")
        acc_ax.annotate(f"best {best['val_acc']:.3f}", (best["epoch"], best["val_acc"]),
                        textcoords="offset points", xytext=(5, -15))
    lr_ax.plot(x, [e["lr"] for e in epochs], "o-", color="tab:green")
    lr_ax.set_title("Learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    for ax in (loss_ax, acc_ax, lr_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    config = history.get("config", {})
    fig.suptitle(f"{config.get('model', 'model')}: {config.get('precision', '')} ZeRO-{config.get('zero_stage', '?')}, "
                 f"{config.get('world_size', '?')} rank(s)")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output


def main(argv=None):
    parser = argparse.ArgumentParser(description="Plot loss, accuracy and learning rate per epoch.")
    parser.add_argument("--history", default="logs/training_history.json")
    parser.add_argument("--output", default="training_curves.png")
    args = parser.parse_args(argv)
    print(f"curves written to {plot_history(load_history(args.history), args.output)}")


if __name__ == "__main__":
    run_cli(main)
