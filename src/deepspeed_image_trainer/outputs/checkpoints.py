"""Checkpoint policy in one place: what is saved when, how it is published, and how a run resumes.

Layout under --checkpoint_dir (each folder is DeepSpeed's save_dir, holding the tag folder, DeepSpeed's
`latest` file and extra_info.json):

    last/last/           every epoch (--save_last_every), and on SIGINT/SIGTERM: what `--resume auto` finds
    best_model/best/     the best validation accuracy so far
    epoch_N/epoch_N/     every --save_every epochs; --keep_last K keeps the newest K

Each epoch DeepSpeed writes one checkpoint into a staging folder (every rank its own shards); rank 0
then hard-links it into the published names and swaps each in with renames, so a reader sees the old
checkpoint or the new one, never a half-written one. A crash between the two renames of a swap leaves
`.old-<name>`, which readers fall back to.

The files are written in the background while the next epoch trains: DeepSpeed hands each file's state
to BackgroundCheckpointEngine, which copies it to host memory (the training may then change the live
tensors) and queues the torch.save on one writer thread. After a checkpoint's files, every rank marks
its part written; rank 0 waits for all the marks, publishes, and only then writes the history line of
that epoch, so the history never names an epoch whose checkpoint is not published. The next save, the
end of the run and a stop by a signal wait for the queue.

A failed write (disk full, permissions) on any rank stops that rank with WriteFailed (exit status 4) at
its next save or at the end, and leaves the published checkpoints as they were; the `deepspeed`
launcher (like torchrun) then ends the other ranks, which would otherwise wait in the next barrier for good.
"""
import json
import math
import os
import shutil
import time
import zipfile
from pathlib import Path

from ..engine.distributed import barrier, from_rank_zero, rank, rank_zero_only, world_size
from ..engine.ema import EMA_FILE, read_files, saved_with_ema
from ..utils.failures import CHECKPOINT_DESCRIPTION, UsageError, stop_on_write_error
from ..utils.files import parse_json, save_safetensors, write_json_atomic
from ..utils.loading import check_checkpoint_files
from ..utils.text import error_line, listed
from . import universal

EXTRA_INFO = CHECKPOINT_DESCRIPTION
LAST, BEST = "last", "best_model"
STAGING = ".staging"
# In the staging folder: that rank's files of the checkpoint are complete, or could not be written.
WRITTEN, FAILED = ".written-rank{}", ".failed-rank{}"
MARK_POLL_S = 0.01


def _tag(name):
    return {LAST: "last", BEST: "best"}.get(name, name)


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy_as(staging, target, tag):
    """Copy the staged checkpoint into `target` with its tag folder renamed to `tag` (hard links)."""
    target.mkdir()
    for entry in staging.iterdir():
        if entry.is_dir():
            shutil.copytree(entry, target / tag, copy_function=_link_or_copy)
        elif entry.name == "latest":
            (target / "latest").write_text(tag)
        elif entry.name != EXTRA_INFO and not entry.name.startswith((WRITTEN.format(""), FAILED.format(""))):
            _link_or_copy(entry, target / entry.name)


