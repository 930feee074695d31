"""A checkpoint resumed on another number of ranks continues exactly as on its own ranks: real engines on
the CPU (gloo), 2 ranks -> 1 and 1 -> 2, loaded as the trainer loads them (checkpoints.load: ZeRO-0
directly, ZeRO-1/2/3 through DeepSpeed's universal checkpoints, universal.py). The steps after the
checkpoint run the model in eval mode, so that their losses depend on every restored piece (weights, Adam
moments and step, the scheduler, the batch-norm running statistics) and not on how the global batch is
split into per-rank batches."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepspeed_image_trainer.engine.distributed import average_buffers
from deepspeed_image_trainer.outputs import universal
from deepspeed_image_trainer.outputs.checkpoint_engine import BackgroundCheckpointEngine
from deepspeed_image_trainer.utils.failures import UsageError, WriteFailed

from conftest import Payload, join_process_group, spawn_ranks, tiny_engine

STAGES = (0, 1, 2, 3)
GLOBAL_BATCH, STEPS = 8, 3


def batches(seed, count):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, 6, generator=generator) * 3 + 1,
             torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)) for _ in range(count)]


class FixedTable(torch.nn.Module):
    """A buffer left out of the state_dict (persistent=False), as EVA's key bias and rotary table: no checkpoint
    holds it, and the model rebuilds it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.ones(17), persistent=False)

    def forward(self, x):
        return x * self.table


def engine_for(stage, world_size, load_universal=False):
    torch.manual_seed(0)
    # Odd sizes, as ResNet18 with an odd class count has: the shards do not split evenly.
    model = torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.BatchNorm1d(17), FixedTable(), torch.nn.ReLU(),
                                torch.nn.Linear(17, 3))
    sections = {}
    if load_universal:
        universal.enable(sections)  # the trainer's setting, in the config's checkpoint section
    engine = tiny_engine(model, micro_batch=GLOBAL_BATCH // world_size, lr=0.05, optimizer={"weight_decay": 0.01},
                         zero={"stage": stage}, train_batch_size=GLOBAL_BATCH, scheduler={
                             "type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.05,
                                                            "warmup_num_steps": 2 * STEPS}}, **sections)
    engine.checkpoint_engine = BackgroundCheckpointEngine(background=False)  # the trainer's: load_checked
    return engine


def steps(engine, seed, train):
    """STEPS optimizer steps on this rank's share of each global batch; the global losses."""
    engine.train(train)
    share = GLOBAL_BATCH // dist.get_world_size()
    losses = []
    for images, labels in batches(seed, STEPS):
        part = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
        loss = F.cross_entropy(engine(images[part]), labels[part])
        engine.backward(loss)
        engine.step()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(summed.item() / dist.get_world_size())
    return losses


def on_rank(rank, port, results, world_size, folder):
    from deepspeed_image_trainer.outputs import checkpoints

    join_process_group(rank, port, world_size)
    other = 3 - world_size  # 2 ranks <-> 1
    for stage in STAGES:
        engine = engine_for(stage, world_size)
        steps(engine, seed=1, train=True)  # batch-norm statistics and Adam state worth restoring
        average_buffers(engine.module)  # as the trainer does before it saves: every rank the same statistics
        engine.save_checkpoint(f"{folder}/stage{stage}-ranks{world_size}", tag="saved")
        own = steps(engine, seed=2, train=False)
        saved_by_other = f"{folder}/stage{stage}-ranks{other}"
        if os.path.isdir(saved_by_other):
            info = {"tag": "saved", "world_size": other, "zero_stage": stage}
            engine = engine_for(stage, world_size, load_universal=universal.needed(info, world_size))
            checkpoints.load(engine, saved_by_other, info, f"{folder}/resumed-stage{stage}-ranks{world_size}")
            resumed = steps(engine, seed=2, train=False)
        else:
            resumed = None
        if rank == 0:
            results[(stage, world_size)] = {"own": own, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 ranks save; 1 rank saves and resumes theirs; 2 ranks resume the 1 rank's."""
    folder = tmp_path_factory.mktemp("universal")
    results = {}
    for world_size in (2, 1, 2):
        results.update(spawn_ranks(on_rank, world_size, world_size, str(folder)))
    return results, folder


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("saved_by, resumed_by", [(2, 1), (1, 2)])
def test_a_checkpoint_continues_on_another_number_of_ranks_as_on_its_own(runs, stage, saved_by, resumed_by):
    results, folder = runs
    own = results[(stage, saved_by)]["own"]
    resumed = results[(stage, resumed_by)]["resumed"]
    assert resumed == pytest.approx(own, rel=1e-5)
    assert len(set(own)) == STEPS  # the steps changed the model: an equal loss is not a frozen one
    assert not (folder / f"resumed-stage{stage}-ranks{resumed_by}" / ".universal").exists()


def not_a_zero_checkpoint(tag_folder, optimizer_state):
    tag_folder.mkdir(parents=True)
    torch.save({"module": {}}, tag_folder / "mp_rank_00_model_states.pt")
    torch.save(optimizer_state, tag_folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return tag_folder


def test_a_checkpoint_ds_to_universal_would_unpickle_is_checked_first(tmp_path):
    tag_folder = not_a_zero_checkpoint(tmp_path / "hostile/tag", {"optimizer_state_dict": Payload(tmp_path / "ran")})
    with pytest.raises(UsageError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt holds Python objects other"):
        universal.convert(tag_folder, tmp_path / "run/.universal/tag")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "run/.universal").exists()


def test_what_ds_to_universal_cannot_convert_or_write_is_one_message(tmp_path, monkeypatch):
    tag_folder = not_a_zero_checkpoint(tmp_path / "plain/tag", {"x": torch.zeros(2)})
    with pytest.raises(UsageError, match=r"optim_states.pt is not a DeepSpeed checkpoint file \(it holds no "
                                         r"'optimizer_state_dict'\)"):
        universal.convert(tag_folder, tmp_path / "run/.universal/tag")
    tag_folder = not_a_zero_checkpoint(tmp_path / "foreign/tag", {"optimizer_state_dict": {"x": torch.zeros(2)}})
    with pytest.raises(UsageError, match=r"cannot convert .*tag for another number of ranks with DeepSpeed's "
                                         r"ds_to_universal \((KeyError|RuntimeError): "):
        universal.convert(tag_folder, tmp_path / "run/.universal/tag")
    assert not (tmp_path / "run/.universal").exists()

    import deepspeed.checkpoint.ds_to_universal as ds_to_universal

    def disk_full(args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ds_to_universal, "main", disk_full)
    with pytest.raises(WriteFailed, match="No space left on device; it takes as much disk as the optimizer state"):
        universal.convert(tag_folder, tmp_path / "run/.universal/tag")
    assert not (tmp_path / "run/.universal").exists()
