import os
import shutil
import subprocess
import sys

import pytest
from torchvision.datasets import ImageFolder

from deepspeed_image_trainer.data.prepare import ANIMALS_90, make_sample_dataset, split_dataset
from deepspeed_image_trainer.utils.failures import UsageError

from conftest import ROOT, assert_usage_error_in_process


def test_animals90_class_list():
    assert len(ANIMALS_90) == len(set(ANIMALS_90)) == 90
    assert ANIMALS_90 == sorted(ANIMALS_90)  # ImageFolder's index order


def test_sample_dataset_is_an_image_folder(tmp_path):
    counts = make_sample_dataset(tmp_path, num_classes=6, train_per_class=3, val_per_class=2, image_size=40, seed=1)
    assert counts == {"train": 18, "val": 12}
    train, val = ImageFolder(tmp_path / "train"), ImageFolder(tmp_path / "val")
    assert train.classes == val.classes == ANIMALS_90[:6]
    assert len(train) == 18 and len(val) == 12
    image, label = train[0]
    assert image.size == (40, 40) and label == 0


def test_sample_dataset_is_made_once_and_never_overwritten(tmp_path):
    make_sample_dataset(tmp_path, 3, 2, 1, 32, seed=5)
    jpeg = tmp_path / "train/bat/bat_0001.jpg"
    before = jpeg.stat().st_mtime_ns
    assert make_sample_dataset(tmp_path, 3, 2, 1, 32, seed=5) == {"train": 6, "val": 3}
    assert jpeg.stat().st_mtime_ns == before
    with pytest.raises(UsageError, match="already holds data"):
        make_sample_dataset(tmp_path, 4, 2, 1, 32, seed=5)
    assert jpeg.stat().st_mtime_ns == before


def test_sample_dataset_is_seeded(tmp_path):
    make_sample_dataset(tmp_path / "a", 3, 2, 1, 32, seed=5)
    make_sample_dataset(tmp_path / "b", 3, 2, 1, 32, seed=5)
    make_sample_dataset(tmp_path / "c", 3, 2, 1, 32, seed=6)
    first = (tmp_path / "a/train/bat/bat_0001.jpg").read_bytes()
    assert first == (tmp_path / "b/train/bat/bat_0001.jpg").read_bytes()
    assert first != (tmp_path / "c/train/bat/bat_0001.jpg").read_bytes()


def make_raw(root, sizes):
    for name, count in sizes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            (root / name / f"{i}.jpg").write_bytes(b"jpeg")
    (root / "cat" / "notes.txt").write_text("not an image")


def test_split_is_stratified_seeded_and_complete(tmp_path):
    raw = tmp_path / "raw"
    make_raw(raw, {"cat": 10, "dog": 20, "owl": 2})
    counts = split_dataset(raw, tmp_path / "out", val_fraction=0.2, seed=3)
    assert counts == {"train": 25, "val": 7}
    for name, n_val in (("cat", 2), ("dog", 4), ("owl", 1)):
        val = {p.name for p in (tmp_path / "out/val" / name).iterdir()}
        train = {p.name for p in (tmp_path / "out/train" / name).iterdir()}
        assert len(val) == n_val and not val & train
        assert val | train == {p.name for p in (raw / name).iterdir() if p.suffix == ".jpg"}
    split_dataset(raw, tmp_path / "again", val_fraction=0.2, seed=3)
    assert sorted(p.name for p in (tmp_path / "again/val/dog").iterdir()) == \
        sorted(p.name for p in (tmp_path / "out/val/dog").iterdir())


def test_split_refuses_to_overwrite_existing_data(tmp_path):
    raw = tmp_path / "raw"
    make_raw(raw, {"cat": 4})
    split_dataset(raw, tmp_path / "out", 0.25, 0)
    before = sorted(p.name for p in (tmp_path / "out/train/cat").iterdir())
    with pytest.raises(UsageError, match="already holds data"):
        split_dataset(raw, tmp_path / "out", 0.5, 1)
    assert sorted(p.name for p in (tmp_path / "out/train/cat").iterdir()) == before


