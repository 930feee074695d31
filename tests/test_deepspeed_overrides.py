"""The trainer's replacements of DeepSpeed's code (engine/overrides.py: ZeRO-1/2 methods, ZeRO-3's per-module
work, the CUDA accelerator's current stream): they stand only over the DeepSpeed source they were checked
against, and train to DeepSpeed's own results, overflow skips included. Also the ZeRO-1/2 setting the trainer
changes from DeepSpeed's default (contiguous gradients off): it trains to the same weights."""
import pytest
import torch

from deepspeed_image_trainer.engine import overrides as deepspeed_overrides

from conftest import assert_usage_error_in_process, data_args, join_process_group, spawn_ranks, tiny_engine

STEPS, ACCUMULATION = 3, 2


def test_the_replaced_deepspeed_methods_are_the_ones_the_overrides_were_checked_against():
    # A DeepSpeed release that changed one of them fails here: read the new source, then update the
    # replacement and its hash in CHECKED_SOURCES (or drop it, if DeepSpeed no longer syncs per parameter).
    assert deepspeed_overrides.changed_sources() == []


def test_the_overflow_flag_stays_on_the_device_until_the_step_reads_it():
    import types

    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert deepspeed_overrides.install()
    try:
        track = DeepSpeedZeroOptimizer.update_offload_overflow_tracker
        optimizer = types.SimpleNamespace(check_grad_overflow=True, local_overflow=False)
        for grad in (torch.ones(3), None, torch.tensor([1.0, float("inf")]), torch.ones(2)):
            track(optimizer, grad)
        assert torch.is_tensor(optimizer.local_overflow) and bool(optimizer.local_overflow)
        optimizer.local_overflow = False
        track(optimizer, torch.tensor([float("nan")]))
        assert bool(optimizer.local_overflow)
        unchecked = types.SimpleNamespace(check_grad_overflow=False, local_overflow=False)
        track(unchecked, torch.tensor([float("inf")]))  # nothing reads it without the check: no work at all
        assert unchecked.local_overflow is False
    finally:
        deepspeed_overrides.uninstall()


def test_accumulation_waits_for_earlier_copies_only_where_its_buffer_is_pageable_or_another_stream_wrote():
    import types

    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert deepspeed_overrides.install()
    originals = DeepSpeedZeroOptimizer._trainer_originals
    deepspeeds = originals["async_accumulate_grad_in_cpu_via_gpu"]
    current, other = get_accelerator().current_stream(), "another stream"
    seen = []

    def deepspeeds_stand_in(self, param):  # what DeepSpeed's method would wait on, then its copy's event
        seen.append(dict(self._pending_offload_events))
        self._pending_offload_events[current] = f"copy of {param}"

    originals["async_accumulate_grad_in_cpu_via_gpu"] = deepspeeds_stand_in
    try:
        accumulate = DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu

        def optimizer(pinned, pending):  # the CPU buffer of parameter "b", if made, and the copies not waited on
            buffers = {} if pinned is None else {"b": types.SimpleNamespace(is_pinned=lambda: pinned)}
            return types.SimpleNamespace(accumulated_grads_in_cpu=buffers, get_param_id=lambda param: param,
                                         _pending_offload_events=dict(pending))

        for pinned in (True, None):
            skipping = optimizer(pinned, {current: "copy of a"})
            accumulate(skipping, "b")
            assert seen.pop() == {} and skipping._pending_offload_events == {current: "copy of b"}
        for pinned, pending in ((False, {current: "copy of a"}), (True, {other: "copy of a"})):
            accumulate(optimizer(pinned, pending), "b")
            assert seen.pop() == pending  # DeepSpeed's own wait
    finally:
        originals["async_accumulate_grad_in_cpu_via_gpu"] = deepspeeds
        deepspeed_overrides.uninstall()


