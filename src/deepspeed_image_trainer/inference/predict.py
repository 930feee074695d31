"""Predict the classes of images with a trained model.

    python src/predict.py --model model.pt photo.jpg more_photos/
    python src/predict.py --model model.pt --top_k 3 --json photo.jpg
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from torchvision.datasets.folder import IMG_EXTENSIONS

from ..data.folders import load_rgb, val_sizes
from ..utils.failures import CliParser, UsageError, check_counts, path_argument
from ..utils.text import listed
from .load import (FlipAveraged, add_inference_args, applied_inference_args, default_device, eval_transform,
                   load_model, predict_log_probabilities)


def image_paths(inputs):
    paths = []
    for item in map(Path, inputs):
        if item.is_dir():
            # Hidden files (macOS `._photo.jpg`, `.ipynb_checkpoints/`) are not photos, as in training; nor is a
            # folder named like one. A link to nothing, a FIFO or a device is kept: Images reports it.
            found = [p for p in sorted(item.rglob("*")) if not p.is_dir()
                     and not any(part.startswith(".") for part in p.relative_to(item).parts)]
            paths += [p for p in found if p.suffix.lower() in IMG_EXTENSIONS]
            other = [str(p) for p in found if p.suffix.lower() not in IMG_EXTENSIONS]
            if other:  # as training's data check says them
                print(f"warning: ignoring {len(other)} file(s) without an image suffix in {item}: {listed(other)}",
                      file=sys.stderr)
        elif item.exists() or item.is_symlink():
            paths.append(item)
        else:
            raise UsageError(f"{item}: no such image or folder")
    if not paths:
        raise UsageError("no images found in " + ", ".join(map(str, inputs)))
    return paths


class Images:
    """The images as a dataset of (tensor, index), preprocessed as in validation. One that does not decode
    gives a blank image, its reason kept in `unreadable` (index -> reason): the others are still predicted."""

    def __init__(self, paths, transform, image_size):
        self.paths, self.transform, self.image_size = paths, transform, image_size
        self.unreadable = {}

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        path = self.paths[index]
        try:
            if path.exists() and not path.is_file():  # reading a FIFO would wait for a writer for good
                raise OSError("not a regular file: a FIFO or a device")
            return self.transform(load_rgb(path)), index
        except Exception as err:  # noqa: BLE001 - corrupt data raises OSError, SyntaxError, ValueError, ...
            self.unreadable[index] = f"not a readable image ({err})"
            return torch.zeros(3, self.image_size, self.image_size), index


def get_args_parser():
    parser = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=path_argument, required=True,
                        help="exported .pt/.safetensors file or a checkpoint folder")
    parser.add_argument("images", type=path_argument, nargs="+", metavar="IMAGE_OR_DIR")
    parser.add_argument("--top_k", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--batch_size", type=int, default=64)
    add_inference_args(parser)
    return parser


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    check_counts(args, batch_size=1, top_k=1)

    paths = image_paths(args.images)
    device = default_device()
    model, metadata = load_model(args.model, device)
    metadata = applied_inference_args(args, metadata)
    if args.tta:
        model = FlipAveraged(model)
    # Decoded in this process, where Images records the unreadable ones.
    images = Images(paths, eval_transform(metadata), val_sizes(metadata["image_size"], metadata["preprocessing"])[1])
    probabilities = predict_log_probabilities(model, images, len(metadata["class_names"]), device, args.batch_size,
                                              num_workers=0).exp()
    if len(images.unreadable) == len(paths):
        raise UsageError("; ".join(f"{paths[i]}: {reason}" for i, reason in sorted(images.unreadable.items())[:3])
                         + (f" (and {len(paths) - 3} more): no image could be read" if len(paths) > 3 else ""))
    for index, reason in sorted(images.unreadable.items()):
        print(f"warning: {paths[index]}: {reason}; left out", file=sys.stderr)
    k = max(1, min(args.top_k, len(metadata["class_names"])))
    top = probabilities.topk(k, dim=1)
    results = [{"image": str(path), "error": images.unreadable[index]} if index in images.unreadable else
               {"image": str(path), "predictions": [
                   {"class": metadata["class_names"][i], "probability": round(p, 6)}
                   for p, i in zip(values.tolist(), indices.tolist())]}
               for index, (path, values, indices) in enumerate(zip(paths, top.values, top.indices))]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for result in (result for result in results if "predictions" in result):
        print(f"{result['image']}: " + ", ".join(f"{p['class']} {p['probability']:.3f}" for p in result["predictions"]))
