import argparse
import json
import re

import pytest
import torch

from deepspeed_image_trainer.cli.options import add_training_args, parse_args
from deepspeed_image_trainer.engine.config import (OPTIMIZER_SETTINGS, build_ds_config,
                                                   check_device_support, check_monitor_support, check_trainer_support,
                                                   coalesces_grad_reduction, load_base_config, lr_schedule,
                                                   num_parameters, precision, resolve_scheduler, steps_per_epoch)
from deepspeed_image_trainer.models.names import BLOCKS
from deepspeed_image_trainer.utils.failures import UsageError

from conftest import ROOT, data_args


def make_args(*argv):
    return parse_args(lambda: add_training_args(argparse.ArgumentParser()), list(argv))


def build(*argv, world_size=1, images=1000, base=None, device_type="cpu", **kwargs):
    return build_ds_config(make_args(*argv), world_size, images, base=base, device_type=device_type, **kwargs)


def test_explicit_flags_are_recorded():
    args = make_args("--batch_size", "8", "--bf16", "--no-offload_optimizer")
    assert args.explicit == {"batch_size", "bf16", "offload_optimizer"}
    assert args.epochs == 50 and args.zero_stage == "auto"


def test_defaults():
    config = build()
    assert config["train_micro_batch_size_per_gpu"] == 16
    assert config["gradient_accumulation_steps"] == 1
    assert config["train_batch_size"] == 16
    assert config["zero_optimization"] == {"stage": 0}  # one rank: nothing to partition
    assert build(world_size=2)["zero_optimization"] == {  # nothing clips; no per-parameter gradient copies
        "stage": 2, "contiguous_gradients": False, "compute_grad_norm": False}
    assert config["gradient_clipping"] == 0.0
    assert "fp16" not in config and "bf16" not in config
    # torch's AdamW, on a CPU its fused kernel; on a GPU torch's own default (its foreach kernels)
    assert config["optimizer"] == {"type": "AdamW", "params": {
        "lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.05, "torch_adam": True, "fused": True}}
    assert "fused" not in build(device_type="cuda")["optimizer"]["params"]
    for key in ("foreach", "fused", "differentiable"):  # a JSON's choice stays (the fused kernel is not differentiable)
        params = build(base={"optimizer": {"type": "AdamW", "params": {key: False}}})["optimizer"]["params"]
        assert params[key] is False and params.get("fused", False) is False
    # 1000 images // 16 = 62 steps per epoch, 50 epochs, 1 warmup epoch
    assert config["scheduler"]["params"]["total_num_steps"] == 62 * 50
    assert config["scheduler"]["params"]["warmup_num_steps"] == 62
    assert precision(config) == "fp32"


@pytest.mark.parametrize("kind, settings, optimizer_class", [
    ("SGD", {"momentum": 0.9}, torch.optim.SGD),
    ("Adagrad", {"eps": 1e-10}, torch.optim.Adagrad),  # DeepSpeed's CPU Adagrad takes what torch's does
    ("Lion", {"betas": [0.9, 0.99], "weight_decay": 0.1}, None),
])
def test_an_optimizer_from_the_json_gets_only_the_settings_it_takes(kind, settings, optimizer_class):
    config = build(base={"optimizer": {"type": kind, "params": {"lr": 0.01, **settings}}})
    params = config["optimizer"]["params"]
    sgd = {"nesterov": False} if kind == "SGD" else {}  # --nesterov's default; the JSON's momentum stands
    assert params == {"lr": 0.01, "weight_decay": 0.05, **settings, **sgd}  # no AdamW betas or eps
    assert config["zero_allow_untested_optimizer"] is True  # see test_sgd_from_the_json_trains_under_zero
    if optimizer_class is not None:  # as DeepSpeed builds it: the class with the config's params
        optimizer_class([torch.nn.Parameter(torch.zeros(1))], **params)


@pytest.mark.parametrize("argv, optimizer", [
    (("--optimizer", "sgd"), {"type": "SGD", "params": {"lr": 0.001, "weight_decay": 0.05, "momentum": 0.9,
                                                        "nesterov": False}}),
    (("--optimizer", "sgd", "--momentum", "0.8", "--nesterov", "--weight_decay", "1e-4"),
     {"type": "SGD", "params": {"lr": 0.001, "weight_decay": 1e-4, "momentum": 0.8, "nesterov": True}}),
    (("--optimizer", "lion"), {"type": "Lion", "params": {"lr": 0.001, "weight_decay": 0.05, "betas": [0.9, 0.999]}}),
    (("--optimizer", "lamb"), {"type": "Lamb", "params": {"lr": 0.001, "weight_decay": 0.05, "betas": [0.9, 0.999],
                                                          "eps": 1e-8}}),
])
def test_the_optimizer_flags_name_the_optimizer_deepspeed_builds(argv, optimizer):
    config = build(*argv)
    assert config["optimizer"] == optimizer and config["zero_allow_untested_optimizer"] is True
    # a JSON's SGD section takes the flags given, keeps its own values otherwise
    json_sgd = {"optimizer": {"type": "sgd", "params": {"momentum": 0.5}}}
    assert build("--nesterov", "--optimizer", "sgd", base=json_sgd)["optimizer"]["params"]["momentum"] == 0.5
    assert build("--nesterov", base=json_sgd)["optimizer"]["params"]["nesterov"] is True  # the JSON's SGD takes it
    assert build("--momentum", "0.7", "--optimizer", "sgd", base=json_sgd)["optimizer"]["params"]["momentum"] == 0.7


@pytest.mark.parametrize("argv, base, message", [
    (("--optimizer", "sgd"), {"optimizer": {"type": "AdamW"}}, "--optimizer sgd and the JSON's optimizer.type AdamW"),
    (("--momentum", "0.5"), None, "--momentum is SGD's, and this run's optimizer is AdamW: use --optimizer sgd"),
    (("--optimizer", "lion", "--nesterov"), None, "--nesterov is SGD's"),
    (("--optimizer", "sgd", "--momentum", "1"), None, "--momentum must be in [0, 1), got 1.0"),
    (("--optimizer", "sgd", "--momentum", "0", "--nesterov"), None, "--nesterov needs a momentum"),
    # one trust ratio over a rank's flattened parameters, not one a layer
    (("--optimizer", "lamb", "--zero_stage", "2"), None, "--optimizer lamb: LAMB scales each layer's step by its own"),
    (("--optimizer", "lamb", "--bf16", "--precision_mode", "half_weights"), None, "and DeepSpeed's bf16 weights)"),
    ((), {"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 1}}, "optimizer.type Lamb: LAMB scales"),
    # the weights' average
    (("--best_on", "ema"), None, "--best_on ema follows the weights' average, which only --model_ema keeps"),
    (("--model_ema", "--model_ema_decay", "1"), None, "--model_ema_decay must be in (0, 1), got 1.0"),
    (("--model_ema", "--model_ema_steps", "0"), None, "--model_ema_steps must be at least 1, got 0"),
    (("--model_ema",), {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "."}}},
     "--model_ema averages the fp32 weights in memory, and zero_optimization.offload_optimizer keeps them on NVMe"),
])
def test_optimizer_flags_that_cannot_be_are_refused(argv, base, message):
    from deepspeed_image_trainer.cli.options import check_values

    with pytest.raises(UsageError, match=re.escape(message)):
        check_values(make_args(*argv))
        build(*argv, base=base)


def test_deepspeeds_cuda_optimizers_are_refused_on_a_cpu():
    from deepspeed_image_trainer.engine.config import built_optimizer

    for kind, stage in (("lamb", "0"), ("lion", "2")):
        config = build("--optimizer", kind, "--zero_stage", stage)
        with pytest.raises(UsageError, match=f"^--optimizer {kind}: optimizer .* a CUDA op: it needs a GPU"):
            built_optimizer(config, f"--optimizer {kind}", "cpu")
    built_optimizer(build("--optimizer", "lion", "--zero_stage", "2", "--offload_optimizer"), "x", "cpu")  # CPU Lion


@pytest.mark.parametrize("zero, message", [
    ({"stage": 2, "cpu_offload": True}, "zero_optimization.cpu_offload is DeepSpeed's old name"),  # a rank's ValueError
    ({"stage": 0, "cpu_offload": True}, "use offload_optimizer"),  # offload at ZeRO-0 got past the check
    ({"stage": 1, "cpu_offload_param": True}, "zero_optimization.cpu_offload_param is DeepSpeed's old name"),
])
def test_deepspeeds_old_offload_keys_are_refused_with_their_new_names(zero, message):
    with pytest.raises(UsageError, match=message):
        build(base={"zero_optimization": zero})


def test_the_optimizers_given_betas_and_eps_are_ones_deepspeed_builds():
    """OPTIMIZER_SETTINGS named DeepSpeed's 1-bit optimizers, which DeepSpeed 0.19 no longer has (refused)."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    assert set(OPTIMIZER_SETTINGS) <= set(DEEPSPEED_OPTIMIZERS)


def test_json_sections_without_a_type_take_the_flags_types():
    config = build(base={"optimizer": {"params": {"lr": 0.01}}, "scheduler": {"params": {"warmup_num_steps": 5}}})
    assert config["optimizer"]["type"] == "AdamW" and config["optimizer"]["params"]["lr"] == 0.01
    assert config["scheduler"]["type"] == build()["scheduler"]["type"]
    assert config["scheduler"]["params"]["warmup_num_steps"] == 5


@pytest.mark.parametrize("world_size", [1, 2, 8])
@pytest.mark.parametrize("micro, accumulation", [(1, 1), (16, 1), (4, 8)])
def test_train_batch_size_is_consistent(world_size, micro, accumulation):
    config = build("--batch_size", str(micro), "--gradient_accumulation_steps", str(accumulation),
                   world_size=world_size, images=10_000)
    assert config["train_batch_size"] == micro * accumulation * world_size
    expected_steps = steps_per_epoch(10_000, world_size, micro, accumulation)
    assert config["scheduler"]["params"]["total_num_steps"] == 50 * expected_steps


def test_steps_per_epoch_drops_partial_batches():
    assert steps_per_epoch(100, world_size=3, micro_batch_size=4, gradient_accumulation_steps=2) == 4  # 33 -> 8 -> 4
    assert steps_per_epoch(7, 1, 8, 1) == 0


def test_too_few_images_is_a_usage_error():
    with pytest.raises(UsageError, match="too few"):
        build("--batch_size", "64", images=100, world_size=2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision_flag", [None, "--fp16", "--bf16"])
@pytest.mark.parametrize("offload_optimizer", [False, True])
@pytest.mark.parametrize("offload_param", [False, True])
def test_every_flag_combination(stage, precision_flag, offload_optimizer, offload_param):
    argv = ["--zero_stage", str(stage)] + ([precision_flag] if precision_flag else [])
    argv += ["--offload_optimizer"] * offload_optimizer + ["--offload_param"] * offload_param
    if (offload_param and stage != 3) or (offload_optimizer and stage == 0):
        with pytest.raises(UsageError, match="offload_(param|optimizer) needs ZeRO stage"):
            build(*argv)
        return
    config = build(*argv)
    zero = config["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) == offload_optimizer
    assert ("offload_param" in zero) == offload_param
    for key in ("offload_optimizer", "offload_param"):
        if key in zero:
            assert zero[key] == {"device": "cpu", "pin_memory": True}
    assert precision(config) == (precision_flag or "--fp32")[2:]
    if precision_flag == "--fp16":
        assert config["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    # torch's AdamW (no compiled op), but for a GPU's optimizer offloaded to the CPU: DeepSpeed's CPUAdam.
    assert config["optimizer"]["params"]["torch_adam"] is True
    on_gpu = build(*argv, device_type="cuda")
    assert on_gpu["optimizer"]["params"].get("torch_adam", False) == (not offload_optimizer)


def test_fp16_and_bf16_together_is_a_usage_error():
    with pytest.raises(UsageError, match="both enabled"):
        build("--fp16", "--bf16")


def test_base_json_values_win_over_flag_defaults_and_lose_to_explicit_flags():
    base = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 1, "overlap_comm": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    config = build(world_size=2, base=base)
    assert config["train_micro_batch_size_per_gpu"] == 8
    assert config["train_batch_size"] == 8 * 2 * 2
    assert config["zero_optimization"] == {"stage": 1, "overlap_comm": True, "contiguous_gradients": True,
                                           "compute_grad_norm": False}
    assert config["optimizer"]["params"]["lr"] == 0.01
    config = build("--batch_size", "4", "--zero_stage", "3", "--learning_rate", "0.5", world_size=2, base=base)
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["train_batch_size"] == 4 * 2 * 2
    assert config["zero_optimization"]["stage"] == 3
    assert config["optimizer"]["params"]["lr"] == 0.5
    assert base["zero_optimization"]["stage"] == 1  # the base itself is not modified


def test_train_batch_size_in_base_must_match_micro_batch_accumulation_and_ranks():
    base = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16}
    assert build(world_size=4, base=base)["train_batch_size"] == 16 * 1 * 4
    with pytest.raises(UsageError, match=r"train_batch_size 64 in the DeepSpeed config is not micro-batch 16 x 1 "
                                         r"accumulation step\(s\) x 2 rank\(s\) = 32: set it to \"auto\""):
        build(world_size=2, base=base)


def test_auto_values_are_resolved_from_flags():
    base = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": True},
    }
    config = build("--batch_size", "10", "--gradient_accumulation_steps", "3", "--bf16",
                   "--learning_rate", "0.02", "--warmup_epochs", "2", world_size=2, images=600, base=base)
    assert "auto" not in json.dumps(config)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (10, 3, 60)
    assert config["gradient_clipping"] == 0.0  # "auto": --clip_grad
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert config["optimizer"]["params"] == {"lr": 0.02, "betas": [0.9, 0.999], "eps": 1e-8,
                                             "weight_decay": 0.05, "torch_adam": True, "fused": True}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                             "warmup_num_steps": 20}  # 600 / 2 / 10 / 3 = 10 steps x 2
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (500_000_000, 50_000_000, 100_000)


def test_unknown_auto_is_a_usage_error():
    with pytest.raises(UsageError, match='"auto" for wall_clock_breakdown'):
        build(base={"wall_clock_breakdown": "auto"})


def test_explicit_precision_flag_replaces_the_base_precision():
    base = {"fp16": {"enabled": True, "loss_scale_window": 500}}
    assert precision(build(base=base)) == "fp16"
    config = build("--bf16", base=base)
    assert precision(config) == "bf16"
    assert config["fp16"] == {"enabled": False, "loss_scale_window": 500}
    assert precision(build("--no-fp16", base=base)) == "fp32"


def test_explicit_no_offload_removes_the_base_offload():
    base = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    assert "offload_optimizer" in build(base=base)["zero_optimization"]
    assert "offload_optimizer" not in build("--no-offload_optimizer", base=base)["zero_optimization"]
    with pytest.raises(UsageError, match="needs ZeRO stage 1, 2 or 3"):
        build("--zero_stage", "0", base=base)


def test_lower_stage_than_base_drops_disabled_param_offload():
    base = {"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}}
    assert "offload_param" not in build("--zero_stage", "2", base=base)["zero_optimization"]


def test_fp16_on_cpu_is_refused_with_a_hint():
    with pytest.raises(UsageError, match="fp16 needs a GPU.*--bf16"):
        check_device_support(build("--fp16"), "cpu")
    check_device_support(build("--fp16"), "cuda")
    check_device_support(build("--bf16"), "cpu")


def test_reference_zero2_config():
    base = load_base_config(ROOT / "ds_config_zero2.json")
    config = build_ds_config(make_args(), 2, 1000, base=base, num_params=11_000_000)
    zero = config["zero_optimization"]
    assert zero["stage"] == 2
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 11_000_000
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    for key in ("allgather_partitions", "overlap_comm", "reduce_scatter", "contiguous_gradients"):
        assert zero[key] is True
    assert config["fp16"]["enabled"] is True
    assert (config["fp16"]["loss_scale"], config["fp16"]["initial_scale_power"]) == (0, 16)
    assert config["train_batch_size"] == 16 * 2
    assert "auto" not in json.dumps(config)


def test_reference_zero3_config():
    base = load_base_config(ROOT / "ds_config_zero3.json")
    config = build("--batch_size", "4", base=base)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert zero["offload_optimizer"]["pin_memory"] and zero["offload_param"]["pin_memory"]
    for key in ("overlap_comm", "contiguous_gradients", "stage3_gather_16bit_weights_on_model_save"):
        assert zero[key] is True
    for key in ("sub_group_size", "reduce_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance"):
        assert isinstance(zero[key], int) and zero[key] > 0
    assert (config["fp16"]["loss_scale_window"], config["fp16"]["hysteresis"]) == (1000, 2)
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert "auto" not in json.dumps(config)


@pytest.mark.parametrize("content, message", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"),
                                              ('{"gradient_clipping": 1' + "0" * 5000 + "}", "not valid JSON")])
def test_bad_base_config_is_a_usage_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_base_config(path)
    with pytest.raises(UsageError, match="file not found"):
        load_base_config(tmp_path / "missing.json")


@pytest.mark.parametrize("flag,dtype", [("--bf16", "bfloat16"), ("--fp16", "float16")])
def test_half_precision_runs_under_torch_autocast_on_gpu(flag, dtype):
    config = build(flag, device_type="cuda")
    assert config["torch_autocast"] == {"enabled": True, "dtype": dtype}
    assert "fp16" not in config and "bf16" not in config
    assert precision(config) == f"autocast-{flag[2:]}"
    # On CPU, and on request, DeepSpeed's own half-precision weights.
    assert precision(build(flag, "--precision_mode", "half_weights", device_type="cuda")) == flag[2:]
    assert precision(build("--bf16")) == "bf16"
    assert precision(build("--bf16", "--precision_mode", "autocast")) == "autocast-bf16"


VIT_B_16, VIT_L_16 = 86_000_000, 303_000_000


def test_bf16_with_offload_keeps_half_precision_weights_for_models_of_200m_parameters_and_more():
    # Measured faster there (capacity_8gib); below, and without offload, autocast's fp32 weights on a GPU.
    def form(*argv, num_params=VIT_L_16, **kwargs):
        return precision(build(*argv, device_type="cuda", num_params=num_params, **kwargs))

    assert form("--bf16", "--offload_optimizer") == "bf16"
    assert form("--bf16", "--zero_stage", "3", "--offload_optimizer", "--offload_param", num_params=631_000_000) == "bf16"
    assert form("--bf16", "--offload_optimizer", base={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) == "bf16"
    assert form("--bf16", "--offload_optimizer", num_params=VIT_B_16) == "autocast-bf16"
    assert form("--bf16", "--offload_optimizer", num_params=None) == "autocast-bf16"
    assert form("--bf16", "--zero_stage", "2") == "autocast-bf16"
    assert form("--fp16", "--offload_optimizer") == "autocast-fp16"  # measured for bf16 only
    assert form("--bf16", "--offload_optimizer", "--precision_mode", "autocast") == "autocast-bf16"
    assert form("--bf16", "--no-offload_optimizer", base={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) \
        == "autocast-bf16"


def test_auto_precision_mode_resumes_in_the_checkpoints_form_of_the_same_half():
    def form(*argv, device_type="cuda", num_params=VIT_B_16, **kwargs):
        return precision(build(*argv, device_type=device_type, num_params=num_params, **kwargs))

    assert form("--bf16", resumed_precision="bf16") == "bf16"  # saved on a CPU, resumed on a GPU
    assert form("--bf16", device_type="cpu", resumed_precision="autocast-bf16") == "autocast-bf16"
    assert form("--bf16", "--offload_optimizer", num_params=VIT_L_16, resumed_precision="autocast-bf16") == "autocast-bf16"
    assert form("--bf16", resumed_precision="fp16") == "autocast-bf16"  # another half: the flags decide
    assert form("--bf16", resumed_precision="fp32") == "autocast-bf16"
    assert form("--bf16", "--precision_mode", "autocast", resumed_precision="bf16") == "autocast-bf16"


def test_base_precision_form_is_kept_unless_a_flag_changes_it():
    native = {"fp16": {"enabled": True}}
    assert precision(build(base=native, device_type="cuda")) == "fp16"
    config = build("--bf16", base=native, device_type="cuda")
    assert precision(config) == "autocast-bf16" and config["fp16"]["enabled"] is False
    autocast = {"torch_autocast": {"enabled": True, "dtype": "float16"}}
    assert precision(build(base=autocast)) == "autocast-fp16"
    config = build("--no-fp16", base=autocast)
    assert precision(config) == "fp32" and config["torch_autocast"]["enabled"] is False
    with pytest.raises(UsageError, match="torch_autocast cannot be combined"):
        build(base={**autocast, "bf16": {"enabled": True}})
    with pytest.raises(UsageError, match="torch_autocast dtype"):
        build(base={"torch_autocast": {"enabled": True, "dtype": "int8"}})


def test_gradient_norm_is_computed_only_when_something_uses_it():
    assert build("--bf16", "--zero_stage", "2", device_type="cuda")["zero_optimization"]["compute_grad_norm"] is False
    clipped = build("--bf16", "--zero_stage", "2", "--clip_grad", "1", device_type="cuda")
    assert clipped["gradient_clipping"] == 1.0 and "compute_grad_norm" not in clipped["zero_optimization"]
    for argv in (["--offload_optimizer"], ["--zero_stage", "3"], ["--zero_stage", "0"], ["--fp16", "--precision_mode",
                                                                                           "half_weights"]):
        assert "compute_grad_norm" not in build(*argv, device_type="cuda")["zero_optimization"]


@pytest.mark.parametrize("mode, argv, expected", [
    ("auto", ["--zero_stage", "2", "--offload_optimizer", "--gradient_accumulation_steps", "4"], True),
    ("auto", ["--zero_stage", "1", "--offload_optimizer", "--gradient_accumulation_steps", "3", "--bf16"], True),
    ("auto", ["--zero_stage", "2", "--offload_optimizer"], False),  # one micro-batch a step: nothing to coalesce
    ("auto", ["--zero_stage", "2", "--gradient_accumulation_steps", "4"], False),  # no offload: not measured
    ("auto", ["--zero_stage", "3", "--offload_optimizer", "--gradient_accumulation_steps", "4"], False),
    ("auto", ["--gradient_accumulation_steps", "4"], False),  # ZeRO-0 on one rank
    ("off", ["--zero_stage", "2", "--offload_optimizer", "--gradient_accumulation_steps", "4"], False),
    ("on", ["--zero_stage", "3", "--gradient_accumulation_steps", "2"], True),
    ("on", ["--zero_stage", "1", "--gradient_accumulation_steps", "2"], True),
    ("on", ["--zero_stage", "2"], False),
])
def test_the_gradient_reduction_is_coalesced_with_offload_and_accumulation_or_when_asked(mode, argv, expected):
    assert coalesces_grad_reduction(mode, build(*argv)) is expected


def test_coalescing_where_deepspeed_cannot_is_refused():
    with pytest.raises(UsageError, match="--coalesce_grad_reduction on needs --zero_stage 1, 2 or 3"):
        coalesces_grad_reduction("on", build("--zero_stage", "0", "--gradient_accumulation_steps", "2"))
    base = {"data_types": {"grad_accum_dtype": "fp32"}}
    config = build("--zero_stage", "1", "--bf16", "--gradient_accumulation_steps", "2", base=base)
    with pytest.raises(UsageError, match="DeepSpeed does not coalesce ZeRO-1 with bf16 weights"):
        coalesces_grad_reduction("on", config)
    assert coalesces_grad_reduction("auto", config) is False


@pytest.mark.parametrize("stage", ["1", "2"])
def test_zero12_gradients_are_not_copied_contiguous_unless_offloaded_or_set(stage):
    assert build("--zero_stage", stage)["zero_optimization"]["contiguous_gradients"] is False
    # DeepSpeed turns them on under optimizer offload whatever the config says: the config says so too
    assert build("--zero_stage", stage, "--offload_optimizer")["zero_optimization"]["contiguous_gradients"] is True
    # with overlap_comm DeepSpeed's path without them synchronises the device before every bucket
    overlapped = {"zero_optimization": {"stage": int(stage), "overlap_comm": True}}
    assert build(base=overlapped)["zero_optimization"]["contiguous_gradients"] is True
    for value, expected in ((True, True), (False, False), ("auto", False)):
        base = {"zero_optimization": {"stage": int(stage), "contiguous_gradients": value}}
        assert build(base=base)["zero_optimization"]["contiguous_gradients"] is expected
    for argv in (["--zero_stage", "0"], ["--zero_stage", "3"]):  # no such copies to cut there
        assert "contiguous_gradients" not in build(*argv)["zero_optimization"]


def test_zero3_with_half_weights_uses_torchs_linear_unless_autocast_offloaded_params_or_the_config_say_otherwise():
    def linear(*argv, base=None):
        return build("--zero_stage", "3", *argv, base=base)["zero_optimization"].get("memory_efficient_linear")

    assert linear("--bf16", "--precision_mode", "half_weights") is False
    for argv in (["--bf16", "--precision_mode", "autocast"], [], ["--bf16", "--precision_mode", "half_weights",
                                                                  "--offload_param", "--offload_optimizer"]):
        assert linear(*argv) is None  # DeepSpeed's default (true): it saves memory there
    for value, expected in ((True, True), ("auto", False)):
        assert linear("--bf16", base={"zero_optimization": {"memory_efficient_linear": value}}) is expected
    assert "memory_efficient_linear" not in build("--zero_stage", "2", "--bf16")["zero_optimization"]


def test_step_syncs_and_zero3_hooks_are_cut_unless_the_base_config_sets_them():
    assert build()["timers"] == {"throughput": {"enabled": False}}  # no device sync at each step's start and end
    assert build(base={"timers": {"throughput": {"enabled": True}}})["timers"]["throughput"]["enabled"] is True
    zero3 = build("--zero_stage", "3")["zero_optimization"]
    assert zero3["leaf_module"] == {"classes": list(BLOCKS)} and "torchvision.models.resnet.BasicBlock" in \
        BLOCKS and zero3["stage3_module_granularity_threshold"] == 0
    assert not {"stage3_module_granularity_threshold", "leaf_module"} & set(build("--zero_stage", "2")["zero_optimization"])
    assert "leaf_module" not in build("--zero_stage", "3", "--model", "vgg11")["zero_optimization"]  # no blocks
    for value, expected in ((200_000, 200_000), ("auto", 0)):
        base = {"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": value}}
        assert build(base=base)["zero_optimization"]["stage3_module_granularity_threshold"] == expected
    own = {"names": ["layer1"]}  # a config's own leaf modules are kept, none added
    assert build(base={"zero_optimization": {"stage": 3, "leaf_module": own}})["zero_optimization"]["leaf_module"] == own


def test_deepcompile_gets_zero3_without_leaf_modules_and_the_trainer_refuses_it():
    deepcompile = {"compile": {"deepcompile": True}}
    args = make_args("--zero_stage", "3", "--compile")
    config = build_ds_config(args, 1, 1000, base=deepcompile, device_type="cuda")
    assert "leaf_module" not in config["zero_optimization"]  # DeepSpeed's default classes match no torchvision module
    with pytest.raises(UsageError, match="DeepCompile .* is not supported: .* failed in validation.*--no-compile"):
        check_trainer_support(config, args)
    # without --compile DeepCompile never runs: the trainer's leaf modules stay, and nothing is refused
    args = make_args("--zero_stage", "3")
    config = build_ds_config(args, 1, 1000, base=deepcompile, device_type="cuda")
    assert "leaf_module" in config["zero_optimization"]
    check_trainer_support(config, args)
    check_trainer_support(build("--compile"), make_args("--compile"))  # torch.compile alone


def scheduled_lrs(config, steps):
    """The learning rate DeepSpeed's scheduler of `config` sets at each of `steps` optimizer steps."""
    import torch
    from deepspeed.runtime import lr_schedules

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config["optimizer"]["params"]["lr"])
    scheduler = getattr(lr_schedules, config["scheduler"]["type"])(optimizer, **config["scheduler"]["params"])
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return lrs


@pytest.mark.parametrize("schedule, kind, final_fraction", [
    ("cosine", "WarmupCosineLR", 0.01), ("linear", "WarmupDecayLR", 0.0), ("constant", "WarmupLR", 1.0)])
def test_lr_schedule_picks_the_deepspeed_scheduler(schedule, kind, final_fraction):
    # 1000 images // 16 = 62 steps per epoch; 10 epochs; 2 warmup epochs = 124 steps
    config = build("--lr_schedule", schedule, "--learning_rate", "0.02", "--warmup_epochs", "2", "--epochs", "10")
    assert config["scheduler"]["type"] == kind and lr_schedule(config) == schedule
    params = config["scheduler"]["params"]
    assert params["warmup_num_steps"] == 124 and params["warmup_type"] == "linear"
    assert params.get("total_num_steps") == (None if schedule == "constant" else 620)
    lrs = scheduled_lrs(config, 620)
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(0.02, rel=1e-3)
    assert 124 <= lrs.index(max(lrs)) <= 125  # the peak, --learning_rate, where the 124 warmup steps end
    assert lrs[-1] == pytest.approx(0.02 * final_fraction, abs=1e-4)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_without_warmup_the_first_step_trains_at_the_peak(schedule):
    # DeepSpeed warms up for 2 steps at least; the first was at lr 0, so a one-step run learnt nothing.
    config = build("--lr_schedule", schedule, "--learning_rate", "0.02", "--warmup_epochs", "0", "--epochs", "10")
    lrs = scheduled_lrs(config, 620)
    assert lrs[:2] == [0.02, 0.02] and lrs[-1] == pytest.approx({"cosine": 0.0002, "linear": 0.0}.get(schedule, 0.02),
                                                                 abs=1e-4)
    assert lrs == sorted(lrs, reverse=True)


def test_the_schedule_sized_again_follows_the_steps_that_run_and_keeps_the_jsons_numbers():
    """The training script sizes the scheduler again once the decode has counted the images that train."""
    args = make_args("--epochs", "10", "--warmup_epochs", "0.1")
    config = build_ds_config(args, 1, 1000, base={})  # 62 steps per epoch
    assert config["scheduler"] == resolve_scheduler({}, args, 0.001, 62)
    params = config["scheduler"]["params"]
    assert (params["total_num_steps"], params["warmup_num_steps"], params["warmup_type"]) == (620, 6, "linear")
    fewer = resolve_scheduler({}, args, 0.001, 61)["params"]
    assert (fewer["total_num_steps"], fewer["warmup_num_steps"], fewer["warmup_type"]) == (610, 6, "linear")
    # What the count decides besides the totals follows it too: 4 steps per epoch leave no warmup step.
    assert resolve_scheduler({}, args, 0.001, 4)["params"] == {
        "total_num_steps": 40, "warmup_num_steps": 1, "warmup_type": "log", "last_batch_iteration": 0,
        "warmup_min_ratio": 0.0, "cos_min_ratio": 0.01}
    base = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500, "warmup_num_steps": "auto"}}}
    assert build_ds_config(args, 1, 1000, base=base)["scheduler"]["params"]["total_num_steps"] == 500
    assert resolve_scheduler(base, args, 0.02, 61)["params"] == {
        "total_num_steps": 500, "warmup_num_steps": 6, "warmup_min_lr": 0.0, "warmup_max_lr": 0.02}
    assert base["scheduler"]["params"]["warmup_num_steps"] == "auto"  # the base is read, never written


