"""Train a torchvision classifier (ResNet18Animals90 by default) with DeepSpeed: the training script's main.

    deepspeed --num_gpus=1 src/train_deepspeed.py --train_dir data/train --val_dir data/val
    python launch_deepspeed.py --num_gpus 2 --bf16          # builds the config and runs the line above
"""
import argparse
import datetime
import gc
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.cache import OFF, cache_root, check_usable
from ..data.check import decodes_every_file
from ..data.device import build_device_loaders, choose_device_data, train_square_size
from ..data.folders import build_loaders, load_datasets, with_val_sizes
from ..data.mixing import BatchMixing, batch_mixing
from ..data.recipe import recipe_of
from ..engine import overrides as deepspeed_overrides
from ..engine.config import load_base_config, precision, resolve_scheduler
from ..engine.ema import WeightEMA, saved_with_ema
from ..engine.distributed import (agreed, alike_on_each_node, all_reduce, any_rank, checked_world_size, differing,
                                  init_distributed, local_device, patient_group, rank_zero_only, restore_own_buffers,
                                  shut_down)
from ..engine.finetune import GroupLearningRates, grouping, parameter_groups, whole_run_frozen
from ..engine.interrupt import StopOnSignal, die_with_parent_call, say_finished, stopped_at_once
from ..engine.loop import (evaluate, input_dtype, no_single_rank_allreduce, peak_gpu_memory_gib,
                           replace_lr_scheduler, train_one_epoch)
from ..engine.memory import advise_on_out_of_memory, state_bytes_per_gpu, zero3_note
from ..engine.numerics import StepHealth
from ..engine.rng import restore_rng_state, rng_state, seed_everything
from ..engine.timing import StartupClock
from ..models import timm_models
from ..models.build import build_model, checked_model, preprocessing
from ..models.norms import synchronize_batch_norm
from ..models.names import saved_name
from ..outputs import run_folders, universal
from ..outputs.checkpoints import CheckpointSaver, carry_best, load
from ..outputs.history import HISTORY_FILE, TrainingHistory, epoch_line
from ..outputs.monitor import prepare_csv_files, write_epoch_events
from ..outputs.record import checkpoint_info
from ..utils.failures import CliParser, UsageError, check_writable, stop_on_write_error
from ..utils.text import listed
from .options import add_training_args, norm_batch_size, parse_args, resolved_flags
from .preflight import preflight, take_saved_weights_name, weights_to_load


@dataclass
class Run:
    """What the epoch loop works with: built once by build()."""
    args: argparse.Namespace
    clock: StartupClock
    engine: object  # DeepSpeed's engine
    ds_config: dict
    coalesced: bool
    tier: str  # the data tier: device, cache or workers
    dtype: torch.dtype  # the inputs'
    train_loader: object
    val_loader: object
    micro_batches: int  # a rank's, each epoch
    samples_per_micro_batch: int  # over all ranks: a position any world size can take up
    body_lr: GroupLearningRates | None
    history: TrainingHistory
    saver: CheckpointSaver
    health: StepHealth
    extra_info: dict
    world_size: int
    start_epoch: int
    start_step: int
    carried: dict | None  # the interrupted epoch's sums, resumed mid-epoch
    mixing: BatchMixing | None
    step_seed: tuple  # (seed, rank): train_one_epoch's
    ema: WeightEMA | None  # --model_ema

    def training_state(self, next_epoch, next_step=0, carried=None):
        """What a checkpoint holds beyond DeepSpeed's state: where to go on, the history, the RNG state."""
        return {"next_epoch": next_epoch, "next_step": next_step,
                "next_sample": next_step * self.samples_per_micro_batch, "carried": carried,
                "history": self.history.data, "rng": rng_state()}


def get_args_parser():
    parser = CliParser(description="Train a torchvision classifier on an image folder with DeepSpeed.")
    add_training_args(parser)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by `deepspeed`
    # set by launch_deepspeed.py: the folders are held for this run by the launcher that started it
    parser.add_argument("--launch_token", default=None, help=argparse.SUPPRESS)
    # set by launch_deepspeed.py: its own flags (GPUs, nodes), which the run's args.yaml records with the rest
    parser.add_argument("--launcher_flags", default=None, help=argparse.SUPPRESS)
    return parser


@rank_zero_only
def say(message):
    print(message, flush=True)


