"""The dataset kept on the device: crops, flips, validation images, resumable epochs, the choice of path."""
import json
import math
import shutil
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torchvision.datasets import ImageFolder
from torchvision.transforms import functional as TF

from deepspeed_image_trainer.data.device import (DeviceTrainLoader, DeviceValLoader, ResizedCrops, auto_tier,
                                                 build_device_loaders, choose_device_data, crop_weights_bytes,
                                                 dataset_bytes, random_resized_crops, recipe_arguments)
from deepspeed_image_trainer.data.folders import DEFAULT_PREPROCESSING, build_loaders, build_transform, load_datasets
from deepspeed_image_trainer.models.build import ResNet18Animals90

from conftest import TINY_CLASSES, TINY_TRAIN_IMAGES, TINY_VAL_IMAGES, data_args, history_of, train_ranks

CPU = torch.device("cpu")


def test_crop_boxes_follow_random_resized_crop():
    top, left, height, width, flip = random_resized_crops(20_000, 256, torch.Generator().manual_seed(0))
    assert (top >= 0).all() and (left >= 0).all() and (top + height <= 256).all() and (left + width <= 256).all()
    area = height * width / 256**2
    assert area.min() >= 0.08 - 0.01 and area.max() <= 1.0
    ratio = width / height
    assert ratio.min() >= 3 / 4 - 0.02 and ratio.max() <= 4 / 3 + 0.02
    assert 0.48 < flip.float().mean() < 0.52
    again = random_resized_crops(20_000, 256, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip((top, left, height, width, flip), again))


@pytest.mark.parametrize("side, out", [(73, 64), (40, 56), (256, 224)])  # shrinking and enlarging boxes
def test_crops_are_torchvisions_antialiased_resized_crops(side, out):
    generator = torch.Generator().manual_seed(side)
    images = torch.randint(0, 256, (24, 3, side, side), dtype=torch.uint8, generator=generator)
    top, left, height, width, flip = random_resized_crops(24, side, generator)
    assert flip.any() and not flip.all()
    ours = ResizedCrops(side, out, CPU)(images, top, left, height, width, flip)
    assert torch.equal(ResizedCrops(side, out, CPU)(images.float(), top, left, height, width, flip), ours)  # float in
    for i in range(24):
        box = [int(v[i]) for v in (top, left, height, width)]
        expected = TF.resized_crop(images[i].float(), *box, [out, out], antialias=True)
        assert torch.allclose(ours[i], expected.flip(-1) if flip[i] else expected, atol=1e-3)


