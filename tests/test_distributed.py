"""Batch norm across ranks, on two gloo processes: --sync_bn against one process seeing the whole batch,
and the averaging of running statistics that runs before every validation and save without it; and the
ranks' comparison of their dataset sizes."""
import os
import re
import signal

import pytest
import torch
import torch.distributed as dist

import memory_profile
from deepspeed_image_trainer.engine.distributed import (agreed, average_buffers, checked_world_size, differing,
                                                         free_port)
from deepspeed_image_trainer.engine.interrupt import StopOnSignal
from deepspeed_image_trainer.models.build import build_model
from deepspeed_image_trainer.models.norms import BatchNorm2dFP32, synchronize_batch_norm
from deepspeed_image_trainer.utils.failures import UsageError

from conftest import spawn_ranks

pytestmark = pytest.mark.slow  # every test here starts processes (training runs, or ranks of a process group)

WORLD_SIZE = 2


def whole_batch():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2 * WORLD_SIZE, 3, 5, 5, generator=generator) * 2 + 1
    weight = torch.randn(x.shape, generator=generator)  # the loss is sum(out * weight)
    return x, weight


def fresh_layer():
    torch.manual_seed(1)
    layer = BatchNorm2dFP32(3)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    return layer


def whole_model():
    torch.manual_seed(2)
    return build_model("mobilenet_v3_small", 3).train()


