"""Checkpoint publishing and lookup, on folders laid out as DeepSpeed writes them (no engine needed)."""
import argparse
import json
import re
import os
import zipfile
from pathlib import Path

import pytest

from deepspeed_image_trainer.outputs.checkpoints import (EXTRA_INFO, _copy_as, _publish, carry_best,
                                                         check_resumable, find_checkpoint, readable)
from deepspeed_image_trainer.outputs.record import resume_settings, run_record
from deepspeed_image_trainer.utils.failures import UsageError


def fake_checkpoint(folder, epoch, tag, world_size=1, zero_stage=2, payload="weights"):
    """The files DeepSpeed writes for `zero_stage` and `world_size` ranks, each a zip (torch.save's form)."""
    (folder / tag).mkdir(parents=True)
    names = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)] if zero_stage == 3
             else ["mp_rank_00_model_states.pt"])
    names += [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)] if zero_stage else []
    for name in names:
        with zipfile.ZipFile(folder / tag / name, "w") as archive:
            archive.writestr("payload", payload)
    (folder / "latest").write_text(tag)
    (folder / EXTRA_INFO).write_text(json.dumps({"epoch": epoch, "tag": tag, "world_size": world_size,
                                                 "zero_stage": zero_stage}))
    return folder


def payload_of(path):
    with zipfile.ZipFile(path) as archive:
        return archive.read("payload").decode()


def test_publish_replaces_and_a_crash_between_renames_leaves_a_readable_copy(tmp_path):
    final = fake_checkpoint(tmp_path / "last", 1, "last", payload="old")
    ready = fake_checkpoint(tmp_path / ".ready-last", 2, "last", payload="new")
    _publish(ready, final)
    assert payload_of(final / "last/mp_rank_00_model_states.pt") == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    # A crash after `last` was moved aside and before the new one was moved in:
    final.rename(tmp_path / ".old-last")
    assert readable(final) == tmp_path / ".old-last"
    assert find_checkpoint("auto", tmp_path) == tmp_path / ".old-last"
    # A half-written folder (no extra_info.json yet) is not a checkpoint.
    (tmp_path / "epoch_5" / "epoch_5").mkdir(parents=True)
    assert readable(tmp_path / "epoch_5") is None


def test_copy_as_renames_the_tag_and_shares_the_files(tmp_path):
    staged = fake_checkpoint(tmp_path / ".staging", 3, "staged")
    _copy_as(staged, tmp_path / "best_model", "best")
    assert (tmp_path / "best_model/latest").read_text() == "best"
    copied = tmp_path / "best_model/best/mp_rank_00_model_states.pt"
    assert payload_of(copied) == "weights"
    assert copied.stat().st_ino == (staged / "staged/mp_rank_00_model_states.pt").stat().st_ino  # hard link
    assert not (tmp_path / "best_model" / EXTRA_INFO).exists()  # written per published name


def test_resume_auto_picks_the_newest_and_prefers_last_on_a_tie(tmp_path):
    assert find_checkpoint("auto", tmp_path / "missing") is None
    assert find_checkpoint("auto", tmp_path) is None
    fake_checkpoint(tmp_path / "epoch_2", 2, "epoch_2")
    fake_checkpoint(tmp_path / "best_model", 1, "best")
    assert find_checkpoint("auto", tmp_path) == tmp_path / "epoch_2"
    fake_checkpoint(tmp_path / "last", 2, "last")
    assert find_checkpoint("auto", tmp_path) == tmp_path / "last"