def test_crops_match_the_dataloader_paths_pil_crops():
    """RandomResizedCrop on a PIL image (the DataLoader path) resamples with PIL's own filter, in integers."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8, 3, 96, 96), dtype=torch.uint8, generator=generator)
    images = F.avg_pool2d(images.float(), 3, stride=1, padding=1).to(torch.uint8)  # some detail at every scale
    top, left, height, width, flip = random_resized_crops(8, 96, generator)
    ours = ResizedCrops(96, 64, CPU)(images, top, left, height, width, torch.zeros(8, dtype=torch.bool))
    for i in range(8):
        box = [int(v[i]) for v in (top, left, height, width)]
        pil = TF.resized_crop(TF.to_pil_image(images[i]), *box, [64, 64], antialias=True)
        assert (ours[i] - TF.pil_to_tensor(pil).float()).abs().max() <= 1.0


# Pretrained weights bring their own (model.preprocessing): here ResNet50 V2's resize and MaxViT's mean and std.
WEIGHTS_PREPROCESSING = {"mean": [0.5] * 3, "std": [0.5] * 3, "resize_ratio": 232 / 224, "interpolation": "bilinear"}


@pytest.mark.parametrize("preprocessing", [None, WEIGHTS_PREPROCESSING])
def test_validation_images_match_the_dataloader_path(tiny_data, preprocessing):
    train_set, val_set = ImageFolder(tiny_data / "train"), ImageFolder(tiny_data / "val")
    train_loader, val_loader, _, _ = build_device_loaders(
        train_set, val_set, micro_batch_size=8, image_size=24, rank=0, world_size=1, seed=0, device=CPU,
        dtype=torch.float32, train_size=40, preprocessing=preprocessing)
    assert train_loader.images.shape[1:] == (3, 40, 40)  # --device_train_size: training squares only
    assert next(train_loader.epoch(0))[0].shape == (8, 3, 24, 24)
    images, labels = next(iter(val_loader))
    reference = ImageFolder(tiny_data / "val", transform=build_transform(24, train=False, preprocessing=preprocessing))
    expected = torch.stack([reference[i][0] for i in range(8)])
    assert labels.tolist() == [reference[i][1] for i in range(8)]
    # PIL's and torchvision's antialiased resizes differ by about one grey level here and there.
    assert (images - expected).abs().mean() < 0.02


def fake_loader(rank=0, world_size=1, **recipe):
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (40, 3, 18, 18), dtype=torch.uint8, generator=generator)
    return DeviceTrainLoader(images, torch.arange(40) % 4, micro_batch_size=4, image_size=16, rank=rank,
                             world_size=world_size, seed=7, dtype=torch.float32, **recipe)


RECIPE = {"auto_augment": "ra", "ra_num_ops": 2, "ra_magnitude": 9, "augmix_severity": 3, "random_erase": 0.5}


@pytest.mark.parametrize("recipe", [{}, {**recipe_arguments(RECIPE), "repetitions": 2}])
def test_an_epoch_resumed_mid_way_gets_the_same_batches(recipe):
    loader = fake_loader(**recipe)
    whole = list(loader.epoch(3))
    assert len(whole) == loader.batches_per_epoch == 10
    assert whole[0][0].shape == (4, 3, 16, 16)
    resumed = list(fake_loader(**recipe).epoch(3, start_batch=6))
    assert len(resumed) == 4
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(whole[6:], resumed))
    assert not torch.equal(whole[0][0], next(iter(loader.epoch(4)))[0])
    zeros = sum(int((images == 0).all(dim=1).sum()) for images, _ in whole)  # erased pixels, in every channel
    assert (zeros > 0) == bool(recipe)
    if recipe:  # the policy's ops too: not the plain crops
        plain = list(fake_loader(repetitions=2).epoch(3))
        assert sum(not torch.equal(a[0], b[0]) for a, b in zip(whole, plain)) == len(whole)


@pytest.mark.parametrize("policy", ["ra", "augmix"])  # rounds; chains and their mixing
def test_the_policy_on_a_chunk_of_batches_gives_each_batch_what_it_gives_alone(policy):
    recipe = recipe_arguments({**RECIPE, "auto_augment": policy})
    chunked, alone = fake_loader(**recipe), fake_loader(**recipe)
    alone.policy_chunk = 1
    assert chunked.policy_chunk == 8  # 10 batches: a chunk of 8 and one of 2
    together, apart = list(chunked.epoch(2)), list(alone.epoch(2))
    assert len(together) == len(apart) == 10
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(together, apart))


def test_weights_of_bicubic_preprocessing_get_the_policy_bilinear_on_the_device_tiers():
    """Most of timm's weights resize bicubically, which torchvision's tensor affine does not take: every rank
    stopped in a traceback (round 26); the GPU path's resizes are bilinear, and so are its policy's ops."""
    bicubic = {**DEFAULT_PREPROCESSING, "interpolation": "bicubic"}
    assert recipe_arguments(RECIPE, bicubic)["policy"].mode == "bilinear"
    nearest = {**DEFAULT_PREPROCESSING, "interpolation": "nearest"}
    assert recipe_arguments(RECIPE, nearest)["policy"].mode == "nearest"


def test_the_dataloader_tier_augments_each_image_the_same_with_any_workers_and_from_any_batch(tiny_data):
    """Each image's crop and flip come from (seed, epoch, image): 0 or 2 workers, a start part-way through the
    epoch, and the training process's own random stream (left as it was) change none of them."""
    train_set, val_set, _ = load_datasets(tiny_data / "train", tiny_data / "val", 32)

    def batches(num_workers, start_batch=0):
        loader, _ = build_loaders(train_set, val_set, 4, num_workers, rank=0, world_size=1, seed=3, pin_memory=False)
        return list(loader.epoch(2, start_batch))

    state = torch.get_rng_state()
    whole = batches(0)
    assert torch.equal(torch.get_rng_state(), state)
    for other in (batches(2)[3:], batches(2, start_batch=3), batches(0, start_batch=3)):
        assert len(other) == len(whole) - 3
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(whole[3:], other))
    loader, _ = build_loaders(train_set, val_set, 4, 0, rank=0, world_size=1, seed=3, pin_memory=False)
    assert not torch.equal(whole[0][0], next(iter(loader.epoch(3)))[0])


