"""The decoded-image cache (data/cache.py): the pixels the device path decodes, read back by later runs
without decoding, a new entry for changed files, nothing half-written used, one fill for runs at once."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from deepspeed_image_trainer.data.cache import entry_key, load_or_fill
from deepspeed_image_trainer.data.check import cache_path
from deepspeed_image_trainer.data.device import build_device_loaders, decode_dataset
from deepspeed_image_trainer.data.folders import load_datasets

from conftest import DEVICES, TINY_TRAIN_IMAGES, TINY_VAL_IMAGES, data_args, launch, unblock_later

CPU = torch.device("cpu")


def loaders(data, cache, tier="device", sets=None, device=CPU):
    train_set, val_set, _ = sets or load_datasets(data / "train", data / "val", 24)
    return build_device_loaders(train_set, val_set, micro_batch_size=4, image_size=24, rank=0, world_size=1, seed=0,
                                device=device, dtype=torch.float32, train_size=40, tier=tier, cache_root=cache)


def entries(cache):
    return sorted(p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith("."))


def test_the_cache_holds_the_decoded_pixels_and_a_second_run_decodes_nothing(tiny_data, tmp_path):
    cache, sets = tmp_path / "cache", load_datasets(tiny_data / "train", tiny_data / "val", 24)
    train, val, done, _ = loaders(tiny_data, cache, sets=sets)
    assert done.startswith(f"decoded {TINY_TRAIN_IMAGES + TINY_VAL_IMAGES} images in ")
    assert done.endswith(f"(cache: {cache})")
    assert len(entries(cache)) == 2  # the training squares and the validation crops
    paths = [path for path, _ in sets[0].samples]
    assert torch.equal(train.images, decode_dataset(paths, 40, 40, CPU)[0])  # the device path's own pixels
    uncached = loaders(tiny_data, None)[1]
    assert torch.equal(val.images, uncached.images)

    # A file rewritten with its size and time kept is still the cached one: proof that nothing is decoded.
    first = paths[0]
    stat, original = os.stat(first), open(first, "rb").read()
    with open(first, "wb") as f:
        f.write(bytes(len(original)))
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    try:
        again, _, done, _ = loaders(tiny_data, cache, sets=sets)
        assert done.startswith(f"read {TINY_TRAIN_IMAGES + TINY_VAL_IMAGES} decoded by an earlier run from the cache")
        assert torch.equal(again.images, train.images)
    finally:
        with open(first, "wb") as f:
            f.write(original)
        os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("tier", ["device", "cache"])  # the cache tier's fallback decodes into host memory
def test_a_cache_that_cannot_be_written_is_a_warning_and_the_run_decodes(tiny_data, tmp_path, capsys, tier):
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    train, _, done, _ = loaders(tiny_data, blocked / "cache", tier=tier)
    assert train.host == (tier == "cache") and train.images.device == CPU
    assert done.startswith(f"decoded {TINY_TRAIN_IMAGES + TINY_VAL_IMAGES} images") and "cache:" not in done
    err = capsys.readouterr().err
    assert err.startswith(f"warning: cannot use the decoded-image cache {blocked / 'cache'}") and err.count("\n") == 1
    assert torch.equal(train.images, loaders(tiny_data, None)[0].images)


def test_an_entry_changed_since_it_was_filled_is_filled_again(tiny_data, tmp_path):
    cache, sets = tmp_path / "cache", load_datasets(tiny_data / "train", tiny_data / "val", 24)
    first = loaders(tiny_data, cache, sets=sets)[0].images.clone()
    entry = next(path for path in (cache / entries(cache)[0]).iterdir() if path.suffix == ".u8")
    with open(entry, "r+b") as f:  # the same size, other bytes: as a disk error or another program leaves it
        f.write(bytes(600))
    train, _, done, _ = loaders(tiny_data, cache, sets=sets)
    assert done.startswith("decoded ") and torch.equal(train.images, first)
    # a record naming images the entry does not have (edited by hand): filled again, not an IndexError
    meta = next(path for path in (cache / entries(cache)[0]).iterdir() if path.suffix == ".json")
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "unreadable": [[99, "x"], [-1, "y"]]}))
    train, _, done, _ = loaders(tiny_data, cache, sets=sets)
    assert done.startswith("decoded ") and torch.equal(train.images, first)


def test_a_changed_file_makes_a_new_entry_and_the_old_one_goes(tiny_data, tmp_path):
    data, cache = tmp_path / "data", tmp_path / "cache"
    shutil.copytree(tiny_data, data)
    loaders(data, cache)
    before = entries(cache)
    changed = sorted((data / "train").rglob("*.*"))[3]
    os.utime(changed, ns=(0, os.stat(changed).st_mtime_ns + 1_000_000_000))
    _, _, done, _ = loaders(data, cache)
    assert done.startswith(f"decoded {TINY_TRAIN_IMAGES} images, read {TINY_VAL_IMAGES} decoded by an earlier run")
    after = entries(cache)
    assert len(after) == 2 and len(set(after) & set(before)) == 1  # the validation entry stays


FILL = """
import os, signal, sys, torch
from deepspeed_image_trainer.data.cache import load_or_fill
paths, cache, mode = {paths!r}, {cache!r}, sys.argv[1]