def test_resume_auto_after_a_rewind_continues_the_checkpoint_saved_last(tmp_path):
    """A run rewound with --resume epoch_1 keeps its run_started: the abandoned branch's epoch_3 outranked the
    new branch's `last`, saved after it in epoch 3, and the next --resume auto mixed the two branches."""
    from deepspeed_image_trainer.outputs.checkpoints import CheckpointSaver

    class Engine:  # DeepSpeed's save_checkpoint, as far as the saver sees it
        def save_checkpoint(self, save_dir, tag, client_state):
            fake_checkpoint(Path(save_dir), 0, tag, zero_stage=0)

    info = {"world_size": 1, "zero_stage": 0, "run_started": 100.0}
    first = CheckpointSaver(Engine(), tmp_path, save_every=1, keep_last=0, background=False)
    for epoch in (1, 2, 3):
        first.save(epoch, info, {})
    fake_checkpoint(tmp_path / "epoch_9", 9, "epoch_9")  # from before saved_at was recorded: older than any with it
    rewound = CheckpointSaver(Engine(), tmp_path, save_every=1, keep_last=0, background=False)
    rewound.save(2, info, {})
    assert find_checkpoint("auto", tmp_path) == tmp_path / "last"  # at the same save as epoch_2
    rewound.save(2, {**info, "interrupted_at": {"epoch": 3, "step": 1}}, {}, interrupted=True)
    assert find_checkpoint("auto", tmp_path) == tmp_path / "last"
    assert json.loads((tmp_path / "last" / EXTRA_INFO).read_text())["interrupted_at"]["epoch"] == 3


def test_a_run_resumed_from_another_folder_brings_the_best_checkpoint_its_history_names(tmp_path):
    other, here = tmp_path / "other", tmp_path / "here"
    fake_checkpoint(other / "best_model", 1, "best", payload="best")
    fake_checkpoint(other / "last", 2, "last")
    here.mkdir()
    assert carry_best(other / "last", here, best_epoch=1) is None
    assert find_checkpoint("best", here) == here / "best_model"
    copied = here / "best_model/best/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert payload_of(copied) == "best" and copied.stat().st_ino == \
        (other / "best_model/best/zero_pp_rank_0_mp_rank_00_optim_states.pt").stat().st_ino
    assert sorted(p.name for p in here.iterdir()) == ["best_model"]
    # Resumed in its own folder, or with a best of its own here already: nothing to bring
    assert carry_best(other / "last", other, best_epoch=1) is None
    fake_checkpoint(tmp_path / "mine/best_model", 2, "best", payload="mine")
    assert carry_best(other / "last", tmp_path / "mine", best_epoch=1) is None
    assert payload_of(tmp_path / "mine/best_model/best/mp_rank_00_model_states.pt") == "mine"
    # That run's best_model has moved on: the epoch_N (or last) saved at the end of that epoch is the same
    fake_checkpoint(tmp_path / "later/best_model", 3, "best")
    fake_checkpoint(tmp_path / "later/epoch_2", 2, "epoch_2", payload="epoch 2")
    (tmp_path / "fourth").mkdir()
    assert carry_best(tmp_path / "later/epoch_2", tmp_path / "fourth", best_epoch=2) is None
    assert payload_of(tmp_path / "fourth/best_model/best/mp_rank_00_model_states.pt") == "epoch 2"
    assert readable(tmp_path / "fourth/best_model") and find_checkpoint("best", tmp_path / "fourth")
    # None whole is left: said, and nothing copied
    (other / "best_model/best/mp_rank_00_model_states.pt").unlink()
    warning = carry_best(other / "last", tmp_path / "third", best_epoch=1)
    assert warning.startswith("warning: the history resumed from") and "names epoch 1 best" in warning
    assert not (tmp_path / "third").exists()


