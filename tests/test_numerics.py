"""fp16 loss scaling under DeepSpeed's torch_autocast: the GradScaler lowers its scale after every skipped
step, whichever of the scaler or DeepSpeed's ZeRO optimizer skipped it. And the one-rank ZeRO-0 all-reduce
the trainer turns off: the same weights without it. Real engines on the CPU (gloo), where DeepSpeed runs
torch_autocast fp16 too."""

import pytest
import torch

from deepspeed_image_trainer.engine.loop import no_single_rank_allreduce
from deepspeed_image_trainer.engine.numerics import StepHealth, back_off

from conftest import join_process_group, spawn_ranks, tiny_engine

OVERFLOWING_STEPS = 3
CONFIGS = {
    "zero0": {"stage": 0},
    "zero2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "zero3-offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "zero1-clipping": {"stage": 1},
}


def train_steps(zero, clipping):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    engine = tiny_engine(model, zero=zero, torch_autocast={"enabled": True, "dtype": "float16"},
                         gradient_clipping=clipping)
    health = StepHealth(engine, max_nonfinite_steps=0)
    health.start_epoch()
    for step in range(OVERFLOWING_STEPS + 3):
        inputs = torch.randn(4, 8) * (1e30 if step < OVERFLOWING_STEPS else 1)  # inf gradients in fp16
        with torch.autocast("cpu", dtype=torch.float16):
            loss = engine(inputs).float().pow(2).mean()
        engine.backward(loss)
        health.before_step()
        engine.step()
        health.after_step()
    return {"scale": health.scaler.get_scale(), "skipped_steps": health.end_epoch(1, 6)["skipped_steps"],
            "deepspeed_skipped": engine.skipped_steps}


def each_way(sections):
    """(all-reduce on?, losses, weights) of three steps of one model, with DeepSpeed's one-rank all-reduce and
    without it (no_single_rank_allreduce)."""
    runs = []
    for off in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        engine = tiny_engine(model, gradient_clipping=1.0, **sections)
        if off:
            no_single_rank_allreduce(engine, {})
        dtype = next(engine.module.parameters()).dtype
        losses = []
        for step in range(3):
            inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(dtype)
            loss = engine(inputs).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        weights = [p.detach().clone() for p in engine.module.parameters()]
        runs.append((engine.enable_backward_allreduce, losses, weights))
    (on, on_losses, on_weights), (off, off_losses, off_weights) = runs
    return {"flags": (on, off), "same": on_losses == off_losses and all(map(torch.equal, on_weights, off_weights))}


def on_rank(rank, port, results):
    join_process_group(rank, port)
    for name, zero in CONFIGS.items():
        results[name] = train_steps(zero, clipping=1.0 if "clipping" in name else 0.0)
    for name, sections in {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}.items():
        results[("allreduce", name)] = each_way(sections)
    engine = tiny_engine(torch.nn.Linear(2, 2), zero={"stage": 1})
    no_single_rank_allreduce(engine, {})
    results["zero1 keeps it"] = engine.enable_backward_allreduce
    engine = tiny_engine(torch.nn.Linear(2, 2))
    no_single_rank_allreduce(engine, {"communication_data_type": "fp16"})  # a cast that rounds: kept
    results["a communication dtype keeps it"] = engine.enable_backward_allreduce


@pytest.fixture(scope="module")
def runs():
    return spawn_ranks(on_rank)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_skipped_step_halves_the_scale_and_is_counted_once(runs, name):
    run = runs[name]
    assert run["scale"] == 2.0**16 * 0.5**OVERFLOWING_STEPS
    assert run["skipped_steps"] == OVERFLOWING_STEPS
    # ZeRO-0 leaves the check to the GradScaler; ZeRO-1/2/3 skip on their own gradient-norm check first
    # (always computed with offload or clipping), before the GradScaler sees the step.
    assert run["deepspeed_skipped"] == (0 if name == "zero0" else OVERFLOWING_STEPS)


def test_back_off_is_what_the_grad_scaler_does_after_an_inf():
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    stepped, backed_off = torch.amp.GradScaler("cpu", growth_interval=3), torch.amp.GradScaler("cpu", growth_interval=3)
    for scaler in (stepped, backed_off):
        for _ in range(2):  # two good steps: the growth count stands at 2
            scaler.scale(parameter.sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    parameter.grad = torch.full((3,), float("inf"))
    stepped.step(optimizer)
    stepped.update()
    back_off(backed_off)
    assert backed_off.state_dict() == stepped.state_dict() == {**stepped.state_dict(), "scale": 2.0**15,
                                                               "_growth_tracker": 0}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero0_on_one_rank_trains_the_same_weights_without_deepspeeds_all_reduce(runs, precision):
    assert runs[("allreduce", precision)] == {"flags": (True, False), "same": True}
    assert runs["zero1 keeps it"] and runs["a communication dtype keeps it"]
