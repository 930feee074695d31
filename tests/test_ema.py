"""--model_ema (engine/ema.py): the average of every ZeRO stage's fp32 weights against the formula applied to the
whole weights, read back on another layout, consolidated whole; and a run that trains, resumes and exports it."""
import pytest
import torch
import torch.nn.functional as F

from conftest import join_process_group, spawn_ranks, tiny_engine

STEPS, EVERY, ALPHA = 5, 2, 0.3
RANKS = 2
OTHER = {"zero3": "zero1", "zero2-offload": "zero3", "zero3-offload": "zero0"}
# name: (ZeRO section, other DeepSpeed sections); each stage reads the files of one before it (OTHER)
STAGES = {"zero0": ({"stage": 0}, {}),
          "zero0-bf16": ({"stage": 0}, {"bf16": {"enabled": True}}),
          "zero1": ({"stage": 1}, {}),
          "zero3": ({"stage": 3, "stage3_param_persistence_threshold": 20}, {}),
          "zero2-offload": ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}),
          "zero3-offload": ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, {})}


class Gram(torch.nn.Module):
    """A floating buffer of two dimensions (as EVA's rotary table), moved by each rank's batches: the rank mean the
    average takes of it keeps its shape."""

    def __init__(self, channels):
        super().__init__()
        self.register_buffer("gram", torch.zeros(channels, channels))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                flat = x.float().flatten(2).mean(-1)
                self.gram.lerp_(flat.T @ flat / len(flat), 0.5)
        return x


def small_model():
    from deepspeed_image_trainer.models.norms import BatchNorm2dFP32  # the trainer's: bf16 weights, fp32 statistics

    torch.manual_seed(0)  # the same weights on every rank and in every engine
    return torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3), BatchNorm2dFP32(5), Gram(5), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(5, 3))


def full_weights(engine):
    """{name: the whole fp32 master weight}, from DeepSpeed's own accessor (collective); at ZeRO-0 the
    optimizer's fp32 copy (bf16 with torch's AdamW: DeepSpeed's FP16_UnfusedOptimizer), else the weight itself."""
    from deepspeed.utils import safe_get_full_fp32_param

    optimizer = engine.optimizer
    masters = {id(lp): hp for hps, lps in zip(getattr(optimizer, "fp32_groups", ()),
                                              getattr(optimizer, "fp16_groups", ())) for hp, lp in zip(hps, lps)}
    return {name: (masters.get(id(param), param) if safe_get_full_fp32_param(param) is None
                   else safe_get_full_fp32_param(param)).detach().float().clone()
            for name, param in engine.module.named_parameters()}