def test_resume_auto_passes_over_a_checkpoint_with_a_file_cut_short(tmp_path):
    fake_checkpoint(tmp_path / "epoch_2", 2, "epoch_2")
    fake_checkpoint(tmp_path / "last", 2, "last")
    shard = tmp_path / "last/last/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:20])
    skipped = []
    assert find_checkpoint("auto", tmp_path, skipped) == tmp_path / "epoch_2"
    assert skipped == [(tmp_path / "last", "zero_pp_rank_0_mp_rank_00_optim_states.pt cut short or not a torch file")]
    shard.unlink()
    os.mkfifo(shard)  # its zip directory was read from a FIFO: the launcher waited for good
    skipped = []
    assert find_checkpoint("auto", tmp_path, skipped) == tmp_path / "epoch_2"
    assert skipped == [(tmp_path / "last", "zero_pp_rank_0_mp_rank_00_optim_states.pt cut short or not a torch file")]
    from deepspeed_image_trainer.utils.loading import load_checked

    with pytest.raises(UsageError, match=r"optim_states.pt is not a regular file \(a folder, FIFO or device\)"):
        load_checked(shard, mmap=True)


def test_resume_auto_names_an_emptied_checkpoint_folder_it_passes_over(tmp_path):
    """`rm -rf last/*` leaves a folder without extra_info.json: passed over with a warning as a checkpoint with
    files missing is; a folder of the user's own under --checkpoint_dir is not a checkpoint, and not named."""
    fake_checkpoint(tmp_path / "epoch_2", 2, "epoch_2")
    for name in ("last", "best_model", "epoch_3", "notes", "epoch_x"):
        (tmp_path / name).mkdir()
    skipped = []
    assert find_checkpoint("auto", tmp_path, skipped) == tmp_path / "epoch_2"
    assert [(folder.name, why.split(" (")[0]) for folder, why in skipped] == [
        (name, f"no {EXTRA_INFO}: damaged") for name in ("best_model", "epoch_3", "last")]


def test_resume_path_forms(tmp_path):
    fake_checkpoint(tmp_path / "epoch_4", 4, "epoch_4")
    fake_checkpoint(tmp_path / "best_model", 3, "best")
    assert find_checkpoint(str(tmp_path / "epoch_4"), tmp_path) == tmp_path / "epoch_4"
    assert find_checkpoint(str(tmp_path / "epoch_4/epoch_4"), tmp_path) == tmp_path / "epoch_4"
    assert find_checkpoint("epoch_4", tmp_path) == tmp_path / "epoch_4"
    assert find_checkpoint("best", tmp_path) == tmp_path / "best_model"
    with pytest.raises(UsageError, match="no checkpoint at epoch_9"):
        find_checkpoint("epoch_9", tmp_path)
    with pytest.raises(UsageError, match=r"looked for extra_info.json in nowhere\)"):  # the one place once
        find_checkpoint("nowhere", ".")


