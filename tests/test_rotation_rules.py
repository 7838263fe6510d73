"""save_total_limit under our rule in real Trainer runs (tiny T5, CPU): transformers' own end-of-training cleanup
(save_total_limit=1 with a best checkpoint), checkpoints a user's on_save edited, a plain Trainer's --save_only_model
checkpoints beside ours, a folder removed while rotation looks; and what a failed save says (the file, the cause kept,
pickling, another rank's failure)."""
from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
import time

import pytest
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

from _t5 import ToyDataset, tiny_t5
from hf_zero_offload import resume
from hf_zero_offload.resume import rotation
from hf_zero_offload.trainer import save_errors
from _resume import COMMON, _trainer


def _dirs(out):
    return sorted(p.name for p in out.iterdir() if p.is_dir())


def test_best_with_limit_1_end_cleanup_follows_our_rule(tmp_path, caplog):
    """transformers' end of train() ("Delete the last checkpoint when save_total_limit=1") removed every checkpoint-*
    but the best: a user's checkpoint-1-old and a folder cut short (checkpoint-50) too."""
    out = tmp_path / "out"
    (out / "checkpoint-1-old").mkdir(parents=True)
    (out / "checkpoint-1-old" / "users_backup.txt").write_text("keep me")
    (out / "checkpoint-50").mkdir()
    (out / "checkpoint-50" / "model.safetensors").write_text("x")
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    _, trainer = _trainer(out, max_steps=6, save_steps=2, save_total_limit=1, eval_strategy="steps", eval_steps=2,
                          load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True,
                          eval_dataset=ToyDataset(8, seed=1))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and os.path.isdir(best)
    assert _dirs(out) == sorted(["checkpoint-1-old", "checkpoint-50", os.path.basename(best)])
    assert any(r.getMessage().endswith("checkpoint-6, an older finished checkpoint") and "save_total_limit 1" in
               r.getMessage() for r in caplog.records) or os.path.basename(best) == "checkpoint-6"


class _Annotate(TrainerCallback):
    """A user's on_save that adds a note to the checkpoint's config.json."""

    def on_save(self, args, state, control, **kw):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["my_note"] = f"saved at step {state.global_step}"
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)


def test_checkpoints_an_on_save_callback_edited_are_rotated_without_a_warning_each(tmp_path, caplog):
    """config.json edited after the marker: every checkpoint read "damaged", none was counted or removed (the disk
    filled), with one warning per folder. Their saves finished: they rotate, oldest first."""
    out = tmp_path / "out"
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    _, trainer = _trainer(out, max_steps=8, save_steps=2, save_total_limit=2)
    trainer.add_callback(_Annotate())
    trainer.train()
    assert _dirs(out) == ["checkpoint-6", "checkpoint-8"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "save_total_limit" in r.getMessage()]


def test_a_plain_trainers_save_only_model_checkpoints_are_rotated_and_not_called_killed(tmp_path, caplog):
    out = tmp_path / "out"
    targs = Seq2SeqTrainingArguments(output_dir=str(out), **{**COMMON, "max_steps": 4, "save_only_model": True})
    Seq2SeqTrainer(model=tiny_t5(0), args=targs, train_dataset=ToyDataset()).train()
    assert _dirs(out) == ["checkpoint-2", "checkpoint-4"]
    for name in ("checkpoint-2", "checkpoint-4"):  # rotation orders by folder time, as transformers: theirs older
        past = time.time() - 10
        os.utime(out / name, (past, past))
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    _, trainer = _trainer(out, max_steps=6, save_steps=3, save_total_limit=2)
    trainer.train()
    assert _dirs(out) == ["checkpoint-3", "checkpoint-6"]
    assert not [r for r in caplog.records if "killed" in r.getMessage()]
    # the message a resume gives for such a folder beside ours does not call it killed either
    shutil.copytree(out / "checkpoint-3", tmp_path / "plain" / "checkpoint-1")
    shutil.copytree(out / "checkpoint-6", tmp_path / "plain" / "checkpoint-2")
    plain = tmp_path / "plain" / "checkpoint-2"
    (plain / resume.MARKER).unlink()
    shutil.rmtree(plain / "zero_offload")
    said = resume.not_whole(str(plain))
    assert "killed" not in said and "--save_only_model" in said, said
    assert rotation.left_out(str(plain)) is None


