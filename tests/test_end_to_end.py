"""Real DeepSpeed runs (CPU accelerator, gloo) through the launcher (or, where the launcher is not what is checked,
the training script in spawn_ranks ranks), on a tiny generated dataset."""
import json
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from torchvision.datasets import ImageFolder

from deepspeed_image_trainer.cli import launch as launch_deepspeed
from deepspeed_image_trainer.data.folders import build_transform
from deepspeed_image_trainer.data.prepare import make_sample_dataset
from deepspeed_image_trainer.inference.evaluate import main as evaluate_main
from deepspeed_image_trainer.inference.export import export, main as export_main
from deepspeed_image_trainer.models.build import ResNet18Animals90
from deepspeed_image_trainer.outputs.checkpoints import missing_files, read_info, saved_precision
from deepspeed_image_trainer.outputs.record import resume_settings
from deepspeed_image_trainer.utils.failures import UsageError

from conftest import (LAUNCHED_RUNS, ROOT, TINY_CLASSES, TINY_VAL_IMAGES, TINY_VAL_PER_CLASS, TRAINED_EPOCHS,
                      TRAINED_RUNS, assert_usage_error, assert_usage_error_in_process, data_args, history_of, launch,
                      run)

pytestmark = pytest.mark.slow  # every test here starts training processes


def accuracy(model, val_dir):
    """Top-1 of `model` on the whole val set, preprocessed as in validation."""
    model.eval()
    dataset = ImageFolder(val_dir, transform=build_transform(32, train=False))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in loader)
    return correct / len(dataset)