def test_another_world_size_resumes_but_not_an_old_mid_epoch_position(tmp_path):
    folder = fake_checkpoint(tmp_path / "last", 2, "last", world_size=2, zero_stage=3)
    assert check_resumable(folder, 2, 3, {})["epoch"] == 2 and check_resumable(folder, 1, 3, {})["epoch"] == 2
    with pytest.raises(UsageError, match=r"saved with ZeRO stage 3 \(this run: 2\)"):
        check_resumable(folder, 2, 2, {})
    info = json.loads((folder / EXTRA_INFO).read_text())
    # SGD's momentum and Nesterov: the saved state's groups carry the run's, which the new flags' left unused
    (folder / EXTRA_INFO).write_text(json.dumps({**info, "settings": {"optimizer": "SGD", "momentum": 0.8,
                                                                      "nesterov": True}}))
    for changed, message in (({"momentum": 0.5}, "--momentum 0.8 (this run: 0.5)"),
                             ({"nesterov": False}, "--nesterov True (this run: False)")):
        with pytest.raises(UsageError, match=re.escape(message)):
            check_resumable(folder, 2, 3, {"optimizer": "SGD", "momentum": 0.8, "nesterov": True, **changed})
    # ds_to_universal converts Adam's moments only (KeyError: 'exp_avg' in a rank for SGD's, Lion's)
    for optimizer, convertible in (("SGD", False), ("Lion", False), ("adamw", True), ("Lamb", True)):
        (folder / EXTRA_INFO).write_text(json.dumps({**info, "settings": {"optimizer": optimizer}}))
        assert check_resumable(folder, 2, 3, {"optimizer": optimizer})["epoch"] == 2
        if convertible:
            assert check_resumable(folder, 1, 3, {"optimizer": optimizer})["epoch"] == 2
        else:
            with pytest.raises(UsageError, match=f"converts the state of Adam's moments only, not {optimizer}'s; "
                                                 r"resume on 2 rank\(s\)"):
                check_resumable(folder, 1, 3, {"optimizer": optimizer})
    (folder / EXTRA_INFO).write_text(json.dumps({**info, "interrupted_at": {"epoch": 3, "step": 5, "samples": 40}}))
    assert check_resumable(folder, 4, 3, {})["epoch"] == 2
    (folder / EXTRA_INFO).write_text(json.dumps({**info, "interrupted_at": {"epoch": 3, "step": 5}}))
    assert check_resumable(folder, 2, 3, {})["epoch"] == 2
    with pytest.raises(UsageError, match=r"in the middle of an epoch.*did not record the position in samples"):
        check_resumable(folder, 1, 3, {})
    for stopped in ({"epoch": 7, "step": 5, "samples": 40}, {"epoch": "3"}):  # saved in epoch 3, after epoch 2
        (folder / EXTRA_INFO).write_text(json.dumps({**info, "interrupted_at": stopped}))
        with pytest.raises(UsageError, match="not a checkpoint description this trainer wrote"):
            check_resumable(folder, 2, 3, {})
    for tag in ("../x", "..", "a/b"):  # a tag "../x" was followed out of the checkpoint
        (folder / EXTRA_INFO).write_text(json.dumps({**info, "tag": tag}))
        with pytest.raises(UsageError, match="is not a folder name inside it"):
            check_resumable(folder, 2, 3, {})
    (folder / EXTRA_INFO).write_text(json.dumps({**info, "settings": {"learning_rate": "0.001"}}))  # edited
    with pytest.raises(UsageError, match=r'--learning_rate "0.001" \(this run: 0.001\)'):  # was: 0.001 (this run: 0.001)
        check_resumable(folder, 2, 3, {"learning_rate": 0.001})
    for batch in (0, -4, 2.5):  # 0 made the resume's accumulation 0: a ZeroDivisionError traceback
        (folder / EXTRA_INFO).write_text(json.dumps({**info, "settings": {"train_batch_size": batch}}))
        with pytest.raises(UsageError, match=r"\(settings of the wrong kind\)"):
            check_resumable(folder, 2, 3, {})


def settings_of(*argv, classes=("ant", "bee", "cat"), world_size=1, base=None):
    from deepspeed_image_trainer.cli.options import add_training_args, parse_args
    from deepspeed_image_trainer.engine.config import build_ds_config

    args = parse_args(lambda: add_training_args(argparse.ArgumentParser()), list(argv))
    config = build_ds_config(args, world_size, 1000, base=base, num_params=11_000_000)
    return resume_settings(run_record(args, config, classes))