def test_a_folder_removed_while_rotation_looks_is_skipped_and_training_goes_on(tmp_path, monkeypatch):
    """The user's rm of checkpoint-2 while rotation went through the folders: the save was reported failed (naming
    checkpoint-2 as the file it was writing, and checkpoint-6 both not complete and the newest complete one)."""
    real = rotation.left_out

    def left_out(c):
        if c.endswith("checkpoint-2") and os.path.isdir(os.path.join(os.path.dirname(c), "checkpoint-6")):
            shutil.rmtree(c)
        return real(c)
    monkeypatch.setattr(rotation, "left_out", left_out)
    out = tmp_path / "out"
    _trainer(out, max_steps=8, save_steps=2, save_total_limit=2)[1].train()
    assert _dirs(out) == ["checkpoint-6", "checkpoint-8"]


def test_an_error_of_rotation_is_a_warning(tmp_path, monkeypatch, caplog):
    def plan(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "out"))
    monkeypatch.setattr(rotation, "plan", plan)
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    out = tmp_path / "out"
    _trainer(out, max_steps=4, save_steps=2, save_total_limit=1)[1].train()
    assert _dirs(out) == ["checkpoint-2", "checkpoint-4"]
    assert resume.status(str(out / "checkpoint-4")) == "complete"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "could not go" in
              r.getMessage()]
    assert len(warned) == 2 and "none removed this time" in warned[0], warned


def test_a_removal_that_fails_is_said_and_leaves_a_folder_that_reads_as_cut_short(tmp_path, monkeypatch, caplog):
    """rmtree(ignore_errors=True) of an old checkpoint: a file it could not delete (read-only storage, an NFS
    silly-rename) left a folder with its marker and files missing, in silence; the marker could be the file left.
    Now the completion records go first (durably), the rest is removed where it can be, and a warning names the file
    and the folder; the next rotation leaves the remains alone (cut short), and a resume skips them."""
    real_unlink = os.unlink

    def unlink(path, *a, **k):
        if os.path.basename(str(path)) == "model.safetensors" and (k.get("dir_fd") is not None  # (rmtree's)
                                                                  or "checkpoint-2" in str(path)):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_unlink(path, *a, **k)

    out = tmp_path / "out"
    trainer = _trainer(out, max_steps=2, save_steps=2, save_total_limit=1)[1]
    trainer.train()
    monkeypatch.setattr(os, "unlink", unlink)
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    trainer = _trainer(out, max_steps=4, save_steps=2, save_total_limit=1)[1]
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert _dirs(out) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(os.listdir(out / "checkpoint-2")) == ["model.safetensors"]
    assert resume.status(str(out / "checkpoint-2")) == "incomplete"
    warned = [r.getMessage() for r in caplog.records if "could not remove all of" in r.getMessage()]
    assert len(warned) == 1 and re.search(r"could not remove all of \S*checkpoint-2 \(\S*model\.safetensors: "
                                          r"Operation not permitted\); what is left reads as cut short", warned[0]), warned
    left = str(out / "checkpoint-2")
    assert rotation.plan(str(out), 1) == ([], [(left, rotation.left_out(left))])


def test_the_file_named_is_one_of_the_checkpoint_saved_and_not_a_temporary(tmp_path):
    target = str(tmp_path / "checkpoint-6")
    other = FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "checkpoint-2"))
    assert save_errors.file_written(other, target) is None
    tmp = OSError(errno.ENOSPC, "No space left on device", f"{target}/zero_offload/rank1_of_2.hzo.hzo-tmp.vm.21138")
    assert save_errors.file_written(tmp, target) == f"{target}/zero_offload/rank1_of_2.hzo"


