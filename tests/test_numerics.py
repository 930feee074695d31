"""fp16 loss scaling under DeepSpeed's torch_autocast: the GradScaler lowers its scale after every skipped
step, whichever of the scaler or DeepSpeed's ZeRO optimizer skipped it. Real engines on the CPU (gloo),
where DeepSpeed runs torch_autocast fp16 too."""

import pytest
import torch

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


def on_rank(rank, port, results):
    join_process_group(rank, port)
    for name, zero in CONFIGS.items():
        results[name] = train_steps(zero, clipping=1.0 if "clipping" in name else 0.0)


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
