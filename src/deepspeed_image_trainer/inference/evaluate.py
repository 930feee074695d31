"""Evaluate a trained model on an image folder: loss, top-1, top-5, per-class accuracy, confusion matrix.

    python src/evaluate.py --model model.pt --data_dir data/val
    python src/evaluate.py --model checkpoints_deepspeed/best_model --data_dir data/val --output_dir eval
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data.folders import image_folder, val_sizes
from ..utils.failures import (WORKERS_PER_CPU, CliParser, UsageError, check_counts, check_not_taken, check_num_workers,
                              check_outside_checkpoints, check_writable, path_argument)
from ..utils.files import within, write_json_atomic
from ..utils.text import drawable
from .load import (DECODES, FlipAveraged, add_inference_args, applied_inference_args, decoded_log_probabilities,
                   default_device, eval_transform, load_model, predict_log_probabilities, trained_decode)


def metrics(log_probabilities, labels, class_names, top_k=5):
    """Plain-dict metrics from per-image log-probabilities and true labels; the loss is the mean cross-entropy,
    as the training history's val_loss."""
    num_classes = len(class_names)
    k = min(top_k, num_classes)
    top = log_probabilities.topk(k, dim=1).indices
    predicted = top[:, 0]
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    confusion.index_put_((labels, predicted), torch.ones_like(labels), accumulate=True)
    per_class = {name: (confusion[i, i].item() / row_total if (row_total := confusion[i].sum().item()) else None)
                 for i, name in enumerate(class_names)}
    return {"images": len(labels), "loss": F.nll_loss(log_probabilities, labels).item(),
            "top1": (predicted == labels).float().mean().item(),
            f"top{k}": (top == labels[:, None]).any(dim=1).float().mean().item(),
            "per_class_accuracy": per_class, "confusion_matrix": confusion.tolist(), "class_names": class_names}


def plot_confusion(confusion, class_names, output):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(class_names)
    size = min(4 + n * 0.18, 24)
    fig, ax = plt.subplots(figsize=(size, size), constrained_layout=True)
    image = ax.imshow(confusion, cmap="Blues")
    names = [drawable(name) for name in class_names]
    ax.set_xticks(range(n), names, rotation=90, fontsize=max(4, 10 - n // 15))
    ax.set_yticks(range(n), names, fontsize=max(4, 10 - n // 15))
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    fig.colorbar(image, ax=ax, shrink=0.6)
    fig.savefig(output, dpi=120)
    plt.close(fig)


OUTPUT_FILES = ("report.json", "confusion_matrix.png")  # what evaluate writes into --output_dir


def get_args_parser():
    parser = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=path_argument, required=True,
                        help="exported .pt/.safetensors file or a checkpoint folder")
    parser.add_argument("--data_dir", type=path_argument, default="data/val",
                        help="image folder with the model's class folders")
    parser.add_argument("--output_dir", type=path_argument, default="evaluation",
                        help="where report.json and confusion_matrix.png go")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--num_workers", type=int, default=2,
                        help=f"DataLoader worker processes (at most {WORKERS_PER_CPU} per CPU the process may use)")
    add_inference_args(parser)
    parser.add_argument("--decode", choices=("auto", *DECODES), default="auto",
                        help="how images become the model's input: PIL's resize (the DataLoader tier's validation) or "
                             "torchvision's on decoded tensors (the device and cache tiers'); auto: as the model's "
                             "training validated, so that the report gives its logged figures")
    return parser


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    check_counts(args, batch_size=1, num_workers=0)
    check_num_workers(args.num_workers)
    if within(args.output_dir, args.data_dir):  # the next evaluation read its png as an image
        raise UsageError(f"--output_dir {args.output_dir} is inside --data_dir {args.data_dir}, the images it "
                         "evaluates: write it elsewhere")
    check_outside_checkpoints(args.output_dir, "--output_dir")  # first: check_writable makes a file in the folder
    check_writable(args.output_dir, "--output_dir")
    for name in OUTPUT_FILES:  # found when written, after evaluating: a traceback (a report without its plot)
        check_not_taken(Path(args.output_dir) / name, "--output_dir", args.output_dir)

    device = default_device()
    model, metadata = load_model(args.model, device)
    metadata = applied_inference_args(args, metadata)
    if args.tta:
        model = FlipAveraged(model)
    dataset, check = image_folder(args.data_dir, eval_transform(metadata), classes=metadata["class_names"])
    for line in check.warnings():
        print(line, file=sys.stderr)
    decode = trained_decode(metadata) if args.decode == "auto" else args.decode
    if decode == "torchvision":
        log_probabilities = decoded_log_probabilities(model, dataset, metadata, device, args.batch_size)
    else:
        log_probabilities = predict_log_probabilities(model, dataset, len(dataset.classes), device, args.batch_size,
                                                      args.num_workers)
    labels = torch.tensor(dataset.targets)
    resize, crop = val_sizes(metadata["image_size"], metadata["preprocessing"])
    report = {"model": str(args.model), "data_dir": str(args.data_dir), "device": device.type, "decode": decode,
              "val_resize_size": resize, "val_crop_size": crop, "tta": args.tta,
              **metrics(log_probabilities, labels, dataset.classes)}
    if args.tta:  # what the averaging gained over the plain logits of the same images
        plain = metrics(torch.log_softmax(torch.cat(model.plain), dim=1) if model.plain else log_probabilities,
                        labels, dataset.classes)
        report["without_tta"] = {key: plain[key] for key in ("loss", "top1")}
        report["tta_gain"] = {"loss": report["loss"] - plain["loss"], "top1": report["top1"] - plain["top1"]}
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    report_file, plot_file = (output_dir / name for name in OUTPUT_FILES)
    write_json_atomic(report_file, report)
    plot_confusion(report["confusion_matrix"], dataset.classes, plot_file)
    top_k = next((k for k in report if k.startswith("top") and k != "top1"), None)  # none with one class
    worst = sorted((acc, name) for name, acc in report["per_class_accuracy"].items() if acc is not None)[:3]
    weakest = ", ".join(f"{name} {acc:.2f}" for acc, name in worst)
    print(f"{report['images']} images ({decode} decode, {resize} -> {crop} px"
          + (f", tta {args.tta}" if args.tta else "") + f"): loss {report['loss']:.4f}, top-1 {report['top1']:.4f}"
          + (f", {top_k} {report[top_k]:.4f}" if top_k else "") + f"; weakest classes: {weakest}")
    if args.tta:
        print(f"tta {args.tta}: top-1 {report['tta_gain']['top1']:+.4f}, loss {report['tta_gain']['loss']:+.4f} against "
              f"the plain model (top-1 {report['without_tta']['top1']:.4f}, loss {report['without_tta']['loss']:.4f})")
    print(f"report: {report_file}, confusion matrix: {plot_file}")