def test_a_failure_describing_the_failure_keeps_the_cause(tmp_path, monkeypatch):
    """newest_whole raising (a folder not readable): the PermissionError was raised in place of the full disk."""
    import transformers.modeling_utils as mu

    real = mu.safe_save_file
    full = OSError(errno.ENOSPC, "No space left on device")

    def save_file(tensors, filename, metadata=None):
        if "checkpoint-4" in filename:
            raise full
        return real(tensors, filename, metadata=metadata)

    def newest(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "out" / "checkpoint-2"))
    monkeypatch.setattr(mu, "safe_save_file", save_file)
    monkeypatch.setattr(resume, "newest_whole", newest)
    _, trainer = _trainer(tmp_path / "out", max_steps=4, save_steps=2)
    with pytest.raises(save_errors.CheckpointSaveError) as e:
        trainer.train()
    assert e.value.__cause__ is full and e.value.errno == errno.ENOSPC
    assert re.search(r"no space left on device .*the newest complete checkpoint could not be looked for "
                     r"\(PermissionError: .*Permission denied", str(e.value)), str(e.value)


@pytest.mark.parametrize("cause", [OSError(errno.ENOSPC, "No space left on device"),
                                   FileNotFoundError(errno.ENOENT, "gone"), RuntimeError("unexpected pos")])
def test_save_errors_survive_pickling(tmp_path, cause):
    e = save_errors.wrap(cause, str(tmp_path / "checkpoint-2"), str(tmp_path))
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is type(e) and str(again) == str(e) and again.errno == e.errno
    assert isinstance(again, save_errors.CheckpointSaveError) and isinstance(again, OSError)
    if isinstance(cause, OSError):
        assert isinstance(again, type(cause))


def test_another_ranks_failure_is_said_once():
    target = "/r/checkpoint-4"
    said = save_errors.failed_on(target, f"rank 1 (host vm): saving {target} failed: no space left on device "
                                         f"writing {target}/rng_state_1.pth (OSError: ...); it is not complete and a "
                                         "resume skips it; the newest complete checkpoint is /r/checkpoint-2")
    assert said.count(f"saving {target} failed") == 1 and said.count("it is not complete") == 1, said
    assert said.startswith(f"saving {target} failed on rank 1 (host vm): no space left on device writing"), said
    assert save_errors.failed_on(target, "rank 1 (host vm): boom") == (
        f"saving {target} failed on rank 1 (host vm): boom; it is not complete and a resume skips it")


def test_path_limits_checked_once_per_train_and_agreed_at_init(tmp_path, monkeypatch):
    from hf_zero_offload.resume import path_limits
    from hf_zero_offload.trainer import mixin

    calls, agreed = [], []
    real, real_first = path_limits.problem, mixin.first_problem
    monkeypatch.setattr(path_limits, "problem", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(mixin, "first_problem", lambda p, w: agreed.append(p) or real_first(p, w))
    _, trainer = _trainer(tmp_path / "out", max_steps=2)
    assert len(calls) == 1 and len(agreed) == 1  # __init__: through the ranks' agreement
    assert trainer._zo_left_said == set()
    trainer.train()
    assert len(calls) == 2  # train(): once (output_dir_problem), not again in the run lock


def test_the_end_listing_of_another_folder_is_transformers_own(tmp_path):
    """Only the folder our Trainer saves into is listed by our rule: a plain Trainer run from a callback keeps
    transformers' listing of its own output_dir."""
    from types import SimpleNamespace

    from hf_zero_offload.trainer import end_rotation

    other = tmp_path / "other"
    for name in ("checkpoint-1-old", "checkpoint-2"):
        (other / name).mkdir(parents=True)
    ours = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path / "ours")),
                           _zo_end_listing=lambda *a: pytest.fail("our listing for another folder"))
    with end_rotation.running(ours):
        import transformers.trainer as tt
        listed = tt.sort_checkpoints(output_dir=str(other), best_model_checkpoint=None)
    assert sorted(os.path.basename(p) for p in listed) == ["checkpoint-1-old", "checkpoint-2"]


