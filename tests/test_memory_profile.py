"""src/memory_profile.py: the ZeRO formulas, and a real two-rank run (gloo) that writes its report."""
import json
import math
import os
import subprocess
import sys
from argparse import Namespace

import max_batch
import pytest
import torch

import memory_profile
from deepspeed_image_trainer.cli.options import run_cli
from deepspeed_image_trainer.engine.distributed import free_port
from memory_profile import GIB, paper_formula_bytes, trainer_config

from conftest import ROOT, run, train_ranks

PSI = 1_000_000


@pytest.mark.parametrize("flags, world_size, bytes_per_param", [
    # the ZeRO paper's mixed-precision Adam: 16, 4 + 12/N, 2 + 14/N, 16/N
    (["--zero_stage", "0", "--bf16"], 4, 16),
    (["--zero_stage", "1", "--bf16"], 4, 4 + 12 / 4),
    (["--zero_stage", "2", "--bf16"], 4, 2 + 14 / 4),
    (["--zero_stage", "3", "--bf16"], 4, 16 / 4),
    # fp32 weights (fp32, or autocast on a GPU): 4 + 4 + 8
    (["--zero_stage", "1"], 2, 8 + 8 / 2),
    (["--zero_stage", "2"], 2, 4 + 12 / 2),
    (["--zero_stage", "2", "--bf16", "--offload_optimizer"], 2, 2),
    (["--zero_stage", "3", "--bf16", "--offload_optimizer", "--offload_param"], 2, 0),
])
def test_paper_formulas(flags, world_size, bytes_per_param):
    args = Namespace(model="resnet18", fp16=False, bf16=False, precision_mode="auto", steps=1)
    config = trainer_config(args, flags, 8, world_size, torch.device("cpu"), None)
    assert paper_formula_bytes(config, PSI, world_size) == pytest.approx(bytes_per_param * PSI)


@pytest.mark.parametrize("model, leaves", [("resnet18", True), ("resnet50", True), ("vgg11", False)])
def test_zero3_gathers_the_blocks_the_trainer_does(model, leaves):
    args = Namespace(model=model, fp16=False, bf16=True, precision_mode="auto", steps=1)
    config = trainer_config(args, ["--zero_stage", "3"], 8, 1, torch.device("cpu"), PSI)
    assert ("leaf_module" in config["zero_optimization"]) == leaves


