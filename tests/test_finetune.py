"""--freeze_backbone_epochs and --backbone_lr_scale on real engines (CPU, gloo) at every ZeRO stage and with
optimizer offload: the body does not move while frozen and does afterwards, at the scaled learning rate."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from deepspeed_image_trainer.data.prepare import make_sample_dataset
from deepspeed_image_trainer.engine.finetune import (GroupLearningRates, head_module, parameter_groups,
                                                    whole_run_frozen)
from deepspeed_image_trainer.utils.loading import check_checkpoint_files, load_checked

from conftest import data_args, history_of, join_process_group, spawn_ranks, tiny_engine

CLASSES, SCALE = 3, 0.1
ZERO = {"zero0": {"stage": 0}, "zero1": {"stage": 1}, "zero2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "zero3": {"stage": 3}}


def small_model(conv_bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=conv_bias), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, CLASSES))


def block_model():
    """small_model with two of ResNet's blocks between its stem and its head: layers 1 and 2 of --layer_decay."""
    from torchvision.models.resnet import BasicBlock

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), BasicBlock(4, 4),
                               BasicBlock(4, 4), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(4, CLASSES))


# the fine-tuning flags with layer decay and no decay on norm layers: 7 groups over block_model
GROUPED = SimpleNamespace(backbone_lr_scale=SCALE, freeze_backbone_epochs=1, layer_decay=0.5, norm_weight_decay=0.0,
                          bias_weight_decay=None, transformer_embedding_decay=None)


def parameters(engine):
    """Full copies of (body, head) parameters, gathered under ZeRO-3."""
    import deepspeed

    head = {id(p) for p in head_module(engine.module, CLASSES).parameters()}
    every = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(every):
        copies = [(id(p) in head, p.detach().float().clone()) for p in every]
    return [t for is_head, t in copies if not is_head], [t for is_head, t in copies if is_head]


def moved(before, after):
    return any(not torch.equal(a, b) for a, b in zip(before, after))


