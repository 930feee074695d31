"""src/utils.py: the curves figure of one run or of several, from synthetic histories (no training)."""
import json
import math

import matplotlib.pyplot as plt
import pytest

from deepspeed_image_trainer.outputs.plots import curves_figure, main, run_labels
from deepspeed_image_trainer.utils.failures import UsageError


def synthetic_history(epochs, best_epoch, memory=None, throughput=True, skipped=0):
    records = []
    for epoch in range(1, epochs + 1):
        record = {"epoch": epoch, "train_loss": 2.0 / epoch, "train_acc": 0.1 * epoch, "val_loss": 2.2 / epoch,
                  "val_acc": 0.5 if epoch == best_epoch else 0.1 * epoch / 2, "lr": 1e-3 / epoch,
                  "peak_gpu_memory_gib": memory, "skipped_steps": skipped if epoch == 1 else 0}
        if throughput:
            record.update(images_per_s=100.0 + epoch, epoch_time_s=2.0, epoch_wall_s=2.5 + epoch)
        records.append(record)
    return {"config": {"model": "ResNet18Animals90", "precision": "bf16", "zero_stage": 2, "world_size": 1},
            "epochs": records, "best": {"epoch": best_epoch, "val_acc": 0.5}}


def panels(fig):
    return {ax.get_title(): ax for ax in fig.axes}


