"""Real DeepSpeed runs (CPU accelerator, gloo) through the launcher, on a tiny generated dataset."""
import json
import shutil
import sys

import pytest
import torch
from torchvision.datasets import ImageFolder

from conftest import ROOT, TINY_CLASSES, assert_usage_error, data_args, launch, run
from data import build_transform
from model import ResNet18Animals90

EPOCHS = 2
RUNS = {
    "zero0": ["--zero_stage", "0"],
    "zero1-2ranks": ["--zero_stage", "1", "--num_gpus", "2"],
    "zero2-bf16-accumulation": ["--zero_stage", "2", "--bf16", "--gradient_accumulation_steps", "2"],
    "zero3": ["--zero_stage", "3"],
}
_finished = {}


def run_training(name, tmp_path_factory, tiny_data):
    """Train once per configuration and share the result between tests."""
    if name not in _finished:
        workdir = tmp_path_factory.mktemp(name)
        args = data_args(tiny_data) + ["--epochs", str(EPOCHS), "--batch_size", "4", "--image_size", "32",
                                       "--save_every", "1", "--num_workers", "1"] + RUNS[name]
        result = launch(args, workdir)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        _finished[name] = (workdir, result)
    return _finished[name]


def load_history(workdir):
    return json.loads((workdir / "logs/training_history.json").read_text())


def accuracy_of_checkpoint(model_states_file, val_dir):
    """Top-1 of a fresh ResNet18Animals90 loaded the way the README shows, on the whole val set."""
    model = ResNet18Animals90(num_classes=TINY_CLASSES)
    model.load_state_dict(torch.load(model_states_file, map_location="cpu")["module"])
    model.eval()
    dataset = ImageFolder(val_dir, transform=build_transform(32, train=False))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in loader)
    return correct / len(dataset)