def model_batch():
    return torch.randn(2 * WORLD_SIZE, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def model_running_means(model):
    return [m.running_mean.clone() for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]


def on_each_rank(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    x, weight = whole_batch()
    shard = slice(rank * 2, rank * 2 + 2)
    layer = fresh_layer()
    synchronize_batch_norm(layer)
    x_shard = x[shard].clone().requires_grad_()
    (layer(x_shard) * weight[shard]).sum().backward()
    grads = [layer.weight.grad.clone(), layer.bias.grad.clone()]
    for grad in grads:
        dist.all_reduce(grad)  # what data parallelism does with parameter gradients (sum, then / N)

    unsynced = fresh_layer()  # each rank normalises its own shard; then the statistics are averaged
    unsynced(x[shard])
    before = unsynced.running_mean.clone()
    average_buffers(unsynced)
    model = whole_model()  # every batch norm of a model other than ResNet, the swapped-in layers included
    synchronize_batch_norm(model)
    model(model_batch()[shard])
    cpu = torch.device("cpu")
    # memory_profile's search: one try's figures as each rank measured them
    attempt = {"batch": 4, "fits": True, "peak_allocated_bytes": 100 + rank, "peak_reserved_bytes": 200 - rank,
               "model_states_gib": None, "images_per_s": 10.0 + rank}

    def refusing_on_rank_1():
        if rank == 1:
            raise UsageError("rank 1 cannot read its shard")
        return rank

    try:
        agreement = agreed(refusing_on_rank_1)
    except UsageError as err:
        agreement = (str(err), err.every_rank)
    stop = StopOnSignal(cpu, WORLD_SIZE)
    stop.signal = signal.SIGTERM if rank == 0 else None  # reached rank 0 alone, during validation
    results[rank] = {"agreed": (agreed(lambda: rank), agreement),
                     "stop_after_epoch": (stop.requested_after_epoch(), stop.signal),
                     "differing": (differing({"images": 10 + rank, "classes": 3}, cpu), differing({"images": 10}, cpu)),
                     "over_ranks": memory_profile.over_ranks(attempt, cpu, WORLD_SIZE),
                     "model_running": model_running_means(model),
                     "input_grad": x_shard.grad, "param_grads": grads,
                     "running": (layer.running_mean, layer.running_var, layer.num_batches_tracked),
                     "unsynced_before": before,
                     "unsynced_after": (unsynced.running_mean, unsynced.running_var)}


@pytest.fixture(scope="module")
def ranks():
    results = spawn_ranks(on_each_rank, WORLD_SIZE)
    return [results[rank] for rank in range(WORLD_SIZE)]


def test_sync_bn_matches_one_process_on_the_whole_batch(ranks):
    x, weight = whole_batch()
    reference = fresh_layer()
    x = x.clone().requires_grad_()
    out = reference(x)
    (out * weight).sum().backward()
    for rank, result in enumerate(ranks):
        shard = slice(rank * 2, rank * 2 + 2)
        torch.testing.assert_close(result["input_grad"], x.grad[shard])
        torch.testing.assert_close(result["param_grads"][0], reference.weight.grad)
        torch.testing.assert_close(result["param_grads"][1], reference.bias.grad)
        running_mean, running_var, tracked = result["running"]
        torch.testing.assert_close(running_mean, reference.running_mean)
        torch.testing.assert_close(running_var, reference.running_var)
        assert tracked.item() == 1
    torch.testing.assert_close(ranks[0]["running"][0], ranks[1]["running"][0], rtol=0, atol=0)


def test_ranks_find_the_numbers_they_do_not_share(ranks):
    """What the training script compares before it trains: the ranks' counts of training and validation images."""
    assert [result["differing"] for result in ranks] == [({"images": (10.0, 11.0)}, {})] * WORLD_SIZE


def test_ranks_agree_on_a_memory_search_try(ranks):
    """Each peak the largest any rank had (what every GPU must hold), images/s the slowest rank's times the
    ranks: every rank the same figures, so each picks the same next micro-batch."""
    agreed = {"batch": 4, "fits": True, "peak_allocated_bytes": 101.0, "peak_reserved_bytes": 200.0,
              "model_states_gib": None, "images_per_s": 20.0}
    assert [result["over_ranks"] for result in ranks] == [agreed] * WORLD_SIZE


def test_a_refusal_on_one_rank_is_every_ranks_for_rank_0_to_report(ranks):
    """What a rank's preflight does: one rank unable to read its shard of a checkpoint would otherwise stop
    alone, and leave the others waiting."""
    assert [result["agreed"] for result in ranks] == [(rank, ("rank 1 cannot read its shard", True))
                                                      for rank in range(WORLD_SIZE)]


def test_a_signal_to_one_rank_stops_every_rank_after_the_epoch(ranks):
    assert [result["stop_after_epoch"] for result in ranks] == [(True, signal.SIGTERM)] * WORLD_SIZE


def test_sync_bn_reaches_every_batch_norm_of_a_model(ranks):
    reference = whole_model()
    reference(model_batch())
    expected = model_running_means(reference)
    assert len(expected) == 34
    for result in ranks:
        torch.testing.assert_close(result["model_running"], expected, rtol=1e-4, atol=1e-5)


def test_average_buffers_makes_every_rank_hold_the_mean_statistics(ranks):
    assert not torch.allclose(ranks[0]["unsynced_before"], ranks[1]["unsynced_before"])
    mean_of_ranks = (ranks[0]["unsynced_before"] + ranks[1]["unsynced_before"]) / 2
    for result in ranks:
        torch.testing.assert_close(result["unsynced_after"][0], mean_of_ranks)
    torch.testing.assert_close(ranks[0]["unsynced_after"][1], ranks[1]["unsynced_after"][1], rtol=0, atol=0)


def on_each_gpu(rank, port, results):
    """--sync_bn on two GPUs (NCCL): this layer beside torch.nn.SyncBatchNorm given the same shard, with fp32
    weights (torch's kernels) in fp32 and under bf16 autocast, and with bf16 weights (the hand-written path)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD_SIZE)
    x, weight = (t.cuda().contiguous(memory_format=torch.channels_last) for t in whole_batch())
    shard = slice(rank * 2, rank * 2 + 2)
    out = {}
    for case, weights, autocast in (("fp32", torch.float32, False), ("autocast", torch.float32, True),
                                    ("bf16 weights", torch.bfloat16, False)):
        for name, layer in (("trainer", fresh_layer()), ("torch", torch.nn.SyncBatchNorm.convert_sync_batchnorm(
                torch.nn.Sequential(fresh_layer()))[0])):
            layer = layer.cuda()
            if name == "trainer":
                synchronize_batch_norm(layer)
                layer.to(weights)
                layer.running_mean.data, layer.running_var.data = (b.float() for b in (layer.running_mean,
                                                                                        layer.running_var))
            x_shard = x[shard].clone().to(weights).requires_grad_()
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                y = layer(x_shard)
            (y.float() * weight[shard]).sum().backward()
            out[case, name] = [t.detach().float().cpu() for t in (y, x_shard.grad, layer.weight.grad,
                                                                  layer.bias.grad, layer.running_mean,
                                                                  layer.running_var, layer.num_batches_tracked)]
    results[rank] = out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_sync_bn_on_gpus_is_torchs_sync_batch_norm():
    """With fp32 weights the layer is torch's SyncBatchNorm (its kernels, bit for bit); with bf16 weights its
    own fp32 statistics agree with torch's to bf16's precision."""
    results = spawn_ranks(on_each_gpu, WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        ran = results[rank]
        for case in ("fp32", "autocast"):
            torch.testing.assert_close(ran[case, "trainer"], ran[case, "torch"], rtol=0, atol=0)
        torch.testing.assert_close(ran["bf16 weights", "trainer"][:4], ran["fp32", "torch"][:4], rtol=0.02, atol=0.05)
        torch.testing.assert_close(ran["bf16 weights", "trainer"][4:], ran["fp32", "torch"][4:], rtol=1e-2, atol=1e-2)


def test_a_rendezvous_that_lost_its_port_starts_again_on_another(monkeypatch):
    """Runs started side by side (the benchmarks' jobs, the memory search's probes) race for free ports:
    a port taken between free_port() and the bind gets a new start on another port; other failures do not."""
    import socket
    import subprocess
    import sys

    from deepspeed_image_trainer.engine import distributed

    bind = "import sys, torch.distributed as d; d.TCPStore('127.0.0.1', int(sys.argv[1]), 1, True)"
    tried = []

    def start(port):
        tried.append(port)
        return subprocess.run([sys.executable, "-c", bind, str(port)], capture_output=True, text=True)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        ports = iter([taken_port, free_port()])
        monkeypatch.setattr(distributed, "free_port", lambda: next(ports))
        result = distributed.run_on_free_port(start)
    assert result.returncode == 0, result.stderr[-2000:]
    assert tried[0] == taken_port and len(tried) == 2

    monkeypatch.setattr(distributed, "free_port", lambda: 0)
    failures = []
    broken = subprocess.CompletedProcess([], 1, stdout="", stderr="ValueError: something else")
    assert distributed.run_on_free_port(lambda port: failures.append(port) or broken) is broken
    assert len(failures) == 1


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "1", "RANK": "3"}, "RANK=3 and WORLD_SIZE=1 in the environment: the ranks are 0 .. WORLD_SIZE - 1"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 in the environment: a rank's index on its node is 0 or more"),
    ({"WORLD_SIZE": "2147483648"}, "WORLD_SIZE=2147483648 in the environment is more ranks than torch's process group "
                                   "can hold (at most 2147483647)"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not a whole number"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' in the environment is not a whole number"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999 in the environment is not a port: use 1 .. 65535"),
    ({"DEEPSPEED_TIMEOUT": "ten"}, "DEEPSPEED_TIMEOUT='ten' in the environment is not a whole number of minutes"),
    ({"DEEPSPEED_TIMEOUT": "-1"}, "DEEPSPEED_TIMEOUT=-1 in the environment is outside 1 .. 100000000 minutes"),
    ({"MASTER_ADDR": "no.such.host.invalid"}, "MASTER_ADDR in the environment 'no.such.host.invalid' is not an "
                                              "address this machine can find")])
def test_a_rank_environment_no_group_can_have_is_refused_before_joining(monkeypatch, env, message):
    from deepspeed_image_trainer.engine.distributed import init_distributed

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", **env}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UsageError, match=re.escape(message)):
        init_distributed()  # before a rendezvous: a RANK of 3 in a group of 1 waited for good


def test_a_group_of_one_no_launcher_started_rendezvouses_on_a_free_port(monkeypatch):
    """It took DeepSpeed's 29500: a second run of the training script or the memory report on the machine was
    refused, with advice to leave out the port it had not given. Ranks of a group keep the port they share."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert checked_world_size() == 1 and os.environ["MASTER_PORT"] != "29500"
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("WORLD_SIZE", "2")
    checked_world_size()
    assert os.environ["MASTER_PORT"] == "29500"
    monkeypatch.setenv("MASTER_PORT", "12345")
    monkeypatch.setenv("WORLD_SIZE", "1")
    checked_world_size()
    assert os.environ["MASTER_PORT"] == "12345"