def fill(f):
    for i, _ in enumerate(paths):
        f.write(bytes([i % 256]) * 3 * 4 * 4)
        if mode == "kill" and i == 1:
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

images, _, filled = load_or_fill(paths, 4, 4, "cpu", cache, fill)
print(filled, images[:, 0, 0, 0].tolist())
"""


def fill_script(tmp_path, paths):
    script = tmp_path / "fill.py"
    script.write_text(FILL.format(paths=[str(p) for p in paths], cache=str(tmp_path / "cache")))
    return script


def test_a_fill_killed_half_way_is_never_used_and_the_next_fill_replaces_it(tmp_path):
    paths = [tmp_path / f"{i}.jpg" for i in range(4)]
    for path in paths:
        path.write_bytes(b"x")
    script = fill_script(tmp_path, paths)
    killed = subprocess.run([sys.executable, str(script), "kill"], capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert entries(tmp_path / "cache") == [] and list((tmp_path / "cache").glob("*.partial"))
    def fill(f):
        f.write(b"".join(bytes([i]) * 48 for i in range(4)))
        return {2: "truncated"}

    images, unreadable, filled = load_or_fill([str(p) for p in paths], 4, 4, "cpu", tmp_path / "cache", fill)
    assert filled and images[:, 0, 0, 0].tolist() == [0, 1, 2, 3] and unreadable == {2: "truncated"}
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_a_damaged_entry_beside_the_one_filled_is_left_alone(tmp_path):
    from deepspeed_image_trainer.data.cache import _remove_replaced

    (tmp_path / "other").mkdir()
    (tmp_path / "other/meta.json").write_text("[1, 2]")  # valid JSON, not an entry's description
    _remove_replaced(tmp_path, "mine", {"resize": 4, "crop": 4, "decoder": "cpu"}, tmp_path / "train")
    assert (tmp_path / "other/meta.json").exists()


def test_a_fifo_as_an_entrys_description_is_never_read(tmp_path):
    """Reading one, the entry's own or another's beside it, waited for a writer for good."""
    paths = [str(tmp_path / f"{i}.jpg") for i in range(2)]
    for path in paths:
        Path(path).write_bytes(b"x")
    entry = tmp_path / "cache" / entry_key(paths, 4, 4, "cpu")
    read = []
    for folder in (entry, tmp_path / "cache/other"):
        folder.mkdir(parents=True)
        os.mkfifo(folder / "meta.json")
        read.append(unblock_later(folder / "meta.json"))

    def fill(f):
        f.write(bytes(2 * 3 * 4 * 4))

    images, _, filled = load_or_fill(paths, 4, 4, "cpu", tmp_path / "cache", fill, source=tmp_path)
    assert not any(ended.is_set() for ended in read)
    assert filled and images.shape == (2, 3, 4, 4) and (entry / "meta.json").is_file()


@pytest.mark.skipif(os.name != "posix", reason="runs take turns on an fcntl lock")
def test_a_fifo_as_an_entrys_lock_is_an_error_not_a_wait(tmp_path):
    """Opened for writing, it waited for a reader for good; an OSError is the cache's warning and no cache."""
    paths = [str(tmp_path / f"{i}.jpg") for i in range(2)]
    for path in paths:
        Path(path).write_bytes(b"x")
    (tmp_path / "cache").mkdir()
    lock = tmp_path / "cache" / f".{entry_key(paths, 4, 4, 'cpu')}.lock"
    os.mkfifo(lock)
    raised = []

    def fill_entry():
        try:
            load_or_fill(paths, 4, 4, "cpu", tmp_path / "cache", lambda f: {}, source=tmp_path)
        except OSError as err:
            raised.append(str(err))

    filling = threading.Thread(target=fill_entry, daemon=True)  # left waiting, if it waits, when the test fails
    filling.start()
    filling.join(10)
    assert not filling.is_alive() and "not a regular file" in raised[0]


