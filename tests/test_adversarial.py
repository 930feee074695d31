"""Hostile and unlucky input: every case runs, or stops before anything starts with one `error:` line and
exit status 2, and nothing already written changes. Mostly in process; the runs they read are the
session's trained ones."""
import functools
import json
import os
import re
import random
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torchvision

import memory_profile
from deepspeed_image_trainer.cli import launch as launch_deepspeed
from deepspeed_image_trainer.cli import train as train_deepspeed
from deepspeed_image_trainer.cli.options import run_cli
from deepspeed_image_trainer.data import prepare as prepare_data
from deepspeed_image_trainer.data.cache import open_entry
from deepspeed_image_trainer.data.check import CACHE_DIR_ENV, cache_path, check_folders, load_cache
from deepspeed_image_trainer.data.folders import ImageFiles
from deepspeed_image_trainer.data.prepare import make_sample_dataset
from deepspeed_image_trainer.engine.config import load_base_config
from deepspeed_image_trainer.inference import evaluate
from deepspeed_image_trainer.inference import export as export_model
from deepspeed_image_trainer.inference import predict
from deepspeed_image_trainer.inference.load import load_model
from deepspeed_image_trainer.outputs import plots as utils
from deepspeed_image_trainer.outputs.checkpoints import read_info
from deepspeed_image_trainer.outputs.history import TrainingHistory
from deepspeed_image_trainer.utils.failures import UsageError, usable_cores

from conftest import (TINY_CLASSES, TRAINED_EPOCHS, Payload, assert_usage_error_in_process, data_args, digests, launch,
                      spawn_ranks)


@functools.cache
def resnet18_tensors():
    """ResNet18's state_dict, built once (each case of the test below built it: a third of its time)."""
    return torchvision.models.resnet18().state_dict()


# --- flags and DeepSpeed JSON, refused by the launcher before anything starts -------------------------------

JSON = {"OPTIMIZER_TYPE": {"optimizer": {"type": 5}},
        "BUCKET_WORDS": {"zero_optimization": {"stage": 2, "reduce_bucket_size": "lots"}},
        "UNKNOWN_ZERO_KEY": {"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5}},
        "NO_SUCH_SCHEDULER": {"scheduler": {"type": "NoSuchLR"}},
        "NO_SUCH_OPTIMIZER": {"optimizer": {"type": "NoSuchOpt"}},
        "BF16_MAYBE": {"bf16": {"enabled": "maybe"}},
        # what DeepSpeed's config models let through and its engine then fails to build, in every rank
        "SGD_NO_SUCH_PARAM": {"optimizer": {"type": "SGD", "params": {"lr": 0.01, "nesterov_x": True}}},
        "BETAS_WORDS": {"optimizer": {"type": "AdamW", "params": {"betas": "x"}}},
        "WARMUP_WORDS": {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "ten"}}},
        "ONECYCLE_BARE": {"scheduler": {"type": "OneCycle", "params": {}}},
        "STEPLR_BARE": {"scheduler": {"type": "StepLR"}},
        "LAMB": {"optimizer": {"type": "Lamb"}},
        "LION": {"optimizer": {"type": "Lion"}},
        "MUADAM": {"optimizer": {"type": "MuAdam"}},
        "ONEBIT_ADAM": {"optimizer": {"type": "OneBitAdam"}},  # gone from DeepSpeed 0.19
        "NVME_NO_PATH": {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
        "TOTAL_NEGATIVE": {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": -5}}},
        "STEPS_WORDS": {"steps_per_print": "x"},
        "STEPLR_GAMMA_WORDS": {"scheduler": {"type": "StepLR", "params": {"step_size": 5, "gamma": "x"}}},
        "ONECYCLE_WORDS": {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "x", "cycle_max_lr": 0.1}}},
        "BETAS_SHORT": {"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
        "SCHEDULER_MODULE": {"scheduler": {"type": "math", "params": {"a": 1}}},
        "ACCUM_DTYPE_CAPS": {"data_types": {"grad_accum_dtype": "FP32"}},
        "DATA_TYPES_NUMBER": {"data_types": 5},
        "LR_INFINITE": {"optimizer": {"type": "AdamW", "params": {"lr": 1e999}}},
        "CLIP_NAN": {"gradient_clipping": float("nan")},
        "ZERO_TYPO": {"zero_optimisation": {"stage": 3}},
        "STAGE_TRUE": {"zero_optimization": {"stage": True}},  # equal to 1, and its checkpoints then unusable
        "ACCUM_FP32": {"data_types": {"grad_accum_dtype": "fp32"}},
        "QUANTIZED_WEIGHTS": {"zero_optimization": {"stage": 3, "zero_quantized_weights": "true"}},
        "QUANTIZED_GRADIENTS": {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
        "RANGE_TEST_NEGATIVE": {"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": -1}}},
        "COSINE_SHORT": {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1}}},
        "CSV_IN_CHECKPOINT": {"csv_monitor": {"enabled": True, "output_path": "ck/epoch_2", "job_name": "j"}},
        "STEPLR_NEGATIVE": {"scheduler": {"type": "StepLR", "params": {"step_size": 4, "gamma": -1}}},
        "POLY_NEGATIVE_POWER": {"scheduler": {"type": "PolynomialLR", "params": {"total_iters": 5, "power": -1}}},
        "PREDIVIDE": {"gradient_predivide_factor": 2.0},
        # DeepSpeed divides the gradients by it: 0 ended the first backward in a ZeroDivisionError
        "PREDIVIDE_ZERO": {"gradient_predivide_factor": 0},
        "PREDIVIDE_WORD": {"gradient_predivide_factor": "2"},
        "PREDIVIDE_NEGATIVE": {"gradient_predivide_factor": -2.0},
        # what passed every check and failed in every rank: Muon's first step on a conv weight, the monitor's
        # package or folder, DeepSpeed's batch check over a sequence-parallel group
        "MUON": {"optimizer": {"type": "Muon", "params": {}}},
        "WANDB": {"wandb": {"enabled": True}},
        "CSV_PROC": {"csv_monitor": {"enabled": True, "output_path": "/proc/nope", "job_name": "x"}},
        # DeepSpeed joins output_path and job_name: the monitor wrote outside output_path
        "CSV_JOB_UP": {"csv_monitor": {"enabled": True, "output_path": "mine", "job_name": "../../x"}},
        "CSV_JOB_ABSOLUTE": {"csv_monitor": {"enabled": True, "output_path": "mine", "job_name": "/tmp/x"}},
        # os.path.join("", job_name): job_name "" failed in every rank (os.makedirs(''))
        "CSV_PATH_EMPTY": {"csv_monitor": {"enabled": True, "output_path": "", "job_name": ""}},
        "SEQUENCE_PARALLEL": {"sequence_parallel_size": 2},
        "AUTOTUNING": {"autotuning": {"enabled": True}},  # a few steps, then DeepSpeed's exit(): status 0
        "ONE_CYCLE_SHORT": {"scheduler": {"type": "OneCycleLR", "params": {"max_lr": 0.01, "total_steps": 3}}},
        "CYCLIC_ONE_GROUP": {"scheduler": {"type": "CyclicLR", "params": {"base_lr": [0.001], "max_lr": [0.01]}}},
        "SGD_UNTESTED": {"optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_allow_untested_optimizer": False,
                         "zero_optimization": {"stage": 2}},
        "FAST_WRITER": {"checkpoint": {"writer": {"type": "fast"}}},
        # DeepSpeed then loaded the trainer's own checkpoints as universal ones: --resume auto's AttributeError
        "LOAD_UNIVERSAL": {"checkpoint": {"load_universal": True}},
        # round 26: each passed the dry run and failed in every rank (a KeyError at the engine's start; the inputs
        # cast to fp16 for fp32 weights)
        "RANDOM_LTD": {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True,
                                                                           "random_ltd": {"enabled": True}}}},
        "AUTO_CAST_OFF": {"fp16": {"enabled": False, "auto_cast": True}},
        # sections the trainer reads itself: an AttributeError traceback
        "CHECKPOINT_NUMBER": {"checkpoint": 5},
        "WANDB_LIST": {"wandb": []},
        "CSV_JOB_NUMBER": {"csv_monitor": {"enabled": True, "job_name": 5}},
        "TENSORBOARD_PATH_LIST": {"tensorboard": {"enabled": False, "output_path": ["a"]}},
        "AUTOTP": {"tensor_parallel": {"autotp_size": 2}},
        "FLOPS_PROC": {"flops_profiler": {"enabled": True, "profile_step": 1, "output_file": "/proc/nope/x.txt"}},
        "CLIP_HUGE": {"gradient_clipping": 10**400},
        # the same as DeepSpeed's config models read them: 0 is false, "true" is true
        "SGD_UNTESTED_ZERO": {"optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_allow_untested_optimizer": 0,
                              "zero_optimization": {"stage": 1}},
        "WANDB_WORD": {"wandb": {"enabled": "true"}},
        "FLOPS_FOLDER": {"flops_profiler": {"enabled": 1, "profile_step": 1, "output_file": "."}},
        # names longer than the file system allows (Errno 36): every rank died in csvMonitor.setup_log_dir
        "CSV_LONG_JOB": {"csv_monitor": {"enabled": True, "job_name": "a" * 300}},
        "CSV_LONG_PATH": {"csv_monitor": {"enabled": True, "output_path": "rl/" + "b" * 300}}}

