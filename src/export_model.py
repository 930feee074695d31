"""Export one plain fp32 state_dict for ResNet18Animals90 from a DeepSpeed checkpoint of any ZeRO stage.

    python src/export_model.py checkpoints_deepspeed/best_model --output model.pt
    python src/export_model.py checkpoints_deepspeed/epoch_10 --output model.safetensors

ZeRO 1-3 checkpoints are consolidated by DeepSpeed's own zero_to_fp32 (the fp32 master weights,
gathered from every rank's shard); a ZeRO-0 checkpoint holds the whole model already. Batch-norm
statistics are the ones the checkpoint was validated with. Class names, image size and the source
checkpoint go into `<output>.json` beside the file (and into the metadata of a .safetensors file).
"""
import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from checkpoints import find_checkpoint, read_info
from failures import UsageError
from files import write_json_atomic
from model import ResNet18Animals90
from options import run_cli

SUFFIXES = (".pt", ".pth", ".safetensors")


def consolidated_state_dict(checkpoint):
    """(fp32 state_dict, extra_info) of a checkpoint written by the trainer: its folder, its tag
    folder, or a name like checkpoints_deepspeed/best_model."""
    folder = find_checkpoint(str(checkpoint), ".")
    info = {**read_info(folder), "folder": str(folder)}
    tag_dir = Path(folder) / info["tag"]
    if info.get("zero_stage", 0) == 0:
        module = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    else:
        # DeepSpeed logs and reports progress on stdout, which may carry JSON: send it all to stderr.
        # The import goes inside too, since DeepSpeed's logger binds the stream when it is created.
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            module = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=info["tag"])
    # Floating tensors become fp32; integer buffers (num_batches_tracked) keep their type.
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in module.items()}, info


def sidecar_path(output):
    return Path(output).with_suffix(Path(output).suffix + ".json")


def export(checkpoint, output):
    output = Path(output)
    if output.suffix not in SUFFIXES:
        raise UsageError(f"--output {output}: use a .pt, .pth or .safetensors file name")
    state_dict, info = consolidated_state_dict(checkpoint)
    model = ResNet18Animals90(num_classes=len(info["class_names"]))
    model.load_state_dict(state_dict)  # strict: the export must load as it is
    metadata = {"model": info["model"], "image_size": info["image_size"], "class_names": info["class_names"],
                "source_checkpoint": info["folder"], "epoch": info["epoch"], "metrics": info.get("metrics")}
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state_dict, str(output), metadata={k: json.dumps(v) for k, v in metadata.items()})
    else:
        torch.save(state_dict, output)
    write_json_atomic(sidecar_path(output), metadata)
    return metadata


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="checkpoint folder (e.g. checkpoints_deepspeed/best_model) or its tag folder")
    parser.add_argument("--output", required=True, help="model.pt or model.safetensors")
    return parser


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    metadata = export(args.checkpoint, args.output)
    print(f"wrote {args.output} ({len(metadata['class_names'])} classes, {metadata['image_size']} px) "
          f"and {sidecar_path(args.output)} from {metadata['source_checkpoint']}")


if __name__ == "__main__":
    run_cli(main)
