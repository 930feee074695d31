"""src/memory_profile.py: the ZeRO formulas, and a real two-rank run (gloo) that writes its report."""
import json
import sys
from argparse import Namespace

import pytest
import torch

import memory_profile
from conftest import ROOT, run
from distributed import free_port
from memory_profile import GIB, paper_formula_bytes, trainer_config
from options import run_cli

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
               "--configs", "ZeRO-0 (DDP-like)", "ZeRO-3", "--output_dir", "report"]
    result = run(command, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report/memory_resnet18_cpu_x2.json").read_text())
    assert (tmp_path / "report/memory_resnet18_cpu_x2.png").stat().st_size > 10_000
    assert report["world_size"] == 2 and report["environment"]["gpu"] is None
    zero0, zero3 = report["results"]
    assert (zero0["config"], zero3["config"]) == ("ZeRO-0 (DDP-like)", "ZeRO-3")
    params = zero0["params"]
    assert params == sum(p.numel() for p in __import__("model").ResNet18Animals90().parameters())
    assert zero0["paper_formula_gib"] == pytest.approx(16 * params / GIB)
    assert zero3["paper_formula_gib"] == pytest.approx(16 * params / 2 / GIB)
    assert zero0["deepspeed_estimate_gpu_gib"] is None and zero3["deepspeed_estimate_gpu_gib"] > 0
    for row in (zero0, zero3):
        assert len(row["per_rank"]) == 2
        assert row["model_states_gib"] is None and row["peak_allocated_gib"] is None  # no GPU counters on CPU
        assert 0.1 < row["host_peak_rss_gib"] == max(r["host_peak_rss_gib"] for r in row["per_rank"])
    assert "ZeRO-0 (DDP-like)" in result.stdout and "2 rank(s) on CPU" in result.stdout


@pytest.mark.parametrize("extra, message", [
    (["--find_max_batch"], "--find_max_batch needs one GPU and one process"),
    (["--fp16", "--bf16"], "--fp16 and --bf16 exclude each other"),
    (["--fp16"], "fp16 needs a GPU"),
])
def test_bad_input(capsys, extra, message):
    with pytest.raises(SystemExit) as stop:
        run_cli(memory_profile.main, extra)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err



def test_a_configuration_out_of_memory_is_a_row_of_the_report(tmp_path, capsys):
    # --find_max_batch on a small GPU: a configuration that cannot train even the asked micro-batch is
    # reported with its largest micro-batch, not a traceback (the GPU search itself needs a GPU)
    args = memory_profile.get_args_parser().parse_args(["--find_max_batch", "--batch_size", "8",
                                                        "--output_dir", str(tmp_path)])
    env = {"gpu": "Some GPU", "command": "python src/memory_profile.py"}
    fitted = {"config": "ZeRO-0 (DDP-like)", "params": PSI, "precision": "autocast-bf16", "max_micro_batch": 40,
              **{key: 1.0 for key in ("paper_formula_gib", "deepspeed_estimate_gpu_gib", "model_states_gib",
                                      "activations_gib", "peak_allocated_gib", "peak_reserved_gib",
                                      "host_peak_rss_gib")}}
    oom = {"config": "ZeRO-1", "params": PSI, "out_of_memory": True, "max_micro_batch": 3}
    memory_profile.report(args, [fitted, oom], 1, env)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].startswith("ZeRO-0 (DDP-like)") and lines[-3].split()[-1] == "40"
    assert lines[-2].startswith("ZeRO-1") and "OOM at 8" in lines[-2] and lines[-2].split()[-1] == "3"
    saved = json.loads((tmp_path / "memory_resnet18_some_gpu_x1.json").read_text())
    assert saved["results"][1] == oom and (tmp_path / "memory_resnet18_some_gpu_x1.png").is_file()


@pytest.mark.slow
def test_each_max_batch_try_runs_in_a_process_of_its_own():
    # the out-of-memory outcome needs a GPU; the child process, its exit status and a broken try do not
    args = memory_profile.get_args_parser().parse_args(["--image_size", "32", "--bf16"])
    assert memory_profile.fits(args, "ZeRO-3", 2, torch.device("cpu"), PSI)
    args.model = "resnet_none"  # the child's own argument parser refuses it: an error, not "does not fit"
    with pytest.raises(RuntimeError, match="the try of ZeRO-0 \\(DDP-like\\) at micro-batch 2 failed"):
        memory_profile.fits(args, "ZeRO-0 (DDP-like)", 2, torch.device("cpu"), PSI)


def test_max_batch_search_per_configuration(monkeypatch):
    # the search itself (doubling, then bisecting to within 5%) against known limits; a real try needs a GPU
    limits = {"ZeRO-0 (DDP-like)": 300, "ZeRO-3": 5}
    monkeypatch.setattr(memory_profile, "fits", lambda args, name, batch, device, n: batch <= limits[name])
    args = memory_profile.get_args_parser().parse_args(["--batch_size", "8", "--configs", *limits])
    found = memory_profile.max_batches(args, torch.device("cpu"), PSI)
    assert found["ZeRO-3"] == (5, False)  # --batch_size 8 does not fit: searched from 1, exactly
    batch, fits_given = found["ZeRO-0 (DDP-like)"]
    assert fits_given and 300 * 0.95 <= batch <= 300