FLAGS = [
    (["--seed", "-1"], "--seed must be in 0 .. 4294967295, got -1"),
    (["--ra_magnitude", "31"], "--ra_magnitude must be in 0 .. 30, got 31"),
    (["--ra_reps", "0"], "--ra_reps must be in 1 .. 16, got 0"),
    (["--mixup_alpha", "-1"], "--mixup_alpha must be in 0 .. 100, got -1.0"),
    (["--cutmix_alpha", "1e-300"], "--cutmix_alpha must be 0 (off) or at least 1e-6, got 1e-300"),
    (["--drop_path", "1", "--model", "convnext_tiny"], "--drop_path must be in 0 .. 0.99, got 1.0"),
    (["--drop_path", "0.1"], "--drop_path: --model resnet18 has no stochastic depth that torchvision lets set"),
    (["--random_erase", "nan"], "--random_erase must be in 0 .. 1, got nan"),
    (["--auto_augment", "foo"], "argument --auto_augment: invalid choice: 'foo'"),
    (["--seed", "4294967296"], "--seed must be in 0 .. 4294967295"),
    # each a process per rank: they were forked until the machine ground to a halt, or fork failed
    (["--num_workers", "100000"], "--num_workers 100000 is more than 8 DataLoader worker processes per CPU this "
                                  f"process may use ({usable_cores()} CPU(s)): use at most {8 * usable_cores()}"),
    (["--warmup_epochs", "1e308"], "--warmup_epochs 1e+308 is longer than the run (--epochs 50)"),
    (["--batch_size", "1", "--image_size", "32"], "--batch_size 1 at --image_size 32"),
    (["--model", "inception_v3", "--image_size", "75", "--batch_size", "1"],
     "--batch_size 1 at --image_size 75: a batch norm layer of inception_v3 then sees one value per channel"),
    (["--model", "maxvit_t", "--image_size", "32"], "--model maxvit_t cannot take --image_size 32: Input size (8, 8)"),
    (["--model", "googlenet", "--image_size", "32", "--batch_size", "1"],  # its own check, not ResNet18's
     "a batch norm layer of googlenet then sees one value per channel"),
    (["--batch_size", "1", "--image_size", "32", "--sync_bn", "--num_gpus", "1"],  # one rank: nothing to sync with
     "a batch norm layer of resnet18 then sees one value per channel"),
    (["--image_size", "99999999999999999999"], "input images alone is "),
    (["--data_on_device", "cache", "--device_train_size", "10000000"], "--device_train_size 10000000: one stored "
                                                                        "training image alone is 279,397 GiB"),
    (["--data_on_device", "off", "--device_train_size", "64"], "--data_on_device off keeps none: drop one of them"),
    (["--pretrained", ""], "--pretrained is empty: give a weights name (DEFAULT, IMAGENET1K_V1, ...) or a file"),
    (["--cache_dir", ""], "--cache_dir is empty: give a folder, or off, or leave the flag out"),
    (["--overwrite", "--resume", "auto"], "give one of them"),
    (["--deepspeed_config", "CSV_LONG_JOB"], "csv_monitor.job_name logs/csv_monitor/aaaaaaaaaaaaaaaaaaaa...(300 "
                                             "bytes): a name in it is longer than the file system allows (255 bytes)"),
    (["--deepspeed_config", "CSV_LONG_PATH"], "csv_monitor.output_path rl/bbbbbbbbbbbbbbbbbbbb...(300 bytes): a name"),
    (["--deepspeed_config", "OPTIMIZER_TYPE"], "optimizer.type in the DeepSpeed config must be a name, got 5"),
    (["--deepspeed_config", "BUCKET_WORDS"], 'zero_optimization.reduce_bucket_size: Input should be a valid integer'),
    (["--deepspeed_config", "UNKNOWN_ZERO_KEY"], "zero_optimization.reduce_bucket_sise: Extra inputs are not permitted"),
    (["--deepspeed_config", "NO_SUCH_SCHEDULER"], "scheduler.type 'NoSuchLR' is neither one of DeepSpeed's"),
    (["--deepspeed_config", "NO_SUCH_OPTIMIZER"], "optimizer.type 'NoSuchOpt' is neither one of DeepSpeed's"),
    (["--deepspeed_config", "ONEBIT_ADAM"], "optimizer.type 'OneBitAdam' is neither one of DeepSpeed's"),
    (["--deepspeed_config", "BF16_MAYBE"], 'bf16.enabled in the DeepSpeed config must be true, false or "auto"'),
    (["--deepspeed_config", "SGD_NO_SUCH_PARAM"], "optimizer SGD cannot be built from optimizer.params "
                                                  "(SGD.__init__() got an unexpected keyword argument 'nesterov_x')"),
    (["--deepspeed_config", "BETAS_WORDS"], "optimizer AdamW cannot be built from optimizer.params"),
    (["--deepspeed_config", "WARMUP_WORDS"], "scheduler.params.warmup_num_steps of WarmupLR must be a number"),
    (["--deepspeed_config", "ONECYCLE_BARE"], "missing 2 required positional arguments: 'cycle_min_lr'"),
    (["--deepspeed_config", "STEPLR_BARE"], "missing 1 required positional argument: 'step_size'"),
    (["--deepspeed_config", "LAMB"], "optimizer Lamb is DeepSpeed's FusedLamb, a CUDA op: it needs a GPU"),
    (["--deepspeed_config", "LION"], "with --offload_optimizer DeepSpeed's CPU Lion runs here"),
    (["--deepspeed_config", "MUADAM"], "optimizer MuAdam needs the mup package"),
    (["--deepspeed_config", "NVME_NO_PATH"], "zero_optimization.offload_param to nvme needs its nvme_path"),
    (["--deepspeed_config", "TOTAL_NEGATIVE"], "scheduler.params.total_num_steps of WarmupDecayLR must be at least "
                                               "1 step, got -5"),  # trained at lr 0 from the second step
    (["--deepspeed_config", "STEPS_WORDS"], "steps_per_print must be a whole number of steps, got 'x'"),
    (["--deepspeed_config", "STEPLR_GAMMA_WORDS"], "scheduler.params.gamma of StepLR must be a number, got 'x'"),
    (["--deepspeed_config", "ONECYCLE_WORDS"], "scheduler OneCycle cannot be built from scheduler.params "
                                               "(unsupported operand type(s)"),  # used from its first step
    (["--deepspeed_config", "BETAS_SHORT"], "optimizer AdamW cannot be built from optimizer.params (list index"),
    (["--deepspeed_config", "SCHEDULER_MODULE"], "scheduler.type 'math' is neither one of DeepSpeed's schedulers"),
    (["--deepspeed_config", "ACCUM_DTYPE_CAPS"], "data_types.grad_accum_dtype 'FP32' is not one of DeepSpeed's dtype "
                                                 "names (torch.float16, fp16"),
    (["--deepspeed_config", "ACCUM_DTYPE_CAPS", "--zero_stage", "1", "--bf16", "--coalesce_grad_reduction", "on"],
     "data_types.grad_accum_dtype 'FP32' is not one of"),
    (["--deepspeed_config", "DATA_TYPES_NUMBER", "--zero_stage", "1", "--bf16", "--coalesce_grad_reduction", "on"],
     "data_types in the DeepSpeed config must be a JSON object, got 5"),
    (["--deepspeed_config", "STAGE_TRUE"], "ZeRO stage must be 0, 1, 2 or 3, got true"),
    # a CUDA op: every rank's engine start failed
    (["--deepspeed_config", "QUANTIZED_WEIGHTS"], "zero_optimization.zero_quantized_weights needs a GPU"),
    # the same op for the gradients: a traceback in every rank's first backward
    (["--deepspeed_config", "QUANTIZED_GRADIENTS"], "zero_optimization.zero_quantized_gradients needs a GPU: "
                                                    "ZeRO++'s gradient quantization is a CUDA op"),
    # trained at lr -1 to a loss of 1e15, and at lr 0 after the first step, both silently
    (["--deepspeed_config", "RANGE_TEST_NEGATIVE"], "scheduler LRRangeTest gives the learning rate -1"),
    (["--deepspeed_config", "COSINE_SHORT"], "scheduler WarmupCosineLR's total_num_steps is 1, and this run takes"),
    # the first save removed the monitor's folder (a traceback); the log folder passed for a damaged checkpoint
    (["--checkpoint_dir", "ck", "--deepspeed_config", "CSV_IN_CHECKPOINT"],
     "csv_monitor.output_path ck/epoch_2 is inside --checkpoint_dir ck's epoch_2, which the run replaces whole"),
    (["--checkpoint_dir", "ck", "--log_dir", "ck/last"], "--log_dir ck/last is inside --checkpoint_dir ck's last"),
    # a link to nothing or a loop: a traceback (FileExistsError in the lock, RuntimeError in resolve())
    (["--checkpoint_dir", "DANGLING"], "--checkpoint_dir DANGLING: DANGLING is a link to nothing or a link loop"),
    (["--checkpoint_dir", "LOOP"], "--checkpoint_dir LOOP: LOOP is a link to nothing or a link loop"),
    (["--log_dir", "LOOP/logs"], "--log_dir LOOP/logs: "),
    (["--cache_dir", "LOOP", "--data_on_device", "cache"], "--cache_dir LOOP: LOOP is a link to nothing or a link"),
    # later in the run: a negative rate trained on (exit 0), a division by zero ended epoch 2 in a traceback
    (["--deepspeed_config", "STEPLR_NEGATIVE"], "scheduler StepLR gives the learning rate -0.001 at optimizer step 4"),
    (["--deepspeed_config", "POLY_NEGATIVE_POWER"], "scheduler PolynomialLR fails at optimizer step 5 of this run "
                                                    "(ZeroDivisionError"),
    (["--deepspeed_config", "PREDIVIDE", "--zero_stage", "2"], "gradient_predivide_factor other than 1 and "
                                                               "prescale_gradients: DeepSpeed's ZeRO-2 refuses"),
    (["--deepspeed_config", "PREDIVIDE", "--zero_stage", "3"], "gradient_predivide_factor other than 1 and "
                                                               "prescale_gradients: DeepSpeed's ZeRO-3 refuses"),
    (["--deepspeed_config", "PREDIVIDE_ZERO"], "gradient_predivide_factor in the DeepSpeed config must be a number "
                                               "above 0 (1, the default, or the number of ranks), got 0"),
    (["--deepspeed_config", "PREDIVIDE_WORD"], 'gradient_predivide_factor in the DeepSpeed config must be a number '
                                               'above 0 (1, the default, or the number of ranks), got "2"'),
    (["--deepspeed_config", "PREDIVIDE_NEGATIVE"], "gradient_predivide_factor in the DeepSpeed config must be a "
                                                   "number above 0"),
    (["--checkpoint_dir", "ck", "--cache_dir", "ck/best_model/c"], "--cache_dir ck/best_model/c is inside "
                                                                    "--checkpoint_dir ck's best_model"),
    (["--deepspeed_config", "ACCUM_FP32", "--zero_stage", "0", "--bf16", "--precision_mode", "half_weights"],
     "grad_accum_dtype 'fp32' at ZeRO stage 0: DeepSpeed accumulates there in the weights' dtype only (bf16)"),
    (["--deepspeed_config", "MUON"], "DeepSpeed's Muon fails in its first step on convolution weights (4-D)"),
    (["--deepspeed_config", "WANDB"], "the wandb monitor needs the wandb package: pip install wandb"),
    (["--deepspeed_config", "CSV_PROC"], "csv_monitor.output_path /proc/nope: cannot write in /proc"),
    (["--deepspeed_config", "CSV_JOB_UP"], "csv_monitor.job_name '../../x': the monitor writes in "
                                           "output_path/job_name, so it must be a folder name, without '/' or '\\' "
                                           "and not '.' or '..'"),
    (["--deepspeed_config", "CSV_JOB_ABSOLUTE"], "csv_monitor.job_name '/tmp/x': the monitor writes in"),
    (["--deepspeed_config", "CSV_PATH_EMPTY"], "csv_monitor.output_path is empty: give a folder, or leave "
                                               "output_path out (the monitor then writes in --log_dir's csv_monitor)"),
    (["--deepspeed_config", "SEQUENCE_PARALLEL"], "sequence_parallel_size is for splitting a language model's"),
    (["--deepspeed_config", "AUTOTUNING"], "autotuning.enabled: DeepSpeed's engine then times a few steps and "
                                           "exits, training nothing"),
    # each passed every check and failed in every rank (OneCycleLR after its last step, mid-run)
    (["--deepspeed_config", "ONE_CYCLE_SHORT", "--epochs", "2"], "scheduler OneCycleLR steps 3 times, and this run "
                                                                 "takes 6 optimizer steps"),
    # checked on a one-group stand-in: fine-tuning's head and body groups failed it in every rank
    (["--deepspeed_config", "CYCLIC_ONE_GROUP", "--freeze_backbone_epochs", "1"], "scheduler CyclicLR cannot be "
     "built from scheduler.params (base_lr must have the same length as optimizer.param_groups. base_lr has 1 "
     "values, param_groups has 2.)"),
    (["--deepspeed_config", "SGD_UNTESTED"], "zero_allow_untested_optimizer false: DeepSpeed's ZeRO then refuses"),
    (["--deepspeed_config", "FAST_WRITER"], "checkpoint.writer: DeepSpeed's checkpoint writers"),
    (["--deepspeed_config", "RANDOM_LTD"], "data_efficiency.data_routing.random_ltd: DeepSpeed's random layerwise "
                                           "token dropping works on a language model's layers"),
    (["--deepspeed_config", "AUTO_CAST_OFF"], "fp16.auto_cast casts the inputs to fp16, which only fp16 weights take "
                                              "(fp16.enabled, --fp16); this run computes in fp32: remove it"),
    (["--deepspeed_config", "LOAD_UNIVERSAL"], "checkpoint.load_universal: the trainer sets it itself, for a resume "
                                               "that needs it (a ZeRO-1/2/3 checkpoint resumed on another number of "
                                               "ranks, through DeepSpeed's universal checkpoint); remove it"),
    (["--deepspeed_config", "CHECKPOINT_NUMBER"], "checkpoint in the DeepSpeed config must be a JSON object, got 5"),
    (["--deepspeed_config", "WANDB_LIST"], "wandb in the DeepSpeed config must be a JSON object, got []"),
    (["--deepspeed_config", "CSV_JOB_NUMBER"], "csv_monitor.job_name in the DeepSpeed config must be a string, got 5"),
    (["--deepspeed_config", "TENSORBOARD_PATH_LIST"], 'tensorboard.output_path in the DeepSpeed config must be a '
                                                      'string, got ["a"]'),
    (["--deepspeed_config", "AUTOTP"], "tensor_parallel.autotp_size: DeepSpeed's automatic tensor parallelism"),
    (["--deepspeed_config", "FLOPS_PROC"], "flops_profiler.output_file /proc/nope/x.txt: /proc/nope is not a folder"),
    (["--deepspeed_config", "CLIP_HUGE"], "gradient_clipping is a whole number of 401 digits, not a finite number"),
    (["--deepspeed_config", "SGD_UNTESTED_ZERO"], "zero_allow_untested_optimizer false: DeepSpeed's ZeRO then"),
    (["--deepspeed_config", "WANDB_WORD"], "the wandb monitor needs the wandb package"),
    (["--deepspeed_config", "FLOPS_FOLDER"], "flops_profiler.output_file .: a folder; give a file name"),
    (["--deepspeed_config", "LR_INFINITE"], "optimizer.params.lr is inf, not a finite number"),
    (["--deepspeed_config", "CLIP_NAN"], "gradient_clipping is nan, not a finite number"),
    (["--deepspeed_config", "ZERO_TYPO"], "'zero_optimisation' is not a key DeepSpeed reads (did you mean "
                                          "'zero_optimization'?)"),
    (["--pretrained", "RANDOM_BYTES"], "is damaged or not a torch file"),
    (["--pretrained", "EMPTY"], "EMPTY is damaged or not a torch file (EOFError)"),
    (["--data_on_device", "cache", "--cache_dir", "RANDOM_BYTES"], "--data_on_device cache needs the decoded-image cache: --cache_dir"),
    (["--pretrained", "MODEL_STATES"], "export it first with export_model.py"),
    (["--pretrained", "SPARSE"], "fc.weight is a torch.sparse_coo torch.float32 tensor; give dense real-valued"),
    (["--pretrained", "BAD_VERSIONS"], "its module versions (_metadata) are not whole numbers"),
    (["--pretrained", "META"], "fc.weight is a meta-device tensor, which holds no values"),
    (["--pretrained", "INT_KEY"], "is not a state_dict (tensors by name)"),
    (["--pretrained", "NESTED"], "fc.weight is a nested torch.float32 tensor; give dense real-valued"),
    (["--pretrained", "WRAPPED"], "is not a state_dict (tensors by name); its tensors are under 'state_dict': save "
                                  "that dict alone"),
    (["--pretrained", "PAYLOAD"], "PAYLOAD holds Python objects other than tensors (GLOBAL io.open): not "
                                  "loaded, since loading it could run any code"),
]