def test_ranks_share_out_the_epoch_and_the_validation_set():
    images = torch.zeros(10, 3, 16, 16, dtype=torch.uint8)
    shards = [DeviceValLoader(images, torch.arange(10), micro_batch_size=3, rank=rank, world_size=2,
                              dtype=torch.float32) for rank in (0, 1)]
    assert sorted(label for shard in shards for _, labels in shard for label in labels.tolist()) == list(range(10))
    assert [len(shard) for shard in shards] == [2, 2]
    epoch_labels = [torch.cat([labels for _, labels in fake_loader(rank, 2).epoch(0)]) for rank in (0, 1)]
    assert [len(labels) for labels in epoch_labels] == [20, 20]


def test_host_batches_are_gathered_on_a_few_threads_and_training_keeps_its_own(monkeypatch):
    from deepspeed_image_trainer.data import device as device_data

    monkeypatch.setattr(device_data, "GATHER_THREADS", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        seen = [counts for _, counts in device_data.sent_ahead(range(6), lambda _: [torch.get_num_threads()],
                                                               torch.device("cpu"))]
        assert seen == [[1]] * 6 and torch.get_num_threads() == 3
        later = []  # threads started after it (autograd's, the checkpoint writer) take the training thread's count
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [3]
    finally:
        torch.set_num_threads(threads)


def test_choice_of_data_path(tmp_path, monkeypatch):
    assert choose_device_data("auto", CPU, 100, 10, 224) == ("workers", "auto: the device is a CPU")
    assert choose_device_data("on", CPU, 100, 10, 224)[0] == "device"
    assert choose_device_data("cache", CPU, 100, 10, 224)[0] == "cache"
    assert choose_device_data("off", CPU, 100, 10, 224)[0] == "workers"
    # On a GPU: the GPU for a dataset within a quarter of its free memory, else the cache where its disk has
    # room (the cache folder need not exist yet), else DataLoader workers.
    cache = tmp_path / "not/yet"
    asked = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: asked.append(path) or SimpleNamespace(free=5 * 2**30))
    assert auto_tier(2**30, 2**30, 8 * 2**30, cache)[0] == "device"
    tier, why = auto_tier(4 * 2**30, 4 * 2**30, 8 * 2**30, cache)
    assert tier == "cache" and why.endswith(f"need more than 25% of the GPU's 8.0 GiB free beside the model's states: "
                                            f"decoded once into the cache {cache}")
    assert asked == [tmp_path]
    tier, why = auto_tier(4 * 2**30, 4 * 2**30, 8 * 2**30, None)
    assert tier == "workers" and why.endswith("of the GPU's 8.0 GiB free beside the model's states, and --cache_dir "
                                              "is off")
    tier, why = auto_tier(6 * 2**30, 6 * 2**30, 8 * 2**30, cache)
    assert tier == "workers" and why.endswith("and the cache's disk has 5.0 GiB free")
    # the model's states counted on each GPU: ZeRO's shards split over the ranks, offloaded ones left out (a 7 B
    # model at ZeRO-3 on two GPUs took the whole GPU's 80 GiB on each, and the reason then read "free -22.3 GiB")
    from deepspeed_image_trainer.engine.memory import state_bytes_per_gpu

    def zero(stage, **offload):
        return {"zero_optimization": {"stage": stage, **{key: {"device": "cpu"} for key in offload}}}

    for config, ranks, per_param in ((zero(0), 2, 16), (zero(1), 2, 12), (zero(2), 2, 10), (zero(3), 2, 8),
                                     (zero(3), 1, 16), (zero(2, offload_optimizer=1), 2, 4),
                                     (zero(1, offload_optimizer=1), 4, 8),
                                     (zero(3, offload_optimizer=1, offload_param=1), 2, 0)):
        assert state_bytes_per_gpu(config, ranks, 1000) == per_param * 1000, (config, ranks)
    # training squares of the validation resize by default (256 for 224), or of --device_train_size
    assert dataset_bytes(100, 10, 224) == 3 * (100 * 256**2 + 10 * 224**2)
    assert dataset_bytes(100, 10, 224, train_size=384) == 3 * (100 * 384**2 + 10 * 224**2)
    # the crop weights auto mode counts on top: the table ResizedCrops keeps (float16 on a GPU)
    table = ResizedCrops(40, 24, CPU, torch.float16).windows
    assert table.untyped_storage().nbytes() == crop_weights_bytes(40, 24)


