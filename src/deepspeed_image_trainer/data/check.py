"""Pre-flight check of an image-folder dataset: every file decoded once, what cannot be used reported.

- a file with an image suffix that does not decode (empty, truncated, corrupt, not an image, beyond
  PIL's decompression-bomb limit) is skipped;
- hidden files and folders (name starts with '.') and files without an image suffix are ignored;
- a class folder with no readable image is ignored;
- validation labels follow the training classes by name: a validation class without training images
  makes the dataset unusable, a training class without validation images is only a warning.

Each file's result is cached under its size and mtime, one cache file per folder in the user's cache
folder (`save_cache`), so the training script, started after the launcher has checked the data, and every
later run on the same folders decode nothing again.

A check that reads headers only (`decode=False`) serves runs whose data the trainer decodes anyway (data on
the GPU, the decoded-image cache): that decode finds the files whose data is broken, so each image is decoded
once (device.decode_split).
"""
import functools
import hashlib
import os
import sys
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ..utils.failures import UsageError
from ..utils.files import parse_json, regular_text, within, write_json_atomic
from ..utils.text import error_line, listed

CACHE_VERSION = 2
CACHE_DIR_ENV = "TRAINER_CACHE_DIR"
APP = "deepspeed-image-trainer"
# torchvision's ImageFolder suffixes (torchvision.datasets.folder.IMG_EXTENSIONS), written out so that the
# launcher does not import torchvision (1-2 s before the first step).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
EXIF_ORIENTATION = 0x0112
SCAN_THREADS = min(16, os.cpu_count() or 1)  # PIL decodes with the GIL released

