"""One record of a run's settings, from which the rest is derived: the history's config is built on it
(training_history.json's "config", with where the run ran and on what data), each checkpoint's
extra_info.json takes its part of that config (checkpoint_info), and a resumed run is compared with the run
it continues on what resume_settings picks from it (outputs/checkpoints.py's SETTINGS_FLAGS)."""
from ..data.recipe import recipe_of
from ..engine.config import lr_schedule, precision
from ..engine.finetune import groups_setting
from ..models.names import saved_name

# What each checkpoint's extra_info.json says of its run, taken from the history's config.
CHECKPOINT_KEYS = ("model", "pretrained", "preprocessing", "image_size", "class_names", "world_size", "zero_stage",
                   "precision", "data_tier")
# The record's "training" values a resumed run must keep (the saved optimizer and scheduler were built for them).
KEPT_TRAINING = ("optimizer", "learning_rate", "weight_decay", "lr_schedule", "warmup_epochs", "label_smoothing",
                 "backbone_lr_scale", "freeze_backbone_epochs", "momentum", "nesterov", "model_ema", "best_on")


def run_record(args, ds_config, class_names):
    """The run's settings as the flags and the DeepSpeed config resolve them, known before anything is built."""
    optimizer = ds_config["optimizer"]["params"]
    return {"model": saved_name(args.model), "pretrained": args.pretrained, "num_classes": len(class_names),
            "class_names": list(class_names), "image_size": args.image_size, "epochs": args.epochs,
            "precision": precision(ds_config), "zero_stage": ds_config["zero_optimization"]["stage"],
            "seed": args.seed, "sync_bn": args.sync_bn,
            "training": {"optimizer": ds_config["optimizer"]["type"], "lr_schedule": lr_schedule(ds_config),
                         "learning_rate": optimizer["lr"],
                         # SGD's (None for the others): the saved state's groups carry them, over the flags
                         "momentum": optimizer.get("momentum"), "nesterov": optimizer.get("nesterov"),
                         "weight_decay": optimizer.get("weight_decay"), "warmup_epochs": args.warmup_epochs,
                         "label_smoothing": args.label_smoothing,
                         "early_stopping_patience": args.early_stopping_patience,
                         "backbone_lr_scale": args.backbone_lr_scale,
                         "freeze_backbone_epochs": args.freeze_backbone_epochs,
                         "parameter_groups": groups_setting(args),
                         "augmentation": recipe_of(args), "ra_reps": args.ra_reps, "mixup_alpha": args.mixup_alpha,
                         "cutmix_alpha": args.cutmix_alpha, "drop_path": args.drop_path,
                         "grad_checkpointing": getattr(args, "grad_checkpointing", False),
                         "model_ema": args.model_ema, "best_on": args.best_on,
                         "model_ema_decay": args.model_ema_decay if args.model_ema else None,
                         "model_ema_steps": args.model_ema_steps if args.model_ema else None},
            "deepspeed": ds_config}


def resume_settings(record):
    """What a resumed run must share with the run it continues, from its record (or its history's config)."""
    training = record["training"]
    return {"model": record["model"], "class_names": record["class_names"], "image_size": record["image_size"],
            "train_batch_size": record["deepspeed"]["train_batch_size"],
            **{key: training[key] for key in KEPT_TRAINING if key in training},  # older records lack some
            "precision": record["precision"], "parameter_groups": training["parameter_groups"]}


def checkpoint_info(config, run_started):
    """A checkpoint's extra_info.json (before its epoch and position) from the history's config."""
    return {**{key: config[key] for key in CHECKPOINT_KEYS}, "settings": resume_settings(config),
            "run_started": run_started}