def on_rank(rank, port, results, workdir):
    """The module's one rank: train_then_resume's trainer runs in `workdir` (first: the engines below change
    torch's linear for the rest of the process under ZeRO-3), then each ZeRO setting's engines, then
    test_ds_config's SGD from a JSON config. A rank's start costs seconds: one serves every test here."""
    from deepspeed_image_trainer.engine import overrides

    join_process_group(rank, port)
    train_then_resume(results, workdir / "data", workdir)
    overrides.uninstall()  # the trainer installed its replacements of DeepSpeed code: DeepSpeed's own below
    for name, zero in ZERO.items():
        model = block_model()
        groups = parameter_groups(model, CLASSES, GROUPED)
        engine = tiny_engine(model, groups, lr=0.01, optimizer={"weight_decay": 0.05},
                             zero=zero, scheduler={"type": "WarmupLR", "params": {
                                 "warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}})
        body_lr = GroupLearningRates(engine, groups, SCALE, freeze_backbone_epochs=1)
        result = {"weight_decay": [group["weight_decay"] for group in engine.optimizer.param_groups],
                  "groups": [{"layer_scale": g["layer_scale"], "body": g["body"], "weight_decay": g.get("weight_decay")}
                             for g in groups]}
        for epoch in (1, 2):
            body_lr.set_epoch(epoch)
            before = parameters(engine)
            rates = []
            for step in range(3):
                rates.append([group["lr"] for group in engine.optimizer.param_groups])
                loss = F.cross_entropy(engine(torch.randn(4, 3, 8, 8)), torch.tensor([0, 1, 2, 0]))
                engine.backward(loss)
                engine.step()
            after = parameters(engine)
            result[epoch] = {"body_moved": moved(before[0], after[0]), "head_moved": moved(before[1], after[1]),
                             "rates": rates}
        results[name] = result
        results[("sgd", name)] = sgd_steps(zero)
    results["json-sgd"] = json_sgd_steps()


SGD_FLAGS = ("--optimizer", "sgd", "--momentum", "0.8", "--nesterov", "--learning_rate", "0.05",
             "--weight_decay", "0.01")


def sgd_steps(zero):
    """(the engine's parameters, torch.optim.SGD's) after 3 steps on the same batches from the same weights, the
    engine's optimizer section as --optimizer sgd --nesterov makes it."""
    from test_ds_config import build

    section = build(*SGD_FLAGS)["optimizer"]
    engine, reference = tiny_engine(small_model(), optimizer=section, zero=zero, zero_allow_untested_optimizer=True), \
        small_model()
    torch_sgd = torch.optim.SGD(reference.parameters(), **section["params"])
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        images, labels = torch.randn(4, 3, 8, 8, generator=generator), torch.tensor([0, 1, 2, 0])
        for model, step in ((engine, None), (reference, torch_sgd)):
            loss = F.cross_entropy(model(images), labels)
            if step is None:
                engine.backward(loss)
                engine.step()
            else:
                step.zero_grad()
                loss.backward()
                step.step()
    return sum(parameters(engine), []), [p.detach().clone() for p in reference.parameters()]


def json_sgd_steps():
    """3 steps of the config the trainer builds for a JSON's SGD, at ZeRO-2 with its state offloaded."""
    from test_ds_config import build, sgd_steps

    return sgd_steps(build("--zero_stage", "2", "--offload_optimizer", "--batch_size", "4", "--warmup_epochs", "0",
                           base={"optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """on_rank's results; train_then_resume's runs in runs["workdir"]."""
    workdir = tmp_path_factory.mktemp("finetune")
    make_sample_dataset(workdir / "data", num_classes=CLASSES, train_per_class=4, val_per_class=2, image_size=32,
                        seed=0)
    return {**spawn_ranks(on_rank, 1, workdir), "workdir": workdir}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZERO))
def test_the_body_waits_while_frozen_then_learns_at_its_scaled_and_layer_decayed_rates(runs, name):
    frozen, after, groups = runs[name][1], runs[name][2], runs[name]["groups"]
    assert frozen["head_moved"] and not frozen["body_moved"]
    assert all(rate == 0 for rates in frozen["rates"] for rate in rates[1:]) and any(r[0] > 0 for r in frozen["rates"])
    assert after["head_moved"] and after["body_moved"]
    # each group at the scheduler's rate x its layer's scale (x the body's): stem, 2 blocks, head; norms apart
    assert sorted({g["layer_scale"] for g in groups}) == [0.125, 0.25, 0.5, 1.0] and len(groups) == 7
    for rates in after["rates"]:
        assert rates[0] > 0 and rates == pytest.approx(
            [rates[0] * g["layer_scale"] * (SCALE if g["body"] else 1) for g in groups])
    assert runs[name]["weight_decay"] == [0.05 if g["weight_decay"] is None else g["weight_decay"] for g in groups]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZERO))
def test_sgd_with_nesterov_momentum_steps_as_torchs_at_every_zero_stage(runs, name):
    engine, reference = runs[("sgd", name)]  # both in the model's order (its body is all but the last layer)
    assert len(engine) == len(reference)
    for got, expected in zip(engine, reference):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), name
    assert moved(reference, [p.detach() for p in small_model().parameters()])  # the steps moved it


@pytest.mark.slow
def test_sgd_from_the_json_trains_under_zero_with_offload(runs):
    """DeepSpeed refuses an optimizer it has not listed under ZeRO (torch's SGD) unless the config allows it:
    the config the trainer builds for a JSON's SGD, at ZeRO-2 with its state offloaded, trains on a real engine.
    (test_ds_config's: trained in this module's rank.)"""
    import math

    results = runs["json-sgd"]
    assert all(results["moved"]) and math.isfinite(results["loss"])


def reference_lion(parameters, grads, states, lr, betas, weight_decay):
    """The Lion paper's update (Chen et al. 2023, Algorithm 2), as DeepSpeed's FusedLion and CPU Lion compute it."""
    for p, g, m in zip(parameters, grads, states):
        update = (m * betas[0] + g * (1 - betas[0])).sign()
        p.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)
        m.mul_(betas[1]).add_(g, alpha=1 - betas[1])


def reference_lamb(parameters, grads, states, lr, betas, weight_decay, eps, step):
    """LAMB (You et al. 2020) as DeepSpeed's FusedLamb kernel computes it: Adam's moments, the update with weight
    decay, a trust ratio ||w|| / ||update|| per tensor clamped to [0.01, 10], bias correction in the step size."""
    for p, g, (m, v) in zip(parameters, grads, states):
        m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
        v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
        update = m / (v.sqrt() + eps) + weight_decay * p
        w_norm, u_norm = p.norm(), update.norm()
        trust = (w_norm / u_norm).clamp(0.01, 10) if w_norm > 0 and u_norm > 0 else torch.tensor(1.0)
        p.sub_(lr * (1 - betas[1] ** step) ** 0.5 / (1 - betas[0] ** step) * trust * update)


def deepspeed_optimizer_steps(rank, port, results):
    """On a GPU: DeepSpeed's FusedLamb (ZeRO-0, fp32 weights: per tensor) and FusedLion (ZeRO-0 and 2) as
    --optimizer builds them, 3 steps on the same batches as the references above. The convolution has no bias: a
    bias before batch norm gets a gradient of rounding noise, whose sign (Lion's step) float32 and float64 draw
    differently."""
    from test_ds_config import build

    join_process_group(rank, port)
    for kind, stage in (("lamb", 0), ("lion", 0), ("lion", 2)):
        section = build("--optimizer", kind, "--learning_rate", "0.01", "--weight_decay", "0.1")["optimizer"]
        engine = tiny_engine(small_model(conv_bias=False), optimizer=section, zero={"stage": stage},
                             zero_allow_untested_optimizer=True)
        reference = [p.detach().clone().double().cuda() for p in small_model(conv_bias=False).parameters()]
        states = ([(torch.zeros_like(p), torch.zeros_like(p)) for p in reference] if kind == "lamb"
                  else [torch.zeros_like(p) for p in reference])
        generator = torch.Generator().manual_seed(1)
        for step in range(1, 4):
            images, labels = torch.randn(4, 3, 8, 8, generator=generator).cuda(), torch.tensor([0, 1, 2, 0]).cuda()
            model = small_model(conv_bias=False).double().cuda()
            with torch.no_grad():
                for p, q in zip(model.parameters(), reference):
                    p.copy_(q)
            F.cross_entropy(model(images.double()), labels).backward()
            grads = [p.grad for p in model.parameters()]
            params = section["params"]
            if kind == "lamb":
                reference_lamb(reference, grads, states, params["lr"], params["betas"], params["weight_decay"],
                               params["eps"], step)
            else:
                reference_lion(reference, grads, states, params["lr"], params["betas"], params["weight_decay"])
            loss = F.cross_entropy(engine(images), labels)
            engine.backward(loss)
            engine.step()
        results[(kind, stage)] = ([t.cpu() for t in sum(parameters(engine), [])], [t.float().cpu() for t in reference])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeed's FusedLamb and FusedLion are CUDA ops")
def test_lamb_and_lion_step_as_their_papers_on_a_gpu():
    runs = spawn_ranks(deepspeed_optimizer_steps)
    differences = {name: max((got - expected).abs().max().item() for got, expected in zip(*run))
                   for name, run in runs.items()}
    assert all(difference < 1e-5 for difference in differences.values()), differences


def test_the_head_is_the_layer_that_gives_the_logits():
    from deepspeed_image_trainer.models.build import build_model

    for name, head in (("resnet18", "fc"), ("squeezenet1_1", "classifier.1"), ("vit_b_16", "heads.head"),
                       ("convnext_tiny", "classifier.2"), ("inception_v3", "fc")):
        model = build_model(name, 5, 224 if name == "vit_b_16" else 96)
        assert head_module(model, 5) is model.get_submodule(head), name
        groups = parameter_groups(model, 5)
        assert len(groups[0]["params"]) == 2 and len(groups[0]["params"]) + len(groups[1]["params"]) == len(
            list(model.parameters()))


# For one model of each family --layer_decay names: (parameter, its layer, its weight decay group) with
# --layer_decay 0.5 --norm_weight_decay 0 --transformer_embedding_decay 0.01 (None: --weight_decay's group).
# Layers as timm numbers them: the stem 0, the repeated blocks 1..L, a downsampling layer the next block's,
# the final norm and the head L + 1.
FAMILY_LAYERS = {
    ("vit_b_16", 224): (13, [("conv_proj.weight", 0, None), ("class_token", 0, 0.01), ("encoder.pos_embedding", 0, 0.01),
                             ("encoder.layers.encoder_layer_0.mlp.0.weight", 1, None),
                             ("encoder.layers.encoder_layer_11.ln_1.weight", 12, 0.0), ("encoder.ln.bias", 13, 0.0),
                             ("heads.head.weight", 13, None)]),
    ("swin_t", 224): (13, [("features.0.0.weight", 0, None), ("features.1.0.attn.relative_position_bias_table", 1, 0.01),
                           ("features.2.reduction.weight", 3, None), ("features.2.norm.weight", 3, 0.0),
                           ("features.7.1.mlp.0.weight", 12, None), ("norm.weight", 13, 0.0), ("head.bias", 13, None)]),
    ("maxvit_t", 224): (12, [("stem.0.0.weight", 0, None), ("blocks.0.layers.0.layers.MBconv.proj.1.weight", 1, None),
                             ("blocks.2.layers.4.layers.MBconv.layers.pre_norm.weight", 9, 0.0),
                             ("classifier.2.weight", 12, 0.0), ("classifier.5.weight", 12, None)]),
    ("convnext_tiny", 64): (19, [("features.0.0.weight", 0, None), ("features.1.0.block.0.weight", 1, None),
                                 ("features.2.1.weight", 4, None), ("features.7.2.layer_scale", 18, None),
                                 ("classifier.0.weight", 19, 0.0), ("classifier.2.weight", 19, None)]),
    ("efficientnet_b0", 64): (17, [("features.0.1.weight", 0, 0.0), ("features.1.0.block.0.0.weight", 1, None),
                                   ("features.7.0.block.3.0.weight", 16, None), ("features.8.0.weight", 17, None),
                                   ("classifier.1.weight", 17, None)]),
}


@pytest.mark.parametrize("family", list(FAMILY_LAYERS), ids=[name for name, _ in FAMILY_LAYERS])
def test_layer_decay_and_weight_decay_put_each_parameter_in_its_group(family):
    from deepspeed_image_trainer.models.build import shape_model

    name, size = family
    top, expected = FAMILY_LAYERS[family]
    model = shape_model(name, 5, size)  # the meta device: shapes only
    args = SimpleNamespace(backbone_lr_scale=0.1, freeze_backbone_epochs=0, layer_decay=0.5, norm_weight_decay=0.0,
                           bias_weight_decay=None, transformer_embedding_decay=0.01)
    groups = parameter_groups(model, 5, args)
    named = {id(p): n for n, p in model.named_parameters()}
    where = {named[id(p)]: group for group in groups for p in group["params"]}
    assert sorted(where) == sorted(named.values())  # each once
    head = [named[id(p)] for p in head_module(model, 5).parameters()]
    assert [named[id(p)] for p in groups[0]["params"]] == head and groups[0]["layer_scale"] == 1  # logged lr: head's
    assert not groups[0]["body"] and all(group["body"] for group in groups[1:])
    for parameter, layer, decay in expected:
        group = where[parameter]
        assert group["layer_scale"] == 0.5 ** (top - layer), parameter
        assert group.get("weight_decay") == decay, parameter
    # biases with --bias_weight_decay before their norm layer's decay, as torchvision's set_weight_decay
    biased = parameter_groups(model, 5, SimpleNamespace(**{**vars(args), "bias_weight_decay": 0.2}))
    decay = {named[id(p)]: group.get("weight_decay") for group in biased for p in group["params"]}
    assert all(value == 0.2 for n, value in decay.items() if n.endswith(".bias"))


def test_layer_decay_needs_repeated_blocks():
    from deepspeed_image_trainer.models.build import shape_model
    from deepspeed_image_trainer.utils.failures import UsageError

    args = SimpleNamespace(backbone_lr_scale=1.0, freeze_backbone_epochs=0, layer_decay=0.5, norm_weight_decay=None,
                           bias_weight_decay=None, transformer_embedding_decay=None)
    with pytest.raises(UsageError, match="^--layer_decay: AlexNet has no repeated blocks"):
        parameter_groups(shape_model("alexnet", 5, 64), 5, args)


def test_a_freeze_over_the_whole_run_is_said():
    assert whole_run_frozen(SimpleNamespace(freeze_backbone_epochs=2, epochs=3)) is None
    for frozen in (3, 4):
        assert whole_run_frozen(SimpleNamespace(freeze_backbone_epochs=frozen, epochs=3)) == (
            f"--freeze_backbone_epochs {frozen} covers the whole run (--epochs 3): only the classifier head trains")


STEPS_PER_EPOCH, GAMMA = 3, 0.5  # 12 images at batch 4; StepLR halves the rate at every step
METRICS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")


def train_then_resume(results, data, workdir):
    """2 epochs of StepLR (a torch scheduler, from the JSON) with a scaled body, then the second again from the
    first run's epoch_1; and 1 epoch of StepLR at ZeRO-2 (DeepSpeed built it over ZeRO's optimizer, which torch's
    schedulers refuse). In on_rank's process group."""
    import gc

    from deepspeed_image_trainer.cli import train
    from deepspeed_image_trainer.engine.distributed import barrier

    train.shut_down = barrier  # the group serves every run: spawn_ranks leaves it at the end
    config = workdir / "steplr.json"
    config.write_text(json.dumps({"scheduler": {"type": "StepLR", "params": {"step_size": 1, "gamma": GAMMA}}}))
    scaled = ["--backbone_lr_scale", str(SCALE), "--epochs", "2"]
    for run, extra in (("whole", [*scaled, "--save_every", "1"]),
                       ("resumed", [*scaled, "--resume", str(workdir / "whole/c/epoch_1")]),
                       ("zero2", ["--zero_stage", "2", "--epochs", "1"])):
        results[run] = train.main(data_args(data) + [
            "--deepspeed_config", str(config), "--batch_size", "4", "--image_size", "32", "--num_workers", "0",
            "--checkpoint_dir", str(workdir / run / "c"), "--log_dir", str(workdir / run / "logs"), *extra])
        gc.unfreeze()  # the trainer froze what it built; the next run needs the memory
        gc.collect()


@pytest.mark.slow
def test_a_torch_scheduler_with_a_scaled_body_saves_and_resumes_at_the_same_rates_and_runs_at_zero2(runs):
    """StepLR with --backbone_lr_scale: the first save failed to pickle the step function put on the scheduler,
    which saves its whole __dict__; and StepLR, stepping on from the body's scaled rate, scaled it again each step."""
    tmp_path = runs["workdir"]  # on_rank's trainer runs
    assert {run: runs[run] for run in ("whole", "resumed", "zero2")} == {"whole": 0, "resumed": 0, "zero2": 0}
    whole, resumed = history_of(tmp_path / "whole")["epochs"], history_of(tmp_path / "resumed")["epochs"]
    assert history_of(tmp_path / "zero2")["epochs"][0]["lr"] == pytest.approx(whole[0]["lr"])
    assert whole[1]["lr"] == pytest.approx(whole[0]["lr"] * GAMMA ** STEPS_PER_EPOCH)
    assert [{k: e[k] for k in METRICS} for e in resumed] == [{k: e[k] for k in METRICS} for e in whole]
    for run in ("whole", "resumed"):
        check_checkpoint_files(tmp_path / run / "c/last", "last")  # what a resume loads: tensors and plain values
        saved = load_checked(tmp_path / run / "c/last/last/mp_rank_00_model_states.pt")
        head, body = saved["optimizer"]["param_groups"]
        scheduler = saved["lr_scheduler"]
        assert scheduler["last_epoch"] == 2 * STEPS_PER_EPOCH
        assert head["lr"] == pytest.approx(scheduler["base_lrs"][0] * GAMMA ** (2 * STEPS_PER_EPOCH))
        assert body["lr"] == pytest.approx(head["lr"] * SCALE)