@pytest.mark.skipif(os.name != "posix", reason="runs take turns on an fcntl lock")
def test_runs_filling_one_entry_at_once_fill_it_once(tmp_path):
    paths = [tmp_path / f"{i}.jpg" for i in range(4)]
    for path in paths:
        path.write_bytes(b"x")
    script = fill_script(tmp_path, paths)
    runs = [subprocess.Popen([sys.executable, str(script), "fill"], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = sorted(run.communicate(timeout=60)[0].strip() for run in runs)
    assert outputs == ["False [0, 1, 2, 3]"] * 2 + ["True [0, 1, 2, 3]"]
    assert len(entries(tmp_path / "cache")) == 1 and not list((tmp_path / "cache").glob("*.partial"))
    assert not list((tmp_path / "cache").glob(".*.lock"))  # taken while filling, not left behind


# On a GPU the host batches are copied on a stream of their own (run there with pytest -k host_memory).
@pytest.mark.parametrize("device", DEVICES)
def test_batches_from_host_memory_are_the_device_paths_and_resume_mid_epoch(tiny_data, tmp_path, device):
    cache = tmp_path / "cache"
    resident, resident_val, _, _ = loaders(tiny_data, cache, device=device)
    host, host_val, _, _ = loaders(tiny_data, cache, tier="cache", device=device)
    assert host.host and not resident.host
    whole = list(host.epoch(2))
    assert len(whole) == host.batches_per_epoch
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(whole, resident.epoch(2)))
    resumed = list(host.epoch(2, start_batch=5))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(whole[5:], resumed))
    assert host_val.host and not resident_val.host  # copied over by a reading thread, as the training batches
    host_val = list(host_val)
    assert len(host_val) == len(resident_val) == math.ceil(TINY_VAL_IMAGES / 4)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(host_val, resident_val))


def not_utf8(name):
    """`name` (bytes) as Python names such a file (its bytes kept as surrogates)."""
    return os.fsdecode(name)


def test_file_names_that_are_not_utf8_train_on_the_cache_tier(tiny_data, tmp_path, monkeypatch):
    """Their paths went into the cache's key, and the data folder's into the data check's cache file name, as
    text that UTF-8 cannot encode (surrogates): the run crashed. A strict UTF-8 stdout (a UTF-8 locale other
    than C's) also crashed on the warning that names such a file."""
    root = tmp_path / not_utf8(b"data\xfa")
    try:
        shutil.copytree(tiny_data, root)
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses file names that are not UTF-8 (macOS's, Windows')")
    bat = root / "train/bat"
    shutil.copyfile(bat / "bat_0000.jpg", bat / not_utf8(b"\xff.jpg"))
    train, _, done, unreadable = loaders(root, tmp_path / "cache", tier="cache")
    assert not unreadable and len(train.indices) == TINY_TRAIN_IMAGES + 1
    assert done.endswith(f"(cache: {tmp_path / 'cache'})") and len(entries(tmp_path / "cache")) == 2
    (bat / not_utf8(b"\xfe.jpg")).write_bytes(b"not an image")  # for the data check's warning
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path / "trainer-cache"))
    assert cache_path(root / "train").parent == tmp_path / "trainer-cache/data_check"  # its file's name hashes it
    monkeypatch.setenv("PYTHONIOENCODING", "utf-8")  # strict, where the C locale's stdout escapes surrogates
    result = launch(data_args(root) + ["--image_size", "32", "--data_on_device", "cache", "--dry_run"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shown = str(bat / not_utf8(b"\xfe.jpg")).encode("utf-8", "backslashreplace").decode()  # ...data\udcfa/...
    assert f"warning: skipping 1 unreadable image(s): {shown} (not an image PIL can read)" in (
        result.stdout + result.stderr).splitlines()
