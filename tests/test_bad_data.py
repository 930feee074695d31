"""Bad input data: every kind of bad file is skipped or converted and reported, unusable datasets stop with status 2."""
import argparse
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from deepspeed_image_trainer.cli import launch as launch_deepspeed
from deepspeed_image_trainer.data import check as data_check
from deepspeed_image_trainer.data.check import cache_path, check_data, check_folders
from deepspeed_image_trainer.data.device import (Normalize, build_device_loaders, decode_chunk, decode_dataset,
                                                 resize_size)
from deepspeed_image_trainer.data.folders import ImageFiles, build_transform, load_datasets, load_rgb
from deepspeed_image_trainer.data.prepare import main as prepare_data_main
from deepspeed_image_trainer.data.prepare import make_sample_dataset
from deepspeed_image_trainer.utils.failures import UsageError

from conftest import (DEVICES, ROOT, assert_usage_error_in_process, data_args, history_of, launch, run,
                      spawn_ranks, train_ranks, unblock_later)

CPU = torch.device("cpu")
# file name -> why it cannot be read
UNREADABLE = {"train/antelope/truncated.jpg": "truncated", "train/antelope/corrupt.jpg": "not an image",
              "train/antelope/empty.jpg": "empty file", "train/antelope/text.png": "not an image",
              "train/antelope/bomb.png": "exceeds limit of 178956970 pixels", "val/bat/truncated.jpg": "truncated",
              "train/antelope/broken_link.jpg": "no such file"}
# file name -> the mode PIL opens it in; all must train, converted to RGB
UNUSUAL = {"grey.jpg": "L", "grey_alpha.png": "LA", "palette.png": "P", "palette_transparent.png": "P",
           "rgba.webp": "RGBA", "cmyk.jpg": "CMYK", "grey16.png": "I;16", "photo.bmp": "RGB",
           "exif_rotated.jpg": "RGB"}


