"""Export one plain fp32 state_dict for ResNet18Animals90 from a DeepSpeed checkpoint of any ZeRO stage.

    python src/export_model.py checkpoints_deepspeed/best_model --output model.pt
    python src/export_model.py checkpoints_deepspeed/epoch_10 --output model.safetensors
    python src/export_model.py checkpoints_deepspeed/best_model --output model.onnx        # ONNX, any batch size
    python src/export_model.py checkpoints_deepspeed/best_model --output model.ts --format torchscript

ZeRO 1-3 checkpoints are consolidated by DeepSpeed's own zero_to_fp32 (the fp32 master weights,
gathered from every rank's shard); a ZeRO-0 checkpoint holds the whole model already. Batch-norm
statistics are the ones the checkpoint was validated with. Class names, image size and the source
checkpoint go into `<output>.json` beside the file (and into the metadata of a .safetensors file).
An ONNX or TorchScript export is the model in eval mode taking normalised fp32 images (N, 3, size, size), any N,
checked against the PyTorch model on the same images before it is published (ONNX: when onnxruntime is installed).
"""
import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ..data.folders import check_preprocessing
from ..models.build import check_saved_model, load_weights, model_for_weights, plain_norms
from ..models.names import MODEL_NAME
from ..outputs.checkpoints import find_checkpoint, read_info
from ..utils.failures import (CliError, CliParser, UsageError, check_not_taken, check_output_file, path_argument,
                              stop_on_write_error)
from ..utils.files import as_open_would, fingerprint, replace_together, save_safetensors, written_beside
from ..utils.loading import check_checkpoint_files, load_checked
from ..utils.text import error_line

SUFFIXES = (".pt", ".pth", ".safetensors")
# --format: its file name suffixes; state_dict unless the name ends in .onnx or --format says otherwise
FORMATS = {"state_dict": SUFFIXES, "onnx": (".onnx",), "torchscript": (".pt", ".pth", ".ts")}
ONNX_SINGLE_FILE_BYTES = 1.8 * 2**30  # protobuf's 2 GiB limit: larger models keep their weights in <output>.data
# How far the exported model's logits may be from PyTorch's on the same images (fp32; kernels differ in order)
EXPORT_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


# reads of a checkpoint folder that the trainer published anew meanwhile, before giving up
READS = 3


def consolidated_state_dict(checkpoint, ema=False):
    """(fp32 state_dict, extra_info) of a checkpoint written by the trainer: its folder, its tag
    folder, or a name like checkpoints_deepspeed/best_model; with `ema`, the weights' average in the weights'
    place. Every file comes from one folder: a running trainer publishes a new checkpoint under the same name
    (last, best_model) by renaming folders, so the name is read through the folder it named at the start
    (pinned_folder), and read again where that folder was removed meanwhile."""
    for attempt in range(READS):
        folder = find_checkpoint(str(checkpoint), ".")
        with pinned_folder(folder) as (path, moved):
            try:
                return _consolidated(path, str(folder), ema)
            except Exception:
                if attempt + 1 < READS and moved():
                    continue
                raise