def recheck(args, inputs, classes):
    """load_datasets with every file decoded, for the DataLoader tier; the classes must be those the model
    was built for. Each node's first rank decodes and keeps the results in the check's cache, which the
    node's other ranks then read: one decode per node, not one per rank at once."""
    def decoded():
        return load_datasets(args.train_dir, args.val_dir, args.image_size, inputs, True, recipe_of(args))

    first = os.environ.get("LOCAL_RANK", "0") == "0"
    waiting = patient_group()  # the decode may outlast the default group's timeout
    error = None
    if first:
        try:
            train_set, val_set, data_check = decoded()
            data_check.save_cache()
        except Exception as err:  # noqa: BLE001 - raised below, once the other ranks know
            error = err
    if any_rank(error is not None, waiting):
        if error is not None:
            raise error
        raise UsageError("a node's first rank could not decode the dataset (its error is in its output)")
    if not first:
        train_set, val_set, data_check = decoded()
    if train_set.classes != classes:
        raise UsageError(f"{args.train_dir}: classes without a readable image once decoded: "
                         f"{listed(sorted(set(classes) - set(train_set.classes)))} (see prepare_data.py --check)")
    return train_set, val_set, data_check


def main(argv=None, process_started=None):
    """`process_started`: when this process started (time.time(), before its imports), for the startup timing."""
    try:
        return train(argv, process_started)
    finally:
        run_folders.release()  # however the run ended: another run of this process may take the folders


def train(argv, process_started):
    clock = StartupClock(process_started or time.time())
    clock.lap("imports")
    if "LOCAL_RANK" in os.environ:  # started by a launcher: stop (and save) when it dies
        die_with_parent_call(os.getppid())()
    with alike_on_each_node():
        args = parse_args(get_args_parser, argv)
    with stopped_at_once(on_stop=run_folders.release):
        run = build(args, clock)
    if run is None:  # nothing to train
        say_finished()
        return 0
    stopped = epoch_loop(run)
    return stopped if stopped is not None else finish(run)