@pytest.mark.parametrize("name", list(TRAINED_RUNS))
def test_training_run_writes_history_and_checkpoints(name, trained, tiny_data):
    workdir, result = trained(name)
    history = history_of(workdir)
    config = history["config"]
    assert config["model"] == "ResNet18Animals90" and config["num_classes"] == TINY_CLASSES
    assert config["world_size"] == (2 if "2ranks" in name else 1)
    assert config["zero_stage"] == int(TRAINED_RUNS[name][1])
    assert config["precision"] == "fp32"  # every shared run (bf16: the reference config's run below)
    # what --precision_mode auto resumes with
    assert saved_precision(workdir / "checkpoints_deepspeed/last") == config["precision"]
    for folder in (workdir / "checkpoints_deepspeed").glob("[!.]*"):  # DeepSpeed's file names, as resume expects
        assert missing_files(folder, read_info(folder)) == [], folder
    assert config["sync_bn"] == ("--sync_bn" in TRAINED_RUNS[name])
    ds = config["deepspeed"]
    assert ds["train_batch_size"] == 4 * ds["gradient_accumulation_steps"] * config["world_size"]
    coalesced = "offload-accumulation" in name
    assert config["training"]["coalesce_grad_reduction"] is coalesced
    assert ("2 micro-batches a step, their gradients reduced once" in result.stdout) is coalesced
    assert "no bf16 instructions" not in result.stdout  # fp32: nothing to warn about

    epochs = history["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(1, TRAINED_EPOCHS + 1))
    for record in epochs:
        averaged = "--model_ema" in TRAINED_RUNS[name]  # the weights' average's, else None
        assert (record["ema_val_loss"] is not None, record["ema_val_acc"] is not None) == (averaged, averaged)
        assert ("EMA val loss" in result.stdout) is averaged
        assert set(record) == {"epoch", "train_loss", "train_acc", "val_loss", "val_acc", "ema_val_loss",
                               "ema_val_acc", "val_images", "lr",
                               "backbone_lr", "epoch_time_s", "images_per_s", "data_wait_s", "compute_s", "validation_s",
                               "checkpoint_s", "epoch_wall_s", "peak_gpu_memory_gib", "skipped_steps",
                               "nonfinite_steps"}
        assert record["backbone_lr"] == record["lr"]  # no fine-tuning controls: one rate for all
        parts = record["epoch_time_s"] + record["validation_s"] + record["checkpoint_s"]
        assert 0 < parts <= record["epoch_wall_s"] < parts + 0.5  # the rest: metrics, monitors, the epoch line
        assert record["skipped_steps"] == record["nonfinite_steps"] == 0
        assert record["peak_gpu_memory_gib"] is None  # CPU run
        assert record["data_wait_s"] + record["compute_s"] == pytest.approx(record["epoch_time_s"])
        assert 0 <= record["train_acc"] <= 1 and 0 <= record["val_acc"] <= 1
        assert record["train_loss"] > 0 and record["images_per_s"] > 0 and record["lr"] > 0
        # 15 val images split over the ranks without padding: each counted once, on whichever rank.
        assert record["val_images"] == TINY_VAL_IMAGES
        assert abs(record["val_acc"] * 15 - round(record["val_acc"] * 15)) < 1e-9
    on = "ema" if averaged else "raw"  # what best_model follows (--best_on: the average's, where there is one)
    key = "ema_val_acc" if averaged else "val_acc"
    best = max(epochs, key=lambda e: e[key])
    assert history["best"] == {"epoch": best["epoch"], "val_acc": best[key], "on": on}
    # Startup: from the launcher's start to the end of the first optimizer step, in phases that add up to it (the
    # runs trained without the launcher, conftest's train_ranks: from the training process's own start).
    timing = history["timing"]
    launched = name in LAUNCHED_RUNS
    assert list(timing["phases"]) == ["launcher_s", "deepspeed_launcher_s"] * launched + [
        "imports_s", "setup_s", "engine_s", "data_s", "first_step_s"]
    assert all(seconds >= 0 for seconds in timing["phases"].values())
    assert sum(timing["phases"].values()) == pytest.approx(timing["startup_s"], abs=0.01)
    assert timing["startup_s"] < timing["total_s"] and sum(e["epoch_wall_s"] for e in epochs) < timing["total_s"]
    first = "launcher" if launched else "imports"
    assert f"First optimizer step {timing['startup_s']:.1f} s after the start ({first} " in result.stdout

    ckpt = workdir / "checkpoints_deepspeed"
    assert (ckpt / "best_model/latest").read_text().strip() == "best"
    assert any((ckpt / "best_model/best").glob("*model_states.pt"))
    for epoch in range(1, TRAINED_EPOCHS + 1):
        assert (ckpt / f"epoch_{epoch}/epoch_{epoch}").is_dir()
        info = json.loads((ckpt / f"epoch_{epoch}/extra_info.json").read_text())
        saved_after = ("checkpoint_s", "epoch_wall_s")  # measured once the checkpoint is written
        assert info["epoch"] == epoch and info["metrics"] == {k: v for k, v in epochs[epoch - 1].items()
                                                              if k not in saved_after}
    assert (ckpt / "last/latest").read_text().strip() == "last"
    assert json.loads((ckpt / "last/extra_info.json").read_text())["epoch"] == TRAINED_EPOCHS
    info = json.loads((ckpt / "best_model/extra_info.json").read_text())
    assert info["epoch"] == history["best"]["epoch"]
    assert (info["world_size"], info["zero_stage"]) == (config["world_size"], config["zero_stage"])
    assert info["class_names"] == ImageFolder(tiny_data / "train").classes
    assert (info["model"], info["image_size"]) == ("ResNet18Animals90", 32)
    assert info["settings"] == resume_settings(config)  # both from the run's one record
    assert info["settings"]["train_batch_size"] == config["deepspeed"]["train_batch_size"]
    assert "Best val acc" in result.stdout


@pytest.mark.parametrize("name", ["zero0", "zero2-2ranks"])
def test_no_shared_memory_left_behind(name, trained):
    """DeepSpeed's CPU all-reduce buffers (64 MiB of /dev/shm per rank) go with the run."""
    _, result = trained(name)
    port = re.search(r"--master_port=(\d+)", result.stdout)[1]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


@pytest.mark.parametrize("name", ["zero0", "zero2-2ranks"])
def test_best_checkpoint_reproduces_logged_val_acc(name, trained, tiny_data):
    workdir, _ = trained(name)
    history = history_of(workdir)
    states = workdir / "checkpoints_deepspeed/best_model/best/mp_rank_00_model_states.pt"
    model = ResNet18Animals90(num_classes=TINY_CLASSES)
    model.load_state_dict(torch.load(states, map_location="cpu")["module"])
    # the weights' val acc that epoch (zero2-2ranks's best follows the weights' average's: --model_ema)
    assert accuracy(model, tiny_data / "val") == pytest.approx(best_epoch(history)["val_acc"])


@pytest.mark.parametrize("old_removed", [False, True], ids=["old kept", "old removed"])
def test_an_export_while_the_run_publishes_a_new_last_reads_one_checkpoint(old_removed, trained, tmp_path, monkeypatch):
    # The trainer publishes by renaming folders: `last` becomes another folder between the export's first read
    # (extra_info.json, the files' check) and DeepSpeed's consolidation. The weights must be those of the epoch
    # the sidecar names: the old folder's (it still exists) or, where it was removed meanwhile, the new one's.
    from deepspeed_image_trainer.inference import export as export_model

    workdir, _ = trained("zero3")
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(workdir / "checkpoints_deepspeed", checkpoints)
    expected = {epoch: export_model.consolidated_state_dict(checkpoints / f"epoch_{epoch}")[0] for epoch in (1, 2)}
    check = export_model.check_checkpoint_files
    swaps = []

    def publishing_meanwhile(folder, tag):
        if not swaps:  # once: epoch 1's checkpoint published as last, as a run would publish a new one
            swaps.append((checkpoints / "last").rename(checkpoints / ".old-last"))
            shutil.copytree(checkpoints / "epoch_1", checkpoints / "last")
            if old_removed:
                shutil.rmtree(checkpoints / ".old-last")
        return check(folder, tag)

    monkeypatch.setattr(export_model, "check_checkpoint_files", publishing_meanwhile)
    state_dict, info = export_model.consolidated_state_dict(checkpoints / "last")
    assert swaps and info["folder"] == str(checkpoints / "last")
    assert info["epoch"] == (1 if old_removed else 2)
    assert all(torch.equal(state_dict[name], expected[info["epoch"]][name]) for name in state_dict)
    assert not torch.equal(expected[1]["fc.weight"], expected[2]["fc.weight"])


def best_epoch(history):
    return next(e for e in history["epochs"] if e["epoch"] == history["best"]["epoch"])


# Every stage and model family is exported in test_models.py; these are the shared multi-rank and ZeRO-3 runs.
@pytest.mark.parametrize("name, suffix", [("zero2-2ranks", ".safetensors"), ("zero3", ".pt")])
def test_export_from_any_stage_reproduces_logged_val_acc(name, suffix, trained, tiny_data, tmp_path, capsys):
    workdir, _ = trained(name)
    history = history_of(workdir)
    output = tmp_path / f"model{suffix}"
    argv = [str(workdir / "checkpoints_deepspeed/best_model"), "--output", str(output)]
    if suffix == ".safetensors":  # the script once; the ZeRO-3 export in this process (the same main)
        result = run([sys.executable, str(ROOT / "src/export_model.py"), *argv], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        export_main(argv)
    metadata = json.loads(output.with_name(output.name + ".json").read_text())
    assert metadata["class_names"] == ImageFolder(tiny_data / "train").classes
    assert metadata["image_size"] == 32 and metadata["epoch"] == history["best"]["epoch"]
    if suffix == ".safetensors":
        from safetensors.torch import load_file, safe_open

        state_dict = load_file(output)
        with safe_open(output, "pt") as f:
            assert json.loads(f.metadata()["class_names"]) == metadata["class_names"]
    else:
        state_dict = torch.load(output, map_location="cpu")
    assert all(v.dtype == torch.float32 for k, v in state_dict.items() if "num_batches" not in k)
    model = ResNet18Animals90(num_classes=len(metadata["class_names"]))
    model.load_state_dict(state_dict)
    assert accuracy(model, tiny_data / "val") == pytest.approx(best_epoch(history)["val_acc"])
    if history["config"]["training"]["model_ema"]:  # and the weights' average, consolidated from both ranks
        assert history["best"] == {"epoch": history["best"]["epoch"], "on": "ema",
                                   "val_acc": best_epoch(history)["ema_val_acc"]}
        averaged = tmp_path / "ema.pt"
        capsys.readouterr()
        export_main([str(workdir / "checkpoints_deepspeed/last"), "--ema", "--output", str(averaged)])
        assert "the weights' average" in capsys.readouterr().out
        ema = torch.load(averaged, map_location="cpu")
        model.load_state_dict(ema)  # strictly
        assert accuracy(model, tiny_data / "val") == pytest.approx(history["epochs"][-1]["ema_val_acc"])
        assert not torch.equal(ema["fc.weight"], state_dict["fc.weight"])
        assert not torch.equal(ema["bn1.running_mean"], state_dict["bn1.running_mean"])
        # a checkpoint missing one of its files of the average: that file named, the earlier export kept
        damaged = tmp_path / "damaged"
        shutil.copytree(workdir / "checkpoints_deepspeed/last", damaged)
        (damaged / "last/ema_rank0.safetensors").unlink()
        with pytest.raises(UsageError, match=r"the weights' average \(--model_ema\) cannot be read "
                                             r"\(ema_rank0.safetensors is missing or not a regular file\)"):
            export(damaged, averaged, ema=True)
        assert torch.equal(torch.load(averaged)["fc.weight"], ema["fc.weight"])
    else:  # a run without an average
        with pytest.raises(UsageError, match=r"holds no weights' average \(its run was trained without --model_ema\)"):
            export(workdir / "checkpoints_deepspeed/last", tmp_path / "ema.pt", ema=True)
        assert not (tmp_path / "ema.pt").exists()


def test_zero3_model_states_file_holds_no_weights(trained, tiny_data):
    """Why the README points ZeRO-3 users to export_model.py."""
    workdir, _ = trained("zero3")
    folder = workdir / "checkpoints_deepspeed/best_model/best"
    assert not (folder / "mp_rank_00_model_states.pt").exists()
    states = torch.load(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu")["module"]
    assert states["conv1.weight"].numel() == 0


def test_seeded_runs_repeat_and_deepspeed_cli_matches_launcher(trained, tiny_data, tmp_path):
    """The users' direct command, `deepspeed ... src/train_deepspeed.py`, reproduces the launcher's run."""
    launched, _ = trained("zero0")
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus=1", str(ROOT / "src/train_deepspeed.py"),
               *data_args(tiny_data), "--epochs", str(TRAINED_EPOCHS), "--batch_size", "4", "--image_size", "32",
               "--save_every", "1", "--num_workers", "1", "--zero_stage", "0"]
    result = run(command, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")
    direct = [{k: e[k] for k in metrics} for e in history_of(tmp_path)["epochs"]]
    assert direct == [{k: e[k] for k in metrics} for e in history_of(launched)["epochs"]]


def test_curves_of_a_real_history(trained, tmp_path, capsys):
    """The figure's panels are unit-tested on synthetic histories (test_plots.py); this is a real run's."""
    import matplotlib.image

    from deepspeed_image_trainer.outputs.plots import main as plot_curves

    workdir, _ = trained("zero0")
    output = tmp_path / "curves.png"
    plot_curves(["--history", str(workdir / "logs/training_history.json"), "--output", str(output)])
    assert f"curves written to {output}" in capsys.readouterr().out
    height, width, _ = matplotlib.image.imread(output).shape
    assert width > 1000 and height > 800  # two rows of panels: the epoch times are recorded, so four panels or more


def test_reference_zero2_config_fp16_is_refused_on_cpu_then_trains_in_bf16(tiny_data, tmp_path, monkeypatch, capsys):
    """As a user runs it, with accumulation: bf16 weights, optimizer offload, two micro-batches a step and their
    gradients reduced once (the trainer's coalescing). One step of 12 images: bf16 convolutions on a CPU without
    oneDNN's bf16 kernels are ~25x slower than fp32."""
    make_sample_dataset(tmp_path / "data", num_classes=3, train_per_class=4, val_per_class=1, image_size=32, seed=0)
    args = data_args(tmp_path / "data") + ["--deepspeed_config", str(ROOT / "ds_config_zero2.json"), "--epochs", "1",
                                           "--batch_size", "6", "--gradient_accumulation_steps", "2",
                                           "--image_size", "32", "--num_workers", "0"]
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(launch_deepspeed.main, args, capsys, "fp16 needs a GPU")
    assert not (tmp_path / "logs").exists()
    result = launch(args + ["--bf16"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    history = history_of(tmp_path)
    zero = history["config"]["deepspeed"]["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu" and zero["overlap_comm"]
    assert history["config"]["precision"] == "bf16" and len(history["epochs"]) == 1
    assert saved_precision(tmp_path / "checkpoints_deepspeed/last") == "bf16"  # what --precision_mode auto resumes with
    assert history["config"]["training"]["coalesce_grad_reduction"] is True
    assert "2 micro-batches a step, their gradients reduced once" in result.stdout
    # bf16 on a CPU whose oneDNN has no bf16 kernels (AVX2 only) runs PyTorch's reference convolution: said once
    slow_bf16 = not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert result.stdout.count("warning: this CPU has no bf16 instructions for oneDNN") == slow_bf16
    # the ranks read the JSON as the launcher read it, so a file edited after the launch changes nothing
    [given] = (tmp_path / "logs").glob("ds_config_given-*.json")
    assert json.loads(given.read_text()) == json.loads((ROOT / "ds_config_zero2.json").read_text())
    assert given.name in result.stdout


def test_a_failed_run_leaves_earlier_outputs_intact(trained, tiny_data, tmp_path, monkeypatch, capsys):
    workdir, _ = trained("zero0")
    shutil.copytree(workdir / "logs", tmp_path / "logs")
    shutil.copytree(workdir / "checkpoints_deepspeed", tmp_path / "checkpoints_deepspeed")
    before = (tmp_path / "logs/training_history.json").read_bytes()
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(launch_deepspeed.main, data_args(tiny_data) + ["--pretrained", "missing.pth"], capsys,
                                  "--pretrained missing.pth: no such file, and not a weights name of resnet18")
    assert (tmp_path / "logs/training_history.json").read_bytes() == before
    assert (tmp_path / "checkpoints_deepspeed/best_model/extra_info.json").is_file()


@pytest.fixture(scope="module")
def exported(trained, tiny_data):
    """The zero0 run's best checkpoint, exported."""
    workdir, _ = trained("zero0")
    output = workdir / "model.pt"
    export_main([str(workdir / "checkpoints_deepspeed/best_model"), "--output", str(output)])
    return workdir, output


@pytest.mark.parametrize("source", ["exported file", "checkpoint folder"])
def test_evaluate_reports_the_logged_accuracy(source, exported, tiny_data, tmp_path, capsys):
    workdir, model_file = exported
    model = model_file if source == "exported file" else workdir / "checkpoints_deepspeed/best_model"
    argv = ["--model", str(model), "--data_dir", str(tiny_data / "val"), "--output_dir", str(tmp_path / "eval"),
            "--num_workers", "0"]
    if source == "exported file":  # the script once; the checkpoint folder in this process (the same main)
        result = run([sys.executable, str(ROOT / "src/evaluate.py"), *argv], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        capsys.readouterr()
        evaluate_main(argv)
        result = types.SimpleNamespace(stdout=capsys.readouterr().out)
    report = json.loads((tmp_path / "eval/report.json").read_text())
    history = history_of(workdir)
    best = history["epochs"][history["best"]["epoch"] - 1]
    assert report["top1"] == pytest.approx(best["val_acc"])
    assert report["loss"] == pytest.approx(best["val_loss"], rel=1e-4)
    assert report["top1"] <= report["top3"] == 1.0  # 3 classes: the top 3 always hold the answer
    confusion = report["confusion_matrix"]
    assert sum(map(sum, confusion)) == report["images"] == TINY_VAL_IMAGES
    assert sum(confusion[i][i] for i in range(TINY_CLASSES)) / TINY_VAL_IMAGES == pytest.approx(report["top1"])
    assert report["per_class_accuracy"] == {name: confusion[i][i] / TINY_VAL_PER_CLASS for i, name in enumerate(report["class_names"])}
    assert (tmp_path / "eval/confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"
    assert f"loss {report['loss']:.4f}, top-1 {report['top1']:.4f}" in result.stdout


def test_predict_agrees_with_evaluate(exported, tiny_data, tmp_path, trained, capsys):
    workdir, model_file = exported
    result = run([sys.executable, str(ROOT / "src/predict.py"), "--model", str(model_file), "--top_k", "2",
                  "--json", str(tiny_data / "val")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    predictions = json.loads(result.stdout)
    assert len(predictions) == TINY_VAL_IMAGES
    for item in predictions:
        probabilities = [p["probability"] for p in item["predictions"]]
        assert len(probabilities) == 2 and probabilities == sorted(probabilities, reverse=True)
        assert 0 < sum(probabilities) <= 1 + 1e-6
    correct = sum(Path(p["image"]).parent.name == p["predictions"][0]["class"] for p in predictions)
    assert correct / TINY_VAL_IMAGES == pytest.approx(history_of(workdir)["best"]["val_acc"])

    # A ZeRO checkpoint folder works too, and DeepSpeed's consolidation notes stay off stdout.
    zero2, _ = trained("zero2-2ranks")
    from_checkpoint = run([sys.executable, str(ROOT / "src/predict.py"), "--model",
                           str(zero2 / "checkpoints_deepspeed/last"), "--json", str(tiny_data / "val")], tmp_path)
    assert from_checkpoint.returncode == 0, from_checkpoint.stderr[-3000:]
    assert len(json.loads(from_checkpoint.stdout)) == TINY_VAL_IMAGES

    from deepspeed_image_trainer.inference import predict

    one_image = predictions[0]["image"]
    capsys.readouterr()
    assert predict.main(["--model", str(model_file), one_image]) in (0, None)  # in process: a start saved
    assert capsys.readouterr().out.startswith(f"{one_image}: {predictions[0]['predictions'][0]['class']} ")


def test_evaluate_with_flip_tta_averages_each_images_and_its_mirrors_logits(exported, tiny_data, tmp_path):
    from deepspeed_image_trainer.inference import evaluate
    from deepspeed_image_trainer.inference.load import eval_transform, load_model

    workdir, model_file = exported
    evaluate.main(["--model", str(model_file), "--data_dir", str(tiny_data / "val"), "--output_dir",
                   str(tmp_path / "eval"), "--num_workers", "0", "--tta", "flip"])
    report = json.loads((tmp_path / "eval/report.json").read_text())
    model, metadata = load_model(model_file, torch.device("cpu"))
    dataset = ImageFolder(tiny_data / "val", transform=eval_transform(metadata))
    images, labels = torch.stack([image for image, _ in dataset]), torch.tensor(dataset.targets)
    with torch.no_grad():
        plain, mirrored = model(images), model(torch.flip(images, dims=[3]))
    averaged = torch.nn.functional.cross_entropy((plain + mirrored) / 2, labels).item()
    assert report["tta"] == "flip" and report["loss"] == pytest.approx(averaged, rel=1e-5)
    best = history_of(workdir)["epochs"][history_of(workdir)["best"]["epoch"] - 1]
    assert report["without_tta"]["loss"] == pytest.approx(best["val_loss"], rel=1e-4)  # the plain model's, logged
    assert report["tta_gain"]["top1"] == pytest.approx(report["top1"] - report["without_tta"]["top1"])
    # another validation crop, as --val_crop_size would have it: a CNN takes it
    evaluate.main(["--model", str(model_file), "--data_dir", str(tiny_data / "val"), "--output_dir",
                   str(tmp_path / "eval40"), "--num_workers", "0", "--val_crop_size", "40"])
    report = json.loads((tmp_path / "eval40/report.json").read_text())
    assert (report["val_resize_size"], report["val_crop_size"]) == (round(40 * 256 / 224), 40)


def test_onnx_and_torchscript_exports_compute_the_state_dict_exports_logits_at_any_batch_size(
        exported, tiny_data, tmp_path, monkeypatch, capsys):
    import onnxruntime

    from deepspeed_image_trainer.inference import export
    from deepspeed_image_trainer.inference.load import eval_transform, load_model

    workdir, model_file = exported
    model, metadata = load_model(model_file, torch.device("cpu"))
    images = torch.stack([image for image, _ in ImageFolder(tiny_data / "val", transform=eval_transform(metadata))])
    with torch.no_grad():
        expected = model(images)
    checkpoint = str(workdir / "checkpoints_deepspeed/best_model")
    export.main([checkpoint, "--output", str(tmp_path / "model.onnx")])
    export.main([checkpoint, "--output", str(tmp_path / "model.ts"), "--format", "torchscript"])
    assert "onnx, logits within" in capsys.readouterr().out
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    scripted = torch.jit.load(str(tmp_path / "model.ts"))
    for batch in (images[:1], images):  # the batch size the export traced was 3
        got = torch.from_numpy(session.run(["logits"], {"images": batch.numpy()})[0])
        assert torch.allclose(got, expected[:len(batch)], rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            assert torch.allclose(scripted(batch), expected[:len(batch)], rtol=1e-5, atol=1e-6)
    sidecar = json.loads((tmp_path / "model.onnx.json").read_text())
    assert sidecar["format"] == "onnx" and sidecar["class_names"] == metadata["class_names"]
    assert sidecar["checked"]["by"] == "onnxruntime" and not list(tmp_path.glob(".*"))  # no temporary files left
    monkeypatch.chdir(tmp_path)
    from deepspeed_image_trainer.inference import predict

    assert_usage_error_in_process(predict.main, ["--model", "model.onnx", str(tiny_data / "val")], capsys,
                                  "--model model.onnx is exported as onnx")
    assert_usage_error_in_process(export.main, [checkpoint, "--output", "m.onnx", "--format", "torchscript"], capsys,
                                  "--output m.onnx: use a file name ending in .pt, .pth, .ts")
    before = (tmp_path / "model.ts").read_bytes()
    # a program that computes otherwise (as an exporter's wrong conversion would)
    monkeypatch.setattr(export, "_write_torchscript",
                        lambda model, images, path: (path.write_bytes(b"x"), (model(images) + 1, "torch.jit.load"))[1])
    assert_usage_error_in_process(export.main, [checkpoint, "--output", "model.ts", "--format", "torchscript"], capsys,
                                  "the torchscript export's logits differ from PyTorch's")
    assert (tmp_path / "model.ts").read_bytes() == before and not list(tmp_path.glob(".*"))


def test_predict_and_evaluate_bad_input(exported, tmp_path, monkeypatch, capsys):
    from deepspeed_image_trainer.inference import evaluate, predict

    _, model_file = exported
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    command = [sys.executable, str(ROOT / "src/predict.py"), "--model", str(model_file)]
    assert_usage_error(run(command + [str(tmp_path / "broken.jpg")], tmp_path), "not a readable image")
    monkeypatch.chdir(tmp_path)  # the rest in process
    assert_usage_error_in_process(predict.main, ["--model", str(model_file), "missing.jpg"], capsys,
                                  "missing.jpg: no such image or folder")
    assert_usage_error_in_process(evaluate.main, ["--data_dir", str(tmp_path / "val"), "--model", "missing.pt"], capsys,
                                  "no such file or checkpoint folder")
    (tmp_path / "loop").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop")  # Path.resolve's RuntimeError before the check that names it
    assert_usage_error_in_process(evaluate.main, ["--data_dir", str(tmp_path / "val"), "--model", str(model_file),
                                                  "--output_dir", "loop"], capsys,
                                  "--output_dir loop: loop is a link to nothing or a link loop")
