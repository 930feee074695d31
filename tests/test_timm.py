"""timm's models (--model timm:NAME, models/timm_models.py): listed, checked by name, their normalisation layers in
fp32 under half-precision weights, ZeRO-3's leaf blocks and timm's layer numbering per family, weights from the
Hugging Face hub cache through timm's loader, and a two-rank ZeRO-3 run that exports and evaluates. Each family
trains, exports, evaluates and predicts at ZeRO-2 and 3 in test_models.py (TIMM_FAMILIES)."""
import json
import sys

import pytest
import timm
import torch

from conftest import data_args, history_of, slim_timm, train_ranks
from deepspeed_image_trainer.cli.launch import checked_listing
from deepspeed_image_trainer.models import timm_models
from deepspeed_image_trainer.models.build import (build_model, check_image_size, check_model_name, checked_model,
                                                  list_models,
                                                  preprocessing, shape_model)
from deepspeed_image_trainer.models.norms import FP32_NORMS
from deepspeed_image_trainer.utils.failures import UsageError

# timm's own models for tests (a ViT of 0.4 M parameters, with weights on the hub)
VIT = "timm:test_vit"
DEFAULT_REPO = "timm/test_vit.r160_in1k"  # its DEFAULT weights' repository
# A model of each family, the size it is built at here
FAMILIES = {VIT: 32, "timm:eva02_tiny_patch14_224": 28, "timm:test_convnext": 32, "timm:test_efficientnet": 32,
            "timm:test_efficientnet_gn": 32, "timm:test_resnet": 32, "timm:test_byobnet": 32,
            "timm:swin_tiny_patch4_window7_224": 224}


def test_timm_models_are_listed_by_wildcard_with_their_weights_tags():
    lines = list_models("timm", "vit_tiny_patch16_*").splitlines()
    names = [line.split()[0] for line in lines[1:]]
    assert names and names == [f"timm:{name}" for name in timm.list_models("vit_tiny_patch16_*")]
    tiny = next(line for line in lines if line.startswith("timm:vit_tiny_patch16_224 "))
    assert tiny.split()[1:4] == ["224px", "DEFAULT", "augreg_in21k"] and "augreg_in21k_ft_in1k" in tiny
    assert list_models("timm", "no_such_model*") == "no timm model matches 'no_such_model*'"
    assert checked_listing([]) == checked_listing(["torchvision"]) == (None, None)
    assert checked_listing(["timm"]) == ("timm", None) and checked_listing(["timm", "vit*"]) == ("timm", "vit*")
    for words in (["tim"], ["timm", "a*", "b*"], ["torchvision", "vit*"]):
        with pytest.raises(UsageError, match=r"--list_models .*: give nothing \(torchvision's models\), or timm"):
            checked_listing(words)


def test_timm_names_are_checked_with_the_closest_ones_and_tags_go_to_pretrained():
    check_model_name(VIT)
    with pytest.raises(UsageError, match=r"--model timm:vit_tiny_patch16_22: not a timm model \(did you mean "
                                         r"timm:vit_tiny_patch16_224"):
        check_model_name("timm:vit_tiny_patch16_22")
    with pytest.raises(UsageError, match=r"give the weights' tag with --pretrained r160_in1k and the model as "
                                         r"--model timm:test_vit$"):
        check_model_name(f"{VIT}.r160_in1k")
    for hub, fix in (("timm:hf-hub:timm/test_vit.r160_in1k", "--model timm:test_vit --pretrained r160_in1k"),
                     ("timm:local-dir:/x/test_vit", "--model timm:test_vit ")):
        with pytest.raises(UsageError, match=f"--model {hub}: name the model as timm lists it.*: {fix}"):
            check_model_name(hub)


def test_each_timm_family_normalises_in_fp32_and_has_leaf_blocks_and_timms_layers():
    for name, size in FAMILIES.items():
        model = shape_model(name, 3, size)
        norms = [m for m in model.modules() if isinstance(m, timm_models.NORM_BASES)]
        assert norms and all(isinstance(m, timm_models._FP32) or type(m) in FP32_NORMS.values() for m in norms), name
        classes = {f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()}
        assert classes & set(timm_models.LEAF_BLOCKS), name  # what ZeRO-3 gathers whole
        layers = timm_models.layer_ids(model)
        names = [n for n, _ in model.named_parameters()]
        head = next(n for n in reversed(names) if n.endswith("weight"))
        assert set(layers) == set(names) and layers[names[0]] == 0, name  # the stem
        assert layers[head] == max(layers.values()) > 2, name