@pytest.mark.parametrize("weights, message", [("RANDOM_BYTES", "is damaged or not a torch file"),
                                              ("a_folder", "a_folder: a folder; give a state_dict file")])
def test_the_training_script_refuses_bad_weights_before_it_takes_the_folders(tiny_data, tmp_path, monkeypatch,
                                                                             capsys, weights, message):
    from deepspeed_image_trainer.cli import train

    (tmp_path / "RANDOM_BYTES").write_bytes(os.urandom(5000))
    (tmp_path / "a_folder").mkdir()
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(train.main, data_args(tiny_data) + ["--pretrained", weights], capsys, message)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "checkpoints").exists()


def test_the_training_script_refuses_a_rank_environment_before_it_checks_anything_else(tiny_data, tmp_path,
                                                                                     monkeypatch, capsys):
    from deepspeed_image_trainer.cli import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "1.5")
    assert_usage_error_in_process(train.main, data_args(tiny_data) + ["--sync_bn"], capsys,
                                  "WORLD_SIZE='1.5' in the environment is not a whole number")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("timeout, message", [
    ("x", "DEEPSPEED_TIMEOUT='x' in the environment is not a whole number of minutes: use 1 .. 100000000"),
    ("0", "DEEPSPEED_TIMEOUT=0 in the environment is outside 1 .. 100000000 minutes, where torch's rendezvous gives "
          "up at once")])
def test_a_deepspeed_timeout_no_rank_can_use_is_refused_before_anything_is_written(tiny_data, tmp_path, monkeypatch,
                                                                                   capsys, timeout, message):
    """DEEPSPEED_TIMEOUT=x passed the launcher, which wrote the run's config, then every rank's import of DeepSpeed
    ended in a ValueError; 0 timed out even a group of one's rendezvous (a traceback)."""
    from deepspeed_image_trainer.cli import train

    monkeypatch.chdir(tmp_path)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # as they were, once checked
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", timeout)
    for main, extra in ((launch_deepspeed.main, ["--dry_run"]), (launch_deepspeed.main, []), (train.main, [])):
        assert_usage_error_in_process(main, data_args(tiny_data) + extra, capsys, message)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("extra, message", [(["--epochs", "0"], "error: --epochs must be at least 1\n"),
                                            (["--train_dir", "nope"], "error: image folder not found: nope\n"),
                                            (["--epochs", "x"], "error: argument --epochs: invalid int value: 'x' "
                                                                "(--help lists the flags)\n")],
                         ids=["--epochs 0", "--train_dir nope", "--epochs x"])
def test_a_refusal_before_the_ranks_can_talk_is_reported_by_each_nodes_first_rank_alone(tiny_data, tmp_path,
                                                                                        monkeypatch, capsys, extra,
                                                                                        message):
    """`deepspeed --num_gpus 2 src/train_deepspeed.py --epochs 0` printed its error line once per rank: the ranks
    read the same flags and folders alike, and cannot yet tell each other. A node's first rank (RANK 2 on the
    second) still says it: that node may lack a folder the first has."""
    from deepspeed_image_trainer.cli import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "die_with_parent_call", lambda pid: lambda: None)  # not this test process
    for key, value in {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    for rank, local_rank, said in (("1", "1", ""), ("2", "0", message)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as exited:
            run_cli(train.main, data_args(tiny_data) + extra)
        assert exited.value.code == 2 and capsys.readouterr().err == said
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "1"}.items():  # a LOCAL_RANK left in a shell
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        run_cli(train.main, data_args(tiny_data) + extra)
    assert exited.value.code == 2 and capsys.readouterr().err == message
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("extra, message", FLAGS, ids=[" ".join(extra) for extra, _ in FLAGS])
def test_the_launcher_refuses_what_no_run_can_use(tiny_data, tmp_path, monkeypatch, capsys, extra, message):
    for name, config in JSON.items():
        (tmp_path / name).write_text(json.dumps(config))
    (tmp_path / "RANDOM_BYTES").write_bytes(os.urandom(5000))
    (tmp_path / "EMPTY").write_bytes(b"")
    (tmp_path / "DANGLING").symlink_to(tmp_path / "nowhere")
    (tmp_path / "LOOP").symlink_to("LOOP")
    torch.save({"module": {"fc.weight": torch.zeros(3, 512)}, "ds_version": "0.19"}, tmp_path / "MODEL_STATES")
    torch.save({"fc.weight": Payload(tmp_path / "ran")}, tmp_path / "PAYLOAD")
    torch.save({"state_dict": {"fc.weight": torch.zeros(3, 512)}, "epoch": 3}, tmp_path / "WRAPPED")
    torch.save({"fc.weight": torch.zeros(3, 512).to_sparse()}, tmp_path / "SPARSE")
    versions = type(resnet18_tensors())(resnet18_tensors())
    versions._metadata = {"bn1": {"version": "x"}}  # BatchNorm's loader compared it with 2 in a rank: TypeError
    torch.save(versions, tmp_path / "BAD_VERSIONS")
    torch.save({"fc.weight": torch.empty(3, 512, device="meta")}, tmp_path / "META")  # a model built on meta
    torch.save({"fc.weight": torch.zeros(3, 512), 0: torch.zeros(1)}, tmp_path / "INT_KEY")
    torch.save({"fc.weight": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])}, tmp_path / "NESTED")
    argv = data_args(tiny_data) + [str(tmp_path / arg) if (tmp_path / arg).is_file() else arg for arg in extra]
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(launch_deepspeed.main, argv + ["--dry_run"], capsys, message)
    assert not (tmp_path / "ran").exists() and not (tmp_path / "logs").exists()


def test_a_cache_folder_from_the_environment_inside_a_checkpoint_is_refused(tiny_data, tmp_path, monkeypatch, capsys):
    """$TRAINER_CACHE_DIR in --checkpoint_dir/last: the launcher wrote the data check's cache there, its rank then
    took it for an earlier run's damaged checkpoint (with --overwrite, the save deleted both caches)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "ck/last"))
    argv = data_args(tiny_data) + ["--checkpoint_dir", "ck", "--dry_run"]
    assert_usage_error_in_process(launch_deepspeed.main, argv, capsys,
                                  f"$TRAINER_CACHE_DIR {tmp_path / 'ck/last'} is inside --checkpoint_dir ck's last")
    assert not any(tmp_path.iterdir())
    (tmp_path / "loop").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop")  # a RuntimeError traceback from Path.resolve before
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "loop/s"))
    assert_usage_error_in_process(launch_deepspeed.main, argv, capsys,
                                  f"$TRAINER_CACHE_DIR {tmp_path / 'loop/s'}: {tmp_path / 'loop'} is a link to nothing")


@pytest.mark.parametrize("inside, message", [
    ("A/ck/last/last/inner", "--checkpoint_dir A/ck/last/last/inner is inside the checkpoint "),
    ("A/ck/best_model/best", "--checkpoint_dir A/ck/best_model/best is inside "),
    # the other run's next save or start removed its scratch folders, and what was written in them
    ("A/ck/.staging/ck", "--checkpoint_dir A/ck/.staging/ck is inside "),
    ("A/ck/.ready-last/ck", "--checkpoint_dir A/ck/.ready-last/ck is inside "),
    ("LOG:A/ck/.staging/l", "--log_dir A/ck/.staging/l is inside "),
], ids=["in a published checkpoint", "where another run will save one", "in its staging", "in a save's next",
        "a log folder in its staging"])
def test_a_checkpoint_dir_inside_another_runs_checkpoints_is_refused(tiny_data, tmp_path, monkeypatch, capsys, inside,
                                                                     message):
    """Another run's next save of last/ (or its first of best_model/) replaced the folder whole, and with it this
    run's checkpoints."""
    (tmp_path / "A/ck/last/last").mkdir(parents=True)
    (tmp_path / "A/ck/last/extra_info.json").write_text("{}")
    (tmp_path / "A/ck/.lock").write_text("")  # the other run holds A/ck
    monkeypatch.chdir(tmp_path)
    folders = ["--checkpoint_dir", "ck", "--log_dir", inside[4:]] if inside.startswith("LOG:") else [
        "--checkpoint_dir", inside, "--log_dir", "logs"]
    assert_usage_error_in_process(launch_deepspeed.main, data_args(tiny_data) + folders + ["--dry_run"], capsys,
                                  message)
    assert sorted(p.name for p in (tmp_path / "A/ck").iterdir()) == [".lock", "last"]
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("name, kind", [(".universal", "file"), (".universal", "link"), (".staging", "link"),
                                        (".ready-last", "file"), (".old-last", "link"), ("last", "file"),
                                        ("epoch_3", "file")])