def test_the_cuda_accelerator_returns_the_stream_deepspeeds_returns(monkeypatch):
    import torch
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    deepspeeds = CUDA_Accelerator.current_stream
    assert deepspeed_overrides.install()
    try:
        assert CUDA_Accelerator.current_stream is not deepspeeds
        with monkeypatch.context() as patched:  # what it asks torch for: the current device's index for none
            asked = []
            patched.setattr(torch.cuda, "current_device", lambda: 3)
            patched.setattr(torch.cuda, "current_stream", lambda device=None: asked.append(device) or "stream")
            for argument in (None, 1, torch.device("cuda:2"), "cuda:0"):
                assert CUDA_Accelerator.current_stream(None, argument) == "stream"
            assert asked == [3, 1, torch.device("cuda:2"), "cuda:0"]
        if torch.cuda.is_available():  # on a GPU: the same stream, on each device and inside another stream
            accelerator = CUDA_Accelerator.__new__(CUDA_Accelerator)
            for index in range(torch.cuda.device_count()):
                with torch.cuda.device(index), torch.cuda.stream(torch.cuda.Stream()):
                    for argument in (None, index, 0):
                        assert (CUDA_Accelerator.current_stream(accelerator, argument)
                                == deepspeeds(accelerator, argument))
    finally:
        deepspeed_overrides.uninstall()
    assert CUDA_Accelerator.current_stream is deepspeeds