def test_a_scheduler_built_again_runs_the_schedule_a_first_build_would():
    """deepspeed.initialize's scheduler has set the rate to its start (0) by the time the decode has counted the
    images; the one built again for the steps that run must still take --learning_rate as its peak."""
    import types

    import torch
    from deepspeed.runtime import lr_schedules

    from deepspeed_image_trainer.engine.loop import replace_lr_scheduler

    args = make_args("--learning_rate", "0.02", "--epochs", "2")
    config = build_ds_config(args, 1, 160, base={})  # 10 steps per epoch, by the data check's count
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.02)
    engine = types.SimpleNamespace(optimizer=optimizer, lr_scheduler=lr_schedules.WarmupCosineLR(
        optimizer, **config["scheduler"]["params"]))
    assert optimizer.param_groups[0]["lr"] == 0.0
    section = resolve_scheduler({}, args, 0.02, 9)  # 9 once the decode has left images out
    replace_lr_scheduler(engine, section, 0.02)
    lrs = []
    for _ in range(18):
        lrs.append(optimizer.param_groups[0]["lr"])
        engine.lr_scheduler.step()
    assert engine.lr_scheduler.total_num_steps == 18
    assert lrs == scheduled_lrs({"optimizer": config["optimizer"], "scheduler": section}, 18)
    assert max(lrs) > 0.019 and optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * 0.01)  # peak, then 1% of it