def test_a_file_or_link_where_the_trainer_makes_its_folders_is_refused(tiny_data, tmp_path, monkeypatch, capsys,
                                                                       name, kind):
    """A file (or a link to a scratch disk) at --checkpoint_dir/.universal ended a resume on another number of
    ranks in a FileExistsError traceback, every time: the conversion removes and makes that folder itself; one at
    .ready-last or .old-last failed every save after an epoch of training (status 4)."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "scratch").mkdir()
    if kind == "file":
        (tmp_path / "ck" / name).write_text("x")
    else:
        (tmp_path / "ck" / name).symlink_to(tmp_path / "scratch")
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(launch_deepspeed.main, data_args(tiny_data) + [
        "--checkpoint_dir", "ck", "--log_dir", "logs", "--dry_run"], capsys,
        f"ck/{name} is a file or a link, where the trainer keeps a folder of its own")
    assert os.path.lexists(tmp_path / "ck" / name) and (tmp_path / "scratch").is_dir()


def test_a_cache_folder_inside_the_images_it_holds_is_refused(tiny_data, tmp_path, monkeypatch, capsys):
    """--cache_dir in --train_dir: its entries showed up in every later run as class folders without images; so did
    $TRAINER_CACHE_DIR's data check and decoded images (of a run, and of prepare_data.py --check)."""
    from deepspeed_image_trainer.data import prepare

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_data, tmp_path / "data")
    assert_usage_error_in_process(launch_deepspeed.main, data_args(Path("data")) + [
        "--data_on_device", "cache", "--cache_dir", "data/train/c", "--dry_run"], capsys,
        "--cache_dir data/train/c is inside --train_dir data/train, whose images it keeps the results of")
    monkeypatch.setenv("TRAINER_CACHE_DIR", "data/val/antelope")
    assert_usage_error_in_process(launch_deepspeed.main, data_args(Path("data")) + ["--dry_run"], capsys,
                                  "$TRAINER_CACHE_DIR data/val/antelope is inside --val_dir data/val, whose images")
    assert_usage_error_in_process(prepare.main, ["--check", "data"], capsys,
                                  "$TRAINER_CACHE_DIR data/val/antelope is inside --check data, whose images")
    for split in ("train", "val"):
        assert sorted(p.name for p in (tmp_path / "data" / split).rglob("*")) == sorted(
            p.name for p in (tiny_data / split).rglob("*"))


@pytest.mark.parametrize("name", [".lock", ".launch.lock"])
def test_a_lock_file_that_is_a_link_is_refused_and_what_it_names_kept(tmp_path, name):
    """The lock (the launcher's, or rank 0's) was opened through the link and emptied: the file it named (a note, a
    checkpoint's extra_info.json) lost its content, on a refused start too."""
    from deepspeed_image_trainer.outputs import run_folders

    (tmp_path / "logs").mkdir()
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "logs" / name).symlink_to(tmp_path / "notes.txt")
    try:
        with pytest.raises(UsageError, match=f"logs/{name}, the lock of the run in it, is not a regular file "
                                             r"\(a folder, FIFO, device or link\): remove it"):
            run_folders.lock(tmp_path / "logs", "--log_dir", name=name)
    finally:
        run_folders.release()
    assert (tmp_path / "notes.txt").read_text() == "keep me" and (tmp_path / "logs" / name).is_symlink()


@pytest.mark.parametrize("config, message", [
    ({"flops_profiler": {"enabled": True, "output_file": "A/ck/last/last/mp_rank_00_model_states.pt"}},
     "flops_profiler.output_file A/ck/last/last/mp_rank_00_model_states.pt is inside the checkpoint"),
    ({"flops_profiler": {"enabled": True, "output_file": "A/logs/training_history.json"}},
     "flops_profiler.output_file A/logs/training_history.json: a run keeps its history under that name"),
    ({"csv_monitor": {"enabled": True, "output_path": "A/logs/csv_monitor", "job_name": "train"}},
     "csv_monitor.output_path A/logs/csv_monitor is inside "),
    ({"csv_monitor": {"enabled": True, "output_path": "A/ck/.staging/m"}}, "csv_monitor.output_path A/ck/.staging/m "
                                                                          "is inside "),
    ({"flops_profiler": {"enabled": True, "output_file": "fifo"}},  # the first step waited on it for good
     "flops_profiler.output_file fifo is not a regular file"),
], ids=["profiler into a checkpoint", "profiler onto a history", "monitor into another run's logs",
        "monitor into another run's staging", "profiler into a FIFO"])
def test_a_json_output_onto_another_runs_files_is_refused(tiny_data, tmp_path, monkeypatch, capsys, config, message):
    """The profiler's report replaced another run's model states or history; a fresh run's CSV monitor replaced the
    rows of the run whose log folder its output_path named."""
    for folder in ("A/ck/last/last", "A/logs/csv_monitor/train"):
        (tmp_path / folder).mkdir(parents=True)
    for path in ("A/ck/last/extra_info.json", "A/ck/last/last/mp_rank_00_model_states.pt",
                 "A/logs/training_history.json", "A/logs/csv_monitor/train/Epoch_val_acc.csv"):
        (tmp_path / path).write_text("A's")
    (tmp_path / "j.json").write_text(json.dumps(config))
    os.mkfifo(tmp_path / "fifo")
    before = digests(tmp_path / "A")
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(launch_deepspeed.main, data_args(tiny_data) + [
        "--checkpoint_dir", "B/ck", "--log_dir", "B/logs", "--deepspeed_config", "j.json", "--dry_run"], capsys,
        message)
    assert digests(tmp_path / "A") == before


def printed_config(out):
    """The DeepSpeed config a --dry_run printed. In a test DeepSpeed's logger writes to the captured stdout too: its
    "Setting accelerator to CPU" line comes first where the dry run is the process's first use of DeepSpeed."""
    start = out.index("{\n")
    return json.loads(out[start:out.index("\n}", start) + 2])


def test_sync_bn_lets_each_rank_take_one_image(tiny_data, tmp_path, monkeypatch, capsys):
    """--sync_bn normalises over every rank's micro-batch: two ranks of one image each give it two values."""
    monkeypatch.chdir(tmp_path)
    assert launch_deepspeed.main(data_args(tiny_data) + ["--batch_size", "1", "--image_size", "32", "--sync_bn",
                                                         "--num_gpus", "2", "--dry_run"]) == 0
    assert printed_config(capsys.readouterr().out)["train_micro_batch_size_per_gpu"] == 1


def test_a_scheduler_with_a_value_for_each_of_fine_tunings_parameter_groups_passes(tiny_data, tmp_path, monkeypatch):
    """Head and body (--backbone_lr_scale) are two groups: the launcher's check refused the two values that
    the run's scheduler needs ("param_groups has 1")."""
    (tmp_path / "one_cycle.json").write_text(json.dumps({"scheduler": {"type": "OneCycleLR", "params": {
        "max_lr": [0.01, 0.001], "total_steps": 1000}}}))
    monkeypatch.chdir(tmp_path)
    assert launch_deepspeed.main(data_args(tiny_data) + ["--deepspeed_config", "one_cycle.json",
                                                         "--backbone_lr_scale", "0.5", "--dry_run"]) == 0


