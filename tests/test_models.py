"""--model (any torchvision classifier), --pretrained through torchvision's weights API, fp32 normalisation."""
import json
import math
import os
import urllib.error
import warnings
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
import torch.nn.functional as F
import torchvision

from deepspeed_image_trainer.data.folders import DEFAULT_PREPROCESSING, build_transform, check_preprocessing
from deepspeed_image_trainer.data.prepare import make_sample_dataset
from deepspeed_image_trainer.models.build import (build_model, check_image_size, checked_model, list_models,
                                                  load_weights, model_for_weights, preprocessing, pretrained_state)
from deepspeed_image_trainer.models.names import WITHOUT_BLOCKS, saved_name
from deepspeed_image_trainer.models.norms import LayerNorm2dFP32, synchronize_batch_norm
from deepspeed_image_trainer.utils.failures import UsageError

from conftest import (TINY_CLASSES, Payload, assert_usage_error_in_process, built_instead, data_args, history_of,
                      join_process_group, slim_timm, spawn_ranks, tiny_engine)

# One small model of each family, with a size each takes.
FAMILIES = {"resnet18": 32, "mobilenet_v3_small": 32, "mobilenet_v2": 32, "efficientnet_b0": 32, "convnext_tiny": 32,
            "vit_b_16": 32, "swin_t": 32, "swin_v2_t": 32, "regnet_x_400mf": 32, "densenet121": 32,
            "shufflenet_v2_x0_5": 32, "mnasnet0_5": 32, "squeezenet1_1": 32, "googlenet": 32, "inception_v3": 80}


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


def test_activation_checkpointing_recomputes_torchvisions_blocks_and_steps_as_without_it(capsys):
    """--grad_checkpointing keeps only each block's input (a tenth of what a plain forward keeps here) and trains to
    the same bits: drop path's draws replayed, batch-norm statistics updated once a step, not again when the block
    is recomputed; AlexNet and VGG, without blocks, are refused."""
    from deepspeed_image_trainer.cli import launch as launch_deepspeed

    images, labels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 2])
    for name, drop_path in (("resnet18", None), ("efficientnet_b0", 0.2)):
        runs = []
        for checkpointing in (False, True):
            torch.manual_seed(0)
            model = build_model(name, 3, 16, drop_path=drop_path, grad_checkpointing=checkpointing).train()
            kept = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                          lambda t: t):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            runs.append((model.state_dict(), sum(kept)))
        (plain, plain_kept), (recomputed, recomputed_kept) = runs
        assert list(recomputed) == list(plain) and all(torch.equal(recomputed[k], plain[k]) for k in plain), name
        assert recomputed_kept < plain_kept / 5, name
    assert_usage_error_in_process(launch_deepspeed.main, ["--model", "vgg11", "--grad_checkpointing", "--dry_run"],
                                  capsys, "--grad_checkpointing: --model vgg11 has no repeated blocks to recompute")


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
    # numbers as strings ("1.1") or true passed float() and ended in a traceback in the transform, or every image
    # reported unreadable
    for damaged in ({"mean": [0.5] * 3}, {**DEFAULT_PREPROCESSING, "std": [0, 1, 1]},
                    {**DEFAULT_PREPROCESSING, "resize_ratio": "big"}, {**DEFAULT_PREPROCESSING, "interpolation": "os"},
                    {**DEFAULT_PREPROCESSING, "resize_ratio": "1.1"}, {**DEFAULT_PREPROCESSING, "resize_ratio": True},
                    {**DEFAULT_PREPROCESSING, "mean": ["0.4", "0.4", "0.4"]},
                    {**DEFAULT_PREPROCESSING, "val_crop_size": 0}, {**DEFAULT_PREPROCESSING, "val_resize_size": "48"},
                    # finite, but every logit NaN (round 25)
                    {**DEFAULT_PREPROCESSING, "mean": [1e308, 0, 0]}, {**DEFAULT_PREPROCESSING, "std": [1e300, 1, 1]}):
        with pytest.raises(UsageError, match="x.json: its preprocessing is not one this trainer writes"):
            check_preprocessing(damaged, "x.json")