def test_gathered_parameters_go_in_runs_in_their_order_and_a_large_one_alone(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(deepspeed_overrides, "GATHER_CHUNK", 10)
    params = [SimpleNamespace(ds_tensor=SimpleNamespace(ds_numel=n)) for n in (2, 2, 1, 8, 3, 3)]
    runs = deepspeed_overrides.gather_chunks(params, world_size=2)  # gathered: 4, 4, 2, 16, 6, 6 elements
    assert [[p.ds_tensor.ds_numel for p in run] for run in runs] == [[2, 2, 1], [8], [3], [3]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU's copy from pinned memory needs CUDA"))])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("size, staging", [(1000, 64), (64, 64), (10, 64), (1, 1)])
def test_weights_copied_through_a_staging_buffer_are_the_ones_one_copy_makes(device, dtype, size, staging):
    source = torch.randn(size, generator=torch.Generator().manual_seed(size)) * 1e3
    destination = torch.full((size,), 7.0, dtype=getattr(torch, dtype), device=device)
    buffer = torch.full((staging,), 5.0, dtype=destination.dtype, pin_memory=device == "cuda")
    deepspeed_overrides.copy_through(destination, source, buffer)
    # every piece, the last one short; on the GPU the same bits as DeepSpeed's one copy_ from the fp32 weights
    assert torch.equal(destination, torch.empty_like(destination).copy_(source))


def test_the_pinned_copy_takes_only_gpu_half_weights_and_sizes_its_buffer_by_the_sub_group():
    import torch

    full = torch.zeros(10)
    assert not deepspeed_overrides.through_pinned(None, full)  # no such sub-group
    assert not deepspeed_overrides.through_pinned(torch.zeros(10, dtype=torch.bfloat16), full)  # weights on the CPU
    if torch.cuda.is_available():
        on_gpu = torch.zeros(10, dtype=torch.bfloat16, device="cuda")
        assert deepspeed_overrides.through_pinned(on_gpu, full)
        assert not deepspeed_overrides.through_pinned(on_gpu.float(), full)  # fp32 weights: the master copy itself
        assert not deepspeed_overrides.through_pinned(on_gpu, full.pin_memory())  # NVMe swapping's pinned copy
    chunk = deepspeed_overrides.PINNED_CHUNK

    def sized(buffer, numel, dtype=torch.bfloat16):
        return deepspeed_overrides.staging_buffer(buffer, torch.empty(numel, dtype=dtype, device="meta"), False)

    small = sized(None, 10)
    assert small.numel() == 10 and small.dtype == torch.bfloat16
    assert sized(small, 4) is small  # a smaller sub-group: the same buffer
    larger = sized(small, 1000)
    assert larger.numel() == 1000  # a larger one after a small first: a buffer of its size
    assert sized(larger, 10, torch.float16).dtype == torch.float16
    assert sized(None, 0).numel() == 1 and sized(None, 10 * chunk).numel() == chunk
    with pytest.raises(RuntimeError, match="10 elements into 9"):
        deepspeed_overrides.copy_through(torch.zeros(9), torch.zeros(10), torch.zeros(4))


def test_the_pinned_weight_copy_replaces_deepspeeds_by_default(monkeypatch):
    monkeypatch.delenv("TRAINER_DEEPSPEED_OVERRIDES", raising=False)
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    deepspeeds = Stage3.__dict__["_reassign_or_swap_out_partitioned_parameters"]
    assert deepspeed_overrides.install()
    try:
        assert Stage3.__dict__["_reassign_or_swap_out_partitioned_parameters"] is not deepspeeds
    finally:
        deepspeed_overrides.uninstall()
    assert Stage3.__dict__["_reassign_or_swap_out_partitioned_parameters"] is deepspeeds


@pytest.mark.parametrize("value, groups", [("1", set(deepspeed_overrides.GROUPS)), ("0", set()),
                                           ("overflow_on_device, grad_norm_on_device",
                                            {"overflow_on_device", "grad_norm_on_device"})])
def test_the_environment_picks_the_overrides(monkeypatch, value, groups):
    from deepspeed_image_trainer.utils.failures import UsageError

    monkeypatch.setenv("TRAINER_DEEPSPEED_OVERRIDES", value)
    assert deepspeed_overrides.enabled() == groups
    monkeypatch.setenv("TRAINER_DEEPSPEED_OVERRIDES", "overflow_on_device,nonsense")
    with pytest.raises(UsageError, match="unknown nonsense"):
        deepspeed_overrides.enabled()


def test_the_training_script_refuses_a_bad_overrides_value_before_making_any_folder(tiny_data, tmp_path, monkeypatch,
                                                                                   capsys):
    from deepspeed_image_trainer.cli import train as train_deepspeed

    monkeypatch.setenv("TRAINER_DEEPSPEED_OVERRIDES", "nonsense")
    argv = [*data_args(tiny_data), "--checkpoint_dir", str(tmp_path / "checkpoints"),
            "--log_dir", str(tmp_path / "logs")]
    assert_usage_error_in_process(train_deepspeed.main, argv, capsys, "TRAINER_DEEPSPEED_OVERRIDES: unknown nonsense")
    assert list(tmp_path.iterdir()) == []


def train(stage, offload, precision, poison_step, grad_accum_dtype=None, zero=(), contiguous=None, coalesced=False):
    """A tiny model through ZeRO-1/2 with gradient accumulation and clipping; the weights after each step,
    the global gradient norms and which steps DeepSpeed skipped. `zero`: (key, value) pairs of
    zero_optimization; `contiguous`: its contiguous_gradients, if given; `coalesced`: each step's
    micro-batches coalesced as the trainer does (training.GradientAccumulation)."""
    import deepspeed
    import torch

    from deepspeed_image_trainer.engine.loop import GradientAccumulation

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    engine = tiny_engine(model, lr=0.05, gradient_accumulation_steps=ACCUMULATION, gradient_clipping=0.5,
                         zero={"stage": stage,
                               **({"offload_optimizer": {"device": "cpu", "pin_memory": True}} if offload else {}),
                               **dict(zero), **({} if contiguous is None else {"contiguous_gradients": contiguous})},
                         **({} if precision == "fp32" else {precision: {"enabled": True}}),
                         **({"data_types": {"grad_accum_dtype": grad_accum_dtype}} if grad_accum_dtype else {}))
    generator = torch.Generator().manual_seed(engine.global_rank)
    weights, norms, skipped = [], [], []
    accumulating = GradientAccumulation(engine, coalesced)
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            inputs = torch.randn(4, 8, generator=generator).to(engine.device, next(engine.parameters()).dtype)
            labels = torch.randint(0, 3, (4,), generator=generator).to(engine.device)
            loss = torch.nn.functional.cross_entropy(engine(inputs).float(), labels)
            if step == poison_step:
                loss = loss * float("inf")
            accumulating.backward(loss, micro == ACCUMULATION - 1)
            accumulating.step(micro == ACCUMULATION - 1)
        skipped.append(bool(engine.optimizer.overflow))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            weights.append([p.detach().float().cpu().clone() for p in engine.module.parameters()])
    contiguous = engine.optimizer.contiguous_gradients
    engine.destroy()
    return {"weights": weights, "norms": norms, "skipped": skipped, "contiguous": contiguous}


def each_way(rank, port, results, experiments):
    """Every experiment's cases trained every way on this rank, under (experiment, case, way, rank);
    `experiments`: name -> (cases, ways), `ways`: name -> (the trainer's overrides installed?, train()'s
    keyword arguments)."""
    import torch

    torch.set_num_threads(1)
    join_process_group(rank, port, world_size=2)
    # the tiny model's gathers in several collectives too (128 elements of a weight alone, biases together)
    deepspeed_overrides.GATHER_CHUNK = 64
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    for experiment, (cases, ways) in experiments.items():
        for case in cases:
            for way, (overridden, kwargs) in ways.items():
                if overridden:
                    assert deepspeed_overrides.install()
                else:
                    deepspeed_overrides.uninstall()
                # ZeRO-3's memory_efficient_linear replaces torch's linear for the rest of the process: torch's again
                torch.nn.functional.linear = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk",
                                                     torch.nn.functional.linear)
                results[(experiment, case, way, rank)] = train(*case, **kwargs)
    deepspeed_overrides.uninstall()


# The three two-rank comparisons below, trained in one spawn of two ranks (each spawn costs its ranks' imports).
PLAIN_LINEAR = (("memory_efficient_linear", False),)
ZERO3_CASES = [(3, False, "fp32", None), (3, False, "bf16", 1), (3, True, "bf16", None)]
# every parameter of the tiny model is persistent (gathered after each step); with none, train()'s
# GatheredParameters gathers them all each step, which the replaced gather serves too
NOTHING_PERSISTENT = (3, False, "bf16", None, None, (("stage3_param_persistence_threshold", 0),))
OVERRIDES_CASES = [(2, True, "fp32", None), (2, True, "bf16", None), (2, True, "bf16", 1), (1, False, "bf16", 1),
                   (2, True, "bf16", 1, "fp32"), *ZERO3_CASES, *((*case, None, PLAIN_LINEAR) for case in ZERO3_CASES),
                   NOTHING_PERSISTENT]
SMALL_BUCKETS = (("reduce_bucket_size", 64), ("allgather_bucket_size", 64))
CONTIGUOUS_CASES = [(1, False, "fp32", None, None, ()), (2, False, "fp32", None, None, ()),
                    (2, False, "bf16", 1, None, ()), (1, False, "bf16", None, None, ()),
                    (2, False, "fp32", None, None, SMALL_BUCKETS), (1, False, "fp32", None, None, SMALL_BUCKETS),
                    (2, False, "bf16", None, "fp32", SMALL_BUCKETS)]
COALESCED_CASES = [(2, True, "bf16", 1), (2, True, "fp32", None), (1, True, "fp32", None), (2, False, "fp32", None),
                   (3, True, "fp32", None)]
EXPERIMENTS = {
    # without and with the trainer's overrides
    "overrides": (OVERRIDES_CASES, {False: (False, {}), True: (True, {})}),
    # DeepSpeed's contiguous gradients on and off, without the overrides
    "contiguous": (CONTIGUOUS_CASES, {contiguous: (False, {"contiguous": contiguous}) for contiguous in (True, False)}),
    # step-by-step and coalesced accumulation, with the trainer's overrides installed, as it runs
    "coalesced": (COALESCED_CASES, {coalesced: (True, {"coalesced": coalesced}) for coalesced in (False, True)}),
}


@pytest.fixture(scope="module")
def two_rank_results():
    """experiment -> {(case, way, rank): train()'s results} of every EXPERIMENTS entry, from one two-rank spawn."""
    results = spawn_ranks(each_way, 2, EXPERIMENTS)
    return {experiment: {key[1:]: value for key, value in results.items() if key[0] == experiment}
            for experiment in EXPERIMENTS}


@pytest.mark.slow  # two processes
def test_offload_with_the_overrides_trains_exactly_as_deepspeed_does_on_two_ranks(two_rank_results):
    # ZeRO-2 + offload with fp32 (DeepSpeed skips no overflow check there: its tracker is off) and bf16
    # weights (check on), once with an infinite loss on the second step: both ways must skip that step and
    # only that one. ZeRO-1 without offload goes through the replaced has_overflow without the tracker.
    # With bf16 weights and DeepSpeed's fp32 gradient accumulation the gradients come to the tracker from an
    # fp32 buffer on the device, which DeepSpeed 0.19.8 does not clear after the skipped step: every later
    # step is skipped as well, both ways. ds_config refuses that combination; when this fails, DeepSpeed
    # has changed: drop the refusal (ds_config._refuse_fp32_accumulation_with_offload) and this exception.
    # ZeRO-3 with its overrides (each module's parameters listed once, quiet debug messages, no NVTX ranges) too,
    # and with torch's linear in place of DeepSpeed's memory_efficient_linear (the trainer's default with
    # half-precision weights), which must train to the same weights: fp32, bf16 with a skipped step, offload.
    plain, zero3, cases = PLAIN_LINEAR, ZERO3_CASES, OVERRIDES_CASES
    results = two_rank_results["overrides"]
    assert set(results) == {(case, way, rank) for case in cases for way in (False, True) for rank in range(2)}
    import torch

    for case in zero3:
        for rank in range(2):
            linear, theirs = results[((*case, None, plain), True, rank)], results[(case, True, rank)]
            assert linear["skipped"] == theirs["skipped"]
            assert linear["norms"] == pytest.approx(theirs["norms"], rel=1e-5)
            for mine, reference in zip(linear["weights"], theirs["weights"]):
                assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(mine, reference)), case

    for case in cases:
        poison = case[3]
        for rank in range(2):
            theirs, ours = results[(case, False, rank)], results[(case, True, rank)]
            never_recovers = case[4:] == ("fp32",)
            assert ours["skipped"] == theirs["skipped"] == [step == poison or (never_recovers and step > poison)
                                                            for step in range(STEPS)]
            assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-6), case
            for step, (mine, reference) in enumerate(zip(ours["weights"], theirs["weights"])):
                assert all(torch.equal(a, b) for a, b in zip(mine, reference)), (case, step)
            if poison is None:  # it trained: the weights moved every step
                assert not torch.equal(ours["weights"][0][0], ours["weights"][-1][0])


