"""--model (any torchvision classifier), --pretrained through torchvision's weights API, fp32 normalisation."""
import json
import sys
import urllib.error
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
import torch.nn.functional as F
import torchvision

from conftest import TINY_CLASSES, data_args, join_process_group, launch, spawn_ranks
from data import DEFAULT_PREPROCESSING, build_transform, check_preprocessing
from failures import UsageError
from model import (LayerNorm2dFP32, build_model, check_image_size, list_models, load_weights, model_for_weights,
                   preprocessing, synchronize_batch_norm)
from options import run_cli

# One small model of each family, with a size each takes.
FAMILIES = {"mobilenet_v3_small": 32, "efficientnet_b0": 32, "convnext_tiny": 32, "vit_b_16": 32, "swin_t": 32,
            "swin_v2_t": 32, "regnet_x_400mf": 32, "densenet121": 32, "shufflenet_v2_x0_5": 32, "mnasnet0_5": 32,
            "squeezenet1_1": 32, "googlenet": 32, "inception_v3": 80}
# Those the engines below train (all of them did, 50 s on 2 CPU cores; these are the families whose layers
# differ most: depthwise and squeeze-excite convolutions, LayerNorm2d, attention, Swin V2's coordinate
# table, Inception's auxiliary head). ResNet18 trains in every other test.
TRAINED = ("mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "vit_b_16", "swin_t", "swin_v2_t",
           "inception_v3")


def test_every_torchvision_classifier_is_listed_with_its_size_and_weights():
    lines = list_models().splitlines()
    names = torchvision.models.list_models(module=torchvision.models)
    assert [line.split()[0] for line in lines[1:]] == names
    resnet50 = next(line for line in lines if line.startswith("resnet50 "))
    assert resnet50.split()[1:4] == ["25.6M", "224px", "DEFAULT"] and "IMAGENET1K_V2" in resnet50
    assert next(line for line in lines if line.startswith("efficientnet_v2_s ")).split()[2] == "384px"


def test_a_model_or_size_no_run_can_use_is_refused_before_anything_starts():
    with pytest.raises(UsageError, match=r"--model resnet19: not a torchvision classifier \(did you mean resnet18"):
        build_model("resnet19", 3)
    with pytest.raises(UsageError, match="--model inception_v3 cannot take --image_size 32"):
        check_image_size("inception_v3", 3, 32)
    with pytest.raises(UsageError, match="--model vit_b_16 cannot take --image_size 40"):
        check_image_size("vit_b_16", 3, 40)
    for name, size in FAMILIES.items():
        check_image_size(name, TINY_CLASSES, size)


def test_sync_bn_reaches_the_batch_norm_of_any_model():
    assert synchronize_batch_norm(build_model("efficientnet_b0", 3)) == 49
    assert synchronize_batch_norm(build_model("vit_b_16", 3, 32)) == 0  # layer norm only: the run says so