@contextlib.contextmanager
def pinned_folder(folder):
    """(path, moved): a path that names `folder`'s directory for as long as this lasts, whatever is renamed
    meanwhile (Linux's /proc/self/fd; elsewhere `folder` itself), and moved() whether `folder` names another
    directory now. Errors inside name `folder`."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        held = os.fstat(fd)
        pinned = f"/proc/self/fd/{fd}"
        path = pinned if os.path.isdir(pinned) and os.path.samestat(os.stat(pinned), held) else str(folder)

        def moved():
            try:
                return not os.path.samestat(os.stat(folder), held)
            except OSError:
                return True

        try:
            yield Path(path), moved
        except CliError as error:  # the one line a user reads names their path
            if path == str(folder):
                raise
            message = str(error).replace(path + os.sep, str(folder) + os.sep).replace(path, str(folder))
            raise type(error)(message) from None
    finally:
        os.close(fd)


def _consolidated(folder, shown, ema):
    info = {**read_info(folder), "folder": shown}
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
    state_dict = {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in module.items()}
    return (with_ema(state_dict, info, folder) if ema else state_dict), info


def sidecar_path(output):
    return Path(output).with_suffix(Path(output).suffix + ".json")


def output_format(output, given=None):
    """The export format for `output`: `given` (--format), else onnx for a .onnx name and a state_dict otherwise."""
    if given is not None:
        return given
    return "onnx" if Path(output).suffix.lower() == ".onnx" else "state_dict"


def check_format_support(kind):
    """One line when the packages `kind` needs are missing (the ONNX exporter's, which the trainer does not need)."""
    import importlib.util

    if kind == "onnx":
        missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
        if missing:
            raise UsageError(f"--format onnx needs the {' and '.join(missing)} package{'s' * (len(missing) > 1)}, "
                             f"which torch.onnx exports with: pip install {' '.join(missing)}")


def with_ema(state_dict, info, folder):
    """`state_dict` with the weights' average of the checkpoint in `folder` (--model_ema) in place of its weights and
    floating buffers, consolidated from every rank's part (engine/ema.py)."""
    from ..engine.ema import BUFFER, read_files, saved_with_ema

    tag_dir = Path(folder) / info["tag"]
    if not saved_with_ema(info):
        raise UsageError(f"--ema: {info['folder']} holds no weights' average (its run was trained without "
                         "--model_ema)")
    saved = read_files(tag_dir, info)
    averaged = dict(state_dict)
    weights = [name for name in saved.metadata["shapes"] if not name.startswith(BUFFER)]
    for name in weights:
        if name not in state_dict:
            raise UsageError(f"--ema: {tag_dir}'s average has a weight {name} its model does not")
        if name in saved.parts:  # a weight no optimizer stepped (frozen for the whole run) is its own average
            averaged[name] = saved.whole(name, state_dict[name].shape).to(state_dict[name].dtype)
    for name, value in state_dict.items():
        if value.is_floating_point() and name not in weights:
            averaged[name] = saved.tensor(BUFFER + name, value.shape).to(value.dtype)
    return averaged


def export(checkpoint, output, kind=None, ema=False):
    output = Path(output)
    kind = output_format(output, kind)
    check_output_file(output, "--output", FORMATS[kind])
    check_format_support(kind)
    # the sidecar's name too: a folder there failed the write after consolidating (status 4)
    check_not_taken(sidecar_path(output), "--output", output)
    if kind == "onnx":
        check_not_taken(onnx_data_path(output), "--output", output)
    state_dict, info = consolidated_state_dict(checkpoint, ema)
    # strict: the export must load as it is
    model = model_for_weights(info["model"], len(info["class_names"]), info["image_size"])
    load_weights(model, state_dict, info["folder"])
    preprocessing = check_preprocessing(info.get("preprocessing"), Path(info["folder"]) / "extra_info.json")
    metadata = {"model": info["model"], "pretrained": info.get("pretrained"), "preprocessing": preprocessing,
                "image_size": info["image_size"], "class_names": info["class_names"],
                "source_checkpoint": info["folder"], "epoch": info["epoch"], "metrics": info.get("metrics"),
                "data_tier": info.get("data_tier"), "weights": "ema" if ema else "raw"}
    if kind != "state_dict":
        metadata["format"] = kind
        return _export_program(plain_norms(model).eval(), kind, output, metadata)
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


def onnx_data_path(output):
    """Where an ONNX export too large for one file keeps its weights (the name torch.onnx gives them)."""
    return Path(output).with_name(Path(output).name + ".data")


def _export_program(model, kind, output, metadata):
    """Write `model` as an ONNX or TorchScript program with a dynamic batch size to a temporary folder beside
    `output`, check it against `model` on the same images, then rename its files and the sidecar over the
    earlier ones together (as the state_dict's): a failed or wrong export leaves an earlier one as it was."""
    size = metadata["image_size"]
    images = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(images)
    with stop_on_write_error("export", "--output", retry="export again"):
        output.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}."))
    try:
        written = work / output.name
        with stop_on_write_error("export", "--output", retry="export again"):
            if kind == "onnx":
                got, checked_by = _write_onnx(model, images, written)
            else:
                got, checked_by = _write_torchscript(model, images, written)
            difference = (got - expected).abs().max().item() if got is not None else None
            if got is not None and not torch.allclose(got, expected, **EXPORT_TOLERANCE):
                raise UsageError(f"the {kind} export's logits differ from PyTorch's by up to {difference:.3g} on "
                                     f"the same images (checked with {checked_by}); the earlier export is intact")
            metadata["checked"] = {"by": checked_by, "max_abs_difference": difference}
            files = [(written, output)]
            if onnx_data_path(written).exists():
                files.append((onnx_data_path(written), onnx_data_path(output)))
            for path, _ in files:
                as_open_would(path)
            sidecar = {**metadata, "model_file": fingerprint(written)}
            files.append((written_beside(sidecar_path(output), json.dumps(sidecar, indent=2).encode()),
                          sidecar_path(output)))
            replace_together(files)
            if len(files) == 2:  # an earlier, larger export's weights: nothing reads them now
                onnx_data_path(output).unlink(missing_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for path in output.parent.glob(f".{sidecar_path(output).name}.*.tmp"):
            path.unlink(missing_ok=True)
    return metadata


def _write_onnx(model, images, path):
    """torch.onnx's exporter (torch.export based) with the batch dimension dynamic; the logits onnxruntime
    computes from the file, or None when onnxruntime is not installed."""
    import importlib.util
    import warnings

    large = sum(t.numel() * t.element_size() for t in model.state_dict().values()) > ONNX_SINGLE_FILE_BYTES
    # The exporter reports its progress on stdout, which may carry JSON: send it to stderr.
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, (images,), str(path), dynamo=True, external_data=large, verbose=False,
                              input_names=["images"], output_names=["logits"],
                              dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
        except Exception as err:  # noqa: BLE001 - the exporter fails many ways (an op without ONNX form)
            if isinstance(err, OSError):
                raise
            raise UsageError(f"torch.onnx cannot export {type(model).__name__} ({error_line(err)}); "
                             "export a state_dict (--output model.pt) instead") from None
    if importlib.util.find_spec("onnxruntime") is None:
        return None, None
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"images": images.numpy()})[0]), "onnxruntime"


