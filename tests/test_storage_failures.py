"""Storage failures in real Trainer runs (tiny T5, CPU): a renamed checkpoint folder, a full disk while the Trainer
writes the weights, an output_dir too long for the file system's limits, folders left incomplete by a crash."""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from hf_zero_offload import resume
from _resume import _copy, _same, _trainer, full  # noqa: F401 (full: the 4-step run, a fixture)


def _cut_short(ckpt, *, trainer_state=False):
    """What a crash during the save leaves: no marker (and by default no trainer_state.json, written last)."""
    (ckpt / resume.MARKER).unlink()
    if not trainer_state:
        (ckpt / resume.TRAINER_STATE).unlink()


# ---------------------------------------------------------------- 1. a renamed checkpoint folder

@pytest.mark.parametrize("name", ["checkpoint-2-old", "ckpt2"])
@pytest.mark.parametrize("kept, source", [(True, r"trainer_state\.json"),
                                          (False, r"optimizer state zero_offload/rank0_of_1\.hzo")],
                         ids=["with-trainer-state", "cut-before-trainer-state"])
def test_a_renamed_incomplete_checkpoint_is_refused_naming_the_step_it_holds(full, tmp_path, name, kept, source):
    """checkpoint-2 renamed by the user and cut short: the refusal named neither the step the folder holds nor that
    it was a checkpoint-2, and offered checkpoint-4 as "the newest complete checkpoint" for a step-2 folder."""
    out = _copy(full, tmp_path)
    _cut_short(out / "checkpoint-2", trainer_state=kept)
    (out / "checkpoint-2").rename(out / name)
    _, trainer = _trainer(out, seed=1)
    with pytest.raises(resume.IncompleteCheckpoint) as e:
        trainer.train(resume_from_checkpoint=str(out / name))
    said = str(e.value)
    assert "\n" not in said
    assert re.search(rf"{name} is incomplete \(no hzo_complete\.json.*; \S*{name} holds step 2 \(by its {source}; a "
                     r"renamed checkpoint-2\); no complete checkpoint of an earlier step is beside it \(the newest "
                     r"complete one, \S*checkpoint-4, is later\): resume from it", said), said


# ---------------------------------------------------------------- 4. incomplete folders left by a crash

def test_resume_true_skips_incomplete_folders_in_one_line_and_rotation_keeps_complete_ones(full, tmp_path, caplog):
    """Crashes left checkpoint-5 and checkpoint-7 without their markers. resume_from_checkpoint=True takes
    checkpoint-4 and names both in one line; with save_total_limit=2 the save of checkpoint-6 removed checkpoint-2
    *and* checkpoint-4 (transformers counted the two incomplete folders, newer by their times, as checkpoints),
    leaving one complete checkpoint; now it removes checkpoint-2 only and names the two it leaves."""
    out = _copy(full, tmp_path)
    for step in (5, 7):
        shutil.copytree(out / "checkpoint-4", out / f"checkpoint-{step}")
        _cut_short(out / f"checkpoint-{step}")
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    _, trainer = _trainer(out, seed=1, max_steps=6, save_total_limit=2)
    trainer.train(resume_from_checkpoint=True)
    skipped = [r for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].levelno == logging.WARNING, skipped
    line = skipped[0].getMessage()
    assert re.search(r"skipping \S*checkpoint-5: incomplete .*; skipping \S*checkpoint-7: incomplete .*; resuming "
                     r"from \S*checkpoint-4$", line), line
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "checkpoint-4", "checkpoint-5", "checkpoint-6", "checkpoint-7"]
    assert [resume.status(str(out / f"checkpoint-{s}")) for s in (4, 5, 6, 7)] == [
        "complete", "incomplete", "complete", "incomplete"]
    left = [r.getMessage() for r in caplog.records if "not counted and not removed" in r.getMessage()]
    assert len(left) == 2 and all("save_total_limit 2" in m for m in left), left
    assert any("removing" in r.getMessage() and r.getMessage().endswith("checkpoint-2, an older finished checkpoint")
               for r in caplog.records)


def test_rotation_leaves_a_users_renamed_copy_alone(full, tmp_path):
    """transformers' rotation globbed checkpoint-*: a user's checkpoint-2-old (a backup) was the first removed."""
    out = _copy(full, tmp_path)
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-2-old")
    _, trainer = _trainer(out, seed=1, max_steps=6, save_total_limit=2)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-2-old", "checkpoint-4",
                                                                    "checkpoint-6"]




# ---------------------------------------------------------------- 2. a full disk while the Trainer writes the weights