def test_the_giants_zero3_is_for_gather_each_block_whole():
    # eva02_enormous's blocks are EVA's post-norm class: without it among the leaf blocks ZeRO-3 gathered each
    # of its layers apart (45 images/s on four H200s)
    for name in ("vit_gigantic_patch14_clip_224", "eva02_enormous_patch14_clip_224", "vit_7b_patch16_dinov3"):
        model = shape_model(f"timm:{name}", 10, 224)
        assert {f"{type(b).__module__}.{type(b).__name__}" for b in model.blocks} <= set(timm_models.LEAF_BLOCKS)


def test_timm_models_under_half_precision_weights_compute_as_in_fp32(monkeypatch):
    """DeepSpeed's bf16 mode casts the parameters and leaves the buffers: EfficientNet's BatchNormAct2d then keeps
    fp32 statistics, EVA's rotary table and fixed key bias follow the weights."""
    slim_timm(monkeypatch)
    for name, size in (("timm:eva02_tiny_patch14_224", 28), ("timm:test_efficientnet", 32)):
        torch.manual_seed(0)
        model = build_model(name, 3, size).eval()
        images = torch.randn(2, 3, size, size)
        with torch.no_grad():
            expected = model(images)
        for param in model.parameters():
            param.data = param.data.bfloat16()
        got = model(images.bfloat16())
        assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), expected, atol=0.05, rtol=0.05), name
        got.float().sum().backward()  # through the norms' fp32 copies to their weights
        norm = next(m for m in model.modules() if isinstance(m, timm_models._FP32))
        assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.bfloat16, name
        assert all(b.dtype == torch.float32 for m in model.modules() if isinstance(m, timm_models.NORM_BASES)
                   for b in m.buffers() if b.is_floating_point()), name


def test_activation_checkpointing_gives_the_gradients_of_a_plain_backward():
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model(VIT, 3, 32, grad_checkpointing=checkpointing).train()
        images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        torch.nn.functional.cross_entropy(model(images), torch.tensor([0, 1, 2, 0])).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert model.grad_checkpointing and all(torch.allclose(grads[1][k], grads[0][k], atol=1e-6) for k in grads[0])


def test_one_image_a_rank_with_sync_bn_is_refused_where_timms_own_batch_norm_sees_it_alone():
    """--sync_bn lets one image a rank through (the layers normalise over every rank's): not for timm's
    BatchNormAct2d, which it does not reach (EfficientNet); timm's ResNet has torch's BatchNorm2d, synchronised."""
    with pytest.raises(UsageError, match=r"^--batch_size 1 at --image_size 32: timm:test_efficientnet's batch norm "
                                         r"layers of timm's own classes \(BatchNormAct2d\), which --sync_bn does not"):
        checked_model("timm:test_efficientnet", 3, 32, 2, None, micro_batch=1)
    assert checked_model("timm:test_resnet", 3, 32, 2, None, micro_batch=1) is not None
    assert checked_model("timm:test_efficientnet", 3, 32, 2, None, micro_batch=2) is not None


def test_timm_models_export_to_torchscript(tmp_path):
    """The exporters' model: timm's norm classes back, the buffers' dtype hook gone (TorchScript compiles hooks,
    and that one it could not: every timm export to TorchScript was refused)."""
    from deepspeed_image_trainer.inference.export import _export_program
    from deepspeed_image_trainer.models.build import plain_norms

    for name in (VIT, "timm:test_efficientnet"):
        torch.manual_seed(0)
        model = plain_norms(build_model(name, 3, 32)).eval()
        assert not model._forward_pre_hooks
        images = torch.randn(3, 3, 32, 32)
        with torch.no_grad():
            expected = model(images)
        path = tmp_path / f"{name[5:]}.ts"
        metadata = _export_program(model, "torchscript", path, {"image_size": 32, "class_names": ["a", "b", "c"]})
        assert metadata["checked"]["max_abs_difference"] < 1e-4, name
        with torch.no_grad():
            assert torch.allclose(torch.jit.load(str(path))(images[:1]), expected[:1], rtol=1e-4, atol=1e-5), name


def fake_hub(cache, repo, state):
    """The Hugging Face hub cache's layout of `repo` holding `state` as model.safetensors."""
    from safetensors.torch import save_file

    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs/main").write_text("0" * 40)
    (folder / "snapshots" / ("0" * 40)).mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "snapshots" / ("0" * 40) / "model.safetensors")