def picture(width=48, height=32):
    """An RGB array with no symmetry (a wrong rotation or flip changes it): gradient, one red corner."""
    y, x = np.mgrid[0:height, 0:width]
    image = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 90)], axis=-1).astype(np.uint8)
    image[: height // 3, : width // 4] = (240, 20, 20)
    return image


def write_unusual_images(folder):
    folder.mkdir(parents=True, exist_ok=True)
    rgb = Image.fromarray(picture())
    rgb.convert("L").save(folder / "grey.jpg")
    rgb.convert("LA").save(folder / "grey_alpha.png")
    rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(folder / "palette.png")
    rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(folder / "palette_transparent.png",
                                                                     transparency=0)
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray(picture()[..., 0]))
    rgba.save(folder / "rgba.webp", lossless=True)
    rgb.convert("CMYK").save(folder / "cmyk.jpg", quality=95)
    Image.fromarray(picture()[..., 0].astype(np.uint16) * 257).save(folder / "grey16.png")
    rgb.save(folder / "photo.bmp")
    exif = Image.Exif()
    exif[data_check.EXIF_ORIENTATION] = 6  # stored sideways, shown rotated 90 degrees clockwise
    rgb.save(folder / "exif_rotated.jpg", exif=exif, quality=95)


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    """Three classes of 32 px drawings (antelope, badger, bat) plus every kind of bad input:
    unreadable files, unusual modes and formats, EXIF rotation, a very large image, hidden files,
    empty class folders, no validation folder for antelope (the first class, so that ImageFolder's
    own val labels would shift) and a text file."""
    root = tmp_path_factory.mktemp("bad_data")
    make_sample_dataset(root, num_classes=3, train_per_class=8, val_per_class=3, image_size=32, seed=1)
    good = (root / "train/antelope/antelope_0000.jpg").read_bytes()
    (root / "train/antelope/truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "train/antelope/corrupt.jpg").write_bytes(good[:2] + bytes(range(256)) * 4)
    (root / "train/antelope/empty.jpg").write_bytes(b"")
    (root / "train/antelope/text.png").write_text("not a picture\n")
    # 182 Mpx: over PIL's decompression-bomb limit, refused from the header alone.
    Image.new("1", (14000, 13000)).save(root / "train/antelope/bomb.png")
    # 90 Mpx: over PIL's warning limit, a legitimate (if slow) photo.
    Image.new("1", (9500, 9500), 1).save(root / "train/bat/large.png")
    (root / "val/bat/truncated.jpg").write_bytes(good[: len(good) - 300])
    (root / "train/antelope/broken_link.jpg").symlink_to(root / "moved_away.jpg")
    write_unusual_images(root / "train/badger")
    write_unusual_images(root / "val/badger")
    (root / "train/badger/._grey.jpg").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (root / "train/.ipynb_checkpoints/antelope").mkdir(parents=True)
    (root / "train/.ipynb_checkpoints/antelope/x.jpg").write_bytes(good)
    (root / "train/bat/.DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (root / "train/bat/notes.txt").write_text("where the bats came from\n")
    (root / "train/stray.jpg").write_bytes(good)  # in no class folder
    (root / "train/zebra").mkdir()
    (root / "val/zebra").mkdir()
    shutil.rmtree(root / "val/antelope")
    return root


def test_the_check_reports_every_kind_of_bad_file(bad_data):
    check = check_data(bad_data / "train", bad_data / "val")
    summary = check.summary()
    skipped = {item["path"]: item["reason"] for item in summary["skipped"]}
    assert set(skipped) == {str(bad_data / name) for name in UNREADABLE}
    for name, reason in UNREADABLE.items():
        assert reason in skipped[str(bad_data / name)].lower()
    assert summary["skipped_count"] == len(UNREADABLE) == 7
    assert check.classes == ["antelope", "badger", "bat"]
    assert summary["train_images"] == 3 * 8 + len(UNUSUAL) + 1 and summary["val_images"] == 2 * 3 + len(UNUSUAL)
    assert summary["empty_class_folders"] == [str(bad_data / "train/zebra"), str(bad_data / "val/zebra")]
    assert summary["classes_without_val_images"] == ["antelope"]
    assert summary["files_without_image_suffix"] == [str(bad_data / "train/bat/notes.txt")]
    assert summary["files_outside_class_folders"] == [str(bad_data / "train/stray.jpg")]
    assert summary["hidden_ignored"] == 3
    assert summary["large_images"] == [str(bad_data / "train/bat/large.png")]
    assert summary["converted_to_rgb"] == {"1": 1, "CMYK": 2, "I;16": 2, "L": 2, "LA": 2, "P": 4, "RGBA": 2}
    assert summary["exif_rotated"] == 2
    warnings = check.warnings()
    assert len(warnings) == 6 and warnings[0].startswith("warning: skipping 7 unreadable image(s): ")
    assert ("warning: ignoring 1 file(s) beside the class folders (images go in <folder>/<class>/): "
            f"{bad_data}/train/stray.jpg") in warnings
    assert warnings[0].endswith(" and 2 more")


def test_validation_labels_follow_the_training_classes_by_name(bad_data):
    train_set, val_set, _ = load_datasets(bad_data / "train", bad_data / "val", 32)
    assert train_set.classes == val_set.classes == ["antelope", "badger", "bat"]
    labels = {path.split("/")[-2]: label for path, label in val_set.samples}
    assert labels == {"badger": 1, "bat": 2}
    image, label = val_set[0]
    assert image.shape == (3, 32, 32) and label == 1


def test_unusual_images_become_the_rgb_picture_they_show(bad_data):
    folder = bad_data / "train/badger"
    expected = picture()
    upright = np.asarray(load_rgb(folder / "exif_rotated.jpg")).astype(int)
    assert upright.shape == (48, 32, 3)  # stored 48 wide, 32 high
    assert np.abs(upright - np.rot90(expected, -1)).mean() < 3
    grey16 = np.asarray(load_rgb(folder / "grey16.png"))
    assert np.array_equal(grey16[..., 1], expected[..., 0])  # scaled to 8 bits, not clipped to white
    alpha = expected[..., :1] / 255  # rgba.webp's alpha is its red channel
    over_white = np.asarray(load_rgb(folder / "rgba.webp")).astype(int)
    assert np.abs(over_white - (expected * alpha + 255 * (1 - alpha))).max() <= 1
    for name, mode in UNUSUAL.items():
        assert Image.open(folder / name).mode == mode
        assert load_rgb(folder / name).mode == "RGB"


def test_the_device_path_decodes_what_the_dataloader_path_does(bad_data, tmp_path):
    """EXIF-rotated, CMYK, 16-bit and palette images: identical pixels after decoding, and the same
    validation tensors (up to the resizes' rounding) from both data paths."""
    names = ["exif_rotated.jpg", "cmyk.jpg", "grey16.png", "palette.png", "palette_transparent.png"]
    paths = [str(bad_data / "val/badger" / name) for name in names]
    # Each file's header read again, or taken from the data check's records (as training does).
    for records in (None, {path: data_check.inspect_image(path) for path in paths}):
        for path, decoded in zip(paths, decode_chunk(paths, CPU, records)[0]):
            assert torch.equal(decoded, torch.from_numpy(np.array(load_rgb(path))).permute(2, 0, 1)), path
    for orientation in range(1, 9):  # every EXIF orientation, as PIL applies it
        exif = Image.Exif()
        exif[data_check.EXIF_ORIENTATION] = orientation
        path = str(tmp_path / f"{orientation}.jpg")
        Image.fromarray(picture()).save(path, exif=exif, quality=95)
        expected = torch.from_numpy(np.array(ImageOps.exif_transpose(Image.open(path)))).permute(2, 0, 1)
        for records in (None, {path: data_check.inspect_image(path)}):
            assert torch.equal(decode_chunk([path], CPU, records)[0][0], expected), orientation
    device_images = Normalize(CPU, torch.float32)(decode_dataset(paths, resize_size(24), 24, CPU)[0])
    reference = ImageFiles([(path, 0) for path in paths], ["badger"], build_transform(24, train=False))
    expected = torch.stack([reference[i][0] for i in range(len(paths))])
    assert ((device_images - expected).abs().mean(dim=(1, 2, 3)) < 0.02).all()


def test_the_cache_spares_unchanged_files_a_second_decode(bad_data, tmp_path, monkeypatch):
    root = tmp_path / "data"
    shutil.copytree(bad_data / "val", root)
    first = check_folders(root)
    first.save_cache()
    inspected = []
    inspect = data_check.inspect_image
    monkeypatch.setattr(data_check, "inspect_image",
                        lambda path, decode=True: inspected.append((path, decode)) or inspect(path, decode))
    (root / "bat/bat_0000.jpg").write_bytes((root / "bat/truncated.jpg").read_bytes())
    again = check_folders(root)
    assert inspected == [(str(root / "bat/bat_0000.jpg"), True)]
    assert first.inspected == len(first.train.records) and again.inspected == 1 and again.decoded
    assert [path for path, _ in again.skipped] == [str(root / "bat/bat_0000.jpg"), str(root / "bat/truncated.jpg")]
    cache = data_check.cache_path(root)  # records that are not (an edited or foreign cache): inspected again
    edited = json.loads(cache.read_text())
    cache.write_text(json.dumps({**edited, "files": {path: 7 for path in edited["files"]}}))
    assert check_folders(root).inspected == len(first.train.records)


def test_a_fifo_in_place_of_the_checks_cache_is_a_warning_and_replaced(tiny_data, tmp_path, monkeypatch, capsys):
    """Reading it waited for a writer for good: the launcher, the training script and --check all hung."""
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "data"
    shutil.copytree(tiny_data / "val", root)
    cache = cache_path(root)
    cache.parent.mkdir(parents=True)
    os.mkfifo(cache)
    read = unblock_later(cache)
    check = check_folders(root)
    assert not read.is_set()
    assert capsys.readouterr().err == (f"warning: cannot read the data check's cache {cache} (not a regular file: a "
                                       "FIFO, a device, a socket or a folder); every image is inspected again\n")
    check.save_cache()  # through a file of its own, renamed over the FIFO
    assert cache.is_file() and check_folders(root).inspected == 0 and not capsys.readouterr().err


@pytest.mark.parametrize("damaged", [{"decoded": True}, {"stat": "STAT"}, {"stat": "STAT", "error": None},
                                     {"stat": "STAT", "error": None, "width": 0, "height": 4}])
def test_a_cache_record_with_keys_missing_is_inspected_again(tiny_data, tmp_path, monkeypatch, damaged):
    """A hand-edited record (a dict without stat, error or the image's size) ended every later check in a
    KeyError traceback, until the file was deleted by hand."""
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "data"
    shutil.copytree(tiny_data / "val", root)
    check_folders(root).save_cache()
    cache = cache_path(root)
    saved = json.loads(cache.read_text())
    first = sorted(saved["files"])[0]
    saved["files"][first] = {key: saved["files"][first]["stat"] if value == "STAT" else value  # the file's own
                             for key, value in damaged.items()}
    cache.write_text(json.dumps(saved))
    check = check_folders(root)
    assert check.inspected == 1 and not check.errors


def test_a_check_of_headers_only_decodes_nothing_and_leaves_a_full_check_to_decode(bad_data, tmp_path, monkeypatch):
    """The launcher reads headers only when training decodes the data anyway; a later check that must
    decode (the DataLoader tier) does not take those records for decoded ones."""
    root = tmp_path / "data"
    shutil.copytree(bad_data / "val", root)
    decoded, load = [], Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda image: decoded.append(image.format) or load(image))
    headers = check_folders(root, decode=False)
    headers.save_cache()
    assert "JPEG" not in decoded and not headers.decoded  # (PIL reads a whole PNG to find its EXIF)
    # the header shows what a truncated JPEG is: only the decode finds it
    assert str(root / "bat/truncated.jpg") in headers.train.images["bat"]
    assert check_folders(root, decode=False).inspected == 0
    full = check_folders(root)
    # a file whose header is unreadable is not read again
    assert full.inspected == sum(record["error"] is None for record in headers.train.records.values())
    assert full.decoded
    assert str(root / "bat/truncated.jpg") in dict(full.skipped)
    full.save_cache()
    assert check_folders(root, decode=False).inspected == check_folders(root).inspected == 0


@pytest.mark.parametrize("device", DEVICES)  # nvJPEG must refuse it too
@pytest.mark.parametrize("tier", ["device", "cache"])
def test_the_decode_leaves_out_what_a_check_of_headers_let_through(bad_data, tmp_path, tier, device):
    root = tmp_path / "data"
    shutil.copytree(bad_data, root, symlinks=True)
    late = root / "train/bat/cut_after_header.jpg"
    late.write_bytes((root / "val/bat/truncated.jpg").read_bytes())
    # bytes after the end marker, as some cameras write: a whole image
    (root / "train/bat/trailer.jpg").write_bytes((root / "train/bat/bat_0000.jpg").read_bytes() + bytes(100))
    train_set, val_set, _ = load_datasets(root / "train", root / "val", 32, decode=False)
    assert str(late) in [path for path, _ in train_set.samples]
    cache = tmp_path / "cache" if tier == "cache" else None
    for _ in range(2 if cache else 1):  # filled, then read back: the same files left out without a decode
        train, val, done, unreadable = build_device_loaders(
            train_set, val_set, micro_batch_size=4, image_size=32, rank=0, world_size=1, seed=0, device=device,
            dtype=torch.float32, tier=tier, cache_root=cache)
        assert sorted(unreadable) == [str(late), str(root / "val/bat/truncated.jpg")]
        assert "truncated" in unreadable[str(late)]
        drawn = torch.cat([indices.cpu() for indices, _ in train.epoch_boxes(0)]).tolist()
        assert train_set.samples.index((str(late), 2)) not in drawn and len(drawn) == 35 // 4 * 4
        assert len(set(drawn)) == len(drawn)
        assert sum(len(labels) for _, labels in val) == 15
    assert done.startswith("read 52 decoded by an earlier run" if cache else "decoded 52 images")


@pytest.mark.parametrize("where", ["decode_jpeg", "load_rgb"])
def test_running_out_of_memory_in_the_decode_stops_it_rather_than_leave_images_out(bad_data, monkeypatch, where):
    """A good image is never recorded as one that does not decode (the cache would remember it, and a rank
    alone would shuffle otherwise) because memory ran out."""
    from deepspeed_image_trainer.data import device as device_data

    def out_of_memory(*args, **kwargs):
        raise (torch.OutOfMemoryError("CUDA out of memory") if where == "decode_jpeg" else MemoryError())

    monkeypatch.setattr(device_data, where, out_of_memory)
    paths = [str(bad_data / "val/bat/bat_0000.jpg"), str(bad_data / "val/badger/palette.png")]
    with pytest.raises(torch.OutOfMemoryError if where == "decode_jpeg" else MemoryError):
        decode_chunk(paths, CPU)


def test_the_check_decodes_every_file_only_where_training_does_not_decode_them():
    from deepspeed_image_trainer.data.check import decodes_every_file

    # DataLoader workers decode nothing before they start: the check does
    assert decodes_every_file("off", "cuda", False) and decodes_every_file("auto", "cpu", False)
    assert decodes_every_file("auto", "cuda", True)  # auto without the cache may end on the DataLoader tier
    # the data on the GPU or in the cache: the decode is the check
    assert not any(decodes_every_file(mode, "cuda", False) for mode in ("auto", "on", "cache"))
    assert not decodes_every_file("on", "cpu", True)


def test_the_dataloader_tier_decodes_what_a_check_of_headers_left(bad_data, tmp_path, monkeypatch):
    """--data_on_device auto on a GPU reads headers only; when it ends on the DataLoader tier (the cache's disk
    full) the training script decodes the rest before it starts, and the classes must not change."""
    from deepspeed_image_trainer.cli import train as train_deepspeed

    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "cache"))  # not the results other tests kept
    args = argparse.Namespace(train_dir=bad_data / "train", val_dir=bad_data / "val", image_size=32)
    headers = load_datasets(args.train_dir, args.val_dir, 32, decode=False)[2]
    assert not headers.decoded and len(headers.skipped) == 6
    train_set, _, check = train_deepspeed.recheck(args, None, headers.classes)
    assert check.decoded and len(check.skipped) == 7 and len(train_set) == 34
    # the node's other ranks read what its first rank decoded
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr("deepspeed_image_trainer.data.check.inspect_image", lambda *_: pytest.fail("a second rank decoded an image"))
    train_set, _, check = train_deepspeed.recheck(args, None, headers.classes)
    assert check.decoded and len(check.skipped) == 7 and len(train_set) == 34
    with pytest.raises(UsageError, match="classes without a readable image once decoded: zebra"):
        train_deepspeed.recheck(args, None, headers.classes + ["zebra"])