def model_weights(engine):
    """{name: the weight the model computes with, whole}."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}


def rank_mean_buffers(engine):
    import torch.distributed as dist

    buffers = {name: b.detach().float().clone() for name, b in engine.module.named_buffers() if b.is_floating_point()}
    for value in buffers.values():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return buffers


def train_with_ema(rank, port, results, tmp_dir):
    from deepspeed_image_trainer.engine.ema import EMA_FILE, WeightEMA
    from deepspeed_image_trainer.utils.files import save_safetensors

    join_process_group(rank, port, RANKS)
    for name, (zero, sections) in STAGES.items():
        engine = tiny_engine(small_model(), zero=zero, lr=0.05, zero_allow_untested_optimizer=True, **sections)
        ema = WeightEMA(engine, decay=0.99, every=EVERY, global_batch=1, epochs=1, warmup_steps=0,
                        steps_per_epoch=STEPS)
        ema.alpha = ALPHA  # the update's weight as given (the adjustment is ema_alpha's, tested apart)
        # every step, in a warmup of 3 steps: copies, then a copy after it, then the formula
        warm = WeightEMA(engine, decay=0.99, every=1, global_batch=1, epochs=1, warmup_steps=3, steps_per_epoch=STEPS)
        warm.alpha, warmed = ALPHA, []
        generator = torch.Generator().manual_seed(rank)  # each rank its own batches: their buffers differ
        expected = expected_buffers = None
        for step in range(STEPS):
            images = torch.randn(4, 3, 8, 8, generator=generator).to(engine.device, next(engine.parameters()).dtype)
            loss = F.cross_entropy(engine(images).float(), torch.tensor([0, 1, 2, 0], device=engine.device))
            engine.backward(loss)
            engine.step()
            ema.after_step(1, step)
            warm.after_step(1, step)
            weights, buffers = full_weights(engine), rank_mean_buffers(engine)
            warmed.append(weights)
            if step % EVERY == 0:  # the formula on the whole weights; a copy at step 0, the warmup's
                if step == 0:
                    expected, expected_buffers = weights, buffers
                else:
                    expected = {k: (1 - ALPHA) * v + ALPHA * weights[k] for k, v in expected.items()}
                    expected_buffers = {k: (1 - ALPHA) * v + ALPHA * buffers[k] for k, v in expected_buffers.items()}
        with warm.swapped_in():
            warm_average = full_weights(engine)
        engine.eval()  # validation's forward passes before, inside and after the swap (ZeRO-3 gathers in them)
        probe = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(9)).to(images.dtype)
        before = model_weights(engine), full_weights(engine)
        with torch.no_grad():  # as validation: the forward passes alone (ZeRO-3 may keep what they gathered)
            logits = [engine(probe).float() for _ in range(2)][1:]
        with ema.swapped_in(), torch.no_grad():
            logits.append(engine(probe).float())
            averaged = model_weights(engine), full_weights(engine)
            averaged_buffers = {n: b.float().clone() for n, b in engine.module.named_buffers() if b.is_floating_point()}
        with torch.no_grad():
            logits.append(engine(probe).float())
        after = model_weights(engine), full_weights(engine)
        state = ema.state(saved_at=1.5)
        if state is not None:
            save_safetensors(state[0], tmp_dir / name / EMA_FILE.format(rank), state[1])
        if rank == 0:
            results[name] = {"expected": expected, "expected_buffers": expected_buffers, "before": before,
                             "averaged": averaged, "averaged_buffers": averaged_buffers, "after": after,
                             "files": ema.files(), "n_averaged": ema.n_averaged, "warmed": warm_average,
                             "probe": probe.float(), "logits": logits,
                             "warm_expected": {k: (1 - ALPHA) * warmed[3][k] + ALPHA * warmed[4][k] for k in weights}}
        torch.distributed.barrier()  # every rank's file written
        # the files of another stage (another layout: ZeRO-1's read by ZeRO-3 and the other way, ZeRO-0's whole)
        other = OTHER.get(name)
        if other:
            ema.load(tmp_dir / other)
            with ema.swapped_in():
                results[(name, "loaded", other, rank)] = full_weights(engine)


def load_on_one_rank(rank, port, results, tmp_dir):
    """Each stage's 2-rank files read by one rank at ZeRO-2 (and ZeRO-3): the whole average."""
    from deepspeed_image_trainer.engine.ema import WeightEMA

    join_process_group(rank, port, 1)
    for stage in (2, 3):
        engine = tiny_engine(small_model(), zero={"stage": stage}, zero_allow_untested_optimizer=True)
        ema = WeightEMA(engine, decay=0.99, every=1, global_batch=1, epochs=1, warmup_steps=0, steps_per_epoch=1)
        for name in STAGES:
            ema.load(tmp_dir / name)
            with ema.swapped_in():
                results[stage, name] = full_weights(engine)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_dir = tmp_path_factory.mktemp("ema")
    for name in STAGES:
        (tmp_dir / name).mkdir()
    results = spawn_ranks(train_with_ema, RANKS, tmp_dir)
    return {**results, **spawn_ranks(load_on_one_rank, 1, tmp_dir)}, tmp_dir


def close(got, expected, tolerance=1e-6):
    assert got.keys() == expected.keys()
    for key in got:
        assert torch.allclose(got[key], expected[key], rtol=tolerance, atol=tolerance), key


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STAGES))
def test_each_stage_averages_its_weights_by_the_formula_and_swaps_them_back_exactly(runs, name):
    run = runs[0][name]
    close(run["averaged"][1], run["expected"])  # the fp32 masters hold the average while swapped in
    half = name.endswith("bf16")  # the model computes with bf16 copies of them
    close(run["averaged"][0], {k: v.bfloat16().float() for k, v in run["expected"].items()} if half
          else run["expected"], 1e-6)
    close(run["averaged_buffers"], run["expected_buffers"], 1e-5)
    for got, before in zip(run["after"], run["before"]):  # bit for bit
        assert all(torch.equal(got[k], before[k]) for k in before), name
    assert not all(torch.equal(run["expected"][k], run["before"][1][k]) for k in run["expected"])
    close(run["warmed"], run["warm_expected"])
    # the model computes with the average inside the swap, with its own weights again after it
    assert torch.equal(run["logits"][2], run["logits"][0])
    if not half:
        reference = small_model().eval()
        reference.load_state_dict({**run["expected"], **run["expected_buffers"]}, strict=False)
        assert torch.allclose(run["logits"][1], reference(run["probe"]), atol=1e-5)
    assert run["n_averaged"] == 3 and run["files"] == (1 if name.startswith("zero0") else RANKS)


@pytest.mark.slow
def test_the_stages_average_alike_and_read_each_others_files_on_any_layout(runs):
    from deepspeed_image_trainer.engine.ema import read_files

    results, tmp_dir = runs
    for name in STAGES:  # the fp32 stages train alike to rounding (bf16 computes otherwise)
        if "bf16" not in name:
            close(results[name]["expected"], results["zero0"]["expected"], 1e-5)
        saved = read_files(tmp_dir / name)  # export --ema's consolidation
        close({k: saved.whole(k, v.shape).flatten() for k, v in results[name]["expected"].items()},
              {k: v.flatten() for k, v in results[name]["expected"].items()})
    for name, other in OTHER.items():
        for rank in range(RANKS):
            close(results[(name, "loaded", other, rank)], results[other]["expected"])
    for name in STAGES:  # 2 ranks -> 1
        for stage in (2, 3):
            close(results[stage, name], results[name]["expected"])
