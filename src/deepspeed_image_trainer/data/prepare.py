"""Data tool: split a raw Animals-90 download into train/val, draw the built-in sample dataset, or check a dataset.

    python src/prepare_data.py split path/to/animals --output data --val_fraction 0.2
    python src/prepare_data.py sample --output data
    python src/prepare_data.py --check data          # data/train + data/val, or one ImageFolder root
"""
import argparse
import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..utils.failures import CliParser, UsageError, check_outside_checkpoints, path_argument
from ..utils.files import parse_json, within
from .check import cache_place, check_cache_outside_data, check_folders

# The 90 class folders of the Animals-90 dataset; the sample dataset borrows them as class names.
ANIMALS_90 = (
    "antelope badger bat bear bee beetle bison boar butterfly cat caterpillar chimpanzee cockroach cow "
    "coyote crab crow deer dog dolphin donkey dragonfly duck eagle elephant flamingo fly fox goat goldfish "
    "goose gorilla grasshopper hamster hare hedgehog hippopotamus hornbill horse hummingbird hyena jellyfish "
    "kangaroo koala ladybugs leopard lion lizard lobster mosquito moth mouse octopus okapi orangutan otter "
    "owl ox oyster panda parrot pelecaniformes penguin pig pigeon porcupine possum raccoon rat reindeer "
    "rhinoceros sandpiper seahorse seal shark sheep snake sparrow squid squirrel starfish swan tiger turkey "
    "turtle whale wolf wombat woodpecker zebra"
).split()
SHAPES = ("circle", "square", "triangle", "diamond", "cross", "ring")
COLOURS = ((220, 40, 40), (40, 180, 60), (50, 80, 230), (235, 200, 30), (200, 60, 200))
BACKGROUNDS = ("plain", "horizontal", "vertical")
SAMPLE_MARKER = "sample_dataset.json"  # the settings a sample dataset was drawn with
MAX_SAMPLE_SIZE = 4096  # a drawn image of 100000 px took more memory than the machine had (killed, no message)
MAX_PER_CLASS = 10_000  # 100000000000 wrote until the disk or the user gave up; Animals-90 has 60 a class


def split_dataset(raw_dir, output, val_fraction, seed):
    """Copy raw_dir/<class>/* into output/train and output/val, stratified per class, seeded."""
    raw_dir, output = Path(raw_dir), Path(output)
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    class_dirs = sorted(d for d in raw_dir.iterdir() if d.is_dir()) if raw_dir.is_dir() else []
    if not class_dirs:
        raise UsageError(f"{raw_dir}: expected one folder per class")
    if {d.name for d in class_dirs} >= {"train", "val"}:  # it wrote 0 images, and classes named train and val
        raise UsageError(f"{raw_dir} holds train/ and val/: it is split already (split takes one folder per class)")
    _check_output(output, "--output")
    if within(output, raw_dir):
        raise UsageError(f"--output {output} is inside {raw_dir}, the folder it splits: its train/ and val/ would be "
                         "taken for classes of it; write it elsewhere")
    _refuse_to_overwrite(output)
    rng = random.Random(seed)
    counts = {"train": 0, "val": 0}
    with _staged(output) as staging:
        for class_dir in class_dirs:
            files = _class_images(class_dir)
            rng.shuffle(files)
            n_val = min(max(1, round(len(files) * val_fraction)), len(files) - 1) if len(files) > 1 else 0
            for split, subset in (("val", files[:n_val]), ("train", files[n_val:])):
                (staging / split / class_dir.name).mkdir(parents=True, exist_ok=True)
                for f in subset:
                    target = staging / split / class_dir.name / f.relative_to(class_dir)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, target)
                counts[split] += len(subset)
    return counts


def _class_images(class_dir):
    """A class folder's images as training finds them: in sub-folders too (ImageFolder walks them), hidden files and
    folders passed over; regular files only (a FIFO or a link to nothing, which training skips, ended the copy in
    a traceback)."""
    found = []
    for root, folders, files in os.walk(class_dir, followlinks=True):
        folders[:] = sorted(d for d in folders if not d.startswith("."))
        found += [Path(root) / name for name in sorted(files) if not name.startswith(".")
                  and Path(name).suffix.lower() in IMG_EXTENSIONS and (Path(root) / name).is_file()]
    return found


@contextlib.contextmanager
def _staged(output):
    """A folder beside output's train/ and val/ to write them in, moved into place when the block ends, removed
    when it fails: a split or sample stopped half-way (Ctrl-C, a full disk) left a partial dataset, which the same
    command then refused as data already there."""
    output.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output, prefix=".partial-"))
    try:
        yield staging
        for split in ("train", "val"):
            if (output / split).is_dir():  # empty (_refuse_to_overwrite)
                (output / split).rmdir()
            if (staging / split).exists():
                os.rename(staging / split, output / split)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def draw_sample_image(class_index, rng, size):
    """One image of a class: its shape, colour and background pattern, at a random place and scale."""
    shape = SHAPES[class_index % len(SHAPES)]
    colour = COLOURS[class_index // len(SHAPES) % len(COLOURS)]
    background = BACKGROUNDS[class_index // (len(SHAPES) * len(COLOURS)) % len(BACKGROUNDS)]
    grey = rng.randint(20, 90)
    image = Image.new("RGB", (size, size), (grey, grey, grey))
    draw = ImageDraw.Draw(image)
    if background != "plain":
        period = max(4, size // 8)
        for pos in range(0, size, period):
            box = (0, pos, size, pos + period // 2) if background == "horizontal" else (pos, 0, pos + period // 2, size)
            draw.rectangle(box, fill=(grey + 80, grey + 80, grey + 80))
    radius = rng.uniform(0.25, 0.4) * size
    cx, cy = (rng.uniform(radius, size - radius) for _ in range(2))
    fill = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in colour)
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=max(2, int(radius / 3)))
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - radius), (cx + radius, cy), (cx, cy + radius), (cx - radius, cy)], fill=fill)
    else:
        bar = radius / 3
        draw.rectangle((cx - radius, cy - bar, cx + radius, cy + bar), fill=fill)
        draw.rectangle((cx - bar, cy - radius, cx + bar, cy + radius), fill=fill)
    return image