def build(args, clock):
    """Preflight, the folders taken, the model, the engine, the data and the outputs: a Run ready to train (None
    when the checkpoint it resumes ends at --epochs: nothing to train)."""
    ranks = checked_world_size()  # a bad WORLD_SIZE, RANK, MASTER_PORT or DEEPSPEED_TIMEOUT (a rank's own)
    with alike_on_each_node():
        deepspeed_overrides.enabled()  # refuses a bad TRAINER_DEEPSPEED_OVERRIDES before any folder is made
        check_writable(args.checkpoint_dir, "--checkpoint_dir")
        check_writable(args.log_dir, "--log_dir")
        check_usable(args)
        base_config = load_base_config(args.deepspeed_config)
        take_saved_weights_name(args)
        # the mean, std and resize its weights were trained with, and the validation sizes
        inputs = with_val_sizes(preprocessing(args.model, args.pretrained), args.val_resize_size, args.val_crop_size)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        train_set, val_set, data_check = load_datasets(args.train_dir, args.val_dir, args.image_size, inputs,
                                                       decodes_every_file(args.data_on_device, device_type,
                                                                          args.cache_dir == OFF), recipe_of(args))
        weights = weights_to_load(args)
        if args.launch_token is None:  # else its launcher checked the model before any rank started
            checked_model(args.model, len(train_set.classes), args.image_size,
                          norm_batch_size(args.batch_size, args.sync_bn, ranks), weights, args.val_crop_size,
                          args.batch_size)
    if os.environ.get("RANK", "0") == "0":
        run_folders.take(args)  # before any rank looks for a checkpoint: tidying may rename one

    rank, world_size = init_distributed(on_stop=run_folders.release)  # a stop while waiting leaves no folder made
    seed_everything(args.seed)
    model = build_model(args.model, len(train_set.classes), args.image_size, weights, args.drop_path,
                        args.grad_checkpointing)
    model_name = saved_name(args.model)
    num_params = sum(p.numel() for p in model.parameters())
    # the optimizer's parameter groups, when flags cut them (fine-tuning, layer decay, weight decay by kind)
    groups = agreed(lambda: parameter_groups(model, len(train_set.classes), args) if grouping(args) else None)
    checked = agreed(lambda: preflight(args, base_config, world_size=world_size, device_type=device_type,
                                       class_names=train_set.classes, num_train_images=len(train_set),
                                       num_params=num_params, parameter_groups=len(groups or [None])))
    # for the history, before the engine takes the groups' parameters (ZeRO's optimizers empty the lists)
    decay = checked.ds_config["optimizer"]["params"].get("weight_decay")
    group_summary = [{"tensors": len(group["params"]), "weights": sum(p.numel() for p in group["params"]),
                      "layer_scale": group["layer_scale"], "body": group["body"],
                      "weight_decay": group.get("weight_decay", decay)} for group in groups or ()] or None
    if checked.finished:
        say(checked.finished)
        shut_down()
        return None
    ds_config, coalesced, resume_from, resumed_info = (checked.ds_config, checked.coalesced, checked.resume_from,
                                                       checked.resumed_info)
    earlier_run = agreed(lambda: rank_zero_only(run_folders.start)(args, resume_from))  # rank 0's refusal, for all
    run_folders.keep()  # a run refused before here leaves no folder it made
    if frozen := whole_run_frozen(args):
        say(frozen)
    if args.coalesce_grad_reduction == "on" and not coalesced:
        say("--coalesce_grad_reduction on: one micro-batch a step (--gradient_accumulation_steps 1), so nothing "
            "to coalesce")
    zero_stage = ds_config["zero_optimization"]["stage"]
    if resumed_info and universal.needed(resumed_info, world_size):
        universal.enable(ds_config)
    if device_type == "cuda":
        torch.backends.cudnn.benchmark = True
    micro_batch = ds_config["train_micro_batch_size_per_gpu"]
    accumulation = ds_config["gradient_accumulation_steps"]
    dtype = input_dtype(precision(ds_config))
    device = local_device()
    if device.type == "cuda" and (note := zero3_note(ds_config, world_size, num_params,
                                                     torch.cuda.get_device_properties(device).total_memory)):
        say(note)
    cache = cache_root(args.cache_dir)
    tier, why = choose_device_data(args.data_on_device, device, len(train_set), len(val_set), args.image_size,
                                   args.device_train_size, state_bytes_per_gpu(ds_config, world_size, num_params),
                                   cache, inputs)
    # auto decides on each rank's own GPU and disk: ranks on other tiers would wait in other collectives
    reach = ("workers", "cache", "device")
    lowest = reach[int(all_reduce({"tier": reach.index(tier)}, device, dist.ReduceOp.MIN)["tier"])]
    if lowest != tier:
        tier, why = lowest, f"{why}, but another rank's {lowest} tier, which every rank takes"
    on_device = tier != "workers"
    if not on_device and not data_check.decoded:  # nothing decodes the files the check read the headers of
        train_set, val_set, data_check = recheck(args, inputs, train_set.classes)
    if data_check.inspected:  # started without the launcher, which keeps the check's results
        rank_zero_only(data_check.save_cache)()
    for line in data_check.warnings():
        say(line)
    clock.lap("setup")

    import deepspeed

    deepspeed_overrides.install()
    unsynced = timm_models.unsynced_batch_norms(model) if args.sync_bn else 0
    if args.sync_bn and not synchronize_batch_norm(model) and not unsynced:
        say(f"--sync_bn: {model_name} has no batch norm, so there is nothing to synchronise")
    if unsynced:
        say(f"--sync_bn: {model_name}'s {unsynced} batch norm layers of timm's own classes (BatchNormAct2d) "
            "normalise each rank's micro-batch alone")
    # What is built by now (the imports, the model, the file lists) lives until the end: DeepSpeed's ZeRO-3 set-up
    # runs full collections, which took 1.5 s each on 2 CPU cores walking it, and need not.
    gc.freeze()
    # Out of memory from here on (the engine's buffers, the dataset on the GPU) ends with the next flags to try.
    with advise_on_out_of_memory(ds_config, tier == "device", coalesced), ThreadPoolExecutor(1) as decoder:
        if on_device:  # decodes on the GPU while DeepSpeed sets up (one of them waits on the host most of the time)
            decoding = decoder.submit(build_device_loaders, train_set, val_set, micro_batch_size=micro_batch,
                                      image_size=args.image_size, rank=rank, world_size=world_size, seed=args.seed,
                                      device=device, dtype=dtype, train_size=args.device_train_size,
                                      records=data_check.records, preprocessing=inputs, tier=tier, cache_root=cache,
                                      repetitions=args.ra_reps, recipe=recipe_of(args))
        # parameter groups of their own only when flags ask for them
        parameters = groups if groups else model.parameters()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameters,
                                               **engine_scheduler(ds_config))
        no_single_rank_allreduce(engine, ds_config)
        if args.compile:
            engine.compile()
        clock.lap("engine")
        if on_device:
            train_loader, val_loader, done, unreadable = decoding.result()
            place = device_type if tier == "device" else f"{device_type}, batches from host memory"
            say(f"Data on {place} ({why}): {done}")
            if unreadable:  # found by the decode, the check having read their headers only
                data_check.exclude(unreadable)
                say(f"warning: skipping {len(unreadable)} image(s) that do not decode: "
                    + listed(f"{path} ({why})" for path, why in unreadable.items()))
                emptied = [name for name in train_set.classes if name not in data_check.classes]
                if emptied:  # the model was built for them: their outputs are kept, never trained
                    say(f"warning: no image of {len(emptied)} class(es) decodes: {listed(emptied)}")
        else:
            train_loader, val_loader = build_loaders(train_set, val_set, micro_batch, args.num_workers, rank,
                                                     world_size, args.seed, pin_memory=device_type == "cuda",
                                                     repetitions=args.ra_reps)
            say(f"Data from {args.num_workers} DataLoader worker(s) per rank ({why})")
    # oneDNN's bf16 kernels need AVX-512 or AMX; without them PyTorch's reference convolution runs instead
    if device_type == "cpu" and "bf16" in precision(ds_config) and not getattr(
            torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)():
        say("warning: this CPU has no bf16 instructions for oneDNN: bf16 convolutions run in PyTorch's slow "
            "fallback, many times slower than fp32 (docs/training.md); leave out --bf16 on this machine")
    clock.lap("data")
    # Ranks with other images (nodes whose copies of the folder differ) would run epochs of other lengths and
    # wait for each other in a collective for good.
    counts = differing({"training images": data_check.train.num_images, "validation images": data_check.val.num_images},
                       device)
    if counts:
        raise UsageError("the ranks see different datasets (" + ", ".join(
            f"{name}: {low:.0f} on one, {high:.0f} on another" for name, (low, high) in counts.items())
            + "): every node needs the same files, in one shared folder or identical copies")
    micro_batches = train_loader.batches_per_epoch // accumulation * accumulation
    if micro_batches == 0:  # images left out by the decode (the config was built on the check's count)
        raise UsageError(f"{args.train_dir}: {data_check.train.num_images} training images decode: too few for "
                         f"{world_size} rank(s) x micro-batch {micro_batch} x {accumulation} accumulation step(s)")
    # The schedule was sized on the check's count, before the decode left out the images it could not read.
    scheduler = resolve_scheduler(base_config, args, ds_config["optimizer"]["params"]["lr"],
                                  micro_batches // accumulation)
    if scheduler != ds_config["scheduler"]:
        ds_config["scheduler"] = scheduler  # the history records the steps that run
        replace_lr_scheduler(engine, scheduler, ds_config["optimizer"]["params"]["lr"])
    body_lr = GroupLearningRates(engine, groups, args.backbone_lr_scale, args.freeze_backbone_epochs) if groups else None
    steps_per_epoch = micro_batches // accumulation
    ema = WeightEMA(engine, decay=args.model_ema_decay, every=args.model_ema_steps,
                    global_batch=ds_config["train_batch_size"], epochs=args.epochs,
                    warmup_steps=round(args.warmup_epochs * steps_per_epoch),
                    steps_per_epoch=steps_per_epoch) if args.model_ema else None
    samples_per_micro_batch = micro_batch * world_size  # over all ranks: a position any world size can take up

    # The history's config: the run's record (outputs/record.py), where it ran and on what data
    run_config = {
        **checked.record, "preprocessing": inputs, "train_dir": str(args.train_dir), "val_dir": str(args.val_dir),
        "train_images": data_check.train.num_images, "val_images": data_check.val.num_images,
        "world_size": world_size, "device": device_type, "data_on_device": on_device, "data_tier": tier,
        "checkpoint_writes": "background" if device_type == "cuda" else "inline",
        "device_train_size": train_square_size(args.image_size, args.device_train_size, inputs) if on_device else None,
        "data_check": data_check.summary(),
        "args": resolved_flags(args),  # written beside the history as args.yaml too
        "training": {**checked.record["training"], "coalesce_grad_reduction": coalesced,
                     "groups": group_summary},
        "deepspeed": ds_config,  # the scheduler resized above
    }
    history = TrainingHistory(Path(args.log_dir) / HISTORY_FILE, run_config)
    # On a GPU the host is free to write checkpoints while the next epoch trains; on a CPU it is not.
    saver = CheckpointSaver(engine, args.checkpoint_dir, args.save_every, args.keep_last, args.save_last_every,
                            background=device_type == "cuda", ema=ema)
    health = StepHealth(engine, args.max_nonfinite_steps)
    # What each checkpoint says of its run (extra_info.json), from the history's record of the run
    extra_info = checkpoint_info(run_config, resumed_info.get("run_started") if resumed_info else clock.started)
    if ema is not None:  # the files the checkpoint's tag folder holds beside DeepSpeed's
        extra_info["model_ema_files"] = ema.files()

    start_epoch, start_step, carried = 1, 0, None
    if resume_from is not None:
        state = load(engine, resume_from, resumed_info, args.checkpoint_dir)
        history.restore(state["history"])
        if history.file_is_behind():  # stopped between the checkpoint and its history line
            history.save()
        restore_rng_state(state["rng"])
        if ema is not None:
            tag_dir = Path(resume_from) / resumed_info["tag"]
            # a checkpoint of an older run without one: the average starts from these weights
            agreed(lambda: ema.load(tag_dir, resumed_info) if saved_with_ema(resumed_info) else None)
        with stop_on_write_error("checkpoint", "--checkpoint_dir"):
            warning = carry_best(resume_from, args.checkpoint_dir, history.data["best"]["epoch"])
        if warning:
            say(warning)
        start_epoch, start_step, carried = state["next_epoch"], state["next_step"], state["carried"]
        restore_own_buffers(engine.module, (carried or {}).get("rank_buffers"))
        if "next_sample" in state:  # the same samples on any number of ranks (the global batch is the same)
            start_step = state["next_sample"] // samples_per_micro_batch
        say(f"Resumed from {resume_from}: epoch {start_epoch}"
            + (f", step {start_step} of {micro_batches}" if start_step else ""))
    earlier_rows = prepare_csv_files(engine, start_epoch if resume_from is not None else None)
    saver.retire_after_first_save(earlier_run, earlier_rows)  # --overwrite: the earlier run stays until then
    say(f"{model_name}: {data_check.train.num_images} train / {data_check.val.num_images} val images, "
        f"{len(train_set.classes)} classes; "
        f"{world_size} rank(s) on {device_type}, ZeRO-{zero_stage}, {run_config['precision']}, "
        f"global batch {ds_config['train_batch_size']}"
        + (f" ({accumulation} micro-batches a step, their gradients reduced once)" if coalesced else ""))

    # The engine and the loaders as well (a full collection over what torch, torchvision and DeepSpeed leave took
    # 0.17 s on 2 CPU cores).
    gc.freeze()
    return Run(args=args, clock=clock, engine=engine, ds_config=ds_config, coalesced=coalesced, tier=tier,
               dtype=dtype, train_loader=train_loader, val_loader=val_loader, micro_batches=micro_batches,
               samples_per_micro_batch=samples_per_micro_batch, body_lr=body_lr, history=history, saver=saver,
               health=health, extra_info=extra_info, world_size=world_size, start_epoch=start_epoch,
               start_step=start_step, carried=carried, mixing=batch_mixing(args, len(train_set.classes), rank),
               step_seed=(args.seed, rank), ema=ema)


def epoch_loop(run):
    """Train and validate each epoch, save and record it; the exit status when a signal stopped the run."""
    args, engine, history, saver = run.args, run.engine, run.history, run.saver
    start_step, carried = run.start_step, run.carried
    with (StopOnSignal(engine.device, run.world_size) as stop,
          advise_on_out_of_memory(run.ds_config, run.tier == "device", run.coalesced)):
        for epoch in range(run.start_epoch, args.epochs + 1):
            # a resumed epoch's time before the stop counts, as it does in the epoch's training time
            epoch_started = time.perf_counter() - (carried or {}).get("time_s", 0.0)
            if run.body_lr is not None:
                run.body_lr.set_epoch(epoch)
            loader = run.train_loader.epoch(epoch, start_batch=start_step)
            train = train_one_epoch(engine, loader, epoch, run.dtype, run.micro_batches, start_step=start_step,
                                    carried=carried, stop=stop, label_smoothing=args.label_smoothing,
                                    health=run.health, on_first_step=run.clock.first_step, coalesced=run.coalesced,
                                    mixing=run.mixing, step_seed=run.step_seed, ema=run.ema)
            if train.get("interrupted"):
                at = {"epoch": epoch, "step": train["step"], "samples": train["step"] * run.samples_per_micro_batch}
                saver.save(epoch - 1, {**run.extra_info, "interrupted_at": at},
                           run.training_state(epoch, train["step"], train["carried"]), interrupted=True)
                saver.wait()
                say(f"Stopped by {stop.name} at epoch {epoch}, step {train['step']} of {run.micro_batches}: saved "
                    f"{Path(args.checkpoint_dir) / 'last'}; continue with --resume auto")
                return 128 + stop.signal
            if not history.data["timing"]:
                history.data["timing"] = run.clock.summary()
                say(run.clock.line())
            start_step, carried = 0, None
            validation_started = time.perf_counter()
            val = evaluate(engine, run.val_loader, run.dtype)
            run.health.check_validation(val["loss"], epoch)
            ema_val = {}
            if run.ema is not None:
                with run.ema.swapped_in():
                    ema_val = evaluate(engine, run.val_loader, run.dtype)
            validation_s = time.perf_counter() - validation_started
            body_scale = run.body_lr.body_scale() if run.body_lr else 1.0
            record = {"epoch": epoch, "train_loss": train["loss"], "train_acc": train["acc"],
                      "val_loss": val["loss"], "val_acc": val["acc"], "val_images": val["images"],
                      "ema_val_loss": ema_val.get("loss"), "ema_val_acc": ema_val.get("acc"),
                      "lr": train["lr"], "backbone_lr": train["lr"] * body_scale,
                      "epoch_time_s": train["time_s"], "validation_s": validation_s,
                      "images_per_s": train["images_per_s"],
                      "data_wait_s": train["data_wait_s"], "compute_s": train["compute_s"],
                      "peak_gpu_memory_gib": peak_gpu_memory_gib(engine.device),
                      "skipped_steps": train["skipped_steps"], "nonfinite_steps": train["nonfinite_steps"]}
            is_best = history.add(record, args.best_on)
            saving_started = time.perf_counter()
            saver.save(epoch, {**run.extra_info, "metrics": record}, run.training_state(epoch + 1), best=is_best)
            history.update_last(checkpoint_s=time.perf_counter() - saving_started,
                                epoch_wall_s=time.perf_counter() - epoch_started)
            saver.after(history.save, history.snapshot())  # once this epoch's checkpoint is published
            write_epoch_events(engine, record)
            say(epoch_line(history.data["epochs"][-1], args.epochs, is_best))
            if stop.requested_after_epoch():
                saver.wait()
                say(f"Stopped by {stop.name} after epoch {epoch}; continue with --resume auto")
                return 128 + stop.signal
            patience = args.early_stopping_patience
            if patience and history.epochs_since_best() >= patience:
                which = "the weights' average's val acc" if args.best_on == "ema" else "val acc"
                say(f"Early stopping after epoch {epoch}: {which} has not improved on epoch "
                    f"{history.data['best']['epoch']}'s for {history.epochs_since_best()} epoch(s) "
                    f"(--early_stopping_patience {patience})")
                break
    return None


def finish(run):
    """The run is over (its last epoch, or early stopping): the history's total time, and the summary."""
    run.saver.wait()
    best = run.history.data["best"]
    if best["epoch"] is not None:
        run.history.data["timing"]["total_s"] = round(run.clock.since_start(), 3)
        run.history.save()
        total = datetime.timedelta(seconds=round(run.clock.since_start()))
        which = " (the weights' average)" if best.get("on") == "ema" else ""
        say(f"Best val acc{which} {best['val_acc']:.4f} at epoch {best['epoch']}; total time {total}; "
            f"history in {run.history.path}, checkpoints in {run.args.checkpoint_dir}")
    say_finished()  # every checkpoint is published and the history written: a signal from here on stops nothing
    shut_down()  # together: a rank leaving gloo while rank 0 still writes can abort in the backend's teardown
    return 0


def engine_scheduler(ds_config):
    """deepspeed.initialize's config and lr_scheduler: a torch.optim.lr_scheduler class named in the config is
    built by DeepSpeed over its own optimizer wrapper (ZeRO's, bf16's), which torch's schedulers refuse
    ("... is not an Optimizer"): it goes in as a callable instead, which DeepSpeed calls with the torch optimizer."""
    from deepspeed.runtime import lr_schedules

    section = ds_config["scheduler"]
    if hasattr(lr_schedules, section["type"]):
        return {"config": ds_config}
    scheduler = getattr(torch.optim.lr_scheduler, section["type"])
    return {"config": {key: value for key, value in ds_config.items() if key != "scheduler"},
            "lr_scheduler": lambda optimizer: scheduler(optimizer, **section.get("params", {}))}