def test_resnet18_keeps_its_name_and_keys_and_others_keep_torchvisions():
    assert type(build_model("resnet18", 3)).__name__ == "ResNet18Animals90"
    model = build_model("convnext_tiny", 5)
    assert list(model.state_dict()) == list(torchvision.models.convnext_tiny(num_classes=5).state_dict())
    assert sum(isinstance(m, LayerNorm2dFP32) for m in model.modules()) > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_computes_in_fp32_under_half_precision_weights(dtype):
    torch.manual_seed(0)
    model = build_model("convnext_tiny", 3)
    norm = next(m for m in model.modules() if isinstance(m, LayerNorm2dFP32))
    x = torch.randn(2, norm.normalized_shape[0], 5, 5) * 3 + 1
    expected = torchvision.models.convnext.LayerNorm2d.forward(norm, x.to(dtype).float())
    norm.weight.data, norm.bias.data = norm.weight.data.to(dtype), norm.bias.data.to(dtype)
    out = norm(x.to(dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_weights_bring_their_preprocessing_and_files_are_checked_for_it():
    assert preprocessing("resnet50", "IMAGENET1K_V2") == {
        "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "resize_ratio": 232 / 224,
        "interpolation": "bilinear"}
    assert preprocessing("vit_b_16", "IMAGENET1K_SWAG_E2E_V1")["interpolation"] == "bicubic"
    assert preprocessing("resnet50", None) == preprocessing("resnet50", "weights.pth") == DEFAULT_PREPROCESSING
    resized = build_transform(224, train=False, preprocessing=preprocessing("resnet50", "IMAGENET1K_V2"))
    assert resized.transforms[0].size == 232
    assert check_preprocessing(None, "x.json") == DEFAULT_PREPROCESSING
    for damaged in ({"mean": [0.5] * 3}, {**DEFAULT_PREPROCESSING, "std": [0, 1, 1]},
                    {**DEFAULT_PREPROCESSING, "resize_ratio": "big"}, {**DEFAULT_PREPROCESSING, "interpolation": "os"}):
        with pytest.raises(UsageError, match="x.json: its preprocessing is not one this trainer writes"):
            check_preprocessing(damaged, "x.json")


def imagenet_weights_file(torch_home, name, weights="DEFAULT"):
    """Where torchvision keeps the weights `weights` of model `name` under TORCH_HOME, written with a model of
    1000 classes (a stand-in for the download); returns (path, the state written)."""
    enum = torchvision.models.get_model_weights(name)
    url = (enum.DEFAULT if weights == "DEFAULT" else enum[weights]).url
    path = Path(torch_home) / "hub/checkpoints" / Path(urlparse(url).path).name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    state = torchvision.models.get_model(name).state_dict()
    torch.save(state, path)
    return path, state


@pytest.mark.parametrize("weights", ["DEFAULT", "IMAGENET1K_V1"])
def test_pretrained_weights_come_from_the_torch_hub_cache_with_a_new_head(tmp_path, monkeypatch, weights):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    _, imagenet = imagenet_weights_file(tmp_path, "mobilenet_v3_small", weights)
    model = build_model("mobilenet_v3_small", 3, pretrained=weights)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in imagenet.items() if not k.startswith("classifier.3."))
    assert loaded["classifier.3.weight"].shape == (3, 1024)


def test_weights_without_module_versions_load_into_mnasnet(tmp_path, monkeypatch):
    """MNASNet's loader refuses a state without its version (an export; torchvision's file seen through a
    filtered copy)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    _, imagenet = imagenet_weights_file(tmp_path, "mnasnet0_5")
    model = build_model("mnasnet0_5", 3, pretrained="DEFAULT")
    assert torch.equal(model.state_dict()["layers.0.weight"], imagenet["layers.0.weight"])
    load_weights(model_for_weights("mnasnet0_5", 3, 224), dict(model.state_dict()), "an export")


def test_pretrained_without_the_file_or_the_network_names_both(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(url, dst, *args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(UsageError, match=r"--pretrained DEFAULT: mobilenet_v3_small-047dcff4.pth is not in "
                                         rf"{tmp_path}/hub/checkpoints and could not be downloaded from https://"
                                         r".*\(Temporary failure in name resolution\); download it into"):
        build_model("mobilenet_v3_small", 3, pretrained="DEFAULT")
    with pytest.raises(UsageError, match=r"--pretrained IMAGENET1K_V2: no such file, and not a weights name of "
                                         r"mobilenet_v3_small \(DEFAULT, IMAGENET1K_V1\)"):
        build_model("mobilenet_v3_small", 3, pretrained="IMAGENET1K_V2")
    path, _ = imagenet_weights_file(tmp_path, "mobilenet_v3_small")
    with pytest.raises(UsageError, match="is not a resnet18 state_dict"):
        build_model("resnet18", 3, pretrained=str(path))


def train_families(rank, port, results):
    """Two bf16 steps (DeepSpeed's half-precision weights, the mode the fp32 norms are for) of each TRAINED
    model, at ZeRO-0 and ZeRO-3."""
    import deepspeed

    join_process_group(rank, port)
    for name in TRAINED:
        size = FAMILIES[name]
        for stage in (0, 3):
            torch.manual_seed(0)
            model = build_model(name, TINY_CLASSES, size)
            before = [p.detach().clone() for p in model.parameters()][0]
            config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                      "zero_optimization": {"stage": stage}}
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            losses = []
            for _ in range(2):
                loss = F.cross_entropy(engine(torch.randn(2, 3, size, size, dtype=torch.bfloat16)).float(),
                                       torch.tensor([0, 2]))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            with deepspeed.zero.GatheredParameters([next(engine.module.parameters())]):
                moved = not torch.equal(next(engine.module.parameters()).detach().float(), before.float())
            results[(name, stage)] = {"losses": losses, "moved": moved}


@pytest.mark.slow
def test_every_family_trains_at_zero0_and_zero3_in_bf16():
    results = spawn_ranks(train_families)
    for name in TRAINED:
        for stage in (0, 3):
            result = results[(name, stage)]
            assert all(map(torch.isfinite, map(torch.tensor, result["losses"]))) and result["moved"], (name, stage)


@pytest.mark.slow
def test_a_pretrained_torchvision_model_fine_tunes_on_two_ranks_at_zero3_exports_and_evaluates(
        tiny_data, tmp_path, monkeypatch):
    import evaluate

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # the launcher and the ranks read it
    imagenet_weights_file(tmp_path / "torch_home", "mobilenet_v3_small")
    args = data_args(tiny_data) + ["--model", "mobilenet_v3_small", "--pretrained", "DEFAULT", "--epochs", "2",
                                   "--freeze_backbone_epochs", "1", "--backbone_lr_scale", "0.1", "--batch_size", "4",
                                   "--image_size", "32", "--num_workers", "0", "--zero_stage", "3", "--num_gpus", "2"]
    result = launch(args, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "mobilenet_v3_small: 48 train / 15 val images" in result.stdout
    history = json.loads((tmp_path / "logs/training_history.json").read_text())
    info = json.loads((tmp_path / "checkpoints_deepspeed/last/extra_info.json").read_text())
    assert history["config"]["model"] == info["model"] == "mobilenet_v3_small"
    assert history["config"]["pretrained"] == info["pretrained"] == "DEFAULT"
    assert history["config"]["preprocessing"] == info["preprocessing"] == preprocessing("mobilenet_v3_small", "DEFAULT")
    assert history["config"]["training"]["freeze_backbone_epochs"] == 1
    first, second = history["epochs"]
    assert first["backbone_lr"] == 0 and second["backbone_lr"] == pytest.approx(0.1 * second["lr"])

    from export_model import main as export

    export([str(tmp_path / "checkpoints_deepspeed/last"), "--output", str(tmp_path / "model.safetensors")])
    sidecar = json.loads((tmp_path / "model.safetensors.json").read_text())
    assert sidecar["model"] == "mobilenet_v3_small" and sidecar["preprocessing"] == info["preprocessing"]
    with pytest.raises(SystemExit) as exited:
        sys.exit(run_cli(evaluate.main, ["--model", str(tmp_path / "model.safetensors"), "--data_dir",
                                         str(tiny_data / "val"), "--output_dir", str(tmp_path / "eval"),
                                         "--num_workers", "0"]))
    assert exited.value.code in (0, None)
    report = json.loads((tmp_path / "eval/report.json").read_text())
    assert report["top1"] == pytest.approx(second["val_acc"])
    # A sidecar of another export: its class count against the head's (classifier.3 here, not ResNet's fc).
    (tmp_path / "model.safetensors.json").write_text(json.dumps({**sidecar, "class_names": ["a", "b"]}))
    with pytest.raises(UsageError, match=f"has {TINY_CLASSES} outputs but its class names list 2"):
        evaluate.main(["--model", str(tmp_path / "model.safetensors"), "--data_dir", str(tiny_data / "val"),
                       "--output_dir", str(tmp_path / "eval"), "--num_workers", "0"])
