"""The training recipe's augmentation flags beyond crops and flips (--auto_augment, --random_erase, and the
batch's --mixup_alpha and --cutmix_alpha), as the rest of the trainer reads them; folders.py and mixing.py
build them with torchvision's transforms.v2 classes, device.py and batched_policies.py on the GPU tiers."""

# --auto_augment's policies, named as torchvision's references name them
AUTO_AUGMENT_POLICIES = ("ra", "ta_wide", "augmix", "imagenet", "cifar10", "svhn")
# --flag: (lowest, highest) of the augmentation's numbers (RandAugment's magnitudes are bins 0-30, of 14 ops)
RECIPE_RANGES = {"ra_magnitude": (0, 30), "ra_num_ops": (1, 14), "augmix_severity": (1, 10), "random_erase": (0, 1),
                 "mixup_alpha": (0, 100), "cutmix_alpha": (0, 100), "drop_path": (0, 0.99),
                 "ra_reps": (1, 16)}


# The per-image flags and their defaults (cli/options.py's)
RECIPE_DEFAULTS = {"auto_augment": None, "ra_magnitude": 9, "ra_num_ops": 2, "augmix_severity": 3, "random_erase": 0.0}
# The models with torchvision's stochastic_depth_prob (--drop_path): ConvNeXt, EfficientNet V1 and V2, Swin, MaxViT
DROP_PATH_FAMILIES = ("convnext_", "efficientnet_", "swin_", "maxvit_")


def recipe_of(args):
    """The per-image augmentation the flags ask for beyond crops and flips (folders.build_transform); None when
    they ask for none."""
    recipe = {key: getattr(args, key, default) for key, default in RECIPE_DEFAULTS.items()}  # scripts' own args too
    return recipe if recipe["auto_augment"] or recipe["random_erase"] else None


MAX_VAL_SIZE = 4096  # pixels: --val_resize_size and --val_crop_size (as prepare_data's largest sample image)


def check_val_size_flags(args):
    """--val_resize_size and --val_crop_size, where given, in pixels (training's flags and evaluate's, predict's)."""
    from ..utils.failures import UsageError

    for name in ("val_resize_size", "val_crop_size"):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= MAX_VAL_SIZE:
            raise UsageError(f"--{name} must be 1 .. {MAX_VAL_SIZE} pixels, got {value}")
