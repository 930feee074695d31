"""--freeze_backbone_epochs and --backbone_lr_scale on real engines (CPU, gloo) at every ZeRO stage and with
optimizer offload: the body does not move while frozen and does afterwards, at the scaled learning rate."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from deepspeed_image_trainer.data.prepare import make_sample_dataset
from deepspeed_image_trainer.engine.finetune import (BodyLearningRate, head_module, parameter_groups,
                                                    whole_run_frozen)
from deepspeed_image_trainer.utils.loading import check_checkpoint_files, load_checked

from conftest import data_args, history_of, join_process_group, spawn_ranks, tiny_engine

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
        body_lr = BodyLearningRate(engine, SCALE, freeze_backbone_epochs=1)
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
        results[("sgd", name)] = sgd_steps(zero)


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


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZERO))
def test_sgd_with_nesterov_momentum_steps_as_torchs_at_every_zero_stage(runs, name):
    engine, reference = runs[("sgd", name)]  # both in the model's order (its body is all but the last layer)
    assert len(engine) == len(reference)
    for got, expected in zip(engine, reference):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), name
    assert moved(reference, [p.detach() for p in small_model().parameters()])  # the steps moved it


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


STEPS_PER_EPOCH, GAMMA = 3, 0.5  # 12 images at batch 4; StepLR halves the rate at every step
METRICS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")


def train_then_resume(rank, port, results, data, workdir):
    """2 epochs of StepLR (a torch scheduler, from the JSON) with a scaled body, then the second again from the
    first run's epoch_1; and 1 epoch of StepLR at ZeRO-2 (DeepSpeed built it over ZeRO's optimizer, which torch's
    schedulers refuse)."""
    import gc

    from deepspeed_image_trainer.cli import train
    from deepspeed_image_trainer.engine.distributed import barrier

    join_process_group(rank, port)
    train.shut_down = barrier  # the group serves both runs: spawn_ranks leaves it at the end
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
def test_a_torch_scheduler_with_a_scaled_body_saves_and_resumes_at_the_same_rates_and_runs_at_zero2(tmp_path):
    """StepLR with --backbone_lr_scale: the first save failed to pickle the step function put on the scheduler,
    which saves its whole __dict__; and StepLR, stepping on from the body's scaled rate, scaled it again each step."""
    make_sample_dataset(tmp_path / "data", num_classes=CLASSES, train_per_class=4, val_per_class=2, image_size=32,
                        seed=0)
    assert spawn_ranks(train_then_resume, 1, tmp_path / "data", tmp_path) == {"whole": 0, "resumed": 0, "zero2": 0}
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