@pytest.mark.parametrize("name", list(RUNS))
def test_training_run_writes_history_and_checkpoints(name, tmp_path_factory, tiny_data):
    workdir, result = run_training(name, tmp_path_factory, tiny_data)
    history = load_history(workdir)
    config = history["config"]
    assert config["model"] == "ResNet18Animals90" and config["num_classes"] == TINY_CLASSES
    assert config["world_size"] == (2 if "2ranks" in name else 1)
    assert config["zero_stage"] == int(RUNS[name][1])
    assert config["precision"] == ("bf16" if "bf16" in name else "fp32")
    ds = config["deepspeed"]
    assert ds["train_batch_size"] == 4 * ds["gradient_accumulation_steps"] * config["world_size"]

    epochs = history["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1))
    for record in epochs:
        assert set(record) == {"epoch", "train_loss", "train_acc", "val_loss", "val_acc", "lr",
                               "epoch_time_s", "images_per_s", "peak_gpu_memory_gib"}
        assert record["peak_gpu_memory_gib"] is None  # CPU run
        assert 0 <= record["train_acc"] <= 1 and 0 <= record["val_acc"] <= 1
        assert record["train_loss"] > 0 and record["images_per_s"] > 0 and record["lr"] > 0
        # 16 val images split over the ranks without padding: accuracies are multiples of 1/16.
        assert abs(record["val_acc"] * 16 - round(record["val_acc"] * 16)) < 1e-9
    best = max(epochs, key=lambda e: e["val_acc"])
    assert history["best"] == {"epoch": best["epoch"], "val_acc": best["val_acc"]}

    ckpt = workdir / "checkpoints_deepspeed"
    assert (ckpt / "best_model/latest").read_text().strip() == "best"
    assert any((ckpt / "best_model/best").glob("*model_states.pt"))
    for epoch in range(1, EPOCHS + 1):
        assert (ckpt / f"epoch_{epoch}/epoch_{epoch}").is_dir()
        info = json.loads((ckpt / f"epoch_{epoch}/extra_info.json").read_text())
        assert info["epoch"] == epoch and info["metrics"] == epochs[epoch - 1]
    info = json.loads((ckpt / "best_model/extra_info.json").read_text())
    assert info["epoch"] == history["best"]["epoch"]
    assert info["class_names"] == ImageFolder(tiny_data / "train").classes
    assert (info["model"], info["image_size"]) == ("ResNet18Animals90", 32)
    assert "Best val acc" in result.stdout


@pytest.mark.parametrize("name", ["zero0", "zero1-2ranks"])
def test_best_checkpoint_reproduces_logged_val_acc(name, tmp_path_factory, tiny_data):
    workdir, _ = run_training(name, tmp_path_factory, tiny_data)
    history = load_history(workdir)
    states = workdir / "checkpoints_deepspeed/best_model/best/mp_rank_00_model_states.pt"
    assert accuracy_of_checkpoint(states, tiny_data / "val") == pytest.approx(history["best"]["val_acc"])


def test_seeded_runs_repeat_and_deepspeed_cli_matches_launcher(tmp_path_factory, tiny_data, tmp_path):
    """The users' direct command, `deepspeed ... src/train_deepspeed.py`, reproduces the launcher's run."""
    launched, _ = run_training("zero0", tmp_path_factory, tiny_data)
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus=1", str(ROOT / "src/train_deepspeed.py"),
               *data_args(tiny_data), "--epochs", str(EPOCHS), "--batch_size", "4", "--image_size", "32",
               "--save_every", "1", "--num_workers", "1", "--zero_stage", "0"]
    result = run(command, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")
    direct = [{k: e[k] for k in metrics} for e in load_history(tmp_path)["epochs"]]
    assert direct == [{k: e[k] for k in metrics} for e in load_history(launched)["epochs"]]


def test_curves_png(tmp_path_factory, tiny_data, tmp_path):
    workdir, _ = run_training("zero0", tmp_path_factory, tiny_data)
    output = tmp_path / "curves.png"
    result = run([sys.executable, str(ROOT / "src/utils.py"), "--history", str(workdir / "logs/training_history.json"),
                  "--output", str(output)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(output).shape
    assert width > 1000 and height > 400


def test_reference_zero2_config_fp16_is_refused_on_cpu_then_trains_in_bf16(tiny_data, tmp_path):
    args = data_args(tiny_data) + ["--deepspeed_config", str(ROOT / "ds_config_zero2.json"), "--epochs", "1",
                                   "--batch_size", "4", "--image_size", "32", "--num_workers", "0"]
    assert_usage_error(launch(args, tmp_path), "fp16 needs a GPU")
    assert not (tmp_path / "logs").exists()
    result = launch(args + ["--bf16"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    history = load_history(tmp_path)
    zero = history["config"]["deepspeed"]["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu" and zero["overlap_comm"]
    assert history["config"]["precision"] == "bf16" and len(history["epochs"]) == 1


def test_reference_zero3_config_trains_in_bf16_with_param_and_optimizer_offload(tiny_data, tmp_path):
    args = data_args(tiny_data) + ["--deepspeed_config", str(ROOT / "ds_config_zero3.json"), "--bf16",
                                   "--epochs", "1", "--batch_size", "4", "--image_size", "32", "--num_workers", "0"]
    result = launch(args, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    history = load_history(tmp_path)
    zero = history["config"]["deepspeed"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    assert len(history["epochs"]) == 1
    assert (tmp_path / "checkpoints_deepspeed/best_model/best").is_dir()


def test_a_failed_run_leaves_earlier_outputs_intact(tmp_path_factory, tiny_data, tmp_path):
    workdir, _ = run_training("zero0", tmp_path_factory, tiny_data)
    shutil.copytree(workdir / "logs", tmp_path / "logs")
    shutil.copytree(workdir / "checkpoints_deepspeed", tmp_path / "checkpoints_deepspeed")
    before = (tmp_path / "logs/training_history.json").read_bytes()
    result = launch(data_args(tiny_data) + ["--pretrained", "missing.pth"], tmp_path)
    assert_usage_error(result, "--pretrained missing.pth: file not found")
    assert (tmp_path / "logs/training_history.json").read_bytes() == before
    assert (tmp_path / "checkpoints_deepspeed/best_model/extra_info.json").is_file()