def test_the_end_listing_of_a_run_under_ours_or_of_another_best_is_transformers_own(tmp_path):
    """A plain Trainer run from a callback into a folder *under* ours (a review: its checkpoints, its best included,
    went by our rule and limit) and a call naming another best checkpoint get transformers' own listing; our run
    and a hyperparameter search's run folder under our output_dir, by any spelling, get ours."""
    from types import SimpleNamespace

    from hf_zero_offload.trainer import end_rotation
    import transformers.trainer as tt

    ours_dir = tmp_path / "ours"
    for run in ("", "probe", "run-0"):
        for name in ("checkpoint-1-old", "checkpoint-2", "checkpoint-4"):
            (ours_dir / run / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / "link").symlink_to(ours_dir)

    def listing(best_ours, run, best):
        trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(ours_dir)),
                                  state=SimpleNamespace(best_model_checkpoint=best_ours),
                                  _zo_end_listing=lambda *a: ["ours"])
        with end_rotation.running(trainer):
            return tt.sort_checkpoints(output_dir=str(run), best_model_checkpoint=best)

    own = str(ours_dir / "checkpoint-2")
    assert listing(own, ours_dir, own) == ["ours"]
    assert listing(own, tmp_path / "link", str(tmp_path / "link" / "checkpoint-2")) == ["ours"]  # another spelling
    assert listing(str(ours_dir / "run-0" / "checkpoint-2"), ours_dir / "run-0",
                   str(ours_dir / "run-0" / "checkpoint-2")) == ["ours"]
    plain = listing(own, ours_dir / "probe", str(ours_dir / "probe" / "checkpoint-4"))  # a nested plain run's
    assert sorted(os.path.basename(p) for p in plain) == ["checkpoint-1-old", "checkpoint-2", "checkpoint-4"]
    assert listing(own, ours_dir, str(ours_dir / "checkpoint-4")) != ["ours"]  # not our best: not our cleanup


def test_the_best_is_kept_by_what_its_path_names_not_its_spelling(tmp_path):
    """Recorded through a symlink (or relative), the best checkpoint was removed by the end cleanup (transformers
    compares with os.path.samefile)."""
    real = tmp_path / "real"
    for step in (2, 4, 6):
        c = real / f"checkpoint-{step}"
        c.mkdir(parents=True)
        resume.write_marker(str(c), {"step": step, "world_size": 1, "engine": None})
        os.utime(c, (step * 10, step * 10))
    (tmp_path / "link").symlink_to(real)
    remove, _ = rotation.plan(str(real), 1, (str(tmp_path / "link" / "checkpoint-2"),), keep_newest=False)
    assert sorted(os.path.basename(c) for c in remove) == ["checkpoint-4", "checkpoint-6"]


def test_a_save_over_a_plain_run_s_checkpoint_cut_short_is_not_taken_for_it(tmp_path):
    """Our --save_only_model save of checkpoint-4 over a plain Trainer's, cut right after trainer_state.json: the
    plain run's optimizer.pt stayed until the end of the save, so the folder looked like that run's checkpoint and a
    resume took its Adam moments over onto our weights (a review). Another run's optimizer state goes first."""
    from transformers import TrainerState

    out = tmp_path / "out"
    Seq2SeqTrainer(model=tiny_t5(0), args=Seq2SeqTrainingArguments(output_dir=str(out), **COMMON),
                   train_dataset=ToyDataset()).train()
    assert (out / "checkpoint-4" / "optimizer.pt").is_file()
    _, trainer = _trainer(out, max_steps=4, save_steps=2, save_only_model=True)
    real = TrainerState.save_to_json

    def cut(state, path):
        real(state, path)
        if "checkpoint-4" in str(path):
            raise KeyboardInterrupt("killed during the save")

    TrainerState.save_to_json = cut
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    finally:
        TrainerState.save_to_json = real
    c4 = str(out / "checkpoint-4")
    assert not os.path.exists(os.path.join(c4, "optimizer.pt"))
    assert resume.status(c4) == "incomplete" and resume.newest_whole(str(out)) == str(out / "checkpoint-2")