RECHECK_TIMEOUT_S = 2  # stands in for the process group's timeout (DeepSpeed's: 10 minutes)
DECODE_S = 3.5  # stands in for a node's decode of a large dataset, longer than that


def recheck_rank(rank, port, data_root, cache_dir, queue, fail):
    """recheck on rank `rank` of 2 (one node), rank 0 decoding for DECODE_S; puts (rank, training images or
    the last line of its error)."""
    import datetime
    import os
    import time
    import traceback

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_RANK=str(rank), TRAINER_CACHE_DIR=cache_dir)
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2,
                                             timeout=datetime.timedelta(seconds=RECHECK_TIMEOUT_S))
        from deepspeed_image_trainer.cli import train as train_deepspeed

        if rank == 0:
            def slow_load(*args, **kwargs):
                if fail:
                    raise UsageError("no readable image")
                time.sleep(DECODE_S)
                return load_datasets(*args, **kwargs)

            train_deepspeed.load_datasets = slow_load
        args = argparse.Namespace(train_dir=f"{data_root}/train", val_dir=f"{data_root}/val", image_size=32)
        headers = load_datasets(args.train_dir, args.val_dir, 32, decode=False)[2]
        queue.put((rank, len(train_deepspeed.recheck(args, None, headers.classes)[0])))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, traceback.format_exc().strip().splitlines()[-1]))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)  # no teardown barrier: the peer may be gone