def labelled_lines(ax):
    return [line for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_gpu_run_gets_throughput_and_memory_panels():
    fig = curves_figure([synthetic_history(4, best_epoch=3, memory=5.5)])
    try:
        axes = panels(fig)
        assert set(axes) == {"Loss", "Top-1 accuracy", "Learning rate (last step of the epoch)",
                             "Training throughput", "Time per epoch (dashed: training loop)",
                             "Peak GPU memory (max over ranks)"}
        whole, loop = axes["Time per epoch (dashed: training loop)"].get_lines()[:2]
        assert list(whole.get_ydata()) == [3.5, 4.5, 5.5, 6.5] and list(loop.get_ydata()) == [2.0] * 4
        assert loop.get_linestyle() == "--"
        assert axes["Training throughput"].get_ylabel() == "images / s"
        assert list(axes["Training throughput"].get_lines()[0].get_ydata()) == [101.0, 102.0, 103.0, 104.0]
        assert list(axes["Peak GPU memory (max over ranks)"].get_lines()[0].get_ydata()) == [5.5] * 4
        assert all(ax.get_xlabel() == "epoch" and ax.get_ylabel() for ax in fig.axes)
        accuracy = axes["Top-1 accuracy"]
        assert [line.get_label() for line in labelled_lines(accuracy)] == ["train", "val", "best 0.500 (epoch 3)"]
        best = labelled_lines(accuracy)[-1]
        assert (list(best.get_xdata()), list(best.get_ydata())) == ([3], [0.5])
        assert "ZeRO-2" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_cpu_run_has_no_memory_panel_and_old_histories_no_throughput_panel():
    fig = curves_figure([synthetic_history(3, best_epoch=1)])  # peak_gpu_memory_gib null: CPU
    assert "Peak GPU memory (max over ranks)" not in panels(fig) and "Training throughput" in panels(fig)
    plt.close(fig)
    fig = curves_figure([synthetic_history(3, best_epoch=1, throughput=False)])
    assert set(panels(fig)) == {"Loss", "Top-1 accuracy", "Learning rate (last step of the epoch)"}
    plt.close(fig)


def test_skipped_fp16_steps_get_a_panel_when_there_were_any():
    fig = curves_figure([synthetic_history(3, best_epoch=1, skipped=7)])
    try:
        panel = panels(fig)["Optimizer steps skipped (fp16 overflow)"]
        assert list(panel.get_lines()[0].get_ydata()) == [7, 0, 0]
    finally:
        plt.close(fig)


def test_several_runs_on_one_figure_one_colour_each():
    runs = [synthetic_history(5, best_epoch=4, memory=3.0), synthetic_history(3, best_epoch=2, memory=None)]
    fig = curves_figure(runs, ["lr 1e-3", "lr 3e-3"])
    try:
        axes = panels(fig)
        loss_lines = labelled_lines(axes["Loss"])
        assert [line.get_label() for line in loss_lines] == ["lr 1e-3: train", "lr 1e-3: val",
                                                            "lr 3e-3: train", "lr 3e-3: val"]
        assert [len(line.get_xdata()) for line in loss_lines] == [5, 5, 3, 3]
        colours = [line.get_color() for line in loss_lines]
        assert colours[0] == colours[1] != colours[2] == colours[3]
        assert [line.get_label() for line in labelled_lines(axes["Training throughput"])] == ["lr 1e-3", "lr 3e-3"]
        assert axes["Learning rate (last step of the epoch)"].get_legend() is not None
        # One run recorded GPU memory: the panel is there, the CPU run's line is empty (NaN).
        memory = labelled_lines(axes["Peak GPU memory (max over ranks)"])
        assert list(memory[0].get_ydata()) == [3.0] * 5 and all(y != y for y in memory[1].get_ydata())
        stars = [line for line in labelled_lines(axes["Top-1 accuracy"]) if "best" in line.get_label()]
        assert [(list(s.get_xdata()), s.get_color()) for s in stars] == [([4], colours[0]), ([2], colours[2])]
        assert fig._suptitle.get_text() == "2 runs: lr 1e-3, lr 3e-3"
    finally:
        plt.close(fig)


def test_run_labels_are_the_differing_parts_of_the_paths():
    assert run_labels(["runs/a/logs/training_history.json", "runs/b/logs/training_history.json"]) == ["a", "b"]
    assert run_labels(["x/logs/training_history.json", "y/z/logs/training_history.json"]) == ["x", "y/z"]
    assert run_labels(["h.json", "h.json"]) == ["h.json", "h.json"]


def test_compare_cli_writes_one_png(tmp_path, capsys):
    paths = []
    for name, best in (("a", 2), ("b", 3)):
        path = tmp_path / name / "logs/training_history.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(synthetic_history(3, best_epoch=best, memory=1.0)))
        paths.append(str(path))
    output = tmp_path / "compare.png"
    main(["--history", *paths, "--output", str(output)])
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"curves written to {output}" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--labels gives 1 name"):
        main(["--history", *paths, "--labels", "only-one", "--output", str(output)])


@pytest.mark.parametrize("damage, message", [
    (lambda h: h["epochs"][1].update(lr="abc"), 'epochs[1].lr is "abc", not a number'),
    (lambda h: h["epochs"][0].update(epoch="one"), 'epochs[0].epoch is "one", not a number'),
    (lambda h: h["epochs"][2].pop("val_acc"), "epochs[2] has no val_acc"),
    (lambda h: h["epochs"][2].update(val_acc=None), "epochs[2].val_acc is null, not a number"),
    # an axis from -1e308 to 1e308: matplotlib's LinAlgError (singular matrix)
    (lambda h: h["epochs"][1].update(images_per_s=-1e308),
     "epochs[1].images_per_s is -1e\\+308, beyond any figure a run records"),
    (lambda h: h["epochs"][0].update(train_loss=10**400),  # an OverflowError where it is compared as a float
     "epochs[0].train_loss is a whole number of 401 digits, beyond any figure a run records"),
    (lambda h: h["best"].update(val_acc=10**400), "best.val_acc is a whole number of 401 digits, not an accuracy"),
    (lambda h: h["epochs"][1].update(val_acc=1.5), "epochs[1].val_acc is 1.5, not an accuracy"),
    (lambda h: h["epochs"][2].update(val_loss=-1e300), "epochs[2].val_loss is -1e\\+300, below 0"),
    (lambda h: h.update(epochs={"a": 1}), "its epochs are not a list of records"),
    (lambda h: h.pop("epochs"), 'no "epochs" in it'),
    # each a traceback before: digits() of an infinity, best without its val_acc, a config of null
    (lambda h: h["epochs"][0].update(val_acc=math.inf), "epochs[0].val_acc is inf, not an accuracy"),
    (lambda h: h["epochs"][0].update(val_loss=-math.inf), "epochs[0].val_loss is -inf, below 0"),
    (lambda h: h.update(best={"epoch": "x"}), 'best is {"epoch": "x"}, not its epoch and val_acc'),
    (lambda h: h.update(config=None), "config is null, not an object")])
def test_a_history_with_values_of_the_wrong_kind_is_one_error(tmp_path, damage, message):
    history = synthetic_history(3, best_epoch=2)
    damage(history)
    path = tmp_path / "training_history.json"
    path.write_text(json.dumps(history))
    with pytest.raises(UsageError, match=f"{path} is not a training history file \\({message}\\)".replace(
            "[", "\\[").replace("]", "\\]")):
        main(["--history", str(path), "--output", str(tmp_path / "curves.png")])


def test_labels_and_names_with_dollar_signs_are_drawn_as_they_are(tmp_path):
    """matplotlib read "$\\frac$" in a --labels name (or a run's folder name) as maths: a ParseSyntaxException."""
    paths = []
    for name in ("$\\frac{a}$", "$x_$"):
        path = tmp_path / name / "training_history.json"
        path.parent.mkdir()
        path.write_text(json.dumps(synthetic_history(2, best_epoch=1)))
        paths.append(str(path))
    main(["--history", *paths, "--output", str(tmp_path / "runs.png")])
    main(["--history", paths[0], "--labels", "$\\frac$", "--output", str(tmp_path / "one.png")])
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in ("runs.png", "one.png"))


