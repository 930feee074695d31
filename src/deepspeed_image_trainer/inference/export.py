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
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from ..data.folders import check_preprocessing
from ..models.build import check_saved_model, load_weights, model_for_weights
from ..models.names import MODEL_NAME
from ..outputs.checkpoints import find_checkpoint, read_info
from ..utils.failures import (CliParser, UsageError, check_not_taken, check_output_file, path_argument,
                              stop_on_write_error)
from ..utils.files import as_open_would, fingerprint, replace_together, written_beside
from ..utils.loading import check_checkpoint_files, load_checked

SUFFIXES = (".pt", ".pth", ".safetensors")


def consolidated_state_dict(checkpoint):
    """(fp32 state_dict, extra_info) of a checkpoint written by the trainer: its folder, its tag
    folder, or a name like checkpoints_deepspeed/best_model."""
    folder = find_checkpoint(str(checkpoint), ".")
    info = {**read_info(folder), "folder": str(folder)}
    info["model"] = check_saved_model(info.get("model", MODEL_NAME), Path(folder) / "extra_info.json")
    tag_dir = Path(folder) / info["tag"]
    check_checkpoint_files(folder, info["tag"])  # before zero_to_fp32, which unpickles anything
    if info.get("zero_stage", 0) == 0:
        states = load_checked(tag_dir / "mp_rank_00_model_states.pt")
        module = states.get("module") if isinstance(states, dict) else None
        if not isinstance(module, dict):
            raise UsageError(f"{tag_dir / 'mp_rank_00_model_states.pt'} holds no model (no 'module' state_dict)")
    else:
        # DeepSpeed logs and reports progress on stdout, which may carry JSON: send it all to stderr.
        # The import goes inside too, since DeepSpeed's logger binds the stream when it is created.
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            module = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=info["tag"])
    if not all(isinstance(k, str) and torch.is_tensor(v) for k, v in module.items()):
        raise UsageError(f"{tag_dir} holds a model state that is not tensors by name: use another checkpoint")
    # Floating tensors become fp32; integer buffers (num_batches_tracked) keep their type.
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in module.items()}, info


def save_safetensors(state_dict, path, metadata):
    """safetensors' save_file, whose failed writes (a full disk) raise SafetensorError: as the OSError they are."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(state_dict, str(path), metadata={k: json.dumps(v) for k, v in metadata.items()})
    except SafetensorError as err:  # "Error while serializing: I/O error: File too large (os error 27)"
        code = re.search(r"\(os error (\d+)\)", str(err))
        raise (OSError(int(code[1]), os.strerror(int(code[1]))) if code else OSError(str(err).splitlines()[0])) from err


def sidecar_path(output):
    return Path(output).with_suffix(Path(output).suffix + ".json")


def export(checkpoint, output):
    output = Path(output)
    check_output_file(output, "--output", SUFFIXES)
    # the sidecar's name too: a folder there failed the write after consolidating (status 4)
    check_not_taken(sidecar_path(output), "--output", output)
    state_dict, info = consolidated_state_dict(checkpoint)
    # strict: the export must load as it is
    load_weights(model_for_weights(info["model"], len(info["class_names"]), info["image_size"]), state_dict,
                 info["folder"])
    preprocessing = check_preprocessing(info.get("preprocessing"), Path(info["folder"]) / "extra_info.json")
    metadata = {"model": info["model"], "pretrained": info.get("pretrained"), "preprocessing": preprocessing,
                "image_size": info["image_size"], "class_names": info["class_names"],
                "source_checkpoint": info["folder"], "epoch": info["epoch"], "metrics": info.get("metrics"),
                "data_tier": info.get("data_tier")}
    # Both files are written beside their names, then renamed over them together: a failed export leaves an
    # earlier one (model and sidecar) as it was.
    with stop_on_write_error("export", "--output", retry="export again"):  # a folder that takes no file (/proc)
        output.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=output.suffix)
    os.close(fd)
    tmp, tmp_sidecar = Path(tmp), None
    try:
        with stop_on_write_error("export", "--output", retry="export again"):
            if output.suffix == ".safetensors":
                save_safetensors(state_dict, tmp, metadata)
            else:
                torch.save(state_dict, tmp)
            # after the write: safetensors puts a new file of its own, private (0600), in tmp's place
            as_open_would(tmp)
            # the model file's fingerprint: a kill between the two renames below pairs files of two exports
            sidecar = {**metadata, "model_file": fingerprint(tmp)}
            tmp_sidecar = written_beside(sidecar_path(output), json.dumps(sidecar, indent=2).encode())
            replace_together([(tmp, output), (tmp_sidecar, sidecar_path(output))])
    finally:
        for path in (tmp, tmp_sidecar):
            if path is not None:
                path.unlink(missing_ok=True)
    return metadata


def get_args_parser():
    parser = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=path_argument,
                        help="checkpoint folder (e.g. checkpoints_deepspeed/best_model) or its tag folder")
    parser.add_argument("--output", type=path_argument, required=True, help="model.pt or model.safetensors")
    return parser


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    metadata = export(args.checkpoint, args.output)
    output = Path(args.output)  # the file written: "m.pt/" writes m.pt
    print(f"wrote {output} ({len(metadata['class_names'])} classes, {metadata['image_size']} px) "
          f"and {sidecar_path(output)} from {metadata['source_checkpoint']}")