def recheck_on_two_ranks(folder, fail=False):
    import multiprocessing

    from deepspeed_image_trainer.engine.distributed import free_port

    context = multiprocessing.get_context("spawn")
    queue, port = context.Queue(), free_port()
    ranks = [context.Process(target=recheck_rank, args=(rank, port, str(folder / "data"), str(folder / "cache"),
                                                        queue, fail)) for rank in range(2)]
    for process in ranks:
        process.start()
    results = dict(queue.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(30)
    return results


@pytest.mark.slow
def test_a_nodes_other_ranks_wait_for_its_decode_past_the_process_groups_timeout(tmp_path):
    """The DataLoader tier after a header-only check: the node's first rank decodes (for longer than the
    default group's timeout, as a large dataset can), the others wait for it; should it fail, they stop too."""
    make_sample_dataset(tmp_path / "data", num_classes=2, train_per_class=4, val_per_class=2, image_size=32, seed=0)
    assert recheck_on_two_ranks(tmp_path) == {0: 8, 1: 8}
    failed = recheck_on_two_ranks(tmp_path, fail=True)
    error = "deepspeed_image_trainer.utils.failures.UsageError"
    assert failed[0] == f"{error}: no readable image"
    assert failed[1].startswith(f"{error}: a node's first rank could not decode the dataset")


def train_with_output_in(rank, port, results, workdir, argv):
    """The training script's run_cli(main) in this rank (a fresh process of its own), its file descriptors 1
    and 2 written to workdir/stdout and workdir/stderr; its exit status in results["status"]."""
    from deepspeed_image_trainer.cli import train
    from deepspeed_image_trainer.cli.options import run_cli

    os.chdir(workdir)
    os.environ["MASTER_PORT"] = str(port)
    for fd, name in ((1, "stdout"), (2, "stderr")):  # everything the process writes, C code and loggers included
        with open(name, "w") as f:
            os.dup2(f.fileno(), fd)
    try:
        results["status"] = run_cli(train.main, argv)
    except SystemExit as exited:
        results["status"] = exited.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


@pytest.mark.slow
def test_a_training_set_that_does_not_decode_stops_the_run_with_status_2(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "cache"))
    make_sample_dataset(tmp_path / "data", num_classes=3, train_per_class=2, val_per_class=1, image_size=32, seed=0)
    for image in (tmp_path / "data/train").rglob("*.jpg"):  # whole headers, data cut short
        image.write_bytes(image.read_bytes()[:-100])
    # The training script in a rank of its own (the launcher passes a rank's status 2 on: test_launcher,
    # test_adversarial); the header-only check passes these files, the rank's decode does not.
    status = spawn_ranks(train_with_output_in, 1, tmp_path, data_args(tmp_path / "data") + [
        "--epochs", "1", "--batch_size", "2", "--image_size", "32", "--data_on_device", "on"])["status"]
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert status == 2, stdout[-2000:] + stderr[-2000:]
    assert "warning: no image of 3 class(es) decodes: antelope, badger, bat" in stdout
    assert (f"error: {tmp_path / 'data/train'}: 0 training images decode: too few for 1 rank(s) x micro-batch 2"
            in stderr)
    assert "Traceback" not in stderr