def test_timm_weights_come_from_the_hub_cache_tensor_for_tensor_with_a_new_head(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # as a machine without the network: nothing waits
    with pytest.raises(UsageError, match=rf"^--pretrained DEFAULT: {DEFAULT_REPO}'s model.safetensors is not in the "
                                         rf"Hugging Face cache \({tmp_path / 'hub'}\) and could not be downloaded "
                                         r"\(HF_HUB_OFFLINE is set\); download it there \(hf download"):
        build_model(VIT, 3, 32, pretrained="DEFAULT")
    assert "downloading" not in capsys.readouterr().err  # offline: no note of a download before that line
    source = timm.create_model("test_vit").state_dict()  # as on the hub: 1000 classes at 160 px
    fake_hub(tmp_path / "hub", DEFAULT_REPO, source)
    assert checked_model(VIT, 3, 32, 2, "DEFAULT") is not None  # the launcher's check, on the meta device
    got = build_model(VIT, 3, 32, pretrained="DEFAULT").state_dict()
    assert got["head.weight"].shape == (3, 64) and got["pos_embed"].shape == (1, 5, 64)  # resampled by timm
    kept = [k for k in got if not k.startswith("head.") and k != "pos_embed"]
    assert len(kept) == len(source) - 3 and all(torch.equal(got[k], source[k]) for k in kept)
    assert preprocessing(VIT, "DEFAULT") == {"mean": [0.5] * 3, "std": [0.5] * 3, "resize_ratio": 1 / 0.95,
                                             "interpolation": "bicubic"}
    # a file: this trainer's own export, whose head (3 classes) is kept; another model's weights are one line
    torch.save(got, tmp_path / "mine.pt")
    again = build_model(VIT, 3, 32, pretrained=str(tmp_path / "mine.pt")).state_dict()
    assert all(torch.equal(again[k], got[k]) for k in got)
    torch.save(timm.create_model("test_resnet", num_classes=3).state_dict(), tmp_path / "other.pt")
    with pytest.raises(UsageError, match=r"^--pretrained: not weights of timm:test_vit \(\d+ of its tensors "
                                         r"missing, \d+ not its own: "):
        build_model(VIT, 3, 32, pretrained=str(tmp_path / "other.pt"))
    # ConvNeXt's checkpoint filter reads its own keys from the file: a KeyError traceback before (round 26)
    with pytest.raises(UsageError, match=r"^--pretrained: not weights of timm:test_convnext \(\d+ of its tensors "
                                         r"missing, \d+ not its own: "):
        build_model("timm:test_convnext", 3, 32, pretrained=str(tmp_path / "other.pt"))
    # timm's strict load (the file's head kept) names its keys in torch's long message: counted the same way; and
    # a file without tensors, which timm took as no weights at all (random weights, status 0: round 25)
    torch.save({k: v for k, v in got.items() if not k.startswith("blocks.1.")}, tmp_path / "part.pt")
    with pytest.raises(UsageError, match=r"^--pretrained: not weights of timm:test_vit \(\d+ of its tensors missing, "
                                         r"0 not its own: blocks\.1\.[\w.]+, blocks\.1\.[\w.]+, blocks\.1\.[\w.]+\)$"):
        build_model(VIT, 3, 32, pretrained=str(tmp_path / "part.pt"))
    torch.save({}, tmp_path / "empty.pt")
    with pytest.raises(UsageError, match=r"^--pretrained: no weights of timm:test_vit in it \(0 tensors\)$"):
        build_model(VIT, 3, 32, pretrained=str(tmp_path / "empty.pt"))
    state = {**got, "blocks.0.norm1.weight": (got["blocks.0.norm1.weight"] * 3).long()}
    torch.save(state, tmp_path / "integers.pt")  # loaded as whole numbers, the run learned from them: status 0
    with pytest.raises(UsageError, match=r"^--pretrained: blocks.0.norm1.weight is a torch.int64 tensor where "
                                         r"timm:test_vit holds torch.float32 values"):
        build_model(VIT, 3, 32, pretrained=str(tmp_path / "integers.pt"))
    with pytest.raises(UsageError, match=r"^--pretrained DEFAULT: timm has no pretrained weights of timm:test_vit4"):
        build_model("timm:test_vit4", 3, 32, pretrained="DEFAULT")
    with pytest.raises(UsageError, match=r"--pretrained nothing: no such file, and not a weights name of "
                                         r"timm:test_vit \(DEFAULT, r160_in1k\)"):
        build_model(VIT, 3, 32, pretrained="nothing")


@pytest.mark.slow
def test_a_timm_model_fine_tunes_from_the_hub_cache_on_two_ranks_at_zero3_exports_and_evaluates(
        tiny_data, tmp_path, monkeypatch):
    """--pretrained DEFAULT from the hub cache (HF_HOME) at ZeRO-3 on 2 ranks with activation checkpointing: the head
    alone for an epoch, then the body at a tenth of its rate with timm's layer decay, and the weights' average; the
    plain and --ema exports
    evaluate to the logged figures. (bf16 computes otherwise than the exports' fp32, 0.02 in the loss of a
    12-block ViT: its steps are test_models.py's bf16_steps.)"""
    from deepspeed_image_trainer.cli.options import run_cli
    from deepspeed_image_trainer.inference import evaluate
    from deepspeed_image_trainer.inference.export import main as export

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub(tmp_path / "hf/hub", DEFAULT_REPO, timm.create_model("test_vit").state_dict())
    args = data_args(tiny_data) + ["--model", VIT, "--pretrained", "DEFAULT", "--epochs", "2", "--batch_size", "8",
                                   "--image_size", "32", "--num_workers", "0", "--zero_stage", "3", "--num_gpus", "2",
                                   "--freeze_backbone_epochs", "1", "--backbone_lr_scale", "0.1", "--layer_decay",
                                   "0.75", "--model_ema", "--model_ema_steps", "1", "--grad_checkpointing"]
    # the training script on 2 spawn_ranks ranks (what this checks is the trainer's), not a launcher run (~10 s of
    # start-up); each rank reads the hub cache from the test's HF_HOME (timm and huggingface_hub are not among the
    # fork server's imports: they read it once imported, in the rank)
    result = train_ranks(args[:args.index("--num_gpus")] + args[args.index("--num_gpus") + 2:], tmp_path, nprocs=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{VIT}: 48 train / 15 val images" in result.stdout
    history = history_of(tmp_path)
    info = json.loads((tmp_path / "checkpoints_deepspeed/last/extra_info.json").read_text())
    assert history["config"]["model"] == info["model"] == VIT
    assert history["config"]["pretrained"] == info["pretrained"] == "DEFAULT"
    assert history["config"]["preprocessing"] == info["preprocessing"] == preprocessing(VIT, "DEFAULT")
    assert history["config"]["training"]["grad_checkpointing"] is True  # blocks recomputed under ZeRO-3's hooks
    first, second = history["epochs"]
    assert first["backbone_lr"] == 0 and second["backbone_lr"] == pytest.approx(0.1 * second["lr"])
    scales = [group["layer_scale"] for group in history["config"]["training"]["groups"]]
    assert len(scales) == 6 + 2 and scales[-1] == pytest.approx(0.75 ** 7)  # the stem's, 7 layers below the head
    config = history["config"]["deepspeed"]  # the config the ranks' engines were built with
    assert "timm.models.vision_transformer.Block" in config["zero_optimization"]["leaf_module"]["classes"]
    for flags, loss, accuracy in (([], "val_loss", "val_acc"), (["--ema"], "ema_val_loss", "ema_val_acc")):
        exported = tmp_path / f"model{len(flags)}.safetensors"
        export([str(tmp_path / "checkpoints_deepspeed/last"), *flags, "--output", str(exported)])
        assert json.loads(exported.with_name(f"{exported.name}.json").read_text())["model"] == VIT
        with pytest.raises(SystemExit) as exited:
            sys.exit(run_cli(evaluate.main, ["--model", str(exported), "--data_dir", str(tiny_data / "val"),
                                             "--output_dir", str(tmp_path / "eval"), "--num_workers", "0"]))
        assert exited.value.code in (0, None)
        report = json.loads((tmp_path / "eval/report.json").read_text())
        assert report["loss"] == pytest.approx(second[loss], rel=1e-5)
        assert report["top1"] == pytest.approx(second[accuracy])
    # A sidecar of another export: its class count against the head's (timm's `head`, not ResNet's fc).
    sidecar = json.loads((tmp_path / "model0.safetensors.json").read_text())
    (tmp_path / "model0.safetensors.json").write_text(json.dumps({**sidecar, "class_names": ["a", "b"]}))
    with pytest.raises(UsageError, match="has 3 outputs but its class names list 2"):
        evaluate.main(["--model", str(tmp_path / "model0.safetensors"), "--data_dir", str(tiny_data / "val"),
                       "--output_dir", str(tmp_path / "eval"), "--num_workers", "0"])


def test_a_batch_of_one_suggests_sync_bn_only_where_it_reaches_the_batch_norms_and_the_command_has_it():
    def message(name, **kwargs):
        with pytest.raises(UsageError) as refused:
            check_image_size(name, 3, 32, 1, **kwargs)
        return str(refused.value)

    assert message("resnet18").endswith("use --batch_size 2 or more, a larger --image_size, or --sync_bn on "
                                        "several ranks")
    for name, kwargs in (("timm:test_efficientnet", {}), ("resnet18", {"sync_bn": False})):  # memory_profile's
        assert message(name, **kwargs).endswith("use --batch_size 2 or more or a larger --image_size"), name