@pytest.mark.slow
def test_training_with_the_dataset_on_the_device(tiny_data, tmp_path):
    # the trainer in a rank of its own (the device tier is the trainer's; a launcher run adds ~10 s of start-up)
    result = train_ranks(data_args(tiny_data) + ["--epochs", "2", "--batch_size", "4", "--image_size", "32",
                                            "--save_every", "1", "--data_on_device", "on",
                                            "--device_train_size", "40", "--cache_dir", str(tmp_path / "cache")],
                    tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"Data on cpu (--data_on_device on): decoded {TINY_TRAIN_IMAGES + TINY_VAL_IMAGES} images" in result.stdout
    history = history_of(tmp_path)
    assert history["config"]["data_on_device"] is True and history["config"]["device_train_size"] == 40
    for epoch in history["epochs"]:
        assert 0 <= epoch["data_wait_s"] <= epoch["epoch_time_s"]
        assert epoch["compute_s"] == pytest.approx(epoch["epoch_time_s"] - epoch["data_wait_s"])
        assert epoch["val_images"] == TINY_VAL_IMAGES  # every validation image once, none dropped
        assert math.isfinite(epoch["train_loss"]) and math.isfinite(epoch["val_loss"])
        correct = epoch["val_acc"] * TINY_VAL_IMAGES  # a count of images, each scored once
        assert 0 <= epoch["val_acc"] <= 1 and abs(correct - round(correct)) < 1e-9
    assert "waiting for data" in result.stdout
    # Each epoch's checkpoint holds the weights it was validated with: scored again on the device path's
    # validation images, they give the logged loss and accuracy.
    train_set, val_set, _ = load_datasets(tiny_data / "train", tiny_data / "val", 32)
    _, val_loader, _, _ = build_device_loaders(train_set, val_set, micro_batch_size=4, image_size=32, rank=0,
                                               world_size=1, seed=42, device=CPU, dtype=torch.float32, train_size=40)
    for epoch in history["epochs"]:
        states = tmp_path / f"checkpoints_deepspeed/epoch_{epoch['epoch']}/epoch_{epoch['epoch']}"
        model = ResNet18Animals90(num_classes=TINY_CLASSES).eval()
        model.load_state_dict(torch.load(states / "mp_rank_00_model_states.pt", weights_only=True)["module"])
        with torch.no_grad():
            scored = [(F.cross_entropy(model(x), y, reduction="sum").item(), (model(x).argmax(1) == y).sum().item())
                      for x, y in val_loader]
        assert sum(c for _, c in scored) / TINY_VAL_IMAGES == epoch["val_acc"]
        assert sum(loss for loss, _ in scored) / TINY_VAL_IMAGES == pytest.approx(epoch["val_loss"], rel=1e-5)
    # evaluate decodes as the run validated (its checkpoint, and its export, say the tier): the logged figures
    from deepspeed_image_trainer.inference import evaluate, export

    best = history["epochs"][history["best"]["epoch"] - 1]
    export.main([str(tmp_path / "checkpoints_deepspeed/best_model"), "--output", str(tmp_path / "model.pt")])
    for model, decode in (("checkpoints_deepspeed/best_model", "auto"), ("model.pt", "auto"), ("model.pt", "pil")):
        evaluate.main(["--model", str(tmp_path / model), "--data_dir", str(tiny_data / "val"), "--output_dir",
                       str(tmp_path / "eval"), "--num_workers", "0", "--decode", decode])
        report = json.loads((tmp_path / "eval/report.json").read_text())
        assert report["decode"] == ("pil" if decode == "pil" else "torchvision")
        if decode == "auto":
            assert report["top1"] == pytest.approx(best["val_acc"])
            assert report["loss"] == pytest.approx(best["val_loss"], rel=1e-5)