def unusable(tmp_path, kind):
    make_sample_dataset(tmp_path, num_classes=2, train_per_class=2, val_per_class=1, image_size=32, seed=0)
    if kind == "missing":
        shutil.rmtree(tmp_path / "val")
        return f"image folder not found: {tmp_path / 'val'}"
    if kind == "no classes":
        for folder in (tmp_path / "train").iterdir():
            shutil.rmtree(folder)
        (tmp_path / "train/readme.txt").write_text("images go here\n")
        return f"{tmp_path / 'train'}: no class folders"
    if kind == "no readable image":
        for image in (tmp_path / "train").rglob("*.jpg"):
            image.write_bytes(b"")
        return f"{tmp_path / 'train'}: no readable image in 2 class folder(s) (4 unreadable)"
    (tmp_path / "val/whale").mkdir()
    shutil.copy(tmp_path / "val/antelope/antelope_0000.jpg", tmp_path / "val/whale")
    return f"{tmp_path / 'val'} has images of classes that {tmp_path / 'train'} has no images of: whale"


@pytest.mark.parametrize("kind", ["missing", "no classes", "no readable image", "val class not in train"])
def test_unusable_data_stops_the_launcher_and_the_check_with_status_2(tmp_path, capsys, kind):
    message = unusable(tmp_path / "data", kind)
    for main, argv in ((launch_deepspeed.main, data_args(tmp_path / "data") + ["--log_dir", str(tmp_path / "logs")]),
                       (prepare_data_main, ["--check", str(tmp_path / "data")])):
        _, stderr = assert_usage_error_in_process(main, argv, capsys, message)
        assert stderr.startswith(f"error: {message}"), stderr
    assert not (tmp_path / "logs").exists()
    with pytest.raises(UsageError):
        check_data(tmp_path / "data/train", tmp_path / "data/val")


