"""The recipe's per-image augmentation on the DataLoader tier: torchvision's transforms.v2 classes in its
reference order, drawn from the per-image seed (so a resumed run draws the same); mixup and cutmix; and the
recipe's flags training on every data tier at ZeRO-0 and 3 on two ranks."""
import json
import math

import pytest
import torch
import torchvision
from PIL import Image
from torchvision import transforms
from torchvision.transforms import v2

from deepspeed_image_trainer.data.folders import DEFAULT_PREPROCESSING, build_transform
from deepspeed_image_trainer.data.mixing import BatchMixing
from conftest import DEVICES

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


def mixed(mixup_alpha, cutmix_alpha, epoch=1, step=0):
    images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 3, 4, 0])
    mixing = BatchMixing(mixup_alpha, cutmix_alpha, num_classes=5, seed=42, rank=0)
    return images, labels, *mixing(images, labels, epoch, step)


def test_mixup_and_cutmix_are_torchvisions_drawn_from_the_step():
    for mixup_alpha, cutmix_alpha in ((0.2, 0.0), (0.0, 1.0), (0.2, 1.0)):
        images, labels, out, targets = mixed(mixup_alpha, cutmix_alpha)
        again = mixed(mixup_alpha, cutmix_alpha)
        assert torch.equal(out, again[2]) and torch.equal(targets, again[3])  # the same step, the same draw
        assert torch.allclose(targets.sum(1), torch.ones(6))
        # the image's share is its target's share: mixup's lambda, or cutmix's area outside the pasted box
        share = targets[torch.arange(6), labels][1:]  # the first image's partner (the last) has its class too
        partner = images.roll(1, 0)
        if mixup_alpha and not cutmix_alpha:
            lam = share[0]  # one lambda for the batch
            assert torch.allclose(share, lam.expand(5)) and torch.allclose(out, lam * images + (1 - lam) * partner,
                                                                           atol=1e-6) and 0 < lam < 1
        if cutmix_alpha and not mixup_alpha:
            kept = (out == images).all(1).float().mean((1, 2))[1:]
            assert torch.allclose(kept, share, atol=1e-6)
    steps = {mixed(0.2, 1.0, epoch, step)[3][1, 1].item() for epoch in (1, 2) for step in range(4)}
    assert len(steps) > 4  # each (epoch, step) its own draw


def test_mixup_and_cutmix_of_one_seed_are_torchvisions_own():
    images, labels, out, targets = mixed(0.2, 1.0, epoch=3, step=7)
    reference = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=5), v2.CutMix(alpha=1.0, num_classes=5)])
    torch.manual_seed(hash((42, 0, 3, 7)) % 2**63)
    expected_images, expected_targets = reference(images, labels)
    assert torch.equal(out, expected_images) and torch.equal(targets, expected_targets)


@pytest.mark.parametrize("device", DEVICES)
def test_mixing_keeps_the_batchs_layout(device):
    # the GPU's batches are channels_last; CUDA's roll (mixup's) returns the default layout, the step's slow one
    images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(device)
    labels = torch.tensor([0, 1, 2, 3, 4, 0], device=device)
    for mixup_alpha, cutmix_alpha in ((0.2, 0.0), (0.0, 1.0)):
        mixing = BatchMixing(mixup_alpha, cutmix_alpha, num_classes=5, seed=42, rank=0)
        plain, plain_targets = mixing(images, labels, 1, 0)
        last, last_targets = mixing(images.contiguous(memory_format=torch.channels_last), labels, 1, 0)
        assert plain.is_contiguous() and last.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(plain, last) and torch.equal(plain_targets, last_targets)
        mix = mixing.mix
        mixing.mix = lambda images, labels: (lambda out: (out[0].contiguous(), out[1]))(mix(images, labels))
        again, _ = mixing(images.contiguous(memory_format=torch.channels_last), labels, 1, 0)
        assert again.is_contiguous(memory_format=torch.channels_last) and torch.equal(again, last)


def test_drop_path_is_torchvisions_stochastic_depth_prob():
    from torchvision.ops import StochasticDepth

    from deepspeed_image_trainer.models.build import build_model

    for name in ("efficientnet_b0", "convnext_tiny"):
        with torch.device("meta"):
            ours = [m.p for m in build_model(name, 5, 64, drop_path=0.3).modules() if isinstance(m, StochasticDepth)]
            theirs = [m.p for m in torchvision.models.get_model(name, num_classes=5, stochastic_depth_prob=0.3).modules()
                      if isinstance(m, StochasticDepth)]
            default = [m.p for m in build_model(name, 5, 64).modules() if isinstance(m, StochasticDepth)]
        assert ours == theirs and ours != default and max(ours) <= 0.3