@pytest.mark.slow
def test_two_ranks_write_table_json_and_chart(tmp_path):
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
               str(ROOT / "src/memory_profile.py"), "--batch_size", "2", "--image_size", "32", "--steps", "1",
               "--configs", "plain PyTorch", "ZeRO-0 (DDP-like)", "ZeRO-3", "--output_dir", "report"]
    result = run(command, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report/memory_resnet18_cpu_x2.json").read_text())
    assert (tmp_path / "report/memory_resnet18_cpu_x2.png").stat().st_size > 10_000
    assert report["world_size"] == 2 and report["environment"]["gpu"] is None
    plain, zero0, zero3 = report["results"]
    assert (plain["config"], zero0["config"], zero3["config"]) == ("plain PyTorch", "ZeRO-0 (DDP-like)", "ZeRO-3")
    params = zero0["params"]
    assert params == plain["params"] == sum(p.numel() for p in __import__("model").ResNet18Animals90().parameters())
    assert plain["paper_formula_gib"] == zero0["paper_formula_gib"] == pytest.approx(16 * params / GIB)
    assert zero3["paper_formula_gib"] == pytest.approx(16 * params / 2 / GIB)
    assert zero0["deepspeed_estimate_gpu_gib"] is None and zero3["deepspeed_estimate_gpu_gib"] > 0
    for row in (plain, zero0, zero3):
        assert len(row["per_rank"]) == 2
        assert row["model_states_gib"] is None and row["peak_allocated_gib"] is None  # no GPU counters on CPU
        assert 0.1 < row["host_peak_rss_gib"] == max(r["host_peak_rss_gib"] for r in row["per_rank"])
    assert "ZeRO-0 (DDP-like)" in result.stdout and "2 rank(s) on CPU" in result.stdout


def test_the_plain_pytorch_reference_builds_timms_models_and_the_report_name_holds_no_colon(tmp_path):
    """`--model timm:NAME` reached torchvision's get_model in the plain-PyTorch configuration: a ValueError
    traceback (round 26); its report was named memory_timm:NAME_..."""
    args = Namespace(model="timm:test_vit", num_classes=3, image_size=32, fp16=False, bf16=False, output_dir=tmp_path)
    engine = memory_profile.PlainEngine(args, torch.device("cpu"), 1)
    assert engine(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    assert memory_profile.results_path(args, {"gpu": None}, 1).name == "memory_timm_test_vit_cpu_x1.json"


@pytest.mark.parametrize("extra, message", [
    (["--find_max_batch"], "--find_max_batch needs a GPU (it searches for the largest micro-batch"),
    (["--num_gpus", "2"], "--num_gpus goes with --find_max_batch and a GPU (this machine has none)"),
    (["--fp16", "--bf16"], "--fp16 and --bf16 exclude each other"),
    (["--fp16"], "fp16 needs a GPU"),
    (["--global_batch", "512"], "--global_batch goes with --find_max_batch"),
    (["--max_batch_limit", "0"], "--max_batch_limit must be at least 1"),
    (["--gpu_memory_gib", "8"], "--gpu_memory_gib needs a GPU"),
])
def test_bad_input(capsys, extra, message):
    with pytest.raises(SystemExit) as stop:
        run_cli(memory_profile.main, extra)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def simulated_process(limit_bytes, per_image, fixed):
    """A search process on a GPU whose peak is fixed + per_image x micro-batch (+2% above 64): it tries
    upwards from the state it is given until a try passes limit_bytes, as memory_profile's --search does."""
    processes = []

    def run(state):
        processes.append(state)
        low, high, peaks, tries = state["low"], state["high"], list(state["peaks"]), []
        batch = max_batch.next_batch(low, high, peaks, limit_bytes, state["limit"])
        if fixed > limit_bytes:  # the engine itself does not fit
            return [{"batch": batch, "fits": False}], False
        while batch is not None:
            peak = fixed + per_image * batch * (1.02 if batch > 64 else 1)
            if peak > limit_bytes:
                return tries + [{"batch": batch, "fits": False}], False
            tries.append({"batch": batch, "fits": True, "peak_allocated_bytes": peak * 0.95, "peak_reserved_bytes": peak,
                          "images_per_s": batch if batch > 2 else None})  # 1 and 2 are not timed
            low, peaks = batch, peaks + [[batch, peak * 0.95, peak]]
            batch = max_batch.next_batch(low, high, peaks, limit_bytes, state["limit"])
        return tries, True

    return run, processes


@pytest.mark.parametrize("fixed, per_image, largest", [
    (10 * GIB, 0.1 * GIB, 0),  # the model states alone are over the 8 GiB
    (7.9 * GIB, 0.06 * GIB, 1),
    (2 * GIB, 1.1 * GIB, 5),
    (1 * GIB, 0.02 * GIB, 343),
    (1 * GIB, 0.0005 * GIB, None),  # more than the limit fits: the search stops there
])
def test_the_search_finds_the_largest_micro_batch_in_few_processes(fixed, per_image, largest):
    limit = 4096
    run, processes = simulated_process(8 * GIB, per_image, fixed)
    found, best, tries = max_batch.search(run, limit)
    if largest is None:
        assert found == limit and best["batch"] == limit
    else:
        assert largest * (1 - 1 / max_batch.TOLERANCE) <= found <= largest
        assert found == 0 and best is None or best["batch"] == found
        assert best is None or best["images_per_s"] == (found if found > 2 else None)
        assert any(not t["fits"] and t["batch"] - found <= max(1, found // max_batch.TOLERANCE) for t in tries)
    assert len(processes) <= 3, processes  # one failure ends a process; predictions keep failures few
    assert len(tries) <= 12


def test_next_batch_predicts_from_the_peaks_then_bisects():
    assert max_batch.next_batch(0, None, [], 100) == 1
    assert max_batch.next_batch(1, None, [[1, 10, 10]], 100) == 2  # one point: no line yet, doubled
    # allocated memory's line through (1, 10) and (2, 20) reaches 100 at 10; aimed 3% under it
    assert max_batch.next_batch(2, None, [[1, 10, 10], [2, 20, 20]], 100) == 9
    # 20% of the reserved memory unallocated at the largest try: the line is aimed at 80% of the budget
    assert max_batch.next_batch(2, None, [[1, 10, 12], [2, 20, 25]], 100) == 7
    assert max_batch.next_batch(2, None, [[1, 10, 10], [2, 20, 20]], 10_000) == 16  # at most 8x the largest that fitted
    assert max_batch.next_batch(40, 80, [], 100) == 60  # a failure known: bisection
    assert max_batch.next_batch(100, 105, [], 100) is None  # within 5%
    assert max_batch.next_batch(9, None, [[8, 80, 80], [9, 90, 90]], 91) == 10  # on the line already: one step up
    # near the cap, reserved memory saturates and allocated memory may even fall: creep up instead of doubling
    assert max_batch.next_batch(40, None, [[39, 7.1, 7.9], [40, 7.0, 7.8]], 8) == 42
    assert max_batch.next_batch(40, None, [[39, 3.1, 3.3], [40, 3.0, 3.3]], 8) == 80
    assert max_batch.next_batch(6, None, [], 100, limit=6) is None


def test_a_search_process_reports_each_try_and_ends_at_the_first_failure(monkeypatch, capsys):
    # the process's loop, without a GPU: micro-batches above 24 "run out of memory"; 1, 2, then 8 x 2 (the line
    # says 32: at most 8 times the largest that fitted), then the line's 32 aimed 3% under it
    def timed_try(engine, config, micro_batch, *args):
        if micro_batch > 24:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"batch": micro_batch, "fits": True, "peak_allocated_bytes": micro_batch * GIB / 4,
                "peak_reserved_bytes": micro_batch * GIB / 4}

    monkeypatch.setattr(memory_profile, "new_engine", lambda *args: None)
    monkeypatch.setattr(memory_profile, "timed_try", timed_try)
    args = memory_profile.get_args_parser().parse_args(
        ["--search", "ZeRO-2", json.dumps({"low": 0, "high": None, "peaks": [], "limit": 4096})])
    assert memory_profile.search_process(args, torch.device("cpu"), (PSI, PSI), 8 * GIB) == memory_profile.OUT_OF_MEMORY
    tries = [json.loads(line[4:]) for line in capsys.readouterr().out.splitlines()]
    assert [t["batch"] for t in tries] == [1, 2, 16, 31] and [t["fits"] for t in tries] == [True] * 3 + [False]


def children_in_a_rank(monkeypatch):
    """child()'s one-process commands (no torchrun) run the script's main with the command's arguments in a
    spawn_ranks rank (conftest's train_ranks: RANK 0 of WORLD_SIZE 1, as child sets them; the rank's exit status,
    stdout and stderr), not in a Python process of their own (~5 s of imports each). A real process: the ZeRO-3
    search below (and torchrun's on two ranks)."""
    def run(command, env, **kwargs):
        assert command[1] == memory_profile.__file__ and "torch.distributed.run" not in command, command
        assert (env["RANK"], env["WORLD_SIZE"]) == ("0", "1")
        result = train_ranks(command[2:], os.getcwd(), script=memory_profile.__file__)
        return subprocess.CompletedProcess(command, result.returncode, result.stdout, result.stderr)

    monkeypatch.setattr(memory_profile.subprocess, "run", run)


@pytest.mark.slow
def test_a_search_process_trains_real_steps_and_a_broken_one_is_an_error(monkeypatch):
    # on the CPU nothing runs out of memory: the search climbs to its limit, timing each try (in fp32: a CPU
    # without oneDNN's bf16 kernels takes seconds a bf16 step)
    args = memory_profile.get_args_parser().parse_args(["--image_size", "64", "--steps", "1"])
    tries, finished = memory_profile.child(args, "search", "ZeRO-3", json.dumps(
        {"low": 0, "high": None, "peaks": [], "limit": 5}))
    assert finished and [t["batch"] for t in tries] == [1, 2, 4, 5]
    assert all(t["fits"] and t["host_peak_rss_gib"] > 0.1 for t in tries)
    assert [t["images_per_s"] > 0 if t["images_per_s"] else None for t in tries] == [None, None, True, True]
    children_in_a_rank(monkeypatch)
    args.model = "resnet_none"  # the child's own checks refuse it: an error, not "out of memory"
    with pytest.raises(RuntimeError, match="^the probe of plain PyTorch \\(2\\) failed \\(exit status 2\\):\n"
                                           "error: --model resnet_none: not a torchvision classifier"):
        memory_profile.child(args, "probe", memory_profile.PLAIN, "2")


def test_a_coalesced_configuration_tries_two_micro_batches_a_step_inside_deepspeeds_coalescing(monkeypatch):
    children_in_a_rank(monkeypatch)
    args = memory_profile.get_args_parser().parse_args(["--image_size", "64", "--bf16", "--steps", "1"])
    # at micro-batch 1 (a CPU's bf16 steps take seconds an image): still two micro-batches a step, coalesced
    tries, finished = memory_profile.child(args, "probe", "ZeRO-2 + offload optimizer, half weights, coalesced", "1")
    assert finished and [(t["batch"], t["accumulation"], t["coalesced"]) for t in tries] == [(1, 2, True)]
    assert tries[0]["images_per_s"] > 0
    assert "ZeRO-2, coalesced" not in args.configs  # measured only when named


def test_the_configurations_coalesce_as_the_trainer_decides_from_their_flags():
    args = memory_profile.get_args_parser().parse_args(["--image_size", "64", "--bf16"])
    config = memory_profile.trainer_config(args, ["--zero_stage", "2", "--offload_optimizer"], 4, 1,
                                           torch.device("cpu"), 1000, accumulation=2)
    # the trainer's auto would coalesce this one: the plain offload names measure DeepSpeed's own way
    assert memory_profile.coalescing_mode("ZeRO-2 + offload optimizer") == "off"
    assert not memory_profile.coalesces("ZeRO-2 + offload optimizer", config)
    assert memory_profile.coalesces("ZeRO-2 + offload optimizer, coalesced", config)
    assert memory_profile.coalesces("ZeRO-2 + offload optimizer", config, "on")  # offload_profile.py --coalesce
    assert memory_profile.CONFIGS["ZeRO-2 + offload optimizer, half weights, coalesced"] == [
        "--zero_stage", "2", "--offload_optimizer", "--precision_mode", "half_weights", "--coalesce_grad_reduction", "on"]
    assert memory_profile.accumulation_of("ZeRO-2, coalesced") == 2 and memory_profile.accumulation_of("ZeRO-2") == 1
    assert not memory_profile.coalesces(memory_profile.PLAIN, config)


@pytest.mark.slow
def test_a_search_on_two_ranks_says_each_try_once_with_the_figures_of_both():
    # torchrun's two gloo ranks: rank 0 says each try, its peaks the larger of the two ranks'
    args = memory_profile.get_args_parser().parse_args(["--image_size", "64", "--steps", "1", "--num_gpus", "2"])
    tries, finished = memory_profile.child(args, "search", "ZeRO-3", json.dumps(
        {"low": 0, "high": None, "peaks": [], "limit": 4}))
    assert finished and [t["batch"] for t in tries] == [1, 2, 4]  # said once each
    assert all(t["fits"] and t["host_peak_rss_gib"] > 0.1 for t in tries) and tries[-1]["images_per_s"] > 0


STDERR = """[rank1]: ValueError: Expected more than 1 value per channel
Traceback (most recent call last):
  File "torch/distributed/run.py", line 1000, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
"""


def test_one_rank_out_of_memory_ends_the_search_process_there(monkeypatch):
    # torchrun exits with 1 when a rank fails; the TRY line the failing rank said is what tells it apart
    # the failing ranks' lines may come before rank 0's last, and a line may be broken by other output
    lines = {0: ['TRY {"batch": 2, "fits": false, "rank": 1}', 'TRY {"batch": 1, "fits": true, "peak_reserved_gib": 1.5}',
                 'TRY {"batch": 2, "fits": false, "rank": 0}', 'TRY {"batch": 4, "fi[rank1]: Traceback'],
             1: ['TRY {"batch": 1, "fits": true, "peak_reserved_gib": 1.5}']}
    outcome = {}
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        status, stderr = (-9, "") if outcome["case"] == 2 else (1, STDERR)
        return subprocess.CompletedProcess(command, status, "\n".join(lines[outcome["case"]]), stderr)

    monkeypatch.setattr(memory_profile.subprocess, "run", run)
    args = memory_profile.get_args_parser().parse_args(["--num_gpus", "2"])
    outcome["case"] = 0
    tries, finished = memory_profile.child(args, "search", "ZeRO-3", "{}")
    assert [(t["batch"], t["fits"]) for t in tries] == [(1, True), (2, False)] and not finished
    assert commands[0][1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    outcome["case"] = 1  # a failure that is not out of memory: the rank's error, not torchrun's summary after it
    with pytest.raises(RuntimeError) as failed:
        memory_profile.child(args, "search", "ZeRO-3", "{}")
    assert str(failed.value).endswith(
        "failed (exit status 1):\n[rank1]: ValueError: Expected more than 1 value per channel\n")
    # killed by a signal (the kernel's out-of-memory killer when the host's memory runs out): no traceback to show
    lines[2], outcome["case"] = [], 2
    with pytest.raises(RuntimeError) as failed:
        memory_profile.child(args, "probe", "ZeRO-2", "10", "--accumulation", "52")
    assert str(failed.value) == "the probe of ZeRO-2 (10 --accumulation 52) failed (killed by SIGKILL):\n"


def test_an_accumulated_probe_that_dies_keeps_the_largest_micro_batch_and_says_why(monkeypatch, tmp_path):
    # EVA-02-E's optimizer offload on one H200: the search found micro-batch 10, the probe accumulated to 520 was
    # killed by the host's out-of-memory killer; the row keeps what the search found
    import report

    def child(args, mode, name, *values, capped=True):
        if mode == "probe" and "--accumulation" in values:
            raise RuntimeError(f"the probe of {name} ({' '.join(values)}) failed (killed by SIGKILL):\n")
        if mode == "probe":
            return [{"batch": int(values[0]), "fits": True, "images_per_s": 100.0}], True
        return simulated_process(8 * GIB, GIB / 8, 8 * GIB - 48 * GIB / 8 - 1)[0](json.loads(values[0]))

    monkeypatch.setattr(memory_profile, "child", child)
    args = memory_profile.get_args_parser().parse_args(
        ["--find_max_batch", "--gpu_memory_gib", "8", "--global_batch", "512", "--configs",
         "ZeRO-2 + offload optimizer", "--output_dir", str(tmp_path)])
    [row] = memory_profile.largest_batches(args, (PSI, PSI))
    assert row["max_micro_batch"] == 48 and row["images_per_s"] and row["global_batch"] == 48 * 11
    assert row["global_batch_images_per_s"] is None and "(killed by SIGKILL)" in row["global_batch_error"]
    assert report.accumulation_failure(row) == "failed (killed by SIGKILL)"
    assert report.accumulation_failure({"global_batch_images_per_s": None}) == "out of memory"


def test_every_configuration_gets_its_largest_batch_its_speed_and_the_reference(monkeypatch, tmp_path, capsys):
    # the parent's side of --find_max_batch on a GPU held to 8 GiB, its child processes simulated
    limits = {memory_profile.PLAIN: 0, "ZeRO-2 + offload optimizer": 48, "ZeRO-3": 5, "ZeRO-2": 2}
    calls = []

    def child(args, mode, name, *values, capped=True):
        calls.append((mode, name, values, capped))
        if mode == "probe":
            batch = int(values[0])
            accumulation = int(values[2]) if len(values) > 2 else 1
            return [{"batch": batch, "fits": True, "images_per_s": 100.0 / accumulation + (not capped) * 900}], True
        return simulated_process(8 * GIB, GIB / 8, 8 * GIB - limits[name] * GIB / 8 - 1)[0](json.loads(values[0]))

    monkeypatch.setattr(memory_profile, "child", child)
    args = memory_profile.get_args_parser().parse_args(
        ["--find_max_batch", "--gpu_memory_gib", "8", "--global_batch", "512", "--batch_size", "32",
         "--configs", *limits, "--output_dir", str(tmp_path)])
    rows = memory_profile.largest_batches(args, (PSI, PSI))
    assert [row["max_micro_batch"] for row in rows] == [0, 48, 5, 2]
    plain, offload, zero3, zero2 = rows
    assert plain["out_of_memory"] and plain["images_per_s"] is None and "global_batch" not in plain
    assert offload["global_batch"] == 48 * 11 and offload["global_batch_images_per_s"] == pytest.approx(100 / 11)
    assert "global_batch" not in zero3 and zero3["images_per_s"] == 5  # accumulation pays for offload only
    assert ("probe", "ZeRO-2", ("2",), True) in calls and zero2["images_per_s"] == 100  # found untimed: timed apart
    reference = memory_profile.reference_speed(args)
    assert calls[-1] == ("probe", memory_profile.PLAIN, ("32",), False) and reference["images_per_s"] == 1000
    env = {"gpu": "Some GPU", "command": "python src/memory_profile.py"}
    memory_profile.report(args, rows, 1, env, reference)
    out = capsys.readouterr().out
    assert "reference: plain PyTorch on the whole GPU at micro-batch 32: 1000.0 images/s" in out
    line = next(line for line in out.splitlines() if line.startswith("ZeRO-2 + offload optimizer"))
    assert line.split()[-3:] == ["48", "48.00", "0.05"]
    saved = json.loads((tmp_path / "memory_resnet18_some_gpu_x1.json").read_text())
    by_name = {row["config"]: row for row in saved["results"]}
    assert [row["config"] for row in saved["results"]] == [c for c in memory_profile.CONFIGS if c in limits]
    assert saved["reference"] == reference and by_name["ZeRO-2 + offload optimizer"]["ratio_to_reference"] == 0.048

    # --update: a later run of one configuration replaces its row and keeps the others and the reference
    args.update, args.configs = True, ["ZeRO-3"]
    limits["ZeRO-3"] = 7
    memory_profile.report(args, memory_profile.largest_batches(args, (PSI, PSI)), 1,
                          {**env, "command": "python src/memory_profile.py --update"})
    saved = json.loads((tmp_path / "memory_resnet18_some_gpu_x1.json").read_text())
    assert [row["max_micro_batch"] for row in saved["results"]] == [0, 2, 7, 48] and saved["reference"] == reference
    assert saved["environment"]["commands"] == ["python src/memory_profile.py", "python src/memory_profile.py --update"]
    # a row of a configuration this script no longer has stays, after the known ones
    path = tmp_path / "memory_resnet18_some_gpu_x1.json"
    path.write_text(json.dumps({**saved, "results": [{"config": "retired", "max_micro_batch": 3}, *saved["results"]]}))
    memory_profile.report(args, memory_profile.largest_batches(args, (PSI, PSI)), 1, env)
    assert [row["config"] for row in json.loads(path.read_text())["results"]] == [*by_name, "retired"]
    # rows measured at one micro-batch do not take rows of another (the search picks each row's own)
    fixed = memory_profile.get_args_parser().parse_args(["--update", "--batch_size", "3", "--output_dir", str(tmp_path),
                                                         "--steps", str(args.steps)])
    path.write_text(json.dumps({**saved, "settings": {**saved["settings"], "find_max_batch": False,
                                                      "gpu_memory_gib": None, "batch_size": 2}}))
    with pytest.raises(memory_profile.UsageError, match="measured with another --batch_size"):
        memory_profile.earlier_results(fixed, env, 1)
    path.write_text(json.dumps(saved))
    args.gpu_memory_gib = 24
    with pytest.raises(memory_profile.UsageError, match="measured with another --gpu_memory_gib"):
        memory_profile.report(args, [], 1, env)
    path.write_text('{"results": [')  # a damaged report: refused, and left as it is
    with pytest.raises(memory_profile.UsageError, match="is not a memory report's JSON .JSONDecodeError"):
        memory_profile.report(args, [], 1, env)
    assert path.read_text() == '{"results": ['


@pytest.mark.parametrize("row, message", [
    ({"config": ["x"]}, "results[0] is not an object with its configuration's name (config)"),
    ({"flags": ["--zero_stage", "1"]}, "results[0] is not an object with its configuration's name (config)"),
    ({"config": "ZeRO-1", "host_peak_rss_gib": "1 GiB"}, "results[0] has host_peak_rss_gib '1 GiB', not a number"),
    ({"config": "ZeRO-1", "error": 5}, "results[0] has error 5, not a message"),
    # json reads NaN and Infinity: the table said "(inf M params)" and the JSON was written back with them
    ({"config": "ZeRO-1", "params": math.inf}, "results[0] has params inf, not a whole number of parameters"),
    ({"config": "ZeRO-1", "peak_host_gib": math.nan}, "results[0] has peak_host_gib nan, not a number"),
    ({"config": "ZeRO-1", "images_per_s": -math.inf}, "results[0] has images_per_s -inf, not a number"),
    ({"config": "ZeRO-1", "model_states_gib": True}, "results[0] has model_states_gib True, not a number"),
    ({"config": "ZeRO-1", "params": 10**400}, "results[0] has params 10000000000000000000... (401 characters), not "
                                              "a whole number of parameters"),
    ({"config": "ZeRO-1", "host_peak_rss_gib": -5}, "results[0] has host_peak_rss_gib -5, below 0"),
    ({"config": "ZeRO-1", "params": -1}, "results[0] has params -1, not a whole number of parameters"),
    ({"config": "ZeRO-1", "params": 1.5}, "results[0] has params 1.5, not a whole number of parameters"),
    # written back as they were, or shown as a 300-digit figure
    ({"config": "ZeRO-1", "host_peak_rss_gib": 1e300}, "results[0] has host_peak_rss_gib 1e+300, over 1,048,576 GiB"),
    ({"config": "ZeRO-1", "seconds": "x"}, "results[0] has seconds 'x', not a number"),
    ({"config": "ZeRO-1", "precision": 5}, "results[0] has precision 5, not one of fp32, fp16, bf16, autocast-fp16, "
                                           "autocast-bf16"),
    ({"config": "ZeRO-1", "per_rank": "x"}, "results[0] has per_rank 'x', not a list of each rank's GiB figures"),
    ({"config": "ZeRO-1", "tries": [{"batch": -2, "fits": True}]}, "results[0] has tries [{'batch': -2, 'fits': "
                                                                    "True}], not a list of the search's tries")],
    ids=["config a list", "no config", "a figure in words", "error a number", "Infinity", "NaN", "-Infinity",
         "true", "past a float", "negative gib", "negative params", "fractional params", "a pebibyte past",
         "seconds in words",
         "precision a number", "per_rank a word", "a negative try"])
def test_an_update_file_whose_rows_cannot_be_merged_is_refused_before_measuring(tmp_path, monkeypatch, capsys,
                                                                                row, message):
    """A row the report cannot merge or show (config ["x"]: unhashable) ended --update in a traceback when the
    report was written, after measuring: the measurement was lost."""
    refused_update(tmp_path, monkeypatch, capsys, {"results": [row]}, message)


@pytest.mark.parametrize("edit, message", [
    ({"environment": {"commands": "str"}}, "environment.commands is 'str', not a list of commands"),
    ({"reference": {"batch": 2, "images_per_s": "fast"}}, "its reference {'batch': 2, 'images_per_s': 'fast'} is "
                                                          "not the plain loop's batch and images/s"),
    # shown twice in the table and kept twice in the JSON
    ({"results": [{"config": "ZeRO-1"}, {"config": "ZeRO-1"}]}, "results[1] is a second row of 'ZeRO-1' (a report "
                                                                "has one row a configuration)")],
    ids=["commands a word", "reference in words", "a configuration twice"])
def test_an_update_file_whose_commands_or_reference_cannot_be_carried_over_is_refused(tmp_path, monkeypatch, capsys,
                                                                                    edit, message):
    """The commands, a word, came back as a list of its letters; a reference in words ended the table's ratio in a
    TypeError after measuring."""
    refused_update(tmp_path, monkeypatch, capsys, edit, message)


def refused_update(tmp_path, monkeypatch, capsys, edit, message):
    """An earlier report with `edit` (its top-level keys replaced, "environment" merged) is refused by --update,
    in one line, before measuring, and left as it was."""
    from conftest import assert_usage_error_in_process

    argv = ["--model", "resnet18", "--num_classes", "3", "--image_size", "32", "--batch_size", "2", "--steps", "1",
            "--output_dir", str(tmp_path)]
    memory_profile.write_results(memory_profile.get_args_parser().parse_args(argv), [{"config": "ZeRO-1"}], 1,
                                 memory_profile.environment())
    path = next(tmp_path.glob("memory_resnet18_*.json"))
    earlier = json.loads(path.read_text())
    path.write_text(json.dumps({**earlier, **edit, "environment": {**earlier["environment"],
                                                                   **edit.get("environment", {})}}))
    before = path.read_text()
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():  # not left set for other tests
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(memory_profile, "measure", lambda *args: pytest.fail("measured before the refusal"))
    assert_usage_error_in_process(memory_profile.main, argv + ["--configs", "ZeRO-2", "--update"], capsys, message)
    assert path.read_text() == before


@pytest.mark.parametrize("what, suffix, update", [("fifo", ".json", True), ("fifo", ".json", False),
                                                  ("fifo", ".png", False), ("folder", ".json", False),
                                                  ("device", ".json", True)])
def test_a_report_name_taken_by_what_is_not_a_file_is_refused_before_measuring(tmp_path, monkeypatch, capsys, what,
                                                                               suffix, update):
    """A FIFO at the JSON's name: --update waited for good for its writer to read it; without --update the write
    after measuring waited for a reader (a folder there: a traceback), and the measurement was lost."""
    import os

    from conftest import assert_usage_error_in_process, unblock_later

    argv = ["--model", "resnet18", "--num_classes", "3", "--image_size", "32", "--batch_size", "2", "--steps", "1",
            "--configs", "ZeRO-1", "--output_dir", str(tmp_path), *(["--update"] if update else [])]
    path = memory_profile.results_path(memory_profile.get_args_parser().parse_args(argv), memory_profile.environment(),
                                       1).with_suffix(suffix)
    if what == "fifo":
        os.mkfifo(path)
        unblock_later(path)  # a miss reads an empty file after 10 s rather than waiting for good
    elif what == "folder":
        path.mkdir()
    else:
        path.symlink_to("/dev/null")
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():  # not left set for other tests
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(memory_profile, "measure", lambda *args: pytest.fail("measured before the refusal"))
    assert_usage_error_in_process(memory_profile.main, argv, capsys, f"error: {path} is not a regular file (a folder, "
                                  "a FIFO or a device): move it away or write to another --output_dir")


@pytest.mark.parametrize("argv, message", [
    (["--image_size", "0"], "--image_size must be at least 1, got 0"),
    (["--image_size=-5"], "--image_size must be at least 1, got -5"),
    (["--num_classes", "0"], "--num_classes must be at least 1, got 0"),
    # a report of two rows of one configuration, which --update then refused
    (["--configs", "ZeRO-1", "ZeRO-2", "ZeRO-1"], "--configs names ZeRO-1 twice: give each configuration once"),
    (["--num_classes", "100000000000"], "--num_classes 100000000000: the model's fp32 weights alone are"),
    (["--model", "vit_b_16", "--image_size", "30"], "--model vit_b_16 cannot take --image_size 30"),
    (["--output_dir", "FILE"], "is not a folder; choose another --output_dir"),
    (["--output_dir", "/proc/report"], "--output_dir /proc/report: cannot write in /proc ("),  # before measuring
    # a link to nothing or a loop: measured, then FileExistsError
    (["--output_dir", "DANGLING"], "DANGLING is a link to nothing or a link loop; remove it or choose another"),
    (["--output_dir", "CHECKPOINT/report"], "is inside the checkpoint"),  # its next save deleted the report
    (["--output_dir", "LOOP/report"], "LOOP is a link to nothing or a link loop; remove it or choose another"),
    (["--image_size", "100000000"], "--image_size 100000000: a micro-batch of 64 input images alone is"),
])
def test_values_no_report_can_use_are_one_error_line(tmp_path, capsys, argv, message):
    from conftest import assert_usage_error_in_process

    (tmp_path / "FILE").write_text("")
    (tmp_path / "DANGLING").symlink_to(tmp_path / "nowhere")
    (tmp_path / "LOOP").symlink_to("LOOP")
    (tmp_path / "CHECKPOINT").mkdir()
    (tmp_path / "CHECKPOINT/extra_info.json").write_text("{}")
    argv = [str(tmp_path / arg) if arg.split("/")[0] in ("FILE", "DANGLING", "LOOP", "CHECKPOINT") else arg
            for arg in argv]
    assert_usage_error_in_process(memory_profile.main, ["--model", "resnet18", *argv], capsys, message)