def _write_torchscript(model, images, path):
    """torch.jit.script's program (the batch size free, as in the model); the logits torch.jit.load's copy computes."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated in favour of torch.export; it still runs anywhere
        try:
            scripted = torch.jit.script(model)
        except Exception as err:  # noqa: BLE001 - TorchScript's compiler refuses Python it does not know
            raise UsageError(f"TorchScript cannot compile {type(model).__name__} ({error_line(err)}); "
                             "export ONNX (--output model.onnx) or a state_dict instead") from None
        scripted.save(str(path))
        with torch.no_grad():
            return torch.jit.load(str(path), map_location="cpu")(images), "torch.jit.load"


def get_args_parser():
    parser = CliParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=path_argument,
                        help="checkpoint folder (e.g. checkpoints_deepspeed/best_model) or its tag folder")
    parser.add_argument("--output", type=path_argument, required=True,
                        help="model.pt or model.safetensors (a state_dict), model.onnx, or with --format "
                             "torchscript model.ts")
    parser.add_argument("--format", choices=tuple(FORMATS), default=None,
                        help="state_dict (default), onnx (default for a .onnx name) or torchscript")
    parser.add_argument("--ema", action="store_true",
                        help="export the weights' average the run kept (--model_ema) instead of its weights")
    return parser


def main(argv=None):
    args = get_args_parser().parse_args(argv)
    metadata = export(args.checkpoint, args.output, args.format, args.ema)
    output = Path(args.output)  # the file written: "m.pt/" writes m.pt
    checked = metadata.get("checked") or {}
    how = (f", {metadata['format']}, logits within {checked['max_abs_difference']:.2g} of PyTorch's"
           if checked.get("by") else f", {metadata['format']}, not run (pip install onnxruntime to check it)"
           if "format" in metadata else "")
    which = "the weights' average, " if args.ema else ""
    print(f"wrote {output} ({which}{len(metadata['class_names'])} classes, "
          f"{metadata['image_size']} px{how}) "
          f"and {sidecar_path(output)} from {metadata['source_checkpoint']}")