@pytest.mark.parametrize("argv, message", [
    (["sample", "--num_classes", "500"], "--num_classes must be between 2 and 90"),
    (["split", ".", "--val_fraction", "1.5"], "--val_fraction must be between 0 and 1"),
    # each a traceback, a write into a checkpoint or the source, or the machine's memory before
    (["sample", "--image_size", "100000"], "--image_size 16 .. 4096"),
    (["sample", "--output", "raw/cat/0.jpg"], "--output raw/cat/0.jpg is not a folder"),
    (["sample", "--output", "ck/last/data"], "--output ck/last/data is inside the checkpoint"),
    (["split", "raw", "--output", "raw/out"], "--output raw/out is inside raw, the folder it splits"),
    (["split", "raw", "--output", "raw"], "--output raw is inside raw, the folder it splits"),
    (["sample", "--output", "d/train"], "--output d/train is inside the dataset"),
    (["sample", "--train_per_class", "100000000000"], "--train_per_class and --val_per_class must be 1 .. 10,000"),
    (["split", "d", "--output", "d2"], "d holds train/ and val/: it is split already"),  # wrote 0 images, status 0
    (["split", "raw", "--output", "d/val/cat/new"], "--output d/val/cat/new is inside the dataset"),
])
def test_cli_errors_are_one_line_with_status_2(tmp_path, monkeypatch, capsys, argv, message):
    from deepspeed_image_trainer.data.prepare import main

    make_raw(tmp_path / "raw", {"cat": 2, "dog": 2})
    make_raw(tmp_path / "d/train", {"cat": 1})
    make_raw(tmp_path / "d/val", {"cat": 1})
    (tmp_path / "ck/last").mkdir(parents=True)
    (tmp_path / "ck/last/extra_info.json").write_text("{}")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(main, argv, capsys, message)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_split_copies_the_images_and_leaves_out_what_is_not_a_file(tmp_path):
    """A FIFO (shutil.SpecialFileError) or a link to nothing (FileNotFoundError) named like an image ended the
    split in a traceback, half written; training and the check skip both."""
    raw = tmp_path / "raw"
    make_raw(raw, {"cat": 4, "dog": 4})
    os.mkfifo(raw / "cat/fifo.jpg")
    (raw / "dog/gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    # in a sub-folder, as ImageFolder finds it (left out before); hidden ones passed over, as in training
    (raw / "cat/sub").mkdir()
    (raw / "cat/0.jpg").rename(raw / "cat/sub/0.jpg")
    (raw / "dog/.hidden").mkdir()
    shutil.copy(raw / "dog/0.jpg", raw / "dog/.hidden/x.jpg")
    counts = split_dataset(raw, tmp_path / "out", val_fraction=0.5, seed=0)
    assert counts == {"train": 4, "val": 4}
    assert not any(p.name in ("fifo.jpg", "gone.jpg", "x.jpg") for p in (tmp_path / "out").rglob("*"))
    assert len(list((tmp_path / "out").glob("*/cat/sub/0.jpg"))) == 1


def test_a_sample_stopped_half_way_leaves_nothing_and_runs_again(tmp_path, monkeypatch):
    """Ctrl-C in the middle left a partial dataset, which the same command then refused as data already there."""
    from deepspeed_image_trainer.data import prepare

    drawn, draw = [], prepare.draw_sample_image

    def interrupted(*args):
        drawn.append(1)
        if len(drawn) == 5:
            raise KeyboardInterrupt
        return draw(*args)

    monkeypatch.setattr(prepare, "draw_sample_image", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_sample_dataset(tmp_path / "d", 3, 2, 2, 32, seed=0)
    assert list((tmp_path / "d").iterdir()) == []
    assert make_sample_dataset(tmp_path / "d", 3, 2, 2, 32, seed=0) == {"train": 6, "val": 6}
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["sample_dataset.json", "train", "val"]


def test_a_tools_ctrl_c_while_it_imports_is_one_line_and_status_130(tmp_path):
    """Before run_cli (torch's import, seconds) a Ctrl-C was a KeyboardInterrupt traceback, or a C++ abort."""
    script = ("import os, signal, time\n"
              "from deepspeed_image_trainer.utils.startup import quiet_interrupt_while_importing\n"
              "with quiet_interrupt_while_importing(True):\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(5)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert result.returncode == 130
    assert result.stderr == "error: stopped by Ctrl-C (SIGINT) while starting; nothing was written\n"


def test_a_tools_ctrl_c_is_one_line_and_status_130(capsys):
    from deepspeed_image_trainer.cli.options import run_cli

    def main(argv):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exited:
        run_cli(main, [])
    assert exited.value.code == 130
    assert capsys.readouterr().err == "error: stopped by Ctrl-C (SIGINT); what it had not finished was not written\n"


def test_the_check_refuses_a_cache_folder_inside_a_checkpoint(tmp_path, monkeypatch, capsys):
    """Its results went with that checkpoint's next save."""
    from deepspeed_image_trainer.data.prepare import main

    make_sample_dataset(tmp_path / "d", 3, 1, 1, 32, seed=0)
    (tmp_path / "ck/last").mkdir(parents=True)
    (tmp_path / "ck/last/extra_info.json").write_text("{}")
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "ck/last/cache"))
    assert_usage_error_in_process(main, ["--check", str(tmp_path / "d")], capsys,
                                  f"$TRAINER_CACHE_DIR {tmp_path / 'ck/last/cache'} is inside the checkpoint")
    assert not (tmp_path / "ck/last/cache").exists()


def test_cli_errors_on_the_command_line(tmp_path, monkeypatch, capsys):
    # in this process: the script's own entry point runs in test_bad_data's and test_failures' --check
    from deepspeed_image_trainer.data.prepare import main

    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(main, ["split", "does-not-exist"], capsys, "expected one folder per class")
