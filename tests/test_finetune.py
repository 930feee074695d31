"""--freeze_backbone_epochs and --backbone_lr_scale on real engines (CPU, gloo) at every ZeRO stage and with
optimizer offload: the body does not move while frozen and does afterwards, at the scaled learning rate."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from deepspeed_image_trainer.engine.finetune import (BodyLearningRate, head_module, parameter_groups,
                                                    whole_run_frozen)

from conftest import join_process_group, spawn_ranks, tiny_engine

CLASSES, SCALE = 3, 0.1
ZERO = {"zero0": {"stage": 0}, "zero1": {"stage": 1}, "zero2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "zero3": {"stage": 3}}


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, CLASSES))


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


def on_rank(rank, port, results):
    join_process_group(rank, port)
    for name, zero in ZERO.items():
        model = small_model()
        engine = tiny_engine(model, parameter_groups(model, CLASSES), lr=0.01, optimizer={"weight_decay": 0.05},
                             zero=zero, scheduler={"type": "WarmupLR", "params": {
                                 "warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}})
        body_lr = BodyLearningRate(engine.lr_scheduler, engine.optimizer, SCALE, freeze_backbone_epochs=1)
        result = {}
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


@pytest.fixture(scope="module")
def runs():
    return spawn_ranks(on_rank)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZERO))
def test_the_body_waits_while_frozen_then_learns_at_its_scaled_rate(runs, name):
    frozen, after = runs[name][1], runs[name][2]
    assert frozen["head_moved"] and not frozen["body_moved"]
    assert all(body == 0 for _, body in frozen["rates"]) and any(head > 0 for head, _ in frozen["rates"])
    assert after["head_moved"] and after["body_moved"]
    assert all(body == pytest.approx(head * SCALE) and head > 0 for head, body in after["rates"])


def test_the_head_is_the_layer_that_gives_the_logits():
    from deepspeed_image_trainer.models.build import build_model

    for name, head in (("resnet18", "fc"), ("squeezenet1_1", "classifier.1"), ("vit_b_16", "heads.head"),
                       ("convnext_tiny", "classifier.2"), ("inception_v3", "fc")):
        model = build_model(name, 5, 224 if name == "vit_b_16" else 96)
        assert head_module(model, 5) is model.get_submodule(head), name
        groups = parameter_groups(model, 5)
        assert len(groups[0]["params"]) == 2 and len(groups[0]["params"]) + len(groups[1]["params"]) == len(
            list(model.parameters()))


def test_a_freeze_over_the_whole_run_is_said():
    assert whole_run_frozen(SimpleNamespace(freeze_backbone_epochs=2, epochs=3)) is None
    for frozen in (3, 4):
        assert whole_run_frozen(SimpleNamespace(freeze_backbone_epochs=frozen, epochs=3)) == (
            f"--freeze_backbone_epochs {frozen} covers the whole run (--epochs 3): only the classifier head trains")