def test_a_history_path_that_is_a_folder_or_binary_says_so(tmp_path):
    with pytest.raises(UsageError, match=f"{tmp_path} is a folder: give its training_history.json"):
        main(["--history", str(tmp_path), "--output", str(tmp_path / "curves.png")])
    with pytest.raises(UsageError, match="/dev/zero: not a regular file"):
        main(["--history", "/dev/zero", "--output", str(tmp_path / "curves.png")])
    (tmp_path / "model.pt").write_bytes(b"PK\x03\x04\x80\xff" * 20)  # an export given by mistake
    with pytest.raises(UsageError, match="model.pt is not a training history file .*can't decode byte"):
        main(["--history", str(tmp_path / "model.pt"), "--output", str(tmp_path / "curves.png")])


@pytest.mark.parametrize("kind, message", [
    ("folder", "is a folder: give a file name inside it"),
    ("fifo", "is not a regular file (a FIFO, a socket, a device or a link to nothing): move it away or give another "
             "file name"),
    ("device", "is not a regular file"), ("link to nothing", "is not a regular file")],
    ids=["folder", "fifo", "device", "link to nothing"])
def test_an_output_name_taken_by_what_is_not_a_file_is_one_error(tmp_path, capsys, kind, message):
    """A FIFO at --output ended in a traceback from savefig (it seeks), a link into a missing folder too."""
    import os

    from conftest import assert_usage_error_in_process

    path = tmp_path / "history.json"
    path.write_text(json.dumps(synthetic_history(2, best_epoch=2)))
    output = tmp_path / "curves.png"
    {"folder": output.mkdir, "fifo": lambda: os.mkfifo(output), "device": lambda: output.symlink_to("/dev/null"),
     "link to nothing": lambda: output.symlink_to(tmp_path / "missing/curves.png")}[kind]()
    assert_usage_error_in_process(main, ["--history", str(path), "--output", str(output)], capsys,
                                  f"error: --output {output} {message}")


def test_names_that_are_not_utf8_are_drawn(tmp_path):
    """matplotlib refuses text with surrogates (a file or folder name's bytes that are not UTF-8): a legend label
    and a confusion matrix's class names ended in a TypeError."""
    from deepspeed_image_trainer.inference.evaluate import plot_confusion

    path = tmp_path / "training_history.json"
    path.write_text(json.dumps(synthetic_history(2, best_epoch=1)))
    main(["--history", str(path), "--labels", "a\udcffb", "--output", str(tmp_path / "curves.png")])
    plot_confusion([[1, 0], [0, 1]], ["b\udce4t", "cat"], tmp_path / "confusion.png")
    assert all((tmp_path / name).read_bytes()[:4] == b"\x89PNG" for name in ("curves.png", "confusion.png"))