def make_sample_dataset(output, num_classes, train_per_class, val_per_class, image_size, seed):
    """Draw a learnable image-folder dataset: output/train and output/val, one folder per class.

    Asking again for the same dataset in the same place finds it there and redraws nothing.
    """
    if not 2 <= num_classes <= len(ANIMALS_90):
        raise UsageError(f"--num_classes must be between 2 and {len(ANIMALS_90)}, got {num_classes}")
    if not (1 <= train_per_class <= MAX_PER_CLASS and 1 <= val_per_class <= MAX_PER_CLASS
            and 16 <= image_size <= MAX_SAMPLE_SIZE):
        raise UsageError(f"--train_per_class and --val_per_class must be 1 .. {MAX_PER_CLASS:,} and --image_size "
                         f"16 .. {MAX_SAMPLE_SIZE}")
    output = Path(output)
    _check_output(output, "--output")
    settings = {"num_classes": num_classes, "train_per_class": train_per_class,
                "val_per_class": val_per_class, "image_size": image_size, "seed": seed}
    counts = {"train": num_classes * train_per_class, "val": num_classes * val_per_class}
    marker = output / SAMPLE_MARKER
    if marker.is_file() and _marked(marker) == settings:
        return counts
    _refuse_to_overwrite(output)
    rng = random.Random(seed)
    with _staged(output) as staging:
        for class_index, name in enumerate(ANIMALS_90[:num_classes]):
            for split, count in (("train", train_per_class), ("val", val_per_class)):
                folder = staging / split / name
                folder.mkdir(parents=True, exist_ok=True)
                for i in range(count):
                    draw_sample_image(class_index, rng, image_size).save(folder / f"{name}_{i:04d}.jpg", quality=90)
    marker.write_text(json.dumps(settings) + "\n")
    return counts


def _marked(marker):
    """The settings a sample dataset's marker records; None when it is damaged (its data is then not redrawn over)."""
    try:
        return parse_json(marker.read_bytes())
    except (OSError, ValueError):
        return None


def _check_output(output, flag):
    """Refuse an --output that is a file (a traceback when the class folders were made under it), inside a
    checkpoint, which the run's next save replaces whole, or inside another dataset's train/ or val/."""
    if os.path.lexists(output) and not output.is_dir():
        raise UsageError(f"{flag} {output} is not a folder: give a folder for train/ and val/")
    check_outside_checkpoints(output, flag)
    for dataset in Path(output).resolve().parents:
        # inside another dataset's train/ or val/, its train/ and val/ would become two classes of that dataset
        if (dataset / "train").is_dir() and (dataset / "val").is_dir() and (
                within(output, dataset / "train") or within(output, dataset / "val")):
            raise UsageError(f"{flag} {output} is inside the dataset {dataset}: its train/ and val/ would be taken "
                             "for classes of it; write it elsewhere")


def _refuse_to_overwrite(output):
    for split in ("train", "val"):
        if (output / split).exists() and any((output / split).iterdir()):
            raise UsageError(f"{output / split} already holds data; choose another --output or remove it")


def get_args_parser():
    parser = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", type=path_argument, metavar="DIR",
                        help="decode every image of DIR (with train/ and val/, or one ImageFolder root), report "
                             "what training would skip or ignore; exit status 2 when it cannot be trained on")
    commands = parser.add_subparsers(dest="command")
    split = commands.add_parser("split", help="split a raw download (one folder per class) into train/val")
    split.add_argument("raw_dir", type=path_argument)
    split.add_argument("--output", type=path_argument, default="data")
    split.add_argument("--val_fraction", type=float, default=0.2)
    split.add_argument("--seed", type=int, default=42)
    sample = commands.add_parser("sample", help="draw the built-in sample dataset")
    sample.add_argument("--output", type=path_argument, default="data")
    sample.add_argument("--num_classes", type=int, default=90)
    sample.add_argument("--train_per_class", type=int, default=24)
    sample.add_argument("--val_per_class", type=int, default=6)
    sample.add_argument("--image_size", type=int, default=96, help="side of the drawn images in pixels")
    sample.add_argument("--seed", type=int, default=0)
    return parser


def check_dataset(folder):
    """Print the data check of `folder` (train/ and val/ inside, or itself an ImageFolder root)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"image folder not found: {folder}")
    check_outside_checkpoints(*cache_place())  # where the check keeps its results: a save there removed them
    check_cache_outside_data(*cache_place(), [("--check", folder)])
    if (folder / "train").is_dir():
        check = check_folders(folder / "train", folder / "val")
    else:
        check = check_folders(folder)
    print(check.report())
    check.save_cache()
    check.raise_if_unusable()


def main(argv=None):
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if (args.check is None) == (args.command is None):
        parser.error("give one of --check DIR, split, sample")
    if args.check is not None:
        return check_dataset(args.check)
    if args.command == "split":
        counts = split_dataset(args.raw_dir, args.output, args.val_fraction, args.seed)
    else:
        counts = make_sample_dataset(args.output, args.num_classes, args.train_per_class,
                                     args.val_per_class, args.image_size, args.seed)
    print(f"wrote {counts['train']} train and {counts['val']} val images under {args.output}")