def test_a_dry_run_says_the_data_checks_warnings(bad_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert launch_deepspeed.main(data_args(bad_data) + ["--dry_run"]) == 0
    warnings = capsys.readouterr().err.splitlines()
    assert warnings[0].startswith("warning: skipping 7 unreadable image(s): ") and len(warnings) == 6, warnings
    assert "warning: 1 training class(es) have no validation images: antelope" in warnings
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_check_command_prints_the_report(bad_data, tmp_path):
    result = run([sys.executable, str(ROOT / "src/prepare_data.py"), "--check", str(bad_data)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "unreadable, skipped: 7\n" in result.stdout
    for name in UNREADABLE:
        assert str(bad_data / name) in result.stdout
    assert f"class folders without a readable image, ignored: 2\n  {bad_data / 'train/zebra'}" in result.stdout
    assert "training classes without validation images: 1\n  antelope\n" in result.stdout
    assert "converted to RGB: 1 1, CMYK 2, I;16 2, L 2, LA 2, P 4, RGBA 2" in result.stdout
    assert "rotated by their EXIF orientation: 2" in result.stdout
    assert f"files beside the class folders, ignored: 1\n  {bad_data / 'train/stray.jpg'}\n" in result.stdout
    assert result.stdout.endswith("usable, 6 warning(s)\n")
    assert result.stderr == ""  # not even PIL's warning about the large image: the report names it


def recorded_skips(workdir):
    history = history_of(workdir)
    return [(item["path"], item["reason"]) for item in history["config"]["data_check"]["skipped"]]


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["off", "cache"])
def test_training_skips_the_bad_files_and_records_them(bad_data, tmp_path, monkeypatch, tier):
    """The DataLoader tier: the launcher's check decodes every file. The cache tier: the check reads headers,
    and the decode into the cache finds the JPEGs cut short after their header; the same files are skipped
    either way, and a second run on two ranks reads them from the cache, decoding nothing. The LR schedule
    is sized on the images that train, not on the check's count: 34 of the 35 headers decode, 6 steps of 5."""
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "cache"))  # the data check's and the decoded images'
    root = tmp_path / "data"
    shutil.copytree(bad_data, root, symlinks=True)
    (root / "train/bat/cut_after_header.jpg").write_bytes((root / "val/bat/truncated.jpg").read_bytes())
    unreadable = {**UNREADABLE, "train/bat/cut_after_header.jpg": "truncated"}
    args = data_args(root) + ["--epochs", "1", "--batch_size", "5", "--image_size", "32", "--zero_stage", "0",
                              "--data_on_device", tier, "--num_workers", "0", "--warmup_epochs", "0"]
    filled = None  # the cache's entries after the first run
    for run_number in (1, 2) if tier == "cache" else (1,):
        workdir = tmp_path / f"run{run_number}"
        workdir.mkdir()
        # the second run: the training script on 2 spawn_ranks ranks (the cache's reader is the trainer; the
        # launcher's check, the first run's, is the same on two ranks); a launcher run adds ~10 s of start-up
        result = launch(args, workdir) if run_number == 1 else train_ranks(args, workdir, nprocs=2)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: skipping")]
        if tier == "off":
            assert len(warnings) == 1 and warnings[0].startswith("warning: skipping 8 unreadable image(s): ")
        else:
            assert warnings[0].startswith("warning: skipping 6 unreadable image(s): ")
            skips = dict(recorded_skips(workdir))
            assert warnings[1] == ("warning: skipping 2 image(s) that do not decode: " + ", ".join(
                f"{path} ({skips[path]})" for path in (str(root / "train/bat/cut_after_header.jpg"),
                                                       str(root / "val/bat/truncated.jpg"))))
            assert len(warnings) == 2
            assert ("decoded 51 images" if run_number == 1 else "read 51 decoded by an earlier run") in result.stdout
            entries = sorted(path.name for path in (tmp_path / "cache/decoded").iterdir())
            assert run_number == 1 or entries == filled  # nothing filled again
            filled = entries
        history = history_of(workdir)
        recorded = history["config"]["data_check"]
        assert recorded["skipped_count"] == 8
        assert {item["path"] for item in recorded["skipped"]} == {str(root / name) for name in unreadable}
        assert history["config"]["train_images"] == recorded["train_images"] == 34
        assert history["epochs"][0]["val_images"] == recorded["val_images"] == 15  # on two ranks as on one
        world_size = history["config"]["world_size"]
        assert world_size == (2 if run_number == 2 else 1)
        # the optimizer steps that ran: 34 images // 5 a micro-batch on 1 rank (6), // 2 ranks // 5 (3)
        steps = 34 // world_size // 5
        scheduler = history["config"]["deepspeed"]["scheduler"]["params"]
        assert scheduler["total_num_steps"] == 1 * steps
        # and the engine's scheduler is that one: the cosine ends (1% of the peak) on the last step that ran
        assert history["epochs"][-1]["lr"] == pytest.approx(0.01 * history["config"]["training"]["learning_rate"])
    cached = [json.loads(cache_path(root / split).read_text())["files"] for split in ("train", "val")]
    assert sum(map(len, cached)) == 34 + 15 + 8  # every file checked, readable or not, kept for the next run
    assert all(record["decoded"] == (tier == "off" or record["error"] is not None)
               for records in cached for record in records.values())