def test_drop_path_of_swin_and_maxvit_is_their_builders_stochastic_depth_prob():
    """Their public builders fix stochastic_depth_prob; the private ones they call take it, as the reference."""
    from torchvision.models import maxvit, swin_transformer
    from torchvision.ops import StochasticDepth

    from deepspeed_image_trainer.models.build import build_model

    swin_t = {"patch_size": [4, 4], "embed_dim": 96, "depths": [2, 2, 6, 2], "num_heads": [3, 6, 12, 24]}
    references = {
        "swin_t": lambda p: swin_transformer._swin_transformer(**swin_t, window_size=[7, 7], stochastic_depth_prob=p,
                                                               weights=None, progress=False, num_classes=5),
        "swin_v2_t": lambda p: swin_transformer._swin_transformer(
            **swin_t, window_size=[8, 8], stochastic_depth_prob=p, weights=None, progress=False, num_classes=5,
            block=swin_transformer.SwinTransformerBlockV2, downsample_layer=swin_transformer.PatchMergingV2),
        "maxvit_t": lambda p: maxvit._maxvit(stem_channels=64, block_channels=[64, 128, 256, 512],
                                             block_layers=[2, 2, 5, 2], head_dim=32, stochastic_depth_prob=p,
                                             partition_size=7, weights=None, progress=False, num_classes=5,
                                             input_size=(224, 224))}
    for name, reference in references.items():
        with torch.device("meta"):
            ours = [m.p for m in build_model(name, 5, 224, drop_path=0.35).modules() if isinstance(m, StochasticDepth)]
            theirs = [m.p for m in reference(0.35).modules() if isinstance(m, StochasticDepth)]
        assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15) and max(ours) == pytest.approx(0.35), name


