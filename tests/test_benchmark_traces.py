"""The figures zero3_settings.py --trace reads from a torch.profiler trace, and the file names benchmarks give
their results (benchmarks/common.py)."""
import common
import pytest
import torch


def test_busy_time_counts_overlapping_intervals_once():
    assert common.busy_time([(0, 10), (5, 20), (30, 40), (32, 35)]) == 30
    assert common.busy_time([]) == 0


def test_a_trace_says_how_long_kernels_waited_for_the_host_and_how_busy_the_gpu_was():
    events = [
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 3, "args": {"correlation": 1}},
        {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 100, "dur": 3, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 200, "dur": 3, "args": {"correlation": 3}},
        # started 5 us after its launch (the GPU was waiting), 2,000 us after it (a queue ahead of it)
        {"cat": "kernel", "name": "gemm", "ts": 5, "dur": 10, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "elementwise", "ts": 2100, "dur": 100, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 0, "dur": 50, "args": {"correlation": 3}},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 20, "args": {}},
    ]
    summary = common.trace_summary(events, steps=2)
    assert summary["compute_busy_ms_per_step"] == pytest.approx(0.110 / 2)
    assert summary["nccl_busy_ms_per_step"] == pytest.approx(0.050 / 2)
    assert summary["kernels_per_step"] == 1.5
    assert summary["launch_to_start_us"] == {"p10": 5, "p50": 2000, "p90": 2000}
    assert summary["started_within_50us"] == 0.5


def test_a_trace_without_kernels_has_no_waits():
    summary = common.trace_summary([{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}], steps=1)
    assert summary["kernels_per_step"] == 0 and summary["started_within_50us"] is None
    assert summary["launch_to_start_us"] == {"p10": None, "p50": None, "p90": None}


def test_a_traced_call_reports_the_hosts_busiest_operations():
    trace = common.GpuTrace(steps=2)
    a = torch.ones(64, 64)
    trace.runcall(lambda: [a @ a for _ in range(4)])
    summary = trace.summary
    assert summary["rank"] == 0 and summary["profiled_ms_per_step"] > 0
    assert dict((name, count) for name, _, count in summary["host_self_ms_per_step"])["aten::mm"] == 2
    if not torch.cuda.is_available():
        assert summary["kernels_per_step"] == 0 and summary["launch_to_start_us"]["p50"] is None


def test_a_long_name_becomes_a_file_name_that_fits_and_stays_apart_from_its_neighbours():
    assert common.slug_of("ZeRO-3 + offload optimizer, half weights") == "zero_3_offload_optimizer_half_weights"
    groups = ",".join(f"override_group_number_{i}" for i in range(12))
    long, other = common.slug_of(groups), common.slug_of(groups + ",one_more")
    assert len(long) == 96 and len(other) == 96 and long != other
    assert long.startswith("override_group_number_0_override_group_number_1")