SGD = {"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}


@pytest.mark.parametrize("argv, kwargs, message", [
    (["--batch_size", "32"], {}, r"the global batch \(.*\) 16 \(this run: 32\)"),
    (["--batch_size", "8", "--gradient_accumulation_steps", "2"], {}, None),  # the same global batch
    (["--image_size", "160"], {}, r"--image_size 224 \(this run: 160\)"),
    (["--learning_rate", "0.01"], {}, r"--learning_rate 0.001 \(this run: 0.01\)"),
    (["--lr_schedule", "linear", "--warmup_epochs", "0"], {}, r"--lr_schedule cosine \(this run: linear\); "
                                                             r"--warmup_epochs 1.0 \(this run: 0.0\)"),
    (["--epochs", "90"], {}, None),  # a run may be extended
    ([], {"classes": ("ant", "bee", "dog")}, r"the classes of --train_dir 3 classes \(ant, bee, cat\) "
                                            r"\(this run: 3 classes \(ant, bee, dog\)\)"),
    # the saved optimizer state did not load into another optimizer's (KeyError: 'step', or 'momentum')
    ([], {"base": SGD}, r"the DeepSpeed config's optimizer.type AdamW \(this run: SGD\)"),
    ([], {"base": {"optimizer": {"type": "Adagrad"}}}, r"optimizer.type AdamW \(this run: Adagrad\)"),
    ([], {"base": {"optimizer": {"type": "adamw"}}}, None),  # DeepSpeed's names in any case: the same optimizer
])
def test_resuming_with_other_settings_is_refused_naming_each(tmp_path, argv, kwargs, message):
    folder = fake_checkpoint(tmp_path / "last", 2, "last", world_size=1, zero_stage=2)
    info = json.loads((folder / EXTRA_INFO).read_text())
    (folder / EXTRA_INFO).write_text(json.dumps({**info, "settings": settings_of()}))
    if message is None:
        check_resumable(folder, 1, 2, settings_of(*argv, **kwargs))
    else:
        with pytest.raises(UsageError, match=message + r".*Resume with the run's own flags"):
            check_resumable(folder, 1, 2, settings_of(*argv, **kwargs))


def test_a_checkpoint_from_before_the_optimizer_was_recorded_resumes(tmp_path):
    folder = fake_checkpoint(tmp_path / "last", 2, "last", world_size=1, zero_stage=2)
    info = json.loads((folder / EXTRA_INFO).read_text())
    older = {key: value for key, value in settings_of().items() if key not in ("optimizer", "momentum", "nesterov")}
    (folder / EXTRA_INFO).write_text(json.dumps({**info, "settings": older}))
    assert check_resumable(folder, 1, 2, settings_of(base=SGD))["epoch"] == 2  # what it does not say is no difference


def test_a_damaged_extra_info_is_not_a_checkpoint(tmp_path):
    folder = fake_checkpoint(tmp_path / "last", 2, "last")
    fake_checkpoint(tmp_path / "epoch_1", 1, "epoch_1")
    # an epoch edited past what it trained (its metrics say 2) and one below 0
    edited = [json.dumps({"epoch": epoch, "tag": "last", "metrics": {"epoch": 2}}).encode() for epoch in (99, -1)]
    for garbage in (b"\x00\xff\xfe", b"[1, 2]", b'{"epoch": "2"}', *edited):
        (folder / EXTRA_INFO).write_bytes(garbage)
        assert readable(folder) is None
        assert find_checkpoint("auto", tmp_path) == tmp_path / "epoch_1"
        with pytest.raises(UsageError, match="last/extra_info.json is (unreadable|not a checkpoint description)"):
            find_checkpoint("last", tmp_path)


@pytest.mark.parametrize("background", [True, False])
def test_the_background_engine_saves_a_copy_and_stops_at_the_first_failed_write(tmp_path, background):
    import collections

    import torch

    from deepspeed_image_trainer.outputs.checkpoint_engine import BackgroundCheckpointEngine

    weights = torch.zeros(3)
    state = {"module": collections.OrderedDict(w=weights), "param_shapes": [{"w": torch.Size([3])}], "epoch": 1}
    engine = BackgroundCheckpointEngine(background=background)
    engine.save(state, tmp_path / "a.pt")
    weights += 1  # the training goes on at once: the file holds the state as it was at save()
    engine.wait()
    saved = torch.load(tmp_path / "a.pt", weights_only=False)
    assert saved["module"]["w"].tolist() == [0.0, 0.0, 0.0] and type(saved["module"]) is collections.OrderedDict
    assert type(saved["param_shapes"][0]["w"]) is torch.Size  # zero_to_fp32 calls .numel() on it
    torch.load(tmp_path / "a.pt", mmap=True, weights_only=False)  # as zero_to_fp32 reads a shard

    failures, later = [], []
    engine = BackgroundCheckpointEngine(on_failure=lambda: failures.append(True), background=background)
    with pytest.raises(RuntimeError, match="does not exist"):  # torch.save's, in the call or from wait()
        engine.save(state, tmp_path / "missing-folder" / "b.pt")
        engine.after(later.append, "published")
        engine.wait()
    assert failures == [True] and later == []  # nothing queued behind a failed file runs


def test_a_resume_keeps_the_figures_measured_after_the_last_epochs_save(tmp_path):
    """The checkpoint holds the history as it was before its own save: the last epoch's checkpoint_s and
    epoch_wall_s came back null from it, over the file's values."""
    from deepspeed_image_trainer.outputs.history import TrainingHistory

    written = {"epoch": 2, "val_loss": 0.5, "val_acc": 0.8, "checkpoint_s": 0.31, "epoch_wall_s": 7.05}
    path = tmp_path / "training_history.json"
    path.write_text(json.dumps({"config": {}, "epochs": [{**written, "epoch": 1, "val_loss": 0.7}, written]}))
    history = TrainingHistory(path, {})
    saved = {"epochs": [{**written, "epoch": 1, "val_loss": 0.7},
                        {**written, "checkpoint_s": None, "epoch_wall_s": None}], "best": {"epoch": 2, "val_acc": 0.8}}
    history.restore(saved)
    assert history.data["epochs"][1] == written
    assert saved["epochs"][1]["checkpoint_s"] is None  # the checkpoint's own copy left as it was


def test_a_resume_takes_the_weights_name_its_run_started_from(tmp_path):
    """Resumed without --pretrained, a run started from named weights used the default preprocessing (bilinear
    where its weights had bicubic) and recorded pretrained null; another name than the checkpoint's is refused; the same file spelled another way is the same start."""
    from types import SimpleNamespace

    from deepspeed_image_trainer.cli.preflight import take_saved_weights_name
    from deepspeed_image_trainer.models.build import preprocessing

    folder = fake_checkpoint(tmp_path / "last", 2, "last")
    info = json.loads((folder / EXTRA_INFO).read_text())
    (folder / EXTRA_INFO).write_text(json.dumps({**info, "model": "vit_b_16", "pretrained": "IMAGENET1K_SWAG_E2E_V1"}))
    args = SimpleNamespace(resume="auto", checkpoint_dir=tmp_path, pretrained=None)
    take_saved_weights_name(args)
    assert args.pretrained == "IMAGENET1K_SWAG_E2E_V1"
    assert preprocessing("vit_b_16", args.pretrained)["interpolation"] == "bicubic"
    take_saved_weights_name(args)  # the same name given: kept
    args.pretrained = "DEFAULT"
    with pytest.raises(UsageError, match=r"^--pretrained DEFAULT: .*last continues a run started from --pretrained "
                                         r"IMAGENET1K_SWAG_E2E_V1, whose trained weights it holds; leave --pretrained"):
        take_saved_weights_name(args)
    (tmp_path / "w").mkdir()
    (tmp_path / "w/p.pt").write_bytes(b"weights")
    (folder / EXTRA_INFO).write_text(json.dumps({**info, "pretrained": str(tmp_path / "w/p.pt")}))
    args.pretrained = str(tmp_path / "w/../w/./p.pt")  # the same file, spelled another way: the saved name kept
    take_saved_weights_name(args)
    assert args.pretrained == str(tmp_path / "w/p.pt")
    (tmp_path / "w/q.pt").write_bytes(b"weights")
    args.pretrained = str(tmp_path / "w/q.pt")  # another file with the same bytes is another start
    with pytest.raises(UsageError, match="q.pt: .*last continues a run started from --pretrained .*p.pt"):
        take_saved_weights_name(args)
    started_at_random = SimpleNamespace(resume="auto", checkpoint_dir=tmp_path / "nothing", pretrained=None)
    take_saved_weights_name(started_at_random)  # no checkpoint yet: a new run
    assert started_at_random.pretrained is None