def test_lr_schedule_flag_and_base_scheduler():
    constant = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    config = build(base=constant)
    assert lr_schedule(config) == "constant"  # no flag: the base's scheduler
    assert config["scheduler"]["params"] == {"warmup_num_steps": 5, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001}
    assert build("--lr_schedule", "cosine", base=constant)["scheduler"]["type"] == "WarmupCosineLR"
    custom = {"scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.1}}}
    assert build("--lr_schedule", "cosine", base=custom)["scheduler"]["params"]["cos_min_ratio"] == 0.1
    assert lr_schedule(build(base={"scheduler": {"type": "OneCycle", "params": {}}})) == "OneCycle"


def test_monitor_flags_add_deepspeed_monitor_sections():
    config = build()
    assert "tensorboard" not in config and "csv_monitor" not in config
    config = build("--tensorboard", "--csv_monitor", "--log_dir", "runs/a")
    for name in ("tensorboard", "csv_monitor"):
        assert config[name] == {"enabled": True, "output_path": f"runs/a/{name}", "job_name": "train"}
    # A base JSON's monitor is kept, "auto" filled in, and an explicit --no-... switches it off.
    base = {"csv_monitor": {"enabled": True, "output_path": "elsewhere", "job_name": "mine"},
            "tensorboard": {"enabled": "auto", "output_path": "auto"}}
    config = build(base=base)
    assert config["csv_monitor"] == base["csv_monitor"]
    assert config["tensorboard"] == {"enabled": False, "output_path": "logs/tensorboard"}
    config = build("--tensorboard", "--no-csv_monitor", base=base)
    assert config["tensorboard"] == {"enabled": True, "output_path": "logs/tensorboard", "job_name": "train"}
    assert config["csv_monitor"]["enabled"] is False


def test_launcher_config_rebuilt_by_the_training_script_is_unchanged():
    """The launcher writes the config; the training script rebuilds it from that file and the same flags."""
    argv = ("--lr_schedule", "linear", "--csv_monitor", "--tensorboard", "--label_smoothing", "0.1",
            "--early_stopping_patience", "3", "--log_dir", "runs/b")
    config = build(*argv)
    assert build(*argv, base=json.loads(json.dumps(config))) == config


def test_tensorboard_without_the_package_is_a_usage_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # find_spec then reports it missing
    check_monitor_support(build("--csv_monitor"))
    with pytest.raises(UsageError, match="the tensorboard monitor needs the tensorboard package: pip install tensorboard"):
        check_monitor_support(build("--tensorboard"))


@pytest.mark.parametrize("section", ["tensorboard", "csv_monitor"])
def test_a_monitor_needs_an_output_path_and_may_write_in_it_itself(section, tmp_path, monkeypatch):
    """output_path "" with job_name "" failed at every rank's engine start, in DeepSpeed's os.makedirs('');
    job_name "" with an output_path writes in output_path itself."""
    import importlib.machinery
    import sys
    import types

    installed = types.ModuleType("tensorboard")  # find_spec then finds it, whether or not it is installed
    installed.__spec__ = importlib.machinery.ModuleSpec("tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard", installed)
    for job_name in ("", "x"):
        with pytest.raises(UsageError, match=f"^{section}.output_path is empty: give a folder, or leave output_path "
                                             rf"out \(the monitor then writes in --log_dir's {section}\)$"):
            check_monitor_support(build(base={section: {"enabled": True, "output_path": "", "job_name": job_name}}))
    check_monitor_support(build(base={section: {"enabled": True, "output_path": str(tmp_path), "job_name": ""}}))
    check_monitor_support(build(base={section: {"enabled": False, "output_path": "", "job_name": ""}}))


def test_launcher_refuses_tensorboard_without_the_package_before_starting(tiny_data, tmp_path, monkeypatch, capsys):
    import runpy
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["launch_deepspeed.py", *data_args(tiny_data), "--tensorboard", "--dry_run"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "launch_deepspeed.py"), run_name="__main__")
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""  # stopped before the dry run's printout
    assert err.count("\n") == 1 and err.startswith("error: ") and "pip install tensorboard" in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("argv, message", [
    (["--early_stopping_patience", "-1"], "--early_stopping_patience must not be negative, got -1"),
    (["--label_smoothing", "1"], "--label_smoothing must be in [0, 1), got 1.0"),
    (["--label_smoothing", "-0.1"], "--label_smoothing must be in [0, 1), got -0.1"),
    (["--weight_decay", "inf"], "--weight_decay must be a finite number, got inf"),
    (["--image_size", "0"], "--image_size must be at least 1"),
    (["--device_train_size", "0"], "--device_train_size must be at least 1, got 0"),
])
def test_bad_training_flag_values_are_usage_errors(argv, message):
    with pytest.raises(UsageError) as error:
        make_args(*argv)
    assert str(error.value) == message