@pytest.mark.slow  # two processes
def test_zero12_without_contiguous_gradients_trains_to_the_same_weights_on_two_ranks(two_rank_results):
    # ds_config turns DeepSpeed's contiguous gradients off at ZeRO-1/2 without offload: the gradients are then
    # reduced from a flattened copy of each bucket, not from the bucket buffer. ZeRO-2 with an infinite loss on
    # the second step: both ways skip it (bf16 weights check for overflow) and only it. Buckets of 64 elements
    # are reduced during the backward, other ranks' gradients freed after each; bf16 weights with fp32
    # accumulation take DeepSpeed's own path without contiguous gradients.
    cases, results = CONTIGUOUS_CASES, two_rank_results["contiguous"]
    assert set(results) == {(case, way, rank) for case in cases for way in (True, False) for rank in range(2)}
    import torch

    for case in cases:
        for rank in range(2):
            contiguous, flat = results[(case, True, rank)], results[(case, False, rank)]
            assert contiguous["contiguous"] and not flat["contiguous"]  # DeepSpeed took the setting
            assert flat["skipped"] == contiguous["skipped"] == [step == case[3] for step in range(STEPS)], case
            assert flat["norms"] == pytest.approx(contiguous["norms"], rel=1e-5), case
            for step, (mine, reference) in enumerate(zip(flat["weights"], contiguous["weights"])):
                assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(mine, reference)), (case, step)
            assert not torch.equal(flat["weights"][0][0], flat["weights"][-1][0])  # it trained