def imagenet_weights_file(torch_home, name, weights="DEFAULT", **kwargs):
    """Where torchvision keeps the weights `weights` of model `name` under TORCH_HOME, written with a model of
    1000 classes (a stand-in for the download; `kwargs` to build it); returns (path, the state written)."""
    enum = torchvision.models.get_model_weights(name)
    url = (enum.DEFAULT if weights == "DEFAULT" else enum[weights]).url
    path = Path(torch_home) / "hub/checkpoints" / Path(urlparse(url).path).name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    state = torchvision.models.get_model(name, **kwargs).state_dict()
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
    # A file of the weights' name in the working directory does not shadow the name (whose preprocessing the
    # run takes); ./<name> is that file.
    monkeypatch.chdir(tmp_path)
    other = build_model("mobilenet_v3_small", 3).state_dict()
    torch.save(other, tmp_path / weights)
    assert torch.equal(build_model("mobilenet_v3_small", 3, pretrained=weights).state_dict()["features.0.0.weight"],
                       imagenet["features.0.0.weight"])
    assert torch.equal(build_model("mobilenet_v3_small", 3, pretrained=f"./{weights}").state_dict()[
        "features.0.0.weight"], other["features.0.0.weight"])


def test_weights_saved_before_batch_norm_counted_its_batches_load(tmp_path):
    """Files from before torch 0.4.1 lack every num_batches_tracked, which batch norm's loader fills in (torch's
    strict load takes them): they were refused as missing those keys."""
    state = {k: v for k, v in torchvision.models.resnet18().state_dict().items()
             if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "old.pth")
    loaded = build_model("resnet18", 3, pretrained=str(tmp_path / "old.pth")).state_dict()
    assert torch.equal(loaded["layer1.0.conv1.weight"], state["layer1.0.conv1.weight"])


