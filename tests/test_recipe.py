"""The recipe's per-image augmentation on the DataLoader tier: torchvision's transforms.v2 classes in its
reference order, drawn from the per-image seed (so a resumed run draws the same)."""
import pytest
import torch
from PIL import Image
from torchvision import transforms
from torchvision.transforms import v2

from deepspeed_image_trainer.data.folders import DEFAULT_PREPROCESSING, build_transform

BILINEAR = transforms.InterpolationMode.BILINEAR
POLICIES = {"ra": lambda: v2.RandAugment(num_ops=3, magnitude=12, interpolation=BILINEAR),
            "ta_wide": lambda: v2.TrivialAugmentWide(interpolation=BILINEAR),
            "augmix": lambda: v2.AugMix(severity=5, interpolation=BILINEAR),
            "imagenet": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=BILINEAR),
            "cifar10": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10, interpolation=BILINEAR),
            "svhn": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.SVHN, interpolation=BILINEAR)}


def recipe(auto_augment=None, random_erase=0.0):
    return {"auto_augment": auto_augment, "ra_magnitude": 12, "ra_num_ops": 3, "augmix_severity": 5,
            "random_erase": random_erase}


def torchvision_reference(policy, random_erase):
    """torchvision's reference scripts' training preset (presets.ClassificationPresetTrain) at 32 px."""
    steps = [transforms.RandomResizedCrop(32, interpolation=BILINEAR, antialias=True),
             transforms.RandomHorizontalFlip(), *([POLICIES[policy]()] if policy else []), transforms.ToTensor(),
             transforms.Normalize(DEFAULT_PREPROCESSING["mean"], DEFAULT_PREPROCESSING["std"])]
    return transforms.Compose(steps + ([v2.RandomErasing(p=random_erase)] if random_erase else []))


@pytest.mark.parametrize("policy, random_erase", [*((policy, 0.0) for policy in POLICIES), ("ta_wide", 0.5),
                                                  (None, 1.0)])
def test_the_recipe_is_torchvisions_reference_preset(policy, random_erase):
    image = Image.fromarray(torch.randint(0, 256, (48, 40, 3), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(0)).numpy())
    ours = build_transform(32, True, recipe=recipe(policy, random_erase))
    reference = torchvision_reference(policy, random_erase)
    plain = build_transform(32, True)
    changed = 0
    for seed in range(8):  # the per-image seed of KeyedAugmentation
        torch.manual_seed(seed)
        got = ours(image)
        torch.manual_seed(seed)
        assert torch.equal(got, reference(image))
        torch.manual_seed(seed)
        changed += not torch.equal(got, plain(image))
    assert changed >= 4  # the policy or the erasing changed at least half the images


def test_random_erasing_erases_a_box_within_torchvisions_ranges():
    image = Image.new("RGB", (64, 64), (200, 100, 50))
    erase = build_transform(64, True, recipe=recipe(random_erase=1.0))
    plain = build_transform(64, True)
    for seed in range(20):
        torch.manual_seed(seed)
        erased = erase(image)
        torch.manual_seed(seed)
        kept = plain(image)
        box = (erased != kept).any(0)
        rows, columns = box.any(1).nonzero(), box.any(0).nonzero()
        area = (rows.max() - rows.min() + 1) * (columns.max() - columns.min() + 1)
        assert box.sum() == area  # one rectangle
        assert 0.02 * 64 * 64 * 0.9 <= area <= 0.33 * 64 * 64 * 1.1  # RandomErasing's scale (0.02, 0.33)
        assert (erased[:, box] == 0).all()  # erased to 0, after normalisation, as its default value