# The check names the images over PIL's warning limit once; a warning per decode would repeat every epoch.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def inspect_image(path, decode=True):
    """{"error", "format", "mode", "width", "height", "orientation", "decoded"} of one file, decoded in full
    or, with `decode` False, its header alone (a twentieth of the time for a photo).

    A JPEG is decoded at 1/8 scale (`draft`): the DCT-scaled decode still reads every entropy-coded
    byte, so a truncated file fails here as it would in training, at a fraction of the cost.
    """
    if os.path.exists(path) and not os.path.isfile(path):  # opening a FIFO would wait for a writer for good
        return {"error": "not a regular file: a FIFO, a device or a socket", "decoded": True}
    if os.path.getsize(path) == 0:
        return {"error": "empty file", "decoded": True}
    try:
        with Image.open(path) as image:
            record = {"error": None, "format": image.format, "mode": image.mode, "width": image.width,
                      "height": image.height, "orientation": image.getexif().get(EXIF_ORIENTATION, 1),
                      "decoded": decode}
            if decode and image.format == "JPEG":
                image.draft(None, (max(1, image.width // 8), max(1, image.height // 8)))
            if decode:
                image.load()
        return record
    except UnidentifiedImageError:
        return {"error": "not an image PIL can read", "decoded": True}
    except Exception as err:  # noqa: BLE001 - corrupt data raises OSError, SyntaxError, ValueError, struct.error, ...
        return {"error": error_line(err), "decoded": True}


def inspect_files(paths, cache, decode=True):
    """Records of `paths` (see inspect_image), inspecting only files not in `cache` with the same size and mtime
    (and, with `decode`, decoded there); and how many were inspected."""
    records, todo = {}, []
    for path in paths:
        try:
            stat = os.stat(path)
        except OSError as err:  # a broken link, a file deleted since it was listed
            records[path] = {"error": err.strerror or str(err), "stat": None, "decoded": True}
            continue
        key = [stat.st_size, stat.st_mtime_ns]
        cached = cache.get(os.path.abspath(path))
        # a record without "decoded" comes from a check that always decoded
        if cached is not None and cached["stat"] == key and (cached.get("decoded", True) or not decode):
            records[path] = cached
        else:
            todo.append((path, key))
    inspect = functools.partial(inspect_image, decode=decode)
    if decode:
        with ThreadPoolExecutor(SCAN_THREADS) as pool:
            found = list(pool.map(inspect, [path for path, _ in todo]))
    else:  # in this thread: in a pool, handing each file over costs twice what reading its header does
        found = [inspect(path) for path, _ in todo]
    for (path, key), record in zip(todo, found):
        records[path] = {**record, "stat": key}
    return records, len(todo)


@dataclass
class FolderScan:
    """One ImageFolder root: class folders, their readable images and everything left out."""
    root: Path
    class_folders: list = field(default_factory=list)
    images: dict = field(default_factory=dict)  # class -> readable image paths, sorted
    unreadable: list = field(default_factory=list)  # (path, reason)
    other_files: list = field(default_factory=list)  # no image suffix
    loose_files: list = field(default_factory=list)  # beside the class folders, in none of them
    hidden: list = field(default_factory=list)
    linked_away: list = field(default_factory=list)  # (folder reached through a link, why it is not read)
    records: dict = field(default_factory=dict)  # path -> inspect_image record
    inspected: int = 0  # files inspected by this scan, not found in the cache

    @property
    def classes(self):
        return [name for name in self.class_folders if self.images[name]]

    @property
    def empty_folders(self):
        return [str(self.root / name) for name in self.class_folders if not self.images[name]]

    @property
    def num_images(self):
        return sum(len(paths) for paths in self.images.values())


def scan_folder(root, cache=None, decode=True):
    """Find and inspect (see inspect_image) every file under root/<class>/ (recursively, as ImageFolder does)."""
    scan = FolderScan(Path(root))
    files = {}
    root_real = os.path.realpath(root)
    entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    twins = _second_names(root_real, [entry for entry in entries if not entry.name.startswith(".") and entry.is_dir()])
    for entry in entries:
        if entry.name.startswith("."):
            scan.hidden.append(entry.path)
        elif not entry.is_dir():
            scan.loose_files.append(entry.path)
        elif entry.name in twins:
            scan.linked_away.append((entry.path, twins[entry.name]))
        else:
            scan.class_folders.append(entry.name)
            files[entry.name] = []
            seen = set()
            for folder, subfolders, names in os.walk(entry.path, followlinks=True):
                reason = _not_of_this_class(os.path.realpath(folder), os.path.realpath(entry.path), root_real, seen)
                if reason:
                    scan.linked_away.append((folder, reason))
                    subfolders[:] = []
                    continue
                scan.hidden += [os.path.join(folder, name) for name in subfolders + names if name.startswith(".")]
                subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
                for name in sorted(n for n in names if not n.startswith(".")):
                    is_image = name.lower().endswith(IMG_EXTENSIONS)
                    (files[entry.name] if is_image else scan.other_files).append(os.path.join(folder, name))
    scan.records, scan.inspected = inspect_files([path for paths in files.values() for path in paths], cache or {},
                                                 decode)
    for name, paths in files.items():
        scan.images[name] = [path for path in paths if scan.records[path]["error"] is None]
        scan.unreadable += [(path, scan.records[path]["error"]) for path in paths
                            if scan.records[path]["error"] is not None]
    return scan


def _second_names(root_real, class_entries):
    """{name: why} of the class folders that are links to images another class folder holds (its twin, a folder
    in it, or one holding it) or to the folder of the classes itself: read, their images would be in two classes.
    Real folders come first, then links in name order."""
    kept, why = [], {}
    for entry in sorted(class_entries, key=lambda entry: (entry.is_symlink(), entry.name)):
        real = os.path.realpath(entry.path)
        other = next((name for name, path in kept if _inside(real, path) or _inside(path, real)), None)
        if entry.is_symlink() and _inside(root_real, real):
            why[entry.name] = "a link up to the folder that holds the class folders"
        elif other is not None:
            why[entry.name] = f"a link to the images of class folder {other}: they would be in two classes"
        else:
            kept.append((entry.name, real))
    return why


def _inside(path, parent):
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def _not_of_this_class(real, class_real, root_real, seen):
    """Why a folder reached through a link must not be read as part of its class folder (None when it may):
    a link back to a folder already read (a loop) or up the tree, or into another class's folder, would
    read images again or under another label."""
    if real in seen:
        return "already read: a link loop"
    seen.add(real)
    if real != class_real and _inside(class_real, real):
        return "a link up to a folder that holds this class"
    if _inside(real, root_real) and not _inside(real, class_real):
        return "a link into another class's folder"
    return None


def labelled_samples(scan, classes):
    """[(path, label)] of a scan's readable images of `classes`, labelled by class name, in ImageFolder's order."""
    return [(path, label) for label, name in enumerate(classes) for path in scan.images.get(name, [])]


@dataclass
class DataCheck:
    """The check of a training folder and, optionally, its validation folder."""
    train: FolderScan
    val: FolderScan = None
    errors: list = field(default_factory=list)

    @property
    def classes(self):
        return self.train.classes

    @property
    def scans(self):
        return [scan for scan in (self.train, self.val) if scan is not None]

    @property
    def records(self):
        """path -> inspect_image record of every file checked."""
        return {path: record for scan in self.scans for path, record in scan.records.items()}

    @property
    def inspected(self):
        """Files this check inspected, not found in the cache: when nonzero, save_cache spares the next check."""
        return sum(scan.inspected for scan in self.scans)

    @property
    def decoded(self):
        """Whether every readable file was decoded (not only its header read) by this check or an earlier one."""
        return all(record.get("decoded", True) for record in self.records.values())

    def exclude(self, unreadable):
        """Leave out the files {path: reason} that training found it cannot decode, as this check would have."""
        for scan in self.scans:
            found = {path: reason for path, reason in unreadable.items() if path in scan.records}
            for path, reason in found.items():
                scan.records[path] = {**scan.records[path], "error": reason, "decoded": True}
            scan.images = {name: [path for path in paths if path not in found] for name, paths in scan.images.items()}
            scan.unreadable += sorted(found.items())

    @property
    def skipped(self):
        return [item for scan in self.scans for item in scan.unreadable]

    @property
    def missing_in_val(self):
        return [name for name in self.classes if self.val is not None and name not in self.val.classes]

    def summary(self):
        """What the check found, for the training history."""
        readable = {path: record for scan in self.scans for path, record in scan.records.items()
                    if record["error"] is None}
        return {
            "train_images": self.train.num_images, "val_images": self.val.num_images if self.val else None,
            "skipped_count": len(self.skipped),
            "skipped": [{"path": path, "reason": reason} for path, reason in self.skipped],
            "empty_class_folders": [folder for scan in self.scans for folder in scan.empty_folders],
            "classes_without_val_images": self.missing_in_val,
            "files_without_image_suffix": [path for scan in self.scans for path in scan.other_files],
            "files_outside_class_folders": [path for scan in self.scans for path in scan.loose_files],
            "hidden_ignored": sum(len(scan.hidden) for scan in self.scans),
            "linked_folders_ignored": [{"path": path, "reason": reason} for scan in self.scans
                                       for path, reason in scan.linked_away],
            "large_images": [path for path, record in readable.items()
                             if record["width"] * record["height"] > Image.MAX_IMAGE_PIXELS],
            "converted_to_rgb": dict(sorted(Counter(record["mode"] for record in readable.values()
                                                    if record["mode"] != "RGB").items())),
            "exif_rotated": sum(record["orientation"] != 1 for record in readable.values()),
        }

    def warnings(self):
        """One line per kind of problem that training works around."""
        summary, lines = self.summary(), []
        if self.skipped:
            lines.append(f"warning: skipping {len(self.skipped)} unreadable image(s): "
                         + listed(f"{path} ({reason})" for path, reason in self.skipped))
        linked = [f"{item['path']} ({item['reason']})" for item in summary["linked_folders_ignored"]]
        for items, what in ((summary["empty_class_folders"], "ignoring {} class folder(s) without a readable image"),
                            (linked, "ignoring {} folder(s) reached through links"),
                            (self.missing_in_val, "{} training class(es) have no validation images"),
                            (summary["files_without_image_suffix"], "ignoring {} file(s) without an image suffix"),
                            (summary["files_outside_class_folders"],
                             "ignoring {} file(s) beside the class folders (images go in <folder>/<class>/)"),
                            (summary["large_images"],
                             f"{{}} image(s) over {Image.MAX_IMAGE_PIXELS / 1e6:.0f} Mpx, slow to decode")):
            if items:
                lines.append(f"warning: {what.format(len(items))}: {listed(items)}")
        return lines

    def report(self):
        """The full report that `prepare_data.py --check` prints."""
        summary = self.summary()
        lines = [f"{scan.root}: {len(scan.classes)} classes, {scan.num_images} readable images" for scan in self.scans]
        sections = {"unreadable, skipped": [f"{s['path']}: {s['reason']}" for s in summary["skipped"]],
                    "class folders without a readable image, ignored": summary["empty_class_folders"],
                    "files without an image suffix, ignored": summary["files_without_image_suffix"],
                    "files beside the class folders, ignored": summary["files_outside_class_folders"],
                    "folders reached through links, ignored": [f"{item['path']}: {item['reason']}"
                                                               for item in summary["linked_folders_ignored"]],
                    f"images over {Image.MAX_IMAGE_PIXELS / 1e6:.0f} Mpx, decoded anyway": summary["large_images"]}
        if self.val is not None:
            sections["training classes without validation images"] = summary["classes_without_val_images"]
        for title, items in sections.items():
            lines += [f"{title}: {len(items)}"] + [f"  {item}" for item in items]
        converted = ", ".join(f"{mode} {count}" for mode, count in summary["converted_to_rgb"].items())
        lines += [f"hidden files and folders, ignored: {summary['hidden_ignored']}",
                  f"converted to RGB: {converted or 'none'}",
                  f"rotated by their EXIF orientation: {summary['exif_rotated']}",
                  "unusable: " + "; ".join(self.errors) if self.errors
                  else f"usable, {len(self.warnings())} warning(s)"]
        return "\n".join(lines)

    def raise_if_unusable(self):
        if self.errors:
            raise UsageError("; ".join(self.errors))

    def save_cache(self):
        """Keep each folder's per-file results for the next check; a cache that cannot be written (a
        read-only home folder) only costs the next check its speed, so that is a warning."""
        for scan in self.scans:
            path = cache_path(scan.root)
            try:
                write_json_atomic(path, {"version": CACHE_VERSION, "root": os.path.abspath(scan.root), "files": {
                    os.path.abspath(p): record for p, record in scan.records.items()}})
            except OSError as err:
                print(f"warning: cannot write the data check's cache {path} ({err.strerror or err}); "
                      f"the next run decodes every image again", file=sys.stderr)


def cache_base():
    """$TRAINER_CACHE_DIR, by default ~/.cache/deepspeed-image-trainer."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / APP)


def cache_place():
    """(cache_base(), what chose it): as a refusal names it (run_folders.check_output_places)."""
    chosen = f"${CACHE_DIR_ENV}" if os.environ.get(CACHE_DIR_ENV) else f"the cache folder (${CACHE_DIR_ENV} unset)"
    return cache_base(), chosen


def check_cache_outside_data(folder, flag, data):
    """A cache folder (`flag`: --cache_dir, $TRAINER_CACHE_DIR) inside the images it keeps results of (`data`:
    (flag, folder) pairs): its entries showed up as class folders and files of the data."""
    for data_flag, data_dir in data:
        if data_dir and within(folder, data_dir):
            raise UsageError(f"{flag} {folder} is inside {data_flag} {data_dir}, whose images it keeps the results of "
                             "(decoded, checked): put the cache elsewhere")


def cache_path(root):
    """Where the per-file results of the folder `root` are kept: one file per folder (its absolute path
    hashed) under cache_base()."""
    # surrogatepass: as the decoded-image cache's key (cache.entry_key), a folder whose name is not UTF-8 works
    digest = hashlib.sha256(os.path.abspath(root).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return cache_base() / "data_check" / f"{Path(root).name or 'root'}-{digest}.json"


def whole_record(record):
    """Whether a cached record has what inspect_files and the check read from it: its file's [size, mtime], and
    the error or, for an image, what inspect_image found (a record with keys missing failed every later run)."""
    if not isinstance(record, dict) or not isinstance(record.get("stat"), list) or len(record["stat"]) != 2:
        return False
    if "error" not in record or record["error"] is not None:
        return isinstance(record.get("error"), str)
    return (all(key in record for key in ("format", "mode", "orientation"))
            and all(isinstance(record.get(key), int) and record[key] > 0 for key in ("width", "height")))


def load_cache(root):
    """The per-file records of an earlier check of `root`, or {} when there is none (or it is unreadable
    or outdated)."""
    saved = cache_path(root)
    try:
        cache = parse_json(regular_text(saved))
        files = cache["files"] if cache.get("version") == CACHE_VERSION else {}
        # a record that is not one (an edited or foreign file) is inspected again, as a file not in the cache is
        return {path: record for path, record in files.items() if whole_record(record)}
    except (FileNotFoundError, NotADirectoryError):  # none yet; a cache folder that is a file: save_cache says so
        return {}
    except OSError as err:  # a FIFO in its place, no permission: save_cache puts this check's results there
        print(f"warning: cannot read the data check's cache {saved} ({err.strerror or err}); every image is "
              "inspected again", file=sys.stderr)
        return {}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


def check_folders(train_dir, val_dir=None, decode=True):
    """Scan the folders (`decode`: see inspect_image) and collect why they cannot be used (DataCheck.errors);
    raises nothing."""
    scans, errors = [], []
    for root in (train_dir, val_dir):
        if root is None:
            scans.append(None)
        elif not Path(root).is_dir():
            errors.append(f"{root} is a file, not an image folder (<folder>/<class>/<image>)" if Path(root).exists()
                          else f"image folder not found: {root}")
            scans.append(FolderScan(Path(root)))
        else:
            scan = scan_folder(root, load_cache(root), decode)
            if not scan.class_folders:
                errors.append(f"{root}: no class folders (expected {Path(root) / '<class>' / '<image>'})")
            elif not scan.num_images:
                errors.append(f"{root}: no readable image in {len(scan.class_folders)} class folder(s)"
                              + (f" ({len(scan.unreadable)} unreadable)" if scan.unreadable else ""))
            scans.append(scan)
    check = DataCheck(scans[0], scans[1], errors)
    if not errors and check.val is not None:
        extra = [name for name in check.val.classes if name not in check.classes]
        if extra:
            errors.append(f"{val_dir} has images of classes that {train_dir} has no images of: {listed(extra)} "
                          "(validation classes must be training classes)")
    return check


def decodes_every_file(data_on_device, device_type, cache_off):
    """Whether the check must decode every file for a run with --data_on_device `data_on_device` on a
    `device_type`: not when the trainer decodes the dataset itself (on the device, or into the decoded-image
    cache, which `auto` picks on a GPU for a dataset the GPU cannot hold). With the cache off (`cache_off`,
    --cache_dir off) `auto` may end on the DataLoader tier, which decodes nothing before it starts, so the
    check decodes, once, here; should `auto` end there because the cache's disk is full, the training
    script decodes what the check did not (see DataCheck.decoded)."""
    return data_on_device == "off" or (data_on_device == "auto" and (device_type != "cuda" or cache_off))


def check_data(train_dir, val_dir, decode=True):
    """check_folders for training, raising a UsageError when the data cannot be trained on."""
    check = check_folders(train_dir, val_dir, decode)
    check.raise_if_unusable()
    return check