def test_repeated_augmentation_deals_each_images_repeats_to_the_ranks_as_torchvisions_rasampler():
    """torchvision's references/classification RASampler, less its rounding of the epoch to 256 images a rank:
    the same keys, and each repeat augmented anew where a plain epoch's image keeps its draw."""
    from deepspeed_image_trainer.data.folders import EpochSampler, KeyedAugmentation

    dataset = list(range(22))
    for world_size, repetitions in ((1, 3), (2, 3), (3, 2), (2, 4)):
        plain = EpochSampler(dataset, num_replicas=world_size, rank=0, shuffle=True, seed=7, drop_last=True)
        samplers = [EpochSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=7, drop_last=True,
                                 repetitions=repetitions) for rank in range(world_size)]
        for epoch in (0, 1):
            for sampler in samplers:
                sampler.set_epoch(epoch)
            order = torch.randperm(22, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
            repeated = [index for index in order for _ in range(repetitions)]
            for rank, sampler in enumerate(samplers):
                keys = list(sampler)
                assert len(keys) == len(plain) and sampler.images() == repeated[rank:len(plain) * world_size:world_size]
                assert [repeat for _, repeat in keys] == [place % repetitions for place in
                                                          range(rank, len(plain) * world_size, world_size)]
                sampler.start = 3  # a resume mid-epoch goes on from its place
                assert list(sampler) == keys[3:]
                sampler.start = 0

    class Draws:  # an augmentation that is one draw from torch's stream
        def __len__(self):
            return 3

        def __getitem__(self, index):
            return torch.rand(1)

    augmented = KeyedAugmentation(Draws(), seed=1)
    assert torch.equal(augmented[2], augmented[2]) and torch.equal(augmented[2, 0], augmented[2, 0])
    assert not torch.equal(augmented[2, 0], augmented[2, 1])


def test_the_device_tiers_erase_as_torchvisions_random_erasing():
    """Each image's box is the one torchvision's erase gets; the boxes are drawn as its make_params draws them
    (compared over many images: how many it erases, and the erased share of the image)."""
    from torchvision.transforms.v2 import functional as TF

    from deepspeed_image_trainer.data.device import erase, random_erasing_boxes

    count, p = 4000, 0.5
    boxes = random_erasing_boxes(count, 24, 20, p, torch.Generator().manual_seed(0))
    images = torch.randn(6, 3, 24, 20, generator=torch.Generator().manual_seed(1))
    erased = erase(images.clone(), boxes[:6])
    for image, box, ours in zip(images, boxes[:6].tolist(), erased):
        assert torch.equal(ours, TF.erase(image, *box, v=torch.zeros(3, 1, 1)))
    assert torch.equal(erase(images.clone(), torch.zeros(6, 4, dtype=torch.long)), images)  # no box: untouched

    torch.manual_seed(2)
    reference = v2.RandomErasing(p=p)
    theirs = [reference.make_params([torch.zeros(3, 24, 20)]) if torch.rand(1) < p else None for _ in range(count)]
    theirs = [params["h"] * params["w"] if params and params["v"] is not None else 0 for params in theirs]
    ours = (boxes[:, 2] * boxes[:, 3]).tolist()
    def erased_share(areas):
        return sum(area > 0 for area in areas) / count

    assert abs(erased_share(ours) - erased_share(theirs)) < 0.03
    assert abs(sum(ours) - sum(theirs)) < 0.1 * sum(theirs)  # the mean erased area
    assert all(0 <= top and top + h <= 24 and 0 <= left and left + w <= 20 for top, left, h, w in boxes.tolist())


def test_repeated_augmentation_on_the_device_tiers_crops_each_repeat_anew():
    from deepspeed_image_trainer.data.device import DeviceTrainLoader

    squares = torch.randint(0, 256, (12, 3, 20, 20), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    loader = DeviceTrainLoader(squares, torch.arange(12) % 3, micro_batch_size=6, image_size=16, rank=0, world_size=1,
                               seed=5, dtype=torch.float32, repetitions=3)
    (first, first_boxes), (second, _) = loader.epoch_boxes(1)
    assert first.tolist() == [first[0].item()] * 3 + [first[3].item()] * 3 and len(set(second.tolist())) == 2
    assert len({tuple(box) for box in first_boxes[:3].tolist()}) == 3  # one image, three crops


def test_a_steps_model_randomness_comes_from_its_seed():
    from deepspeed_image_trainer.engine.rng import seed_step

    dropout, x = torch.nn.Dropout(0.5), torch.ones(1000)
    seed_step(42, 1, 3, 7)
    first = dropout(x)
    seed_step(42, 1, 3, 8)
    other = dropout(x)
    seed_step(42, 1, 3, 7)
    assert torch.equal(dropout(x), first) and not torch.equal(other, first)


# the recipe on each data tier at ZeRO-0 and 3, on 2 ranks: the tiers apply the policy and erasing, the loop
# mixes and smooths whatever the stage (test_resume.py trains the recipe at the 2-rank default, ZeRO-2)
TIER_STAGES = [(tier, stage) for tier in ("off", "on", "cache") for stage in (0, 3)]


def recipe_runs(rank, port, results, data, workdir):
    """A one-epoch run with every recipe flag for each of TIER_STAGES, in one group of 2 ranks."""
    import gc

    from deepspeed_image_trainer.cli import train
    from deepspeed_image_trainer.engine.distributed import barrier

    from conftest import data_args, join_process_group

    join_process_group(rank, port, world_size=2)
    train.shut_down = barrier  # the group serves every run: spawn_ranks leaves it at the end
    for tier, stage in TIER_STAGES:
        folder = workdir / f"{tier}-{stage}"
        results[tier, stage, rank] = train.main(data_args(data) + [
            "--epochs", "1", "--batch_size", "4", "--image_size", "32", "--num_workers", "0", "--zero_stage",
            str(stage), "--data_on_device", tier, "--auto_augment", "ra", "--random_erase", "0.25", "--mixup_alpha",
            "0.2", "--cutmix_alpha", "1.0", "--label_smoothing", "0.1", "--ra_reps", "2", "--save_every", "0",
            "--save_last_every", "1" if stage == 0 else "0", "--val_resize_size", "48", "--val_crop_size", "40",
            "--checkpoint_dir", str(folder / "checkpoints"), "--log_dir", str(folder / "logs")])
        gc.unfreeze()  # the trainer froze what it built; the next run needs the memory
        gc.collect()


@pytest.mark.slow
def test_the_recipe_trains_on_every_tier_and_at_zero_0_and_3_on_two_ranks(tmp_path):
    from conftest import history_of, make_sample_dataset, spawn_ranks

    # 16 training images: with --ra_reps 2, two steps a rank (the suite's tiny data took twice as long)
    make_sample_dataset(tmp_path / "data", num_classes=4, train_per_class=4, val_per_class=1, image_size=32, seed=0)
    statuses = spawn_ranks(recipe_runs, 2, tmp_path / "data", tmp_path)
    assert statuses == {(tier, stage, rank): 0 for tier, stage in TIER_STAGES for rank in (0, 1)}
    for tier, stage in TIER_STAGES:
        history = history_of(tmp_path / f"{tier}-{stage}")
        config, (epoch,) = history["config"], history["epochs"]
        assert config["data_tier"] == {"off": "workers", "on": "device", "cache": "cache"}[tier], (tier, stage)
        assert config["zero_stage"] == stage and config["world_size"] == 2
        training = config["training"]
        assert training["augmentation"]["auto_augment"] == "ra" and training["mixup_alpha"] == 0.2
        assert training["cutmix_alpha"] == 1.0 and training["ra_reps"] == 2
        assert math.isfinite(epoch["train_loss"]) and math.isfinite(epoch["val_loss"]), (tier, stage)
        assert (config["preprocessing"]["val_resize_size"], config["preprocessing"]["val_crop_size"]) == (48, 40)
        if stage == 0:  # validated at 48 -> 40 px on each tier: evaluate's figures are the logged ones
            from deepspeed_image_trainer.inference import evaluate

            evaluate.main(["--model", str(tmp_path / f"{tier}-0/checkpoints/last"), "--data_dir",
                           str(tmp_path / "data/val"), "--output_dir", str(tmp_path / f"eval-{tier}"),
                           "--num_workers", "0"])
            report = json.loads((tmp_path / f"eval-{tier}/report.json").read_text())
            assert (report["val_resize_size"], report["val_crop_size"]) == (48, 40)
            assert report["loss"] == pytest.approx(epoch["val_loss"], rel=1e-5), tier
            assert report["top1"] == pytest.approx(epoch["val_acc"]), tier