def _publish(ready, final):
    old = final.with_name(f".old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.rename(final, old)
    os.rename(ready, final)
    shutil.rmtree(old, ignore_errors=True)


def readable(folder):
    """`folder`, or the copy a crash in the middle of a swap left behind, or None (also when its
    extra_info.json is damaged)."""
    folder = Path(folder)
    candidates = [folder, folder.with_name(f".old-{folder.name}")] if folder.name else [folder]
    for candidate in candidates:
        if (candidate / EXTRA_INFO).is_file():
            try:
                read_info(candidate)
                return candidate
            except UsageError:
                continue
    return None


def _whole_number(value, low=0):
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


# What the fields of extra_info.json that the tools read must be, where present (older checkpoints lack some).
INFO_TYPES = {"class_names": lambda v: isinstance(v, list) and v and all(isinstance(n, str) for n in v),
              "image_size": lambda v: _whole_number(v, 1), "world_size": lambda v: _whole_number(v, 1),
              "zero_stage": lambda v: v in (0, 1, 2, 3) and _whole_number(v),
              "settings": lambda v: isinstance(v, dict) and _whole_number(v.get("train_batch_size", 1), 1),
              "run_started": lambda v: v is None or isinstance(v, (int, float)) and not isinstance(v, bool),
              "saved_at": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "pretrained": lambda v: v is None or isinstance(v, str),
              "interrupted_at": lambda v: isinstance(v, dict) and _whole_number(v.get("epoch"), 1),
              "model_ema_files": lambda v: _whole_number(v, 1)}


def read_info(folder):
    """A checkpoint's extra_info.json; UsageError when it is not what this trainer writes."""
    path = Path(folder) / EXTRA_INFO
    try:
        info = parse_json(path.read_bytes())
    except (OSError, ValueError) as err:
        raise UsageError(f"{path} is unreadable ({str(err).splitlines()[0]}): use another checkpoint (last, "
                         "best_model, epoch_N)") from None
    if not isinstance(info, dict) or not isinstance(info.get("epoch"), int) or not isinstance(info.get("tag"), str):
        raise UsageError(f"{path} is not a checkpoint description this trainer wrote (no epoch and tag): use "
                         "another checkpoint (last, best_model, epoch_N)")
    if info["tag"] in ("", ".", "..") or any(sep in info["tag"] for sep in ("/", "\\")):  # a tag "../x" was followed
        raise UsageError(f"{path} is not a checkpoint description this trainer wrote (its tag {info['tag']!r} is "
                         "not a folder name inside it): use another checkpoint (last, best_model, epoch_N)")
    wrong = [key for key, right in INFO_TYPES.items() if key in info and not right(info[key])]
    metrics = info.get("metrics")
    stopped = info.get("interrupted_at")
    if info["epoch"] < 0 or isinstance(metrics, dict) and metrics.get("epoch", info["epoch"]) != info["epoch"] or (
            isinstance(stopped, dict) and stopped.get("epoch", info["epoch"] + 1) != info["epoch"] + 1):
        # an end-of-epoch checkpoint's epoch is its metrics' too; one saved in epoch N is after epoch N - 1
        raise UsageError(f"{path} is not a checkpoint description this trainer wrote (its epoch {info['epoch']} is "
                         f"not the epoch its metrics record): use another checkpoint (last, best_model, epoch_N)")
    if wrong:
        raise UsageError(f"{path} is not a checkpoint description this trainer wrote ({', '.join(wrong)} of the "
                         "wrong kind): use another checkpoint (last, best_model, epoch_N)")
    return info


@rank_zero_only
def carry_best(resume_from, checkpoint_dir, best_epoch):
    """A run resumed from another folder's checkpoint keeps that run's history, whose best epoch names a
    checkpoint there: link it into checkpoint_dir as best_model (before this run saves a better one), so that
    --resume best, export and evaluate find it here too. Any whole checkpoint saved at the end of that epoch
    holds the same weights (that run's best_model may have moved on since). Returns a warning line when none
    is left, else None."""
    source_dir, checkpoint_dir = Path(resume_from).parent, Path(checkpoint_dir)
    if best_epoch is None or source_dir.resolve() == checkpoint_dir.resolve() or readable(checkpoint_dir / BEST):
        return None
    for candidate in (source_dir / BEST, source_dir / f"epoch_{best_epoch}", source_dir / LAST, Path(resume_from)):
        source = readable(candidate)
        info = read_info(source) if source else {}
        if info.get("epoch") == best_epoch and "interrupted_at" not in info and not missing_files(source, info):
            ready = checkpoint_dir / f".ready-{BEST}"
            shutil.rmtree(ready, ignore_errors=True)
            _copy_as(source, ready, _tag(BEST))
            write_json_atomic(ready / EXTRA_INFO, {**info, "tag": _tag(BEST)})
            _publish(ready, checkpoint_dir / BEST)
            return None
    return (f"warning: the history resumed from {resume_from} names epoch {best_epoch} best, but no whole "
            f"checkpoint of that epoch is left in {source_dir}: {checkpoint_dir / BEST} appears once an epoch of "
            "this run does better")


class CheckpointSaver:
    def __init__(self, engine, checkpoint_dir, save_every, keep_last, save_last_every=1, background=True, ema=None):
        self.engine, self.ema = engine, ema  # ema: engine/ema.py's WeightEMA, whose files go into the tag folder
        self.dir = Path(checkpoint_dir)
        self.save_every = save_every
        self.keep_last = keep_last
        self.save_last_every = save_last_every
        from .checkpoint_engine import BackgroundCheckpointEngine  # DeepSpeed's classes: not for the launcher

        self.background = engine.checkpoint_engine = BackgroundCheckpointEngine(self._mark_failed, background)
        self.earlier = []

    def retire_after_first_save(self, *earlier):
        """Once this run's first checkpoint is published, each of `earlier` that is not None (what an earlier run
        left in these folders) is told the names it was published under: retire(names). Until then a run that
        fails leaves them as they were."""
        self.earlier = [what for what in earlier if what is not None]

    @stop_on_write_error("checkpoint", "--checkpoint_dir")
    def wait(self):
        """Until every checkpoint saved so far is written and published (and what came after it)."""
        self.background.wait()

    def after(self, fn, *args):
        """fn(*args) once the checkpoints saved so far are published (the history line of their epoch)."""
        self.background.after(fn, *args)

    def save(self, epoch, info, state, best=False, interrupted=False):
        """Save after `epoch` (or mid-epoch when interrupted); it is published under the names due once
        written, in the background. Every rank must call this: DeepSpeed's save_checkpoint is collective.
        Returns the names it will be published under."""
        names = []
        if best:
            names.append(BEST)
        if not interrupted and self.save_every and epoch % self.save_every == 0:
            names.append(f"epoch_{epoch}")
        if interrupted or (self.save_last_every and epoch % self.save_last_every == 0):
            names.append(LAST)
        if not names:
            return names
        self.wait()  # the previous checkpoint is out of the staging folder
        staging = self.dir / STAGING
        barrier()
        rank_zero_only(shutil.rmtree)(staging, ignore_errors=True)
        barrier()
        self.staging = staging
        with stop_on_write_error("checkpoint", "--checkpoint_dir"):
            self.engine.save_checkpoint(str(staging), tag="staged", client_state=state)
            # orders --resume auto's candidates; every rank's file of the weights' average names it too
            saved_at = from_rank_zero(time.time()) if self.ema is not None else time.time()
            ema = self.ema.state(saved_at) if self.ema is not None else None  # copied now: the training changes it
            if ema is not None:
                self.after(save_ema, staging / "staged" / EMA_FILE.format(rank()), *ema)
            self.after(self._mark, staging, WRITTEN)
            # saved_at orders --resume auto's candidates: a resume keeps run_started, and may rewind the epoch
            self.after(self._publish_staged, staging, names, {**info, "epoch": epoch, "saved_at": saved_at})
            if self.earlier:  # rank 0's: in this thread, not the writer's, while no monitor writes a row
                self.wait()
                for what in self.earlier:
                    what.retire(names)
                self.earlier = []
                self._prune()
        return names

    @staticmethod
    def _mark(staging, kind):
        (staging / kind.format(rank())).touch()

    def _mark_failed(self):
        try:
            self._mark(self.staging, FAILED)
        except OSError:  # as full as the disk that failed the write: rank 0 then waits until this rank exits
            pass

    @rank_zero_only
    def _publish_staged(self, staging, names, info):
        for r in range(world_size()):  # the other ranks' writer threads
            while not (staging / WRITTEN.format(r)).exists():
                if (staging / FAILED.format(r)).exists():
                    raise OSError(f"rank {r} could not write its part of the checkpoint (its own error "
                                  "is in its output)")
                time.sleep(MARK_POLL_S)
        for name in names:
            ready = self.dir / f".ready-{name}"
            shutil.rmtree(ready, ignore_errors=True)
            _copy_as(staging, ready, _tag(name))
            write_json_atomic(ready / EXTRA_INFO, {**info, "tag": _tag(name)})
            _publish(ready, self.dir / name)
        shutil.rmtree(staging, ignore_errors=True)
        if not self.earlier:  # else once the earlier run's epoch_N are gone, which --keep_last would count
            self._prune()

    def _prune(self):
        if not self.keep_last:
            return
        numbered = sorted((int(p.name.split("_")[1]), p) for p in self.dir.glob("epoch_*")
                          if p.name.split("_")[1].isdigit())
        for _, folder in numbered[:-self.keep_last]:
            shutil.rmtree(folder, ignore_errors=True)


def save_ema(path, tensors, metadata):
    """A rank's part of the weights' average (engine/ema.py) as a safetensors file in the checkpoint's tag folder."""
    path.parent.mkdir(parents=True, exist_ok=True)  # at ZeRO-0 DeepSpeed makes it on rank 0 only
    save_safetensors(tensors, path, metadata)


def is_checkpoint_name(name):
    """Whether `name` is one the trainer publishes a checkpoint under: last, best_model, epoch_N."""
    return name in (LAST, BEST) or name.startswith("epoch_") and name[len("epoch_"):].isdigit()


def missing_files(folder, info):
    """The files of DeepSpeed's that checkpoint `folder` (its extra_info.json: `info`) lacks for its ZeRO stage
    and number of ranks: an interrupted copy, files removed by hand."""
    tag, stage, ranks = Path(folder, info["tag"]), info.get("zero_stage", 0), info.get("world_size", 1)
    if not isinstance(stage, int) or not isinstance(ranks, int) or ranks < 1:
        return [f"{tag} (extra_info.json names no ZeRO stage and number of ranks)"]
    present = {path.name for path in tag.glob("*.pt")} | {path.name for path in tag.glob("*.safetensors")}
    wanted = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(ranks)] if stage == 3
              else ["mp_rank_00_model_states.pt"])
    if stage:  # the optimizer's shards, one a rank (bf16_zero_pp_rank_... with DeepSpeed's bf16 weights)
        wanted += [name for r in range(ranks) for name in [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"]
                   if name not in present and f"bf16_{name}" not in present]
    wanted += [EMA_FILE.format(r) for r in range(info.get("model_ema_files", 0))]  # --model_ema's
    return [str(tag / name) for name in wanted if name not in present]


def _cut_short(path):
    """Why torch.save's zip archive at `path` cannot be opened (its directory is at the end: a file cut short by a
    full disk or a stopped copy has none), or None."""
    if not os.path.isfile(path):  # a FIFO's open() waits for a writer for good
        return "not a regular file (a folder, FIFO or device)"
    try:
        zipfile.ZipFile(path).close()
        return None
    except (zipfile.BadZipFile, OSError) as err:
        return str(err)


def find_checkpoint(resume, checkpoint_dir, skipped=None):
    """The folder to resume from: for "auto", the whole one under checkpoint_dir saved last (None when there is
    none), adding those it passed over to `skipped` as (folder, why: a damaged extra_info.json, files missing or
    cut short);
    otherwise a checkpoint folder, its tag folder, or a name under checkpoint_dir (last, best, epoch_N)."""
    checkpoint_dir = Path(checkpoint_dir)
    if resume == "auto":
        names = {p.name.removeprefix(".old-") for p in checkpoint_dir.iterdir()} if checkpoint_dir.is_dir() else ()
        found, passed_over = [], []
        for name in sorted(n for n in names if not n.startswith(".")):
            folder = readable(checkpoint_dir / name)
            if folder is None and (checkpoint_dir / name / EXTRA_INFO).is_file():
                try:
                    read_info(checkpoint_dir / name)
                except UsageError as err:
                    passed_over.append((checkpoint_dir / name, str(err).split(": use another checkpoint")[0]))
            elif folder is None and (checkpoint_dir / name).is_dir() and is_checkpoint_name(name):
                passed_over.append((checkpoint_dir / name,
                                    f"no {EXTRA_INFO}: damaged (emptied, or an interrupted copy)"))
            elif folder is not None:
                info = read_info(folder)
                missing = missing_files(folder, info)
                cut = [path.name for path in sorted(Path(folder, info["tag"]).glob("*.pt")) if _cut_short(path)]
                if missing:
                    passed_over.append((folder, f"{len(missing)} of its files are missing ({listed(missing, 2)})"))
                elif cut:
                    passed_over.append((folder, f"{listed(cut, 2)} cut short or not a torch file"))
                else:
                    found.append(folder)
        if skipped is not None:
            skipped += passed_over
        if not found:
            return None
        # The one saved last, whatever its epoch (after --resume epoch_N, not the abandoned branch's later epoch_M);
        # among those from before saved_at was recorded, the newest run's (an --overwrite run cut before it removed
        # the earlier run's epoch_N), then its newest epoch; at the same save or epoch `last`, which may hold a
        # mid-epoch interruption.
        return max(found, key=lambda f: (read_info(f).get("saved_at", 0), read_info(f).get("run_started") or 0,
                                         read_info(f)["epoch"], f.name.endswith(LAST)))
    path = Path(resume)
    candidates = [path, path.parent, checkpoint_dir / resume, checkpoint_dir / {"best": BEST}.get(resume, resume)]
    for candidate in candidates:
        folder = readable(candidate)
        if folder is not None:
            return folder
        if (Path(candidate) / EXTRA_INFO).is_file():
            read_info(candidate)  # a damaged one: stop naming what is wrong with it
    looked = " and ".join(dict.fromkeys(map(str, (path, checkpoint_dir / resume))))  # once when both are one
    raise UsageError(f"no checkpoint at {resume} (looked for {EXTRA_INFO} in {looked})")


def saved_stage(folder):
    """The ZeRO stage a checkpoint was saved with (what --zero_stage auto resumes with), or None."""
    return read_info(folder)["zero_stage"] if folder is not None else None


def saved_precision(folder):
    """The precision a checkpoint was saved with (engine/config.py's precision() name: what --precision_mode auto
    resumes with), or None."""
    if folder is None:
        return None
    info = read_info(folder)
    return info.get("settings", {}).get("precision", info.get("precision"))


# What a resumed run must share with the run it continues (the data it learns, the model's input, and what
# the saved optimizer and scheduler state were built for), with the flag that sets each. --epochs may change.
SETTINGS_FLAGS = {"model": "--model", "class_names": "the classes of --train_dir", "image_size": "--image_size",
                  "optimizer": "--optimizer or the DeepSpeed config's optimizer.type",
                  "train_batch_size": "the global batch (--batch_size x ranks x --gradient_accumulation_steps)",
                  "learning_rate": "--learning_rate", "weight_decay": "--weight_decay", "lr_schedule": "--lr_schedule",
                  "warmup_epochs": "--warmup_epochs", "label_smoothing": "--label_smoothing", "precision": "precision",
                  "backbone_lr_scale": "--backbone_lr_scale", "freeze_backbone_epochs": "--freeze_backbone_epochs",
                  "momentum": "--momentum", "nesterov": "--nesterov", "model_ema": "--model_ema",
                  "best_on": "--best_on",
                  "parameter_groups": "the parameter groups (--backbone_lr_scale, --freeze_backbone_epochs, "
                                      "--layer_decay, --norm_weight_decay, --bias_weight_decay, "
                                      "--transformer_embedding_decay):"}
GROUPS = {False: "one parameter group", True: "head and body in parameter groups of their own"}


def _shown(key, value, other=None):
    """A setting's value in a message, quoted where the other side is not a string (an edited "0.001")."""
    if key == "parameter_groups":
        if isinstance(value, dict):  # see finetune.grouping
            return "groups by " + ", ".join(("head and body" if name == "head_and_body" else f"--{name} {setting:g}")
                                            for name, setting in value.items() if setting is not None and setting is not False)
        return GROUPS.get(value, str(value))
    if key == "class_names":
        return f"{len(value)} classes ({listed(value, 4)})"
    if key == "model_ema" and isinstance(value, bool):
        return "on" if value else "off"
    return json.dumps(value) if isinstance(value, str) and not isinstance(other, str) else str(value)


def _same(key, saved, value):
    """Whether a saved setting is this run's. DeepSpeed reads its own optimizers' names in any case ("AdamW" and
    "adamw" are one optimizer); torch.optim's differ by more than case."""
    if key in ("momentum", "nesterov") and saved is None:  # not SGD's run: its optimizer's line says what differs
        return True
    if key in ("model_ema", "best_on") and saved is None:  # saved before --model_ema was a flag: without it
        saved = {"model_ema": False, "best_on": "raw"}[key]
    if key == "optimizer" and isinstance(saved, str) and isinstance(value, str):
        return saved.lower() == value.lower()
    return saved == value


def check_resumable(folder, world_size, zero_stage, settings, read_shards=False):
    """Stop with a message naming what differs when `folder` cannot be resumed by this run: another ZeRO
    stage; other settings (SETTINGS_FLAGS; checkpoints from before settings were saved are compared on what
    they hold); files missing, cut short, or (`read_shards`, the launcher's check) that do not load as the
    ranks would load them. Another world size is fine (see `load`) but for a mid-epoch checkpoint from
    before positions were saved in samples."""
    info = read_info(folder)
    saved = {**{key: info[key] for key in ("model", "class_names", "image_size", "precision") if key in info},
             **info.get("settings", {})}
    if info.get("zero_stage") != zero_stage:
        raise UsageError(f"cannot resume from {folder}: it was saved with ZeRO stage {info.get('zero_stage')} (this "
                         f"run: {zero_stage}); resume with its --zero_stage (auto takes it), or start a new run")
    if info.get("world_size") != world_size and "interrupted_at" in info and "samples" not in info["interrupted_at"]:
        raise UsageError(f"cannot resume from {folder}: it was saved by {info.get('world_size')} rank(s) (this run: "
                         f"{world_size}) in the middle of an epoch, by a version of the trainer that did not record "
                         "the position in samples; resume from the end of an epoch (--resume epoch_N or best), "
                         "resume with the same --num_gpus/--num_nodes, or start a new run")
    differs = [f"{SETTINGS_FLAGS[key]} {_shown(key, saved[key], value)} (this run: {_shown(key, value, saved[key])})"
               for key, value in settings.items() if key in saved and not _same(key, saved[key], value)]
    if differs:
        raise UsageError(f"cannot resume from {folder}: it was saved with " + "; ".join(differs)
                         + ". Resume with the run's own flags, or start a new run (--overwrite, or other folders)")
    optimizer = str(saved.get("optimizer", "AdamW"))
    if universal.needed(info, world_size) and optimizer.lower() not in universal.CONVERTIBLE_OPTIMIZERS:
        raise UsageError(f"cannot resume from {folder} on {world_size} rank(s): it was saved by "
                         f"{info.get('world_size')} at ZeRO stage {info.get('zero_stage')}, and DeepSpeed's "
                         f"universal checkpoint converts the state of Adam's moments only, not {optimizer}'s; resume "
                         f"on {info.get('world_size')} rank(s)")
    missing = missing_files(folder, info)
    if missing:
        raise UsageError(f"cannot resume from {folder}: {len(missing)} of its files are missing "
                         f"({listed(missing, 2)}): an interrupted copy? Resume from another checkpoint (--resume PATH: "
                         "last, best, epoch_N) or start a new run")
    for path in sorted(Path(folder, info["tag"]).glob("*.pt")):
        # one cut short stops here, before any rank starts, instead of in DeepSpeed's load on every rank
        why = _cut_short(path)
        if why:
            raise UsageError(f"cannot resume from {folder}: {path.name} is cut short or not a torch file ({why}); "
                             "resume from another checkpoint (--resume PATH: last, best, epoch_N) or start a new "
                             "run")
    try:  # every rank's shard, read as its rank will read it (memory-mapped: the structure, not the tensors)
        if read_shards:
            check_checkpoint_files(folder, info["tag"])
            if saved_with_ema(info):  # the weights' average's headers (safetensors: nothing unpickled)
                read_files(Path(folder, info["tag"]), info)
    except UsageError as err:
        raise UsageError(f"cannot resume from {folder}: {err}; resume from another checkpoint (--resume PATH: last, "
                         "best, epoch_N) or start a new run") from None
    return info


# What torch's load_state_dict says of a model or optimizer state that is another's
MISFIT = ("Error(s) in loading state_dict", "different number of parameter groups",
          "doesn't match the size of optimizer's group")


def load(engine, folder, info, checkpoint_dir):
    """Load model, optimizer, loss scaler and LR scheduler from `folder`, whose check_resumable gave `info`;
    return the saved training state. Every file goes through the trainer's checkpoint engine, so through
    loading.load_checked: a damaged or foreign one stops here naming it. A ZeRO-0 checkpoint holds the whole
    optimizer state in one file, which DeepSpeed loads on any number of ranks; a ZeRO-1/2/3 one saved by
    another number of ranks goes through a universal checkpoint (universal.py)."""

    try:
        if universal.needed(info, world_size()):
            load_path, state = universal.load(engine, folder, info, checkpoint_dir)
        else:
            load_path, state = engine.load_checkpoint(str(folder), tag=info["tag"])
    except UsageError as err:
        advice = UsageError(f"cannot resume from {folder}: {err}; resume from another checkpoint (--resume PATH: "
                            "last, best, epoch_N) or start a new run")
        advice.every_rank = err.every_rank
        raise advice from None
    except (RuntimeError, ValueError) as err:
        if not any(text in str(err) for text in MISFIT):
            raise
        # files of another run or model swapped in: torch's load_state_dict refuses them, alike in every rank
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]  # torch's second line says what
        misfit = UsageError(f"cannot resume from {folder}: its files do not fit this run's model and optimizer "
                            f"({lines[1] if len(lines) > 1 else error_line(err)}); resume from another checkpoint (--resume PATH: last, best, epoch_N) "
                            "or start a new run")
        misfit.every_rank = True
        raise misfit from None
    if load_path is None or state is None:
        raise UsageError(f"cannot resume from {folder}: DeepSpeed found no checkpoint there")
    return state