def test_the_readme_dry_run_works_without_a_dataset(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    launch_deepspeed.main(["--zero_stage", "3", "--offload_param", "--offload_optimizer", "--bf16", "--dry_run"])
    out, err = capsys.readouterr()
    assert "data/train not found; the config below assumes Animals-90's 90 classes" in err
    config = printed_config(out)
    assert config["zero_optimization"]["stage"] == 3
    assert not (tmp_path / "logs").exists()


# --- resuming with what the checkpoint was not made with ----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["--batch_size", "8"], "it was saved with the global batch 4, which its optimizer and schedule were built for, "
                            "and micro-batch 8 x 1 rank(s) x --gradient_accumulation_steps N does not make it; resume "
                            "with --batch_size 4 --gradient_accumulation_steps 1"),
    (["--batch_size", "2", "--gradient_accumulation_steps", "1"], "micro-batch 2 x 1 rank(s) x "
                                                                 "--gradient_accumulation_steps 1 does not make it"),
    (["--learning_rate", "0.01"], "--learning_rate 0.001 (this run: 0.01)"),
    (["--image_size", "48"], "--image_size 32 (this run: 48)"),
    (["--backbone_lr_scale", "0.5"], "--transformer_embedding_decay): one parameter group (this "
                                     "run: head and body in parameter groups of their own)"),
    (["--layer_decay", "0.7", "--norm_weight_decay", "0"], "--transformer_embedding_decay): one parameter group (this "
                                                           "run: groups by --norm_weight_decay 0, --layer_decay 0.7)"),
    (["--train_dir", "OTHER_CLASSES"], "the classes of --train_dir 3 classes (antelope, badger, bat) (this run: "
                                       "4 classes"),
    (["--freeze_backbone_epochs", "1"], "--freeze_backbone_epochs 0 (this run: 1)"),
    (["--model_ema"], "--model_ema off (this run: on)"),  # the average would start from the weights mid-run
])
def test_resuming_with_other_settings_stops_before_anything_starts(trained, tiny_data, tmp_path, monkeypatch, capsys,
                                                                   extra, message):
    workdir, first = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    make_sample_dataset(tmp_path / "other", num_classes=4, train_per_class=4, val_per_class=1, image_size=32, seed=0)
    extra = [str(tmp_path / "other/train") if arg == "OTHER_CLASSES" else arg for arg in extra]
    before = digests(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert_usage_error_in_process(launch_deepspeed.main, first.args[2:] + ["--epochs", "3", "--resume", "auto",
                                                                           *extra], capsys, message)
    assert digests(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("extra, accumulation, said", [
    ([], 2, "Resuming on 1 rank(s) with the checkpoint's global batch 8: micro-batch 4 x --gradient_accumulation_steps 2"),
    (["--num_gpus", "2", "--batch_size", "2"], 2, "Resuming on 2 rank(s) with the checkpoint's global batch 8: "
                                                  "micro-batch 2 x --gradient_accumulation_steps 2"),
    (["--deepspeed_config", "AUTO_BATCH"], 2, "micro-batch 4 x --gradient_accumulation_steps 2")])  # "auto" sets none
def test_the_same_command_resumes_on_another_number_of_ranks_with_the_saved_global_batch(
        trained, tmp_path, monkeypatch, capsys, extra, accumulation, said):
    """Saved by 2 ranks of micro-batch 4: one rank (or a smaller micro-batch) accumulates up to the same global
    batch, which the optimizer and schedule were built for, instead of refusing it."""
    workdir, first = trained("zero2-2ranks")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    argv = first.args[2:]
    at = argv.index("--num_gpus")
    (tmp_path / "AUTO_BATCH").write_text(json.dumps({key: "auto" for key in (
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}))
    extra = [str(tmp_path / arg) if arg == "AUTO_BATCH" else arg for arg in extra]
    argv = argv[:at] + argv[at + 2:] + extra  # the same command, but for where it runs
    monkeypatch.chdir(tmp_path)
    assert launch_deepspeed.main(argv + ["--epochs", "3", "--resume", "auto", "--dry_run"]) == 0
    out, err = capsys.readouterr()
    config = printed_config(out)
    assert config["gradient_accumulation_steps"] == accumulation and config["train_batch_size"] == 8
    assert said in err


def test_a_resume_needs_neither_the_pretrained_file_nor_the_network(trained, tmp_path, monkeypatch, capsys):
    """The checkpoint holds every weight: a run started from --pretrained weights resumes after the file is gone
    (or the hub cache emptied on a machine offline)."""
    workdir, first = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    for path in (tmp_path / "checkpoints_deepspeed").glob("*/extra_info.json"):  # as if started from gone.pth
        path.write_text(json.dumps({**json.loads(path.read_text()), "pretrained": "gone.pth"}))
    monkeypatch.chdir(tmp_path)
    argv = first.args[2:] + ["--epochs", "3", "--resume", "auto", "--pretrained", "gone.pth", "--dry_run"]
    for resumed in (argv, [arg for arg in argv if arg not in ("--pretrained", "gone.pth")]):  # given, or taken
        assert launch_deepspeed.main(resumed) == 0, capsys.readouterr().err
        assert '"train_batch_size"' in capsys.readouterr().out
    assert_usage_error_in_process(launch_deepspeed.main, argv[:-5] + ["--pretrained", "gone.pth", "--dry_run"], capsys,
                                  "--pretrained gone.pth: no such file")  # a new run needs it


# --- damaged and hostile checkpoints, exports and sidecars --------------------------------------------------

def damage(path, how, marker):
    if how == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif how == "payload":
        torch.save({"module": Payload(marker)}, path)
    elif how == "meta tensors":  # saved from a model on the meta device: shapes only
        torch.save({key: value.to("meta") for key, value in torch.load(path).items()}, path)
    elif how == "class_names 5":
        path.write_text(json.dumps({**json.loads(path.read_text()), "class_names": 5}))


CHECKPOINT_DAMAGE = [("extra_info.json", "random bytes", "unreadable"),
                     ("extra_info.json", "class_names 5", "(class_names of the wrong kind)"),
                     ("last/mp_rank_00_model_states.pt", "truncated", "is damaged or not a torch file"),
                     ("last/mp_rank_00_model_states.pt", "random bytes", "is damaged or not a torch file"),
                     ("last/mp_rank_00_model_states.pt", "payload", "holds Python objects other than tensors")]


@pytest.fixture
def export_of_a_run(trained, tmp_path):
    """tmp_path/last: a copy of the trained ZeRO-0 run's `last` checkpoint; tmp_path/model.pt: its export."""
    workdir, _ = trained("zero0")
    shutil.copytree(workdir / "checkpoints_deepspeed/last", tmp_path / "last")
    export_model.main([str(tmp_path / "last"), "--output", str(tmp_path / "model.pt")])
    return tmp_path


def users_of_a_model(model, tiny_data, tmp_path):
    return [(export_model.main, [model, "--output", str(tmp_path / "out.pt")]),
            (evaluate.main, ["--model", model, "--data_dir", str(tiny_data / "val"),
                             "--output_dir", str(tmp_path / "eval"), "--num_workers", "0"]),
            (predict.main, ["--model", model, str(tiny_data / "val")])]


@pytest.mark.slow
@pytest.mark.parametrize("file, how, message", CHECKPOINT_DAMAGE)
def test_a_damaged_or_hostile_checkpoint_folder_is_refused(export_of_a_run, tiny_data, capsys, file, how, message):
    folder = export_of_a_run / "last"
    damage(folder / file, how, export_of_a_run / "ran")
    before = digests(folder)
    for main, argv in users_of_a_model(str(folder), tiny_data, export_of_a_run):
        assert_usage_error_in_process(main, argv, capsys, message)
    assert not (export_of_a_run / "ran").exists() and digests(folder) == before


EXPORT_DAMAGE = [("model.pt", "random bytes", "is damaged or not a torch file"),
                 ("model.pt", "truncated", "is damaged or not a torch file"),
                 ("model.pt", "payload", "holds Python objects other than tensors"),
                 ("model.pt", "meta tensors", "is a meta-device tensor, which holds no values"),
                 ("model.pt.json", "not json", "model.pt.json is unreadable"),
                 ("model.pt.json", "no classes", "expected class_names (a list of names) and image_size"),
                 ("model.pt.json", "an empty class name", "expected class_names (a list of names) and image_size"),
                 ("model.pt.json", "a lone surrogate", "expected class_names (a list of names) and image_size"),
                 ("model.pt.json", "two classes", f"has {TINY_CLASSES} outputs but its class names list 2"),
                 ("model.pt.json", "a million pixels", "image_size 1000000: one input image alone is more than this "
                                                       "machine's"),
                 ("model.pt.json", "10**400 pixels", "image_size a whole number of 401 digits: one input image"),
                 ("model.pt.json", "a class twice", "class_names names a class twice"),
                 ("model.pt.json", "a ratio of 400 digits", "its preprocessing is not one this trainer writes"),
                 # built for the sidecar's size before the weights are read: ViT's AssertionError, a traceback
                 ("model.pt.json", "a model that cannot take its size", "its metadata names vit_h_14 at 32 px, which "
                                                                        "that model cannot take"),
                 ("model.safetensors", "random bytes", "is damaged or not a safetensors file")]


@pytest.mark.slow
@pytest.mark.parametrize("file, how, message", EXPORT_DAMAGE)
def test_a_damaged_export_or_sidecar_is_refused(export_of_a_run, tiny_data, capsys, file, how, message):
    path = export_of_a_run / file
    if file == "model.safetensors":
        shutil.copy(export_of_a_run / "model.pt.json", export_of_a_run / "model.safetensors.json")
    sidecar = json.loads((export_of_a_run / "model.pt.json").read_text())
    if how == "not json":
        path.write_text("{'class_names': ")
    elif how == "no classes":
        path.write_text(json.dumps({**sidecar, "class_names": None}))
    elif how == "an empty class name":  # predict printed a nameless class; evaluate blamed the data folder
        path.write_text(json.dumps({**sidecar, "class_names": ["", *sidecar["class_names"][1:]]}))
    elif how == "a lone surrogate":  # no file name decodes to it: predict's print failed in a traceback
        path.write_text(json.dumps({**sidecar, "class_names": ["\ud800", *sidecar["class_names"][1:]]}))
    elif how == "two classes":
        path.write_text(json.dumps({**sidecar, "class_names": sidecar["class_names"][:2]}))
    elif how == "a million pixels":  # a DataLoader worker was killed for memory, then a traceback
        path.write_text(json.dumps({**sidecar, "image_size": 10**6}))
    elif how == "10**400 pixels":  # an OverflowError in predict
        path.write_text(json.dumps({**sidecar, "image_size": 10**400}))
    elif how == "a model that cannot take its size":
        path.write_text(json.dumps({**sidecar, "model": "vit_h_14"}))
    elif how == "a ratio of 400 digits":  # an OverflowError in the preprocessing check
        path.write_text(json.dumps({**sidecar, "preprocessing": {**sidecar["preprocessing"], "resize_ratio": 10**400}}))
    elif how == "a class twice":  # predict named two outputs alike; evaluate blamed the data folder
        path.write_text(json.dumps({**sidecar, "class_names": sidecar["class_names"][:1] * 2
                                    + sidecar["class_names"][2:]}))
    else:
        damage(path, how, export_of_a_run / "ran")
    model = str(export_of_a_run / ("model.safetensors" if file == "model.safetensors" else "model.pt"))
    for main, argv in users_of_a_model(model, tiny_data, export_of_a_run)[1:]:
        assert_usage_error_in_process(main, argv, capsys, message)
    assert not (export_of_a_run / "ran").exists()


def disk_full(obj, path, *args, **kwargs):
    with open(path, "wb") as f:
        f.write(b"half a file")
    raise OSError(28, "No space left on device")


def refuse_replacing(name):
    """os.replace that fails onto `name`, as onto an immutable file or one open in another process on Windows."""
    replace = os.replace

    def refusing(src, dst):
        if os.path.basename(dst) == name:
            raise PermissionError(1, "Operation not permitted", str(dst))
        replace(src, dst)
    return refusing


@pytest.mark.slow
def test_an_export_into_a_folder_that_takes_no_file_is_one_line(export_of_a_run, capsys):
    # /proc: a folder its permission bits call writable, that refuses new files
    assert_usage_error_in_process(export_model.main, [str(export_of_a_run / "last"), "--output", "/proc/model.pt"],
                                  capsys, "--output /proc: cannot write in /proc (")


def test_an_export_names_the_file_it_wrote(export_of_a_run, tmp_path, capsys):
    export_model.main([str(export_of_a_run / "last"), "--output", f"{tmp_path / 'm.pt'}/"])  # a trailing slash
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'm.pt'} (") and (tmp_path / "m.pt.json").is_file()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_an_export_and_its_sidecar_are_as_readable_as_the_files_open_makes(tmp_path, monkeypatch, suffix):
    """safetensors writes a file of its own, private (0600), in the temporary file's place: other users of the
    machine could not read a .safetensors export, where a .pt one was 0644."""
    from deepspeed_image_trainer.models.build import build_model

    info = {"model": "ResNet18Animals90", "class_names": ["a", "b", "c"], "image_size": 32, "epoch": 1,
            "folder": str(tmp_path / "ck")}
    state_dict = build_model("resnet18", 3, 32).state_dict()
    monkeypatch.setattr(export_model, "consolidated_state_dict", lambda checkpoint, ema=False: (state_dict, info))
    umask = os.umask(0o022)
    try:
        (tmp_path / "opened").write_text("")
        export_model.main(["ck", "--output", str(tmp_path / f"model{suffix}")])
    finally:
        os.umask(umask)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in ("opened", f"model{suffix}",
                                                                         f"model{suffix}.json")}
    assert modes == dict.fromkeys(modes, 0o644)


@pytest.mark.slow
@pytest.mark.parametrize("failure, output, message", [
    ("torch.save", "model.pt", "[Errno 28] No space left"),
    ("model rename", "model.pt", "[Errno 1] Operation not permitted"),
    ("sidecar rename", "model.pt", "[Errno 1] Operation not permitted"),  # after the model's: undone
    ("file size limit", "model.safetensors", "[Errno 27] File too large"),  # a real failed write (ulimit -f)
])
def test_a_failed_export_leaves_the_earlier_one_as_it_was(export_of_a_run, tiny_data, monkeypatch, capsys, failure,
                                                          output, message):
    import resource

    last, output = str(export_of_a_run / "last"), str(export_of_a_run / output)
    if output.endswith(".safetensors"):
        export_model.main([last, "--output", output])
    before = digests(export_of_a_run)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if failure == "torch.save":
        monkeypatch.setattr(export_model.torch, "save", disk_full)
    elif failure == "file size limit":  # Python ignores SIGXFSZ: the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limit[1]))
    else:
        refused = os.path.basename(output) + (".json" if failure == "sidecar rename" else "")
        monkeypatch.setattr(os, "replace", refuse_replacing(refused))
    try:
        with pytest.raises(SystemExit) as exited:
            run_cli(export_model.main, [last, "--output", output])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        monkeypatch.undo()
    err = capsys.readouterr().err
    assert exited.value.code == 4 and err.count("\n") == 1, err  # a failed write: exit status 4
    assert err.startswith(f"error: cannot write the export: {message}") and "export again" in err, err
    assert digests(export_of_a_run) == before  # no temporary file left either
    predict.main(["--model", output, str(tiny_data / "val")])  # the earlier export still works
    assert capsys.readouterr().out.count(".jpg") == TINY_CLASSES * 5


@pytest.mark.slow
def test_a_model_paired_with_another_exports_sidecar_is_refused(export_of_a_run, trained, tiny_data, capsys):
    """What a kill between the export's two renames leaves: the new model beside the earlier sidecar."""
    workdir, _ = trained("zero0")
    other = str(export_of_a_run / "epoch_1.pt")
    export_model.main([str(workdir / "checkpoints_deepspeed/epoch_1"), "--output", other])
    shutil.copy(other, export_of_a_run / "model.pt")  # the sidecar is last epoch's
    for main, argv in users_of_a_model(str(export_of_a_run / "model.pt"), tiny_data, export_of_a_run)[1:]:
        assert_usage_error_in_process(main, argv, capsys, "is not the file "
                                      f"{export_of_a_run / 'model.pt.json'} was written with")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["files removed", "tag folder removed", "tag names no folder", "class_names 5"])
def test_resume_auto_passes_over_a_checkpoint_with_files_missing(trained, tmp_path, monkeypatch, capsys, how):
    from deepspeed_image_trainer.outputs.checkpoints import find_checkpoint

    workdir, first = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    last = tmp_path / "checkpoints_deepspeed/last"
    if how == "files removed":  # an interrupted copy
        for path in (last / "last").glob("*.pt"):
            path.unlink()
    elif how == "tag folder removed":
        shutil.rmtree(last / "last")
    elif how == "tag names no folder":
        info = json.loads((last / "extra_info.json").read_text())
        (last / "extra_info.json").write_text(json.dumps({**info, "tag": "nothing_here"}))
    else:
        damage(last / "extra_info.json", "class_names 5", None)
    skipped = []
    assert find_checkpoint("auto", tmp_path / "checkpoints_deepspeed", skipped).name in ("best_model", "epoch_2")
    assert [folder.name for folder, _ in skipped] == ["last"]
    why = "(class_names of the wrong kind)" if how == "class_names 5" else "1 of its files are missing"
    before = digests(tmp_path)
    monkeypatch.chdir(tmp_path)
    _, err = assert_usage_error_in_process(launch_deepspeed.main, first.args[2:] + ["--epochs", "3", "--resume", "last"],
                                           capsys, "" if how == "class_names 5" else
                                           "cannot resume from checkpoints_deepspeed/last: 1 of its files are missing (")
    assert why in err
    launch_deepspeed.main(first.args[2:] + ["--epochs", "3", "--resume", "auto", "--dry_run"])
    assert "warning: --resume auto skips checkpoints_deepspeed/last" in (err := capsys.readouterr().err) and why in err
    assert digests(tmp_path) == before


def _train_in(rank, port, results, workdir, argv):
    from deepspeed_image_trainer.cli import train

    os.chdir(workdir)
    os.environ["MASTER_PORT"] = str(port)
    results["status"] = train.main(argv)


@pytest.mark.slow
def test_a_checkpoint_of_another_model_swapped_in_is_one_line(trained, tmp_path):
    """A model-states file whose head has another class count (from another run): torch's size mismatch
    traceback in the rank; and an edited run_started made --resume auto fail in a TypeError."""
    workdir, first = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    states = tmp_path / "checkpoints_deepspeed/last/last/mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)
    saved["module"].update({"fc.weight": torch.zeros(4, 512), "fc.bias": torch.zeros(4)})
    torch.save(saved, states)
    info = tmp_path / "checkpoints_deepspeed/best_model/extra_info.json"
    info.write_text(json.dumps({**json.loads(info.read_text()), "run_started": "x"}))
    before = digests(tmp_path)
    result = launch(first.args[2:] + ["--epochs", str(TRAINED_EPOCHS + 1), "--resume", "auto"], tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 2, result.stderr[-3000:]
    assert lines[0].endswith("best_model/extra_info.json is not a checkpoint description this trainer wrote "
                             "(run_started of the wrong kind)")
    assert lines[1].startswith("error: cannot resume from checkpoints_deepspeed/last: its files do not fit this run's "
                               "model and optimizer (size mismatch for fc.weight")
    # the checkpoints and history as they were; ds_config.json is each launch's own, written before its ranks start
    after = digests(tmp_path)
    assert {k: v for k, v in after.items() if k != "logs/ds_config.json"} == {
        k: v for k, v in before.items() if k != "logs/ds_config.json"}


@pytest.mark.slow
def test_resuming_a_finished_run_trains_nothing_and_changes_nothing(trained, tmp_path, tmp_path_factory, monkeypatch,
                                                                   capsys):
    workdir, first = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    before = digests(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert launch_deepspeed.main(first.args[2:] + ["--resume", "auto"]) == 0
    assert capsys.readouterr().out == (f"Nothing to train: checkpoints_deepspeed/last ends at epoch {TRAINED_EPOCHS} "
                                       f"and --epochs is {TRAINED_EPOCHS}; its checkpoints and history are left as "
                                       "they are (a larger --epochs trains on)\n")
    # the training script run directly says the same once it holds the folders, and that the run has finished
    marker = tmp_path_factory.mktemp("marker") / "finished"
    monkeypatch.setenv("TRAINER_FINISHED_FILE", str(marker))
    assert spawn_ranks(_train_in, 1, tmp_path, first.args[2:] + ["--resume", "last"])["status"] == 0
    assert digests(tmp_path) == before and marker.read_text() == "finished\n"


@pytest.mark.slow
def test_a_checkpoint_stopped_in_an_epoch_past_epochs_trains_nothing(trained, tmp_path, monkeypatch, capsys):
    """A checkpoint saved in epoch N (a stop mid-epoch) resumed with --epochs below N trained nothing and
    rewrote the history's config.epochs, silently."""
    workdir, first = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    info_path = tmp_path / "checkpoints_deepspeed/last/extra_info.json"
    info = {key: value for key, value in json.loads(info_path.read_text()).items() if key != "metrics"}
    info_path.write_text(json.dumps({**info, "interrupted_at": {"epoch": TRAINED_EPOCHS + 1, "step": 1, "samples": 4}}))
    before = digests(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert launch_deepspeed.main(first.args[2:] + ["--resume", "auto", "--epochs", str(TRAINED_EPOCHS)]) == 0
    assert capsys.readouterr().out.startswith(f"Nothing to train: checkpoints_deepspeed/last stopped in epoch "
                                              f"{TRAINED_EPOCHS + 1} and --epochs is {TRAINED_EPOCHS}")
    assert digests(tmp_path) == before


@pytest.mark.slow
def test_a_dry_run_refuses_what_the_run_refuses_when_no_checkpoint_is_left(trained, tmp_path, monkeypatch, capsys):
    """--resume auto --dry_run passed over every damaged checkpoint with a warning and exited 0, where the run
    then refused to start over the earlier results."""
    workdir, first = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    for info_path in (tmp_path / "checkpoints_deepspeed").glob("*/extra_info.json"):
        info_path.write_text("{")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        run_cli(launch_deepspeed.main, first.args[2:] + ["--resume", "auto", "--dry_run"])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and not out
    assert err.count("warning: --resume auto skips") == 4 and err.splitlines()[-1].startswith(
        "error: --resume auto found no checkpoint to continue from, but these hold an earlier run's results")


@pytest.mark.slow
@pytest.mark.parametrize("how, message", [
    ("payload", "zero_pp_rank_1_mp_rank_00_optim_states.pt holds Python objects other than tensors"),
    # trained on silently: each rank's shard holds its own part of the optimizer
    ("rank 0's copied", "zero_pp_rank_1_mp_rank_00_optim_states.pt is the same file as "
                        "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("ranks swapped", "zero_pp_rank_1_mp_rank_00_optim_states.pt holds parameters that come before rank 0's"),
    # a KeyError: 'module' in DeepSpeed's load, in every rank
    ("model states a state_dict", "mp_rank_00_model_states.pt is not a DeepSpeed checkpoint file (it holds no "
                                  "'module')"),
    # the weights' average (--model_ema): its safetensors headers, read before any rank starts
    ("average garbage", "the weights' average (--model_ema) cannot be read (Error while deserializing header")])
def test_a_shard_no_rank_can_load_stops_the_launcher(trained, tmp_path, monkeypatch, capsys, how, message):
    """The launcher reads every shard as the load will, before any rank starts: a valid zip archive whose pickle
    names other objects, a copy of another rank's shard, a file without what DeepSpeed reads from it."""
    workdir, first = trained("zero2-2ranks")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    tag = tmp_path / "checkpoints_deepspeed/last/last"
    shard = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if how == "payload":
        damage(shard, how, tmp_path / "ran")
    elif how == "rank 0's copied":
        shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", shard)
    elif how == "ranks swapped":
        (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(tag / "swapped")
        shard.rename(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (tag / "swapped").rename(shard)
    elif how.startswith("average"):
        damage_average(tag, how, None)
    else:
        torch.save(torchvision.models.resnet18().state_dict(), tag / "mp_rank_00_model_states.pt")
    before = digests(tmp_path)
    monkeypatch.chdir(tmp_path)
    _, err = assert_usage_error_in_process(launch_deepspeed.main, first.args[2:] + ["--epochs", "3", "--resume", "last"],
                                           capsys, "cannot resume from checkpoints_deepspeed/last: ")
    assert message in err
    assert not (tmp_path / "ran").exists() and digests(tmp_path) == before


def damage_average(tag, how, other_tag):
    """The weights' average's files in checkpoint folder `tag` damaged as `how` says (`other_tag`: another
    checkpoint's tag folder of the same run)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    average, first_file = tag / "ema_rank1.safetensors", tag / "ema_rank0.safetensors"
    with safe_open(first_file, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(first_file)
    if how == "average garbage":
        average.write_bytes(b"\xff" * 100)
    elif how == "average a FIFO":
        average.unlink()
        os.mkfifo(average)
    elif how == "average of another checkpoint":
        shutil.copy(other_tag / "ema_rank1.safetensors", average)
    elif how == "average of one rank's run":  # as a one-rank run writes it
        save_file(tensors, first_file, metadata={**metadata, "files": "1"})
    elif how == "average's buffer cut":
        save_file({**tensors, "buffer:bn1.running_mean": torch.zeros(10)}, first_file, metadata=metadata)
    elif how == "average's part unnamed":
        tensors["bn1.bias"] = tensors.pop("bn1.bias@0")
        save_file(tensors, first_file, metadata=metadata)
    elif how == "average's parts overlap":  # rank 0's first part in rank 1's file too
        with safe_open(average, "pt") as f:
            other_metadata = f.metadata()
        save_file({**load_file(average), "bn1.bias@0": tensors["bn1.bias@0"]}, average, metadata=other_metadata)
    elif how == "average in fp16":
        save_file({k: v.half() for k, v in tensors.items()}, first_file, metadata=metadata)
    else:  # its metadata lies
        save_file(tensors, first_file, metadata={**metadata, "files": "2.5"})


@pytest.mark.parametrize("how, message", [
    ("average a FIFO", "ema_rank1.safetensors is missing or not a regular file"),
    ("average's metadata lies", "ema_rank0.safetensors's metadata is not the trainer's"),
    ("average in fp16", "bn1.bias@0 is F16, not fp32"),
    ("average of another checkpoint", "ema_rank1.safetensors belongs to another checkpoint"),
    ("average of one rank's run", "ema_rank0.safetensors names 1 file(s), the checkpoint 2"),
    ("average's buffer cut", "buffer:bn1.running_mean is [10], its metadata says [64]"),
    ("average's part unnamed", "bn1.bias is not the part of a weight its metadata names"),
    ("average's parts overlap", "the parts of bn1.bias do not cover it once")])
def test_the_weights_averages_files_are_checked_as_one_set(trained, tmp_path, how, message):
    """What the launcher (above), a rank's resume and export --ema read before trusting the average's files: each
    of a two-rank checkpoint's files damaged as a user's copy or a crafted file could be."""
    from deepspeed_image_trainer.engine.ema import read_files

    workdir, _ = trained("zero2-2ranks")
    checkpoints = workdir / "checkpoints_deepspeed"
    tag = tmp_path / "last"
    shutil.copytree(checkpoints / "last/last", tag, ignore=shutil.ignore_patterns("*.pt"))
    damage_average(tag, how, checkpoints / "epoch_1/epoch_1")
    info = read_info(checkpoints / "last")
    with pytest.raises(UsageError, match=f"^{re.escape(str(tag))}: the weights' average \\(--model_ema\\) cannot be read "
                                         f"\\({re.escape(message)}"):
        read_files(tag, info)
    read_files(checkpoints / "last/last", info)  # the run's own


@pytest.mark.slow
def test_resuming_from_a_truncated_checkpoint_stops_with_a_hint(trained, tiny_data, tmp_path, monkeypatch, capsys):
    workdir, first = trained("zero0")
    for name in ("logs", "checkpoints_deepspeed"):
        shutil.copytree(workdir / name, tmp_path / name)
    damage(tmp_path / "checkpoints_deepspeed/last/last/mp_rank_00_model_states.pt", "truncated", None)
    before = digests(tmp_path / "checkpoints_deepspeed"), (tmp_path / "logs/training_history.json").read_bytes()
    monkeypatch.chdir(tmp_path)  # the launcher stops before any process starts
    _, err = assert_usage_error_in_process(launch_deepspeed.main, first.args[2:] + ["--epochs", "3", "--resume", "last"],
                                           capsys, "mp_rank_00_model_states.pt is cut short or not a torch file")
    assert "cannot resume from checkpoints_deepspeed/last" in err and "resume from another checkpoint" in err
    assert (digests(tmp_path / "checkpoints_deepspeed"), (tmp_path / "logs/training_history.json").read_bytes()) == before


# --- the command-line tools' own flags ---------------------------------------------------------------------

TOOLS = {"launch_deepspeed.py": launch_deepspeed.main, "train_deepspeed.py": train_deepspeed.main,
         "evaluate.py": evaluate.main, "predict.py": predict.main, "export_model.py": export_model.main,
         "prepare_data.py": prepare_data.main, "utils.py": utils.main, "memory_profile.py": memory_profile.main}
SAMPLE = ["--num_classes", "2", "--train_per_class", "1", "--val_per_class", "1", "--image_size", "16"]
WORD_OR_PATH = ("--cache_dir", "--pretrained", "--deepspeed_config", "--resume")  # say so in check_values' words
EMPTY_PATHS = [  # (tool, its other arguments, the argument given as '')
    *(("launch_deepspeed.py", ["--dry_run"], flag)
      for flag in ("--train_dir", "--val_dir", "--checkpoint_dir", "--log_dir", "--hostfile", *WORD_OR_PATH)),
    ("train_deepspeed.py", [], "--train_dir"),
    *(("evaluate.py", ["--model", "m.pt"], flag) for flag in ("--model", "--data_dir", "--output_dir")),
    ("predict.py", ["x.jpg"], "--model"), ("predict.py", ["--model", "m.pt"], "IMAGE_OR_DIR"),
    ("export_model.py", ["--output", "m.pt"], "checkpoint"), ("export_model.py", ["ck"], "--output"),
    ("prepare_data.py", [], "--check"), ("prepare_data.py", ["split"], "raw_dir"),
    ("prepare_data.py", ["split", "raw"], "--output"), ("prepare_data.py", ["sample", *SAMPLE], "--output"),
    ("utils.py", [], "--history"), ("utils.py", [], "--output"),
    ("memory_profile.py", ["--steps", "0"], "--output_dir"),  # --steps 0: a miss stops before measuring
]


@pytest.mark.parametrize("tool, argv, flag", EMPTY_PATHS,
                         ids=[f"{tool} {argv[0] + ' ' if tool == 'prepare_data.py' and argv else ''}{flag}"
                              for tool, argv, flag in EMPTY_PATHS])
def test_an_empty_path_is_refused_by_every_tool(tiny_data, tmp_path, monkeypatch, capsys, tool, argv, flag):
    """'' (an unset shell variable) failed in os.scandir('') with a traceback, or was the current folder: --check
    checked it, predict predicted its images, a sample dataset was drawn into it."""
    monkeypatch.chdir(tmp_path)
    argv = (data_args(tiny_data) if tool.startswith(("launch", "train")) else []) + argv
    argv += [flag, ""] if flag.startswith("-") else [""]
    message = (f"error: {flag} is empty: give" if flag in WORD_OR_PATH
               else f"error: argument {flag}: empty: give a path ('' names no file or folder)")
    assert_usage_error_in_process(TOOLS[tool], argv, capsys, message)
    assert not any(tmp_path.iterdir())


LONG = "b" * 300  # longer than a name may be (NAME_MAX, 255 bytes here): an OSError [Errno 36] traceback
LONG_NAMES = [  # (tool, its other arguments, the flag, its value)
    *(("launch_deepspeed.py", ["--dry_run"], flag, f"rl/{LONG}")
      for flag in ("--checkpoint_dir", "--log_dir", "--train_dir", "--resume")),
    ("launch_deepspeed.py", ["--dry_run", "--data_on_device", "cache"], "--cache_dir", f"rl/{LONG}"),
    ("launch_deepspeed.py", [], "--deepspeed_config", f"{LONG}.json"),
    ("launch_deepspeed.py", [], "--pretrained", f"{LONG}.pt"),
    ("evaluate.py", ["--model", "m.pt"], "--output_dir", f"rl/{LONG}"),
    ("predict.py", ["--model", "m.pt"], "IMAGE_OR_DIR", f"{LONG}.jpg"),
    ("export_model.py", ["ck"], "--output", f"{LONG}.pt"),  # was status 4, 'free disk space'
    ("export_model.py", ["ck"], "--output", f"rl/{LONG}/x.pt"),
    ("prepare_data.py", [], "--check", LONG), ("prepare_data.py", ["sample", *SAMPLE], "--output", f"rl/{LONG}"),
    ("utils.py", [], "--output", f"{LONG}.png"),
    ("memory_profile.py", ["--steps", "0"], "--output_dir", f"rl/{LONG}"),
]


@pytest.mark.parametrize("tool, argv, flag, value", LONG_NAMES,
                         ids=[f"{tool} {flag} {value[:3]}" for tool, _, flag, value in LONG_NAMES])
def test_a_name_too_long_for_the_file_system_is_refused_by_every_tool(tiny_data, tmp_path, monkeypatch, capsys, tool,
                                                                      argv, flag, value):
    monkeypatch.chdir(tmp_path)
    argv = (data_args(tiny_data) if tool.startswith(("launch", "train")) else []) + argv
    argv += [flag, value] if flag.startswith("-") else [value]
    _, err = assert_usage_error_in_process(TOOLS[tool], argv, capsys, "bbbbbbbbbbbbbbbbbbbb...(30")
    assert "a name in it is longer than the file system allows (255 bytes)" in err
    assert not any(tmp_path.iterdir())


# --- JSON nested deeper than Python's parser reads ---------------------------------------------------------

def deep_json(path, levels=5000):
    """`path` holding JSON nested `levels` deep (5000: json.loads raises RecursionError, which no reader caught)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"a": ' * levels + "1" + "}" * levels)
    return path


def read_sidecar(folder):
    (folder / "model.pt").write_bytes(b"")  # the sidecar is read first
    deep_json(folder / "model.pt.json")
    return load_model(folder / "model.pt", "cpu")


def read_safetensors_metadata(folder):
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(1)}, str(folder / "m.safetensors"),
              metadata={"class_names": deep_json(folder / "names.json").read_text()})
    return load_model(folder / "m.safetensors", "cpu")


def read_memory_report(folder):
    args = memory_profile.get_args_parser().parse_args(["--update", "--output_dir", str(folder)])
    env = memory_profile.environment()
    deep_json(memory_profile.results_path(args, env, 1))
    return memory_profile.earlier_results(args, env, 1)


# Each reader of a JSON file given a deep one, and its answer to any other damaged file: a one-line refusal (the
# regex), or what it falls back to.
DEEP_JSON_READERS = {
    "--deepspeed_config": (lambda tmp: load_base_config(deep_json(tmp / "ds.json")),
                           r"--deepspeed_config .*ds.json: not valid JSON \(nested too deeply to read\)"),
    "--deepspeed_config 500 levels": (  # parsed, then copying it ended in a RecursionError
        lambda tmp: load_base_config(deep_json(tmp / "ds.json", 500)),
        r"ds.json: not valid JSON \(nested more than 100 levels deep\)"),
    "utils.py --history": (lambda tmp: utils.load_history(deep_json(tmp / "h.json")),
                           r"h.json is not a training history file \(nested too deeply to read\)"),
    "an export's sidecar": (read_sidecar,
                            r"model.pt.json is unreadable \(nested too deeply to read\): export the model again"),
    "a .safetensors file's metadata": (read_safetensors_metadata,
                                       r"m.safetensors is damaged or not a safetensors file \(nested too deeply"),
    "a checkpoint's extra_info.json (export, --resume)": (
        lambda tmp: read_info(deep_json(tmp / "last/extra_info.json").parent),
        r"last/extra_info.json is unreadable \(nested too deeply to read\): use another checkpoint"),
    "memory_profile.py --update": (read_memory_report,
                                   r"is not a memory report's JSON \(ValueError: nested too deeply to read\)"),
    "the data check's cache": (lambda tmp: deep_json(cache_path(tmp)) and load_cache(tmp), {}),  # inspected again
    "a decoded-image cache entry's meta.json": (  # filled again
        lambda tmp: open_entry(deep_json(tmp / "entry/meta.json").parent, 1, 32), None),
    "the history file a resumed run rewrites": (  # rewritten
        lambda tmp: TrainingHistory(deep_json(tmp / "h.json"), {}).file_is_behind(), True),
    "a sample dataset's marker": (  # no images there yet: drawn
        lambda tmp: make_sample_dataset(deep_json(tmp / "data/sample_dataset.json").parent, 2, 1, 1, 16, 0),
        {"train": 2, "val": 2}),
}


@pytest.mark.parametrize("reader", DEEP_JSON_READERS)
def test_json_nested_too_deeply_is_a_damaged_file_to_every_reader(tmp_path, monkeypatch, reader):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    read, expected = DEEP_JSON_READERS[reader]
    if isinstance(expected, str):
        with pytest.raises(UsageError, match=expected):
            read(tmp_path)
    else:
        assert read(tmp_path) == expected


@pytest.mark.parametrize("inside", ["val", "val/bat", "train/../val/bat/more"])
def test_evaluate_refuses_an_output_folder_in_the_images_it_evaluates(tiny_data, capsys, inside):
    """Its confusion_matrix.png in val/bat was an image of a bat to the next evaluation."""
    before = digests(tiny_data)
    assert_usage_error_in_process(evaluate.main, ["--model", "model.pt", "--data_dir", str(tiny_data / "val"),
                                                  "--output_dir", str(tiny_data / inside)], capsys,
                                  f"--output_dir {tiny_data / inside} is inside --data_dir {tiny_data / 'val'}")
    assert digests(tiny_data) == before and not (tiny_data / "val/bat/more").exists()


@pytest.mark.parametrize("name, kind", [("report.json", "folder"), ("confusion_matrix.png", "fifo"),
                                        ("report.json", "fifo"), ("confusion_matrix.png", "folder"),
                                        ("confusion_matrix.png", "device"), ("report.json", "link to nothing")])
def test_evaluate_refuses_an_output_name_taken_by_what_is_not_a_file_before_evaluating(tmp_path, monkeypatch, capsys,
                                                                                       name, kind):
    """A folder at report.json ended in a traceback from its rename, a FIFO at confusion_matrix.png in one from
    savefig after report.json was written: both after evaluating."""
    output_dir, path = tmp_path / "eval", tmp_path / "eval" / name
    output_dir.mkdir()
    {"folder": path.mkdir, "fifo": lambda: os.mkfifo(path), "device": lambda: path.symlink_to("/dev/null"),
     "link to nothing": lambda: path.symlink_to(tmp_path / "missing" / name)}[kind]()
    monkeypatch.setattr(evaluate, "load_model", lambda *args: pytest.fail("evaluated before the refusal"))
    what = "a folder" if kind == "folder" else "not a regular file (a FIFO, a socket, a device or a link to nothing)"
    assert_usage_error_in_process(evaluate.main, ["--model", "model.pt", "--data_dir", str(tmp_path / "val"),
                                                  "--output_dir", str(output_dir)], capsys,
                                  f"--output_dir {output_dir}: {path} is {what}: move it away or choose another "
                                  "--output_dir")
    assert [p.name for p in output_dir.iterdir()] == [name]


@pytest.mark.slow
def test_the_tools_refuse_values_no_run_can_use(export_of_a_run, tiny_data, capsys):
    model = str(export_of_a_run / "model.pt")
    (export_of_a_run / "a_file").write_text("")
    cases = [(evaluate.main, ["--model", model, "--batch_size", "0"], "--batch_size must be at least 1, got 0"),
             (evaluate.main, ["--model", model, "--num_workers", "-1"], "--num_workers must be at least 0, got -1"),
             (evaluate.main, ["--model", model, "--num_workers", "100000"],
              "--num_workers 100000 is more than 8 DataLoader worker processes per CPU"),
             (evaluate.main, ["--model", model, "--output_dir", str(export_of_a_run / "a_file/eval")], "is not a folder"),
             (predict.main, ["--model", model, "--batch_size", "0", str(tiny_data)], "--batch_size must be at least 1"),
             (export_model.main, [str(export_of_a_run / "last"), "--output", str(export_of_a_run)],
              "use a file name ending in .pt"),
             (export_model.main, [str(export_of_a_run / "last"), "--output", str(export_of_a_run / "dir.pt")],
              "is a folder"),
             (export_model.main, [str(export_of_a_run / "last"), "--output",  # it replaced the file it reads
                                  str(export_of_a_run / "last/last/mp_rank_00_model_states.pt")],
              "is inside the checkpoint"),
             (export_model.main, [str(export_of_a_run / "last"), "--output",  # the next save of best removed it
                                  str(export_of_a_run / "best/model.pt")], "which a run replaces whole"),
             # the next save of that checkpoint removed what was written there
             (evaluate.main, ["--model", model, "--output_dir", str(export_of_a_run / "last")], "is inside the checkpoint"),
             (utils.main, ["--output", str(export_of_a_run / "last/last/curves.png")], "which a run replaces whole"),
             (utils.main, ["--output", str(export_of_a_run / "curves.xyz")], "use a file name ending in .png"),
             (utils.main, ["--output", str(export_of_a_run / "a_file/curves.png")], "is not a folder")]
    (export_of_a_run / "dir.pt").mkdir()
    shutil.copytree(export_of_a_run / "last", export_of_a_run / "best")  # another checkpoint of the run
    states = digests(export_of_a_run / "last")
    for main, argv, message in cases:
        assert_usage_error_in_process(main, argv, capsys, message)
    assert digests(export_of_a_run / "last") == states


@pytest.mark.slow
def test_predict_skips_what_is_not_an_image_file_in_a_folder(export_of_a_run, tiny_data, tmp_path, capsys):
    folder = tmp_path / "photos"
    (folder / "dir.jpg").mkdir(parents=True)  # a folder named like an image: not a photo, passed over
    os.mkfifo(folder / "x.jpg")  # reading it would wait for a writer for good
    shutil.copy(next((tiny_data / "val").rglob("*.jpg")), folder / "photo.jpg")
    (folder / "broken.jpg").write_bytes(b"not a jpeg")  # one bad photo does not cost the others their predictions
    os.symlink(tmp_path / "nowhere.jpg", folder / "link.jpg")  # nor a link to nothing, which is said too
    os.symlink("/dev/zero", folder / "zero.jpg")  # nor a device
    model = str(export_of_a_run / "model.pt")
    predict.main(["--model", model, str(folder)])
    out, err = capsys.readouterr()
    assert [line.split(":")[0] for line in out.splitlines()] == [str(folder / "photo.jpg")]
    assert [line.split(": ")[:2] for line in err.splitlines()] == [["warning", str(folder / name)] for name in (
        "broken.jpg", "link.jpg", "x.jpg", "zero.jpg")]
    assert all(line.endswith("left out") and "not a readable image (" in line for line in err.splitlines())
    assert err.count("not a regular file: a FIFO or a device") == 2
    predict.main(["--model", model, "--json", str(folder)])
    broken, link, photo, fifo, zero = json.loads(capsys.readouterr().out)
    assert broken["image"] == str(folder / "broken.jpg") and broken["error"].startswith("not a readable image (")
    assert link["image"] == str(folder / "link.jpg") and "error" in link and "error" in fifo and "error" in zero
    assert photo["image"] == str(folder / "photo.jpg") and len(photo["predictions"]) == 3
    # Named on the command line, a FIFO is left out in the same way and the others are predicted
    predict.main(["--model", model, str(folder / "x.jpg"), str(folder / "photo.jpg")])
    out, err = capsys.readouterr()
    assert out.startswith(str(folder / "photo.jpg")) and err.startswith(f"warning: {folder / 'x.jpg'}: ")
    # A file without an image suffix in a folder is passed over as training's check does: said
    (tmp_path / "more").mkdir()
    shutil.copy(folder / "photo.jpg", tmp_path / "more/photo.jpg")
    (tmp_path / "more/anim.gif").write_bytes(b"GIF89a")
    predict.main(["--model", model, str(tmp_path / "more")])
    assert capsys.readouterr().err == (f"warning: ignoring 1 file(s) without an image suffix in {tmp_path / 'more'}: "
                                       f"{tmp_path / 'more/anim.gif'}\n")
    (folder / "photo.jpg").unlink()
    assert_usage_error_in_process(predict.main, ["--model", model, str(folder)], capsys,
                                  "broken.jpg: not a readable image (")
    assert_usage_error_in_process(predict.main, ["--model", model, str(folder / "x.jpg")], capsys,
                                  "x.jpg: not a readable image (not a regular file: a FIFO or a device)")


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"\xff" * 30])
def test_predict_names_an_image_pil_cannot_parse(export_of_a_run, tmp_path, capsys, content):
    (tmp_path / "broken.png").write_bytes(content)
    assert_usage_error_in_process(predict.main, ["--model", str(export_of_a_run / "model.pt"),
                                                 str(tmp_path / "broken.png")], capsys, "broken.png: not a readable image")


# --- a seeded fuzz: bytes changed at random in what the tools read --------------------------------------------

FUZZ_SEEDS = range(int(os.environ.get("FUZZ_SEEDS", 4)))


def pickle_bytes(path):
    """(start, end) of the pickle inside a torch zip file: structure rather than tensor values (which carry
    no checksum: a changed weight is a valid file)."""
    with zipfile.ZipFile(path) as archive:
        entry = next(e for e in archive.infolist() if e.filename.endswith("data.pkl"))
    header = path.read_bytes()[entry.header_offset:entry.header_offset + 30]
    start = entry.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return start, start + entry.compress_size


def change_bytes(path, seed, span=None):
    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    start, end = span or (0, len(data))
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(start, end)] = rng.randrange(256)
    path.write_bytes(bytes(data))


def assert_works_or_refuses(main, argv, capsys):
    """Success, or one error line with exit status 2: never a traceback."""
    with pytest.raises(SystemExit) as exited:
        sys.exit(run_cli(main, argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    assert exited.value.code in (0, None) or (exited.value.code == 2 and err.startswith("error: ")
                                               and err.count("\n") == 1), (exited.value.code, err[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("seed", FUZZ_SEEDS)
def test_fuzzed_checkpoints_exports_sidecars_and_images(export_of_a_run, tiny_data, tmp_path_factory, capsys,
                                                        monkeypatch, seed):
    """Each seed changes a few bytes of the checkpoint's description, its model-states pickle, the export's
    pickle, its sidecar and an image; resume (the launcher's checks), export, evaluate and predict each work
    or refuse in one line, and leave what they read as it was."""
    folder, model, image = export_of_a_run / "last", export_of_a_run / "model.pt", export_of_a_run / "image.jpg"
    states = folder / "last/mp_rank_00_model_states.pt"
    shutil.copy(next((tiny_data / "val").rglob("*.jpg")), image)
    change_bytes(folder / "extra_info.json", seed)
    change_bytes(states, seed, pickle_bytes(states))
    change_bytes(model, seed, pickle_bytes(model))
    change_bytes(export_of_a_run / "model.pt.json", seed)
    change_bytes(image, seed, (0, 200))  # the headers
    before = digests(export_of_a_run)

    outputs = tmp_path_factory.mktemp("outputs")
    monkeypatch.chdir(outputs)
    assert_works_or_refuses(launch_deepspeed.main, data_args(tiny_data) + [
        "--resume", str(folder), "--dry_run", "--batch_size", "4", "--image_size", "32"], capsys)
    assert_works_or_refuses(export_model.main, [str(folder), "--output", str(outputs / "out.pt")], capsys)
    for main, argv in users_of_a_model(str(model), tiny_data, outputs)[1:]:
        assert_works_or_refuses(main, argv, capsys)
    assert_works_or_refuses(predict.main, ["--model", str(model), str(image)], capsys)
    assert digests(export_of_a_run) == before


# --- data that changes or loops ----------------------------------------------------------------------------

def test_links_that_loop_or_reach_another_class_are_not_read(tmp_path):
    make_sample_dataset(tmp_path, num_classes=3, train_per_class=8, val_per_class=2, image_size=32, seed=0)
    train = tmp_path / "train"
    first, second, third = sorted(p.name for p in train.iterdir())
    (train / first / "loop").symlink_to("..")
    (train / first / "self").symlink_to(".")
    (train / first / "other").symlink_to(f"../{second}")
    shutil.copytree(train / third, tmp_path / "elsewhere")
    (train / third / "more").symlink_to(tmp_path / "elsewhere")  # a link to images outside the dataset: read
    check = check_folders(train, None)
    assert {name: len(paths) for name, paths in check.train.images.items()} == {first: 8, second: 8, third: 16}
    reasons = {os.path.basename(item["path"]): item["reason"] for item in check.summary()["linked_folders_ignored"]}
    assert reasons == {"loop": "a link up to a folder that holds this class", "self": "already read: a link loop",
                       "other": "a link into another class's folder"}
    assert any("ignoring 3 folder(s) reached through links" in line for line in check.warnings())


def test_class_folders_that_are_links_to_other_classes_images_are_not_classes(tmp_path):
    make_sample_dataset(tmp_path, num_classes=3, train_per_class=4, val_per_class=1, image_size=32, seed=0)
    train = tmp_path / "train"
    first, second, third = sorted(p.name for p in train.iterdir())
    (train / "a_twin").symlink_to(first)  # sorts before its target: the real folder stays the class
    (train / "root").symlink_to(".")
    (train / "up").symlink_to(tmp_path)
    (tmp_path / "outside").mkdir()
    shutil.copytree(train / third, tmp_path / "outside/third")
    (train / "z1").symlink_to(tmp_path / "outside")  # a class of its own (outside the dataset)
    (train / "z2").symlink_to(tmp_path / "outside/third")  # inside z1's images
    check = check_folders(train, None)
    assert {name: len(paths) for name, paths in check.train.images.items()} == {first: 4, second: 4, third: 4, "z1": 4}
    reasons = {os.path.basename(item["path"]): item["reason"] for item in check.summary()["linked_folders_ignored"]}
    assert reasons == {"a_twin": f"a link to the images of class folder {first}: they would be in two classes",
                       "root": "a link up to the folder that holds the class folders",
                       "up": "a link up to the folder that holds the class folders",
                       "z2": "a link to the images of class folder z1: they would be in two classes"}


def test_an_image_rewritten_during_the_run_is_replaced_by_the_next(tmp_path, capsys):
    make_sample_dataset(tmp_path, num_classes=2, train_per_class=3, val_per_class=1, image_size=32, seed=0)
    check = check_folders(tmp_path / "train", None)
    samples = [(path, label) for label, name in enumerate(check.classes) for path in check.train.images[name]]
    dataset = ImageFiles(samples, check.classes)
    with open(samples[0][0], "w") as f:
        f.write("no longer an image")
    image, label = dataset[0]
    assert image.size == (32, 32) and label == samples[1][1]
    assert "can no longer be read" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_export_refuses_a_sidecar_name_taken_by_what_is_not_a_file_before_consolidating(tmp_path, monkeypatch, kind):
    """A folder at <output>.json: the export consolidated the checkpoint, then failed its write (status 4)."""
    from deepspeed_image_trainer.inference import export

    sidecar = tmp_path / "m.pt.json"
    sidecar.mkdir() if kind == "folder" else os.mkfifo(sidecar)
    monkeypatch.setattr(export, "consolidated_state_dict", lambda *a: pytest.fail("consolidated before the refusal"))
    with pytest.raises(UsageError, match=f"^--output {tmp_path / 'm.pt'}: {sidecar} is (a folder|not a regular file)"):
        export.export(tmp_path / "ck", tmp_path / "m.pt")
