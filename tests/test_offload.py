"""ZeRO-3 with parameters and optimizer state offloaded to the CPU, on 2 ranks (gloo): a transformer and a CNN
train, resume from a checkpoint to exactly where an uninterrupted run gets, and export the model they validated."""
import json
import math

import pytest

from deepspeed_image_trainer.data.prepare import make_sample_dataset
from deepspeed_image_trainer.inference import evaluate
from deepspeed_image_trainer.inference import export as export_model

from conftest import ROOT, TINY_CLASSES, built_instead, data_args, history_of, join_process_group, spawn_ranks

pytestmark = pytest.mark.slow  # it starts two training processes

# model -> (--image_size, how ZeRO-3 and offload are asked for): a ViT (vit_b_16's class at DeiT-Tiny's size, below)
# at 2 x 2 patches with the reference config
# ds_config_zero3.json in bf16 (its fp16 replaced), as a user runs it; the default CNN (batch norm) by flags in
# fp32, where its export must give the trainer's validation loss to the last digits
MODELS = {"vit_b_16": (32, ["--deepspeed_config", str(ROOT / "ds_config_zero3.json"), "--bf16",
                            "--learning_rate", "0.005"]),
          "resnet18": (32, ["--zero_stage", "3", "--offload_param", "--offload_optimizer"])}
BF16_AGAINST_FP32 = 2e-3  # the trainer validates the bf16 model, evaluate.py the fp32 export
TRAIN_PER_CLASS, VAL_PER_CLASS = 4, 2  # 12 images: 3 steps of 2 x 2 an epoch
METRICS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")


def vit_tiny(**kwargs):
    """torchvision's ViT at DeiT-Tiny's size (5.7 M parameters: 12 blocks 192 wide): ViT-B/16's 86 M took this test
    a minute and a half of CPU Adam steps and gigabyte checkpoints, and offload, partitioning (its large weights above
    the persistence threshold, the small ones below), resume and export treat both alike."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(patch_size=16, num_layers=12, num_heads=3, hidden_dim=192, mlp_dim=768, **kwargs)


def train_and_resume(rank, port, results, data, workdir):
    """On each of 2 ranks, for each model: 2 epochs in one run, then the second again from its epoch_1."""
    import gc

    import torch

    from deepspeed_image_trainer.cli import train as train_deepspeed
    from deepspeed_image_trainer.engine.distributed import barrier

    torch.set_num_threads(1)  # two ranks share the machine's cores
    join_process_group(rank, port, world_size=2)
    built_instead({"vit_b_16": vit_tiny})
    # The ranks finish each run together (a rank leaving early would look for the next run's checkpoint while
    # rank 0 still writes it), and the group serves every run here: spawn_ranks leaves it at the end.
    train_deepspeed.shut_down = barrier
    for name, (size, flags) in MODELS.items():
        epoch_1 = workdir / name / "whole/checkpoints/epoch_1"
        for folder, extra in (("whole", ["--save_every", "1"]), ("resumed", ["--resume", str(epoch_1)])):
            results[(name, folder, rank)] = train_deepspeed.main(data_args(data) + [
                "--model", name, "--image_size", str(size), *flags, "--epochs", "2", "--batch_size", "2", "--warmup_epochs", "0",
                "--num_workers", "0", "--checkpoint_dir", str(workdir / name / folder / "checkpoints"),
                "--log_dir", str(workdir / name / folder / "logs"), *extra])
            gc.unfreeze()  # the trainer froze what it built; the next run needs the memory
            gc.collect()


def test_zero3_with_offload_trains_resumes_and_exports_a_transformer_and_a_cnn_on_two_ranks(tmp_path, monkeypatch):
    built_instead({"vit_b_16": vit_tiny}, monkeypatch)  # for the export and evaluation here
    data = tmp_path / "data"
    make_sample_dataset(data, num_classes=TINY_CLASSES, train_per_class=TRAIN_PER_CLASS, val_per_class=VAL_PER_CLASS,
                        image_size=32, seed=0)
    results = spawn_ranks(train_and_resume, 2, data, tmp_path)
    assert set(results.values()) == {0} and len(results) == len(MODELS) * 2 * 2
    for name, (_, flags) in MODELS.items():
        bf16 = "--bf16" in flags
        whole, resumed = (history_of(tmp_path / name / run)
                          for run in ("whole", "resumed"))
        config = resumed["config"]
        zero = config["deepspeed"]["zero_optimization"]
        assert config["world_size"] == 2 and config["zero_stage"] == 3, name
        assert config["precision"] == ("bf16" if bf16 else "fp32"), name
        assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu", name
        # Weights, Adam's moments (offloaded), the schedule and the data order all come back: the resumed run's
        # second epoch is the uninterrupted run's, to the last digit.
        assert [{k: e[k] for k in METRICS} for e in resumed["epochs"]] == \
            [{k: e[k] for k in METRICS} for e in whole["epochs"]], name
        # The best checkpoint its history names is in its own folder, whichever run's epoch that was
        best = json.loads((tmp_path / name / "resumed/checkpoints/best_model/extra_info.json").read_text())
        assert best["epoch"] == resumed["best"]["epoch"], name
        last = resumed["epochs"][-1]
        assert abs(last["val_loss"] - math.log(TINY_CLASSES)) > 1e-3, name  # it learnt: another model would differ
        # The export, gathered from both ranks' offloaded partitions, is the model the trainer validated
        # (here, outside the ranks' process group: evaluation sums its metrics over any group it is in).
        exported = tmp_path / f"{name}.safetensors"
        export_model.main([str(tmp_path / name / "resumed/checkpoints/last"), "--output", str(exported)])
        evaluate.main(["--model", str(exported), "--data_dir", str(data / "val"), "--output_dir",
                       str(tmp_path / name / "eval"), "--num_workers", "0"])
        report = json.loads((tmp_path / name / "eval/report.json").read_text())
        tolerance = BF16_AGAINST_FP32 if bf16 else 1e-5
        assert report["loss"] == pytest.approx(last["val_loss"], rel=tolerance), name
        previous = resumed["epochs"][-2]["val_loss"]  # what an export of the weights before would give
        assert abs(previous - last["val_loss"]) > 10 * tolerance * last["val_loss"], name
        assert report["top1"] == pytest.approx(last["val_acc"]), name