def test_weights_without_module_versions_load_into_mnasnet(tmp_path, monkeypatch):
    """MNASNet's loader refuses a state without its version (an export; torchvision's file seen through a
    filtered copy)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    _, imagenet = imagenet_weights_file(tmp_path, "mnasnet0_5")
    model = build_model("mnasnet0_5", 3, pretrained="DEFAULT")
    assert torch.equal(model.state_dict()["layers.0.weight"], imagenet["layers.0.weight"])
    load_weights(model_for_weights("mnasnet0_5", 3, 224), dict(model.state_dict()), "an export")
    path = tmp_path / "version3.pth"
    state = model.state_dict()
    state._metadata[""] = {"version": 3}  # no MNASNet had it
    torch.save(state, path)
    with pytest.raises(UsageError, match=f"--pretrained {path}: version should be set to 1 or 2 instead of 3"):
        build_model("mnasnet0_5", 3, pretrained=str(path))
    state._metadata[""] = {"version": 1}  # MNASNet's stem before version 2: other shapes, a traceback in the rank
    torch.save(state, path)
    with pytest.raises(UsageError, match=r"its module versions \(_metadata\) do not fit the model \(size mismatch"):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            checked_model("mnasnet0_5", 3, 224, 2, str(path))  # the launcher's check, on the meta device
    assert not said  # torch warned once for each parameter copied into the meta model: 482 lines before the error


def test_pretrained_weights_in_torchs_legacy_format_load_in_the_launcher_and_the_ranks(tmp_path):
    path = tmp_path / "legacy.pt"
    state = build_model("mobilenet_v3_small", 3).state_dict()
    torch.save(state, path, _use_new_zipfile_serialization=False)
    shapes = check_image_size("mobilenet_v3_small", 3, 224)
    checked = pretrained_state(shapes, "mobilenet_v3_small", str(path), 3, mmap=True)  # as the launcher reads it
    loaded = build_model("mobilenet_v3_small", 3, pretrained=str(path)).state_dict()  # as each rank does
    assert all(torch.equal(checked[k], v) and torch.equal(loaded[k], v) for k, v in state.items())


def test_a_plain_pickle_as_weights_is_refused_in_one_line_and_never_run(tmp_path):
    """pickle.dump's file (protocol 4), not torch.save's: refused without torch's protocol warning, and its
    object never built."""
    import pickle
    import warnings

    path = tmp_path / "weights.pkl"
    with open(path, "wb") as f:
        pickle.dump({"fc.weight": Payload(tmp_path / "ran")}, f, protocol=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would print a line of its own before the error
        with pytest.raises(UsageError, match=r"weights.pkl is damaged or not a torch file \(Unsupported operand"):
            build_model("resnet18", 3, pretrained=str(path))
    assert not (tmp_path / "ran").exists()


def test_a_torchscript_archive_as_weights_is_refused_in_one_line(tmp_path):
    """torch.load warned that it looks like TorchScript (two lines) before its weights_only error."""
    import warnings

    path = tmp_path / "scripted.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UsageError, match=r"scripted.pt is a TorchScript archive \(torch.jit.save\), not a "):
            build_model("resnet18", 3, pretrained=str(path))


def test_pretrained_without_the_file_or_the_network_names_both(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(url, dst, *args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(UsageError, match=r"--pretrained DEFAULT: mobilenet_v3_small-047dcff4.pth is not in "
                                         rf"{tmp_path}/hub/checkpoints and could not be downloaded from https://"
                                         r".*\(Temporary failure in name resolution\); download it into"):
        build_model("mobilenet_v3_small", 3, pretrained="DEFAULT")
    (tmp_path / "hub/checkpoints/mobilenet_v3_small-047dcff4.pth").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"--pretrained DEFAULT: .*/mobilenet_v3_small-047dcff4.pth is a folder, "
                                         r"where the weights file should be"):
        build_model("mobilenet_v3_small", 3, pretrained="DEFAULT")
    (tmp_path / "hub/checkpoints/mobilenet_v3_small-047dcff4.pth").rmdir()
    with pytest.raises(UsageError, match=r"--pretrained IMAGENET1K_V2: no such file, and not a weights name of "
                                         r"mobilenet_v3_small \(DEFAULT, IMAGENET1K_V1\)"):
        build_model("mobilenet_v3_small", 3, pretrained="IMAGENET1K_V2")
    path, _ = imagenet_weights_file(tmp_path, "mobilenet_v3_small")
    with pytest.raises(UsageError, match="is not a resnet18 state_dict"):
        build_model("resnet18", 3, pretrained=str(path))
    state = build_model("resnet18", 3).state_dict()
    state["layer2.0.conv1.weight"][0, 0, 0, 0] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    with pytest.raises(UsageError, match=r"nan.pt: layer2.0.conv1.weight holds NaN or infinite values"):
        build_model("resnet18", 3, pretrained=str(tmp_path / "nan.pt"))
    state = build_model("resnet18", 3).state_dict()
    state["conv1.weight"] = state["conv1.weight"].double() * 1e300  # finite in the file, infinite in fp32
    torch.save(state, tmp_path / "huge.pt")
    with pytest.raises(UsageError, match=r"huge.pt: conv1.weight holds NaN or infinite values \(in fp32"):
        build_model("resnet18", 3, pretrained=str(tmp_path / "huge.pt"))
    state = build_model("resnet18", 3).state_dict()
    state["bn1.running_var"][5] = -1.0  # the run stopped after an epoch on a NaN validation loss (status 3)
    torch.save(state, tmp_path / "negative.pt")
    with pytest.raises(UsageError, match=r"negative.pt: bn1.running_var holds negative variances"):
        build_model("resnet18", 3, pretrained=str(tmp_path / "negative.pt"))
    state = build_model("resnet18", 3).state_dict()
    state["conv1.weight"] = state["conv1.weight"].long()  # loaded as zeros: the run learned nothing, status 0
    torch.save(state, tmp_path / "integers.pt")
    with pytest.raises(UsageError, match=r"integers.pt: conv1.weight is a torch.int64 tensor where resnet18 holds "
                                         r"torch.float32 values"):
        build_model("resnet18", 3, pretrained=str(tmp_path / "integers.pt"))
    state["conv1.weight"] = state["conv1.weight"].half()  # another floating type is cast, as torchvision's loader does
    torch.save(state, tmp_path / "half.pt")
    build_model("resnet18", 3, pretrained=str(tmp_path / "half.pt"))
    hub = tmp_path / "hub/checkpoints/mobilenet_v3_small-047dcff4.pth"
    hub.unlink()
    hub.symlink_to(hub)  # a link loop where the weights file should be
    with pytest.raises(UsageError, match=r"--pretrained DEFAULT: .*mobilenet_v3_small-047dcff4.pth is a link to "
                                         r"nothing"):
        build_model("mobilenet_v3_small", 3, pretrained="DEFAULT")


def bf16_steps(name, size):
    """Two bf16 steps at ZeRO-3 (half-precision weights, fp32 buffers: the mode the fp32 norms and Swin V2's
    table cast are for): the losses, and whether the first weight moved."""
    import deepspeed

    torch.manual_seed(0)
    model = build_model(name, TINY_CLASSES, size)
    before = next(model.parameters()).detach().clone()
    engine = tiny_engine(model, micro_batch=2, zero={"stage": 3}, bf16={"enabled": True})
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(engine(torch.randn(2, 3, size, size, dtype=torch.bfloat16)).float(),
                               torch.tensor([0, 2]))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters([next(engine.module.parameters())]):
        moved = not torch.equal(next(engine.module.parameters()).detach().float(), before.float())
    return {"losses": losses, "moved": moved}


# The families split in two for two processes, about the same time each.
FAMILY_HALVES = (("vit_b_16", "densenet121", "efficientnet_b0", "googlenet", "mobilenet_v3_small", "squeezenet1_1",
                  "resnet18", "regnet_x_400mf"),
                 ("swin_v2_t", "swin_t", "inception_v3", "convnext_tiny", "mnasnet0_5", "shufflenet_v2_x0_5",
                  "mobilenet_v2"))
# The rest of torchvision's model builders, through the same checks with ALL_FAMILIES=1: each of them takes
# a CPU longer than the families above together (tens of millions of parameters; MaxViT takes 224 px only).
MORE_FAMILIES = {"efficientnet_v2_s": 32, "resnext50_32x4d": 32, "wide_resnet50_2": 32, "alexnet": 64, "vgg11": 32,
                 "maxvit_t": 224}
MORE_HALVES = (("maxvit_t", "resnext50_32x4d"), ("vgg11", "wide_resnet50_2", "alexnet", "efficientnet_v2_s"))
# bf16_steps for one model of each kind of normalisation layer the fp32 swap covers: batch norm (with
# squeeze-excite), ConvNeXt's LayerNorm2d, and Swin V2's layer norm and coordinate table (EfficientNet's and
# Swin V1's layers are among these; their steps took about 5 s of the test's CPU time).
BF16_STEPPED = ("mobilenet_v3_small", "convnext_tiny", "swin_v2_t", "timm:test_efficientnet",
                "timm:eva02_tiny_patch14_224")
# A model of each timm family (--model timm:NAME): timm's own for tests (about 0.4 M parameters), and EVA (its
# rotary embedding) at two blocks (slim_timm), in two halves
TIMM_FAMILIES = {"timm:test_vit": 32, "timm:eva02_tiny_patch14_224": 28, "timm:test_convnext": 32,
                 "timm:test_efficientnet": 32, "timm:test_resnet": 32}
TIMM_HALVES = (("timm:eva02_tiny_patch14_224", "timm:test_resnet"),
               ("timm:test_efficientnet", "timm:test_convnext", "timm:test_vit"))


# ZeRO-2 and 3, where a family's own handling lies (its blocks as ZeRO-3 leaves, its buffers consolidated from
# shards). ZeRO-0 keeps the model whole and ZeRO-1 runs ZeRO-2's optimizer: the session's trained runs
# (conftest's TRAINED_RUNS) and test_end_to_end's exports cover them, not every family.
STAGES = (2, 3)
# exported, evaluated and predicted from: ZeRO-3's consolidation is the family's (its leaf blocks' shards);
# ZeRO-2's export is test_end_to_end's, and here its run checks that ZeRO-3 trains the same model
EXPORTED_STAGE = 3
# 4 train and 2 validation images per class: one step of 12 (a quarter of the compute of the shared tiny
# dataset's epoch, which for ViT-B/16 was a quarter of a run).
FAMILY_TRAIN_IMAGES, FAMILY_VAL_IMAGES = 4 * TINY_CLASSES, 2 * TINY_CLASSES


def slim_transformers(monkeypatch=None):
    """torchvision's ViT-B/16, Swin T, Swin V2 T and ConvNeXt Tiny built from their own classes at a fraction of
    their width and depth, in this process: their 28 to 86 M parameters took two thirds of this test's time in
    checkpoints and exports, and the trainer's handling of each family (its blocks as ZeRO-3 leaves, its norms,
    export and load by name) is the same. A 5.7 M-parameter ViT trains, resumes and exports in test_offload.py."""
    from torchvision.models import ConvNeXt, SwinTransformer, VisionTransformer
    from torchvision.models.convnext import CNBlockConfig
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformerBlockV2

    built_instead({
        "vit_b_16": lambda **kw: VisionTransformer(patch_size=16, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128,
                                                   **kw),
        "swin_t": lambda **kw: SwinTransformer([4, 4], 24, [2, 2, 2, 2], [1, 2, 4, 8], [7, 7], 0.2, **kw),
        "swin_v2_t": lambda **kw: SwinTransformer([4, 4], 24, [2, 2, 2, 2], [1, 2, 4, 8], [8, 8], 0.2,
                                                  block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2, **kw),
        "convnext_tiny": lambda **kw: ConvNeXt([CNBlockConfig(24, 48, 1), CNBlockConfig(48, 96, 1),
                                                CNBlockConfig(96, 192, 1), CNBlockConfig(192, None, 1)], 0.1, **kw)},
                  monkeypatch)


def recomputes(name):
    """Whether the family harness's ZeRO-3 run of `name` turns on --grad_checkpointing: torchvision's families with
    repeated blocks (timm's own checkpointing is test_timm.py's)."""
    return not name.startswith(("timm:", *WITHOUT_BLOCKS))


def train_export_evaluate_predict(process, _, results, data, workdir, halves, sizes):
    """For each model of halves[process] (sizes: its --image_size): a run of the trainer at each ZeRO stage in
    fp32, its export, evaluate and predict on it; then bf16_steps. The trainer's main() in this process: a
    launcher run each would add seconds of startup to each of the 30 runs."""
    import contextlib
    import gc
    import io
    import shutil

    from deepspeed.runtime import engine

    from deepspeed_image_trainer.cli import train as train_deepspeed
    from deepspeed_image_trainer.engine.distributed import free_port
    from deepspeed_image_trainer.inference import evaluate
    from deepspeed_image_trainer.inference import export as export_model
    from deepspeed_image_trainer.inference import predict

    torch.set_num_threads(1)  # two of these processes share the machine's cores
    slim_transformers()
    if any(name.startswith("timm:") for name in halves[process]):
        slim_timm()
    join_process_group(0, free_port())  # a group of one of its own
    train_deepspeed.shut_down = lambda: None  # it serves every run here; spawn_ranks leaves it at the end
    leaves = []  # the modules ZeRO-3 gathers whole, as the trainer's config names them, for each engine
    apply_leaves = engine.apply_zero_leaf_module_config
    engine.apply_zero_leaf_module_config = lambda model, config: leaves.append(apply_leaves(model, config)) or leaves[-1]
    for name in halves[process]:
        size = sizes[name]
        for stage in STAGES:
            work = workdir / f"{name}-{stage}"
            exported = work / ("model.pt" if stage % 2 else "model.safetensors")
            code = train_deepspeed.main(data_args(data) + [
                "--model", name, "--image_size", str(size), "--zero_stage", str(stage), "--epochs", "1",
                "--batch_size", str(FAMILY_TRAIN_IMAGES), "--learning_rate", "0.05", "--warmup_epochs", "0",
                "--num_workers", "0", "--checkpoint_dir", str(work / "checkpoints"), "--log_dir", str(work / "logs"),
                *(["--grad_checkpointing"] if stage == 3 and recomputes(name) else [])])
            result = {"code": code, "history": history_of(work), "leaf_modules": len(leaves[-1])}
            if stage == EXPORTED_STAGE:
                export_model.main([str(work / "checkpoints/last"), "--output", str(exported)])
                evaluate.main(["--model", str(exported), "--data_dir", str(data / "val"), "--output_dir",
                               str(work / "eval"), "--num_workers", "0"])
                with contextlib.redirect_stdout(io.StringIO()) as printed:
                    predict.main(["--model", str(exported), str(data / "val"), "--json"])
                result.update(sidecar=json.loads(Path(f"{exported}.json").read_text()),
                              report=json.loads((work / "eval/report.json").read_text()),
                              predictions=json.loads(printed.getvalue()))
            results[(name, stage)] = result  # a shared dict: stored whole
            gc.unfreeze()  # the trainer froze what it built: collectable again (a full collection here took 2 s a run)
            shutil.rmtree(work)  # a ViT-B/16 run writes 1.5 GB
        if name in BF16_STEPPED:
            results[(name, "bf16")] = bf16_steps(name, size)


@pytest.mark.slow
@pytest.mark.parametrize("halves, sizes", [
    (FAMILY_HALVES, FAMILIES),
    pytest.param(MORE_HALVES, MORE_FAMILIES, marks=pytest.mark.skipif(not os.environ.get("ALL_FAMILIES"),
                                                                      reason="ALL_FAMILIES=1 runs these")),
    (TIMM_HALVES, TIMM_FAMILIES)],
    ids=["families", "more families", "timm families"])
def test_every_family_trains_exports_evaluates_and_predicts_at_zero_2_and_3(tmp_path, halves, sizes):
    assert sorted(sum(halves, ())) == sorted(sizes)
    data = tmp_path / "data"
    make_sample_dataset(data, num_classes=TINY_CLASSES, train_per_class=FAMILY_TRAIN_IMAGES // TINY_CLASSES,
                        val_per_class=FAMILY_VAL_IMAGES // TINY_CLASSES, image_size=32, seed=0)
    results = spawn_ranks(train_export_evaluate_predict, 2, data, tmp_path, halves, sizes)
    for name in sizes:
        for stage in STAGES:
            result = results[(name, stage)]
            history, report = result["history"], result.get("report")
            last = history["epochs"][-1]
            assert result["code"] == 0 and history["config"]["model"] == saved_name(name), (name, stage)
            assert history["config"]["zero_stage"] == stage
            # It learnt (not chance's loss), so an export of other weights could not match the loss below.
            assert abs(last["val_loss"] - math.log(TINY_CLASSES)) > 1e-4, (name, stage)
            if stage != EXPORTED_STAGE:
                continue
            assert result["sidecar"]["model"] == saved_name(name)
            # The export is the model the trainer validated: the same loss and accuracy on the same images.
            assert report["loss"] == pytest.approx(last["val_loss"], rel=1e-5), (name, stage)
            assert report["top1"] == pytest.approx(last["val_acc"]), (name, stage)
            classes = [Path(p["image"]).parent.name == p["predictions"][0]["class"] for p in result["predictions"]]
            assert len(classes) == FAMILY_VAL_IMAGES and sum(classes) / len(classes) == pytest.approx(report["top1"])
        # ZeRO-3 gathers the family's repeated blocks whole (leaf modules) and trains the model ZeRO-2 does, for
        # torchvision's families with those blocks recomputed in the backward pass (--grad_checkpointing)
        assert results[(name, 3)]["history"]["config"]["training"]["grad_checkpointing"] is recomputes(name), name
        assert results[(name, 3)]["leaf_modules"] > 0 and results[(name, 2)]["leaf_modules"] == 0, name
        losses = [results[(name, stage)]["history"]["epochs"][-1]["val_loss"] for stage in (2, 3)]
        assert losses[1] == pytest.approx(losses[0], rel=1e-5), name
    for name in (name for name in BF16_STEPPED if name in sizes):
        bf16 = results[(name, "bf16")]
        assert all(map(math.isfinite, bf16["losses"])) and bf16["moved"], name


def test_a_transformer_exports_to_onnx_and_torchscript_with_a_dynamic_batch(tmp_path, monkeypatch):
    """test_end_to_end exports ResNet18 from a checkpoint; this a ViT's patching and attention (slim, as in the
    family runs) through the same writer (Swin's windows export too: 19 s here)."""
    import onnxruntime

    from deepspeed_image_trainer.inference.export import _export_program
    from deepspeed_image_trainer.models.build import model_for_weights, plain_norms

    slim_transformers(monkeypatch)
    torch.manual_seed(0)
    name = "vit_b_16"
    model = plain_norms(model_for_weights(name, TINY_CLASSES, 32))
    for parameter in model.parameters():  # ViT's head starts at zero: logits of 0 would match anything
        torch.nn.init.normal_(parameter, std=0.2)
    model.eval()
    images = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        expected = model(images)
    for kind, file in (("onnx", "m.onnx"), ("torchscript", "m.ts")):
        metadata = _export_program(model, kind, tmp_path / file, {"image_size": 32, "class_names": ["a", "b", "c"]})
        assert metadata["checked"]["max_abs_difference"] < 1e-4
        assert json.loads((tmp_path / f"{file}.json").read_text())["checked"] == metadata["checked"]
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    scripted = torch.jit.load(str(tmp_path / "m.ts"))
    for batch in (images[:1], images):
        got = torch.from_numpy(session.run(["logits"], {"images": batch.numpy()})[0])
        assert torch.allclose(got, expected[:len(batch)], rtol=1e-4, atol=1e-5), name
        with torch.no_grad():
            assert torch.allclose(scripted(batch), expected[:len(batch)], rtol=1e-4, atol=1e-5), name

    import importlib.util

    from deepspeed_image_trainer.inference.export import check_format_support
    from deepspeed_image_trainer.utils.failures import UsageError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # an installation without the exporter
    with pytest.raises(UsageError, match="^--format onnx needs the onnx and onnxscript packages, .*: pip install onnx"):
        check_format_support("onnx")