def test_a_bad_choice_is_refused_by_argparse_with_status_2(capsys):
    with pytest.raises(SystemExit) as exited:
        make_args("--lr_schedule", "step")
    assert exited.value.code == 2 and "invalid choice: 'step'" in capsys.readouterr().err


def test_unset_zero_buckets_are_capped_at_the_model_size():
    # DeepSpeed allocates its buckets at full size: 2 x 5e8 fp32 elements (3.7 GiB) for an 11 M-parameter model
    args = make_args("--zero_stage", "2")
    config = build_ds_config(args, 1, 1000, num_params=11_000_000)
    assert config["zero_optimization"]["reduce_bucket_size"] == 11_000_000
    assert config["zero_optimization"]["allgather_bucket_size"] == 11_000_000
    zero3 = build_ds_config(make_args("--zero_stage", "3"), 1, 1000, num_params=11_000_000)["zero_optimization"]
    assert zero3["stage3_prefetch_bucket_size"] == 11_000_000  # DeepSpeed's 5e7 is larger than the model
    # wide_resnet101_2: a 125 M-element fp32 bucket (0.47 GiB) in backward took what optimizer offload saved
    wide = build_ds_config(args, 1, 1000, num_params=125_022_106)["zero_optimization"]
    assert wide["reduce_bucket_size"] == wide["allgather_bucket_size"] == 50_000_000
    huge = build_ds_config(make_args("--zero_stage", "3"), 1, 1000, num_params=10**10)["zero_optimization"]
    assert huge["reduce_bucket_size"] == huge["stage3_prefetch_bucket_size"] == 50_000_000