@pytest.mark.slow  # two processes
def test_coalesced_accumulation_trains_as_deepspeeds_step_by_step_accumulation_on_two_ranks(two_rank_results):
    # The trainer coalesces with optimizer offload (--coalesce_grad_reduction auto), or at any ZeRO stage when
    # asked: the micro-batches' gradients summed on the device, one reduction a step, against DeepSpeed's
    # accumulation micro-batch by micro-batch, with the trainer's overrides: both must train to the same weights
    # and skip the same steps.
    # with the trainer's overrides installed, as it runs
    cases, results = COALESCED_CASES, two_rank_results["coalesced"]
    assert set(results) == {(case, way, rank) for case in cases for way in (False, True) for rank in range(2)}
    import torch

    for case in cases:
        for rank in range(2):
            stepwise, coalesced = results[(case, False, rank)], results[(case, True, rank)]
            assert coalesced["skipped"] == stepwise["skipped"] == [step == case[3] for step in range(STEPS)], case
            tolerance = 1e-2 if case[2] == "bf16" else 1e-5  # the sums' order differs; bf16 rounds each
            assert coalesced["norms"] == pytest.approx(stepwise["norms"], rel=tolerance), case
            for step, (mine, reference) in enumerate(zip(coalesced["weights"], stepwise["weights"])):
                assert all(torch.allclose(a, b, rtol=tolerance, atol=tolerance) for a, b in zip(mine, reference)), (
                    case, step, max((a - b).abs().max().item() for a, b in zip(mine, reference)))