def _disk_fills_at(monkeypatch, *, step_dir: str, failing: int, raise_as):
    """safetensors' writer (as transformers calls it) fills the disk part way through the ``failing``-th file it
    writes into ``step_dir``: half the file is on disk, then ENOSPC."""
    import transformers.modeling_utils as mu

    real, seen = mu.safe_save_file, []

    def save_file(tensors, filename, metadata=None):
        if os.path.basename(os.path.dirname(filename)) == step_dir:
            seen.append(filename)
            if len(seen) == failing:
                real(tensors, filename, metadata=metadata)
                with open(filename, "r+b") as f:
                    f.truncate(os.path.getsize(filename) // 2)
                raise raise_as
        return real(tensors, filename, metadata=metadata)
    monkeypatch.setattr(mu, "safe_save_file", save_file)


def _sharded(monkeypatch):
    """transformers' save_pretrained with 60 KB shards: model-00001-of-0000N.safetensors and an index."""
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained
    monkeypatch.setattr(PreTrainedModel, "save_pretrained",
                        lambda self, *a, **k: real(self, *a, **{**k, "max_shard_size": "60KB"}))


@pytest.mark.parametrize("cause", ["OSError", "SafetensorError"])
@pytest.mark.parametrize("shards", [False, True], ids=["model.safetensors", "sharded"])
def test_a_full_disk_while_the_weights_are_written_names_the_file_and_space_and_keeps_the_last_checkpoint(
        full, tmp_path, monkeypatch, caplog, cause, shards):
    from safetensors import SafetensorError

    raised = (OSError(errno.ENOSPC, "No space left on device") if cause == "OSError" else
              SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    out = tmp_path / "out"
    if shards:
        _sharded(monkeypatch)
    _disk_fills_at(monkeypatch, step_dir="checkpoint-4", failing=2 if shards else 1, raise_as=raised)
    _, trainer = _trainer(out)
    with pytest.raises(OSError) as e:
        trainer.train()
    said = str(e.value)
    file = "model-00002-of-0000\\d.safetensors" if shards else "model.safetensors"
    assert "\n" not in said and e.value.__cause__ is raised and isinstance(e.value, type(raised))
    if cause == "OSError":
        assert e.value.errno == errno.ENOSPC
    assert re.fullmatch(rf"saving \S*checkpoint-4 failed: no space left on device writing \S*checkpoint-4/{file} "
                        rf"\({cause}: .*No space left on device.*\); [\d.]+ (B|KiB|MiB|GiB|TiB) free on that file "
                        r"system; it is not complete and a resume skips it; the newest complete checkpoint is "
                        r"\S*checkpoint-2, intact \(its files match its marker\): a resume takes it", said), said
    # what the message says: checkpoint-2 is whole, and a resume from it ends where the uninterrupted run did
    assert resume.status(str(out / "checkpoint-2")) == "complete"
    assert resume.status(str(out / "checkpoint-4")) == "incomplete"
    monkeypatch.undo()
    model, again = _trainer(out, seed=1)
    again.train(resume_from_checkpoint=True)
    assert _same(model, full[1])
    assert any("skipping" in r.getMessage() and "checkpoint-4: incomplete" in r.getMessage() for r in caplog.records)


def test_a_failed_scheduler_write_is_named_though_its_temporary_is_gone(tmp_path, monkeypatch):
    """scheduler.pt goes through a temporary that the failure removes: the newest file changed was the optimizer
    state's, which the message must not name."""
    import torch

    real = torch.save

    def save(obj, f, *a, **k):
        if ".hzo-tmp." in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8384 vs 8278")
        return real(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", save)
    _, trainer = _trainer(tmp_path / "out", max_steps=2)
    with pytest.raises(RuntimeError) as e:
        trainer.train()
    assert isinstance(e.value, OSError)
    assert re.match(r"saving \S*checkpoint-2 failed writing \S*checkpoint-2/scheduler\.pt \(RuntimeError: .*unexpected "
                    r"pos.*; no complete checkpoint exists yet$", str(e.value)), str(e.value)


# ---------------------------------------------------------------- 3. an output_dir too long for the file system

def _deep(base, total: int):
    """A directory under ``base`` whose absolute path is ``total`` bytes long (components of up to 200)."""
    path = os.path.abspath(base)
    while len(path) < total:
        path = os.path.join(path, "d" * min(200, total - len(path) - 1))
    os.makedirs(path)
    assert len(path) == total
    return path


def test_an_output_dir_too_long_for_the_checkpoint_paths_is_refused_before_training(tmp_path):
    """Within PATH_MAX for output_dir/hzo-run.lock, over it for checkpoint-2/zero_offload/rank0_of_1.hzo's temporary:
    the run trained 2 steps and failed at their save ("File name too long")."""
    path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
    out = _deep(tmp_path, path_max - 30)
    with pytest.raises(ValueError) as e:
        _trainer(out, max_steps=2)[1].train()
    said = str(e.value)
    assert "\n" not in said
    assert re.fullmatch(rf"--output_dir {re.escape(out)}: the path of checkpoint-2/\S+ under it would be \d+ bytes "
                        rf"\(absolute, with its NUL\), over the file system's PC_PATH_MAX of {path_max} bytes; the "
                        r"first checkpoint save would fail after training: use a shorter --output_dir \(at most \d+ "
                        r"bytes as an absolute path\)", said), said
    assert not any(p.name.startswith("checkpoint-") for p in Path(out).iterdir())


def test_a_name_over_name_max_is_refused(tmp_path, monkeypatch):
    from hf_zero_offload.resume import path_limits

    real = os.pathconf
    monkeypatch.setattr(os, "pathconf", lambda p, n: 30 if n == "PC_NAME_MAX" else real(p, n))
    said = path_limits.problem(str(tmp_path / "out"), 500, 2)
    assert re.fullmatch(r"--output_dir \S+/out: the name rank1_of_2\.hzo\.hzo-tmp\.\S+ \(\d+ bytes\) is over the file "
                        r"system's PC_NAME_MAX of 30 bytes \(os.pathconf of \S+\); the first checkpoint save would "
                        r"fail after training: use a shorter --output_dir", said), said
    assert path_limits.problem(str(tmp_path / "out"), 500, 2) is not None
    monkeypatch.undo()
    assert path_limits.problem(str(tmp_path / ("x" * 200)), 500, 2) is None