def test_buckets_the_config_sets_are_kept():
    base = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 200_000_000, "allgather_bucket_size": "auto"}}
    zero = build_ds_config(make_args(), 1, 1000, base=base, num_params=11_000_000)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 200_000_000 and zero["allgather_bucket_size"] == 11_000_000
    assert "reduce_bucket_size" not in build("--zero_stage", "2")["zero_optimization"]  # no model size: DeepSpeed's


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("num_classes", range(1, 10))
def test_model_sized_buckets_are_valid_for_every_class_count(stage, num_classes):
    """ResNet18 has 11,176,512 + 513 x classes parameters: odd for odd class counts, and ZeRO-1/2 assert
    an even allgather bucket."""
    from deepspeed_image_trainer.models.build import ResNet18Animals90

    num_params = sum(p.numel() for p in ResNet18Animals90(num_classes=num_classes).parameters())
    assert num_params == num_parameters(num_classes)  # the launcher's count, without building the model
    zero = build_ds_config(make_args("--zero_stage", str(stage)), 1, 1000, num_params=num_params)["zero_optimization"]
    buckets = [zero[key] for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")]
    assert all(bucket % 2 == 0 and num_params <= bucket <= num_params + 1 for bucket in buckets)


def test_an_odd_allgather_bucket_in_the_json_is_a_usage_error():
    base = {"zero_optimization": {"stage": 2, "allgather_bucket_size": 11_177_025}}
    with pytest.raises(UsageError, match="allgather_bucket_size must be a multiple of 2"):
        build_ds_config(make_args(), 1, 1000, base=base, num_params=11_000_000)


@pytest.mark.slow
def test_the_launcher_imports_neither_torchvision_nor_deepspeed_and_its_dry_run_not_torchs_compiler(tiny_data, tmp_path):
    """Each costs seconds before the first step (torchvision 1-2 s, DeepSpeed 2-3 s); torch._dynamo took a second
    of every launch (torch.optim's wrapper imports it where the launcher checks the optimizer's settings): the
    training processes import them anyway. Checked in a fresh interpreter: the import, then a dry run."""
    import subprocess
    import sys

    argv = [*data_args(tiny_data), "--dry_run", "--log_dir", str(tmp_path / "logs")]
    code = ("import sys; sys.argv = ['launch_deepspeed.py']; import launch_deepspeed; "
            "print(sorted(m for m in ('torchvision', 'deepspeed') if m in sys.modules)); "
            f"launch_deepspeed.main({argv!r}); print('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "[]" and lines[-1] == "False", result.stdout[-2000:] + result.stderr[-2000:]


def test_image_suffixes_are_torchvisions():
    from torchvision.datasets.folder import IMG_EXTENSIONS

    from deepspeed_image_trainer.data import check as data_check

    assert data_check.IMG_EXTENSIONS == IMG_EXTENSIONS


@pytest.mark.parametrize("argv, world_size, resumed, stage", [
    ([], 1, None, 0), ([], 4, None, 2), (["--offload_optimizer"], 1, None, 2),
    (["--offload_optimizer", "--offload_param"], 1, None, 3), ([], 1, 2, 2),  # resuming an earlier ZeRO-2 run
    (["--zero_stage", "1"], 1, 2, 1), (["--zero_stage", "auto"], 8, 0, 0)])
def test_zero_stage_auto(argv, world_size, resumed, stage):
    config = build_ds_config(make_args(*argv), world_size, 1000, resumed_stage=resumed)
    assert config["zero_optimization"]["stage"] == stage
    base = {"zero_optimization": {"stage": 3}}  # a JSON's stage wins over the flag's default
    assert build_ds_config(make_args(), world_size, 1000, base=base)["zero_optimization"]["stage"] == 3


def test_a_bad_zero_stage_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exited:
        make_args("--zero_stage", "4")
    assert exited.value.code == 2 and "invalid choice: '4' (choose from auto, 0, 1, 2, 3)" in capsys.readouterr().err


def test_fp32_gradient_accumulation_with_optimizer_offload_and_half_weights_is_refused():
    # DeepSpeed would skip every step after the first with inf/nan gradients (test_deepspeed_overrides.py)
    offload = ["--offload_optimizer", "--bf16", "--precision_mode", "half_weights"]
    for stage in ("1", "2"):
        with pytest.raises(UsageError, match="DeepSpeed then skips every step after the first one with inf/nan"):
            build("--zero_stage", stage, *offload, base={"data_types": {"grad_accum_dtype": "float32"}})
    for argv in (["--zero_stage", "2", "--bf16", "--precision_mode", "half_weights"],  # no offload: it recovers
                 ["--zero_stage", "2", "--offload_optimizer", "--bf16", "--precision_mode", "autocast"],  # fp32 weights
                 ["--zero_stage", "3", *offload]):
        fp32 = {"grad_accum_dtype": "fp32"}
        assert build(*argv, base={"data_types": fp32})["data_types"] == fp32
    bf16 = {"grad_accum_dtype": "bf16"}  # DeepSpeed's own choice with bf16 weights, named
    assert build("--zero_stage", "2", *offload, base={"data_types": bf16})["data_types"] == bf16


@pytest.mark.parametrize("argv, ranks, hint", [
    (["--batch_size", "64"], 1, "; lower --batch_size"),
    (["--gradient_accumulation_steps", "1000000"], 1, "; lower --batch_size or --gradient_accumulation_steps"),
    (["--batch_size", "2"], 32, "; lower --batch_size, or use fewer ranks"),
    (["--batch_size", "2"], 64, "; use fewer ranks (--num_gpus, --num_nodes)"),  # 50 images: one a rank is too many
    (["--batch_size", "1"], 64, "; use fewer ranks (--num_gpus, --num_nodes)")])
def test_a_training_set_too_small_for_one_step_names_the_flags_to_lower(argv, ranks, hint):
    with pytest.raises(UsageError, match=f"the training set has 50 images: too few for {ranks} rank") as refused:
        build(*argv, images=50, world_size=ranks)
    assert str(refused.value).endswith(hint)


def sgd_steps(config):
    """3 steps of a real engine of `config` (in a process group of one): whether each parameter moved and the
    last loss. test_finetune's rank runs it for the config the trainer builds for a JSON's SGD at ZeRO-2 with
    offload (test_sgd_from_the_json_trains_under_zero_with_offload there): DeepSpeed refuses an optimizer it has
    not listed under ZeRO unless the config allows it."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    before = [p.detach().clone() for p in model.parameters()]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(engine(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0]))
        engine.backward(loss)
        engine.step()
    return {"moved": [not torch.equal(a, b.detach()) for a, b in zip(before, engine.module.parameters())],
            "loss": loss.item()}


def test_nvme_offload_is_refused_where_deepspeed_cannot_build_its_async_io_op(tmp_path, monkeypatch):
    """The engine's start failed in every rank with a RuntimeError traceback (no libaio) after the launcher let it
    through; an nvme_path under a file is refused too."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from deepspeed_image_trainer.engine.config import build_ds_config, check_with_deepspeed

    (tmp_path / "a_file").write_text("")

    def checked(nvme_path):
        config = build_ds_config(parse_args(lambda: add_training_args(argparse.ArgumentParser()), []), 1, 64,
                                 base={"zero_optimization": {"stage": 3, "offload_param": {
                                     "device": "nvme", "nvme_path": str(nvme_path)}}}, device_type="cpu")
        check_with_deepspeed(config, "x.json", "cpu")

    with pytest.raises(UsageError, match="^--deepspeed_config x.json: zero_optimization.offload_param.nvme_path .*a_file is not a folder"):
        checked(tmp_path / "a_file" / "swap")
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=True: False)
    with pytest.raises(UsageError, match=r"^--deepspeed_config x.json: zero_optimization.offload_param to nvme needs DeepSpeed's "
                                         r"async_io op, which cannot be built on this machine"):
        checked(tmp_path / "swap")
