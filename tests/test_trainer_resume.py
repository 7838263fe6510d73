"""Nothing lost, nothing silent on resume: the completion marker and the choice of checkpoint it drives (a
checkpoint cut short is skipped or refused naming the intact one). Split by concept: a checkpoint whose contents
are not what its save wrote is in tests/test_trainer_resume_contents.py, the schedule and settings carried over in
tests/test_trainer_resume_changes.py, the output_dir's run lock in tests/test_trainer_resume_lock.py."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket

import pytest
import torch

from _resume import _copy, _same, _trainer, full  # noqa: F401 (full is a fixture)
from hf_zero_offload import resume
from hf_zero_offload.run_lock import LOCK_NAME


def test_checkpoints_carry_the_marker_written_last(full):
    out, _ = full
    for step in (2, 4):
        ckpt = out / f"checkpoint-{step}"
        marker = json.loads((ckpt / resume.MARKER).read_text())
        assert marker["complete"] and marker["step"] == step and marker["world_size"] == 1
        assert marker["engine"]["format"] == "hf_zero_offload.state/2" and marker["engine"]["dtype"] == "float32"
        newest = max(os.path.getmtime(p) for p in ckpt.rglob("*") if p.name != resume.MARKER)
        assert os.path.getmtime(ckpt / resume.MARKER) >= newest
    assert not (out / LOCK_NAME).exists()  # released when train() returned


def _cut_short(ckpt):
    """What a kill during transformers' save leaves: the model and some state, no trainer_state.json, no marker."""
    (ckpt / resume.MARKER).unlink()
    (ckpt / resume.TRAINER_STATE).unlink()


def test_resume_true_skips_a_half_written_checkpoint(full, tmp_path, caplog):
    out = _copy(full, tmp_path)
    _cut_short(out / "checkpoint-4")
    model, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=True)
    assert _same(model, full[1])  # steps 3 and 4 redone from checkpoint-2: the same result
    assert any("skipping" in r.getMessage() and "checkpoint-4" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("word", ["true", "last"])
def test_resume_true_as_the_command_line_writes_it(full, tmp_path, caplog, word):
    """--resume_from_checkpoint true reaches train() as the string 'true': it was refused as 'not a directory'."""
    out = _copy(full, tmp_path)
    _cut_short(out / "checkpoint-4")
    model, trainer = _trainer(out, seed=1)
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    trainer.train(resume_from_checkpoint=word)
    assert _same(model, full[1])
    # information, not a warning (it was a WARNING, once per rank), naming the checkpoint taken
    said = [r for r in caplog.records if f"--resume_from_checkpoint {word}: the newest complete" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] and said[0].getMessage().endswith("checkpoint-2")


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("max_steps, warned", [(4, True), (2, True), (6, False)])
def test_a_resume_with_nothing_left_to_train_says_what_happens(full, tmp_path, caplog, max_steps, warned, named):
    """After --overwrite_output_dir, --resume_from_checkpoint true took an earlier run's checkpoint-25 for a 6-step
    run without a word. The warning then said "nothing is left to train" while transformers trained one step past
    max_steps and saved it (step 5, checkpoint-5): it now says so, and names an earlier run only where "true" chose
    the checkpoint."""
    out = _copy(full, tmp_path)
    _, trainer = _trainer(out, seed=1, max_steps=max_steps)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-4") if named else True)
    said = [r for r in caplog.records if "nothing left to train" in r.getMessage()]
    assert [r.levelno for r in said] == ([logging.WARNING] if warned else []), said
    if warned:
        message = said[0].getMessage()
        assert "checkpoint-4 is at step 4" in message
        assert trainer.state.global_step == 5 and (out / "checkpoint-5").is_dir()  # what the warning says may happen
        assert "one step past it (step 5) and save it" in message
        assert ("A checkpoint of an earlier run" in message) != named


def test_an_incomplete_checkpoint_is_refused_naming_the_intact_one(full, tmp_path):
    out = _copy(full, tmp_path)
    _cut_short(out / "checkpoint-4")
    _, trainer = _trainer(out, seed=1)
    with pytest.raises(resume.IncompleteCheckpoint, match=r"checkpoint-4 is incomplete.*newest complete checkpoint "
                                                          r"is .*checkpoint-2"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    # with trainer_state.json but no marker while an older sibling has one: cut short after the state
    out2 = _copy(full, tmp_path / "b")
    (out2 / "checkpoint-4" / resume.MARKER).unlink()
    assert resume.status(str(out2 / "checkpoint-4")) == "incomplete"


@pytest.mark.parametrize("what, match", [
    ("run folder", r"full\S* is a run folder, not a checkpoint: it holds checkpoint-2, checkpoint-4 \(the newest "
                   r"complete one is \S*checkpoint-4\); pass one of them, or resume_from_checkpoint=True"),
    ("saved model", r"saved\S* holds a model \(config.json\) but no trainer_state.json.*from_pretrained"),
    ("empty folder", r"empty\S* is not a Trainer checkpoint \(no trainer_state.json, model weights or optimizer"),
    ("missing", r"nope\S* does not exist"),
    ("file", r"trainer_state.json is a file, not a checkpoint directory"),
    ("final save", r"final\S* holds a model and trainer_state.json but no optimizer, scheduler or RNG state: a run's "
                   r"final save \(save_model\), not a Trainer checkpoint"),
], ids=["run-folder", "saved-model", "empty-folder", "missing", "file", "final-save"])
def test_a_path_that_is_no_checkpoint_says_what_it_is(full, tmp_path, what, match):
    """transformers' test_can_resume_training_errors: a wrong resume_from_checkpoint is a clear error. The run folder
    or an empty one were reported as 'incomplete ... its writer stopped during the save': the wrong diagnosis."""
    out = full[0]
    (tmp_path / "empty").mkdir()
    (tmp_path / "saved").mkdir()
    for name in ("config.json", "model.safetensors", "training_args.bin"):  # what save_model writes (its weights
        shutil.copy(out / "checkpoint-2" / name, tmp_path / "saved")        # made it a checkpoint cut short: a review)
    shutil.copytree(tmp_path / "saved", tmp_path / "final")  # a finished run's output_dir: save_model and the
    shutil.copy(out / "checkpoint-2" / resume.TRAINER_STATE, tmp_path / "final")  # state (resumed with fresh Adam)
    target = {"run folder": out, "saved model": tmp_path / "saved", "final save": tmp_path / "final",
              "empty folder": tmp_path / "empty",
              "missing": tmp_path / "nope", "file": out / "checkpoint-2" / resume.TRAINER_STATE}[what]
    _, trainer = _trainer(tmp_path / "x")
    with pytest.raises(resume.NotACheckpoint, match=match) as e:
        trainer.train(resume_from_checkpoint=str(target))
    assert str(e.value).startswith(f"Can't find a valid checkpoint at {target}. ")  # transformers' words first
    assert trainer.state.global_step == 0


def test_temp_files_of_killed_writers_are_removed_at_the_next_start(full, tmp_path, caplog):
    out = _copy(full, tmp_path)
    host = socket.gethostname()
    (out / "checkpoint-4" / "zero_offload" / f"rank0_of_1.hzo.hzo-tmp.{host}.999999").write_bytes(b"torn")
    (out / "checkpoint-4" / "zero_offload" / f"param_names.json.tmp.{host}.999998").write_text("{")
    _, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=True)
    assert not [p for p in out.rglob("*") if "tmp." in p.name]
    assert sum("left by a writer that was stopped" in r.getMessage() for r in caplog.records) == 2


def _as_before_save_ids(checkpoint) -> None:
    """The state file as versions before markers and save ids wrote it: its header without the save id."""
    from hf_zero_offload.engine import checkpoint as ck

    path = str(checkpoint / "zero_offload" / "rank0_of_1.hzo")
    meta, entries, _ = ck.read_header(path)
    tensors = {key: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"])) for key, e in entries.items()}
    ck.read_into(path, tensors)
    ck.write_state(path, {k: v for k, v in meta.items() if k != "save_id"}, tensors)


def test_checkpoints_from_before_the_marker_resume_with_a_warning(full, tmp_path, caplog):
    out = _copy(full, tmp_path)
    for step in (2, 4):
        (out / f"checkpoint-{step}" / resume.MARKER).unlink()
        _as_before_save_ids(out / f"checkpoint-{step}")
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    model, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert _same(model, full[1])
    text = caplog.text
    assert "has no completion marker" in text and "resumed as is" in text
    assert "written before completion markers" in text


def test_a_first_checkpoint_without_its_marker_is_cut_short_not_legacy(full, tmp_path):
    """A run's first checkpoint has no older one whose marker tells the era: 2 ranks killed mid-save (rank 1's RNG
    file not yet written, trainer_state.json already) resumed it as "written before completion markers", 0.109 off.
    A state file with a save id was written since markers exist: without its marker the save was cut short."""
    out = _copy(full, tmp_path)
    for step in (2, 4):
        (out / f"checkpoint-{step}" / resume.MARKER).unlink()
    assert resume.status(str(out / "checkpoint-2")) == "incomplete"
    _, trainer = _trainer(out, seed=1)
    with pytest.raises(resume.IncompleteCheckpoint, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)
    _as_before_save_ids(out / "checkpoint-2")
    assert resume.status(str(out / "checkpoint-2")) == "legacy"
    assert resume.status(str(out / "checkpoint-4")) == "incomplete"


def test_resume_true_refuses_a_highest_step_older_than_a_lower_one(full, tmp_path):
    """After --overwrite_output_dir (which removes nothing) a requeued job's --resume_from_checkpoint true took the
    earlier run's checkpoint-40 over the new run's newer checkpoint-10, and trained on from it without a word (an
    outside probe: the new run's steps lost). The markers' own clocks tell (a copy keeps them; file times it does
    not), and an explicit path stays the user's choice."""
    out = _copy(full, tmp_path)
    marker = out / "checkpoint-2" / resume.MARKER
    m4 = json.loads((out / "checkpoint-4" / resume.MARKER).read_text())
    os.utime(out / "checkpoint-2" / resume.MARKER)  # a newer file time alone (a copy's) is no sign
    _, trainer = _trainer(out, seed=1)
    assert resume.target(True, str(out))[0] == str(out / "checkpoint-4")
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "written_ns": m4["written_ns"] + 1}))
    with pytest.raises(ValueError, match=r"checkpoint-4 has the highest step, but .*checkpoint-2 was written after "
                                         r"it: output_dir holds checkpoints of more than one run.*"
                                         r"--resume_from_checkpoint .*checkpoint-2"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 0
    model, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert _same(model, full[1])
    # the newer run killed in its save of checkpoint-2 (no marker, its state files' save id): the same refusal
    out = _copy(full, tmp_path / "cut")
    (out / "checkpoint-2" / resume.MARKER).unlink()
    for f in (out / "checkpoint-2").rglob("*"):  # (file times: the newer run's files are the later ones)
        os.utime(f, (2e9, 2e9))
    with pytest.raises(ValueError, match=r"checkpoint-2 was written after it \(and cut short\).*"
                                         r"--resume_from_checkpoint PATH"):
        resume.target(True, str(out))
    # a checkpoint left part deleted by an older rotation (older files) is no sign
    for f in (out / "checkpoint-2").rglob("*"):
        os.utime(f, (1e8, 1e8))
    assert resume.target(True, str(out))[0] == str(out / "checkpoint-4")


@pytest.mark.parametrize("marker, said", [
    ({"files": {}}, r'its hzo_complete.json is damaged \("files" is \{\}, not the files its save wrote\)'),
    ({"engine": "x"}, r'its hzo_complete.json is damaged \("engine" is a str, not an object\)'),
    ({"step": "4"}, r'its hzo_complete.json is damaged \("step" is \'4\', not an int >= 0\)'),
    ([1], r"its hzo_complete.json is damaged \(a JSON list, not an object\)"),
    ("{bad", r"its hzo_complete.json cannot be read \(JSONDecodeError")],
    ids=["files-empty", "engine-str", "step-str", "list", "not-json"])
def test_a_damaged_marker_is_named_as_damaged_not_missing(full, tmp_path, caplog, marker, said):
    """An "engine" that is no object crashed the resume's summary (AttributeError); a marker that is no object
    was reported as missing. The resume goes on as before (the state files say what was saved) and says so."""
    out = _copy(full, tmp_path)
    path, damage = out / "checkpoint-2" / resume.MARKER, marker
    if isinstance(marker, dict):
        marker = {**json.loads(path.read_text()), **marker}
    path.write_text(marker if isinstance(marker, str) else json.dumps(marker))
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    model, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert _same(model, full[1])
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_zero_offload: resumed")]
    assert re.search(said, line) and "hf_zero_offload.state/2 saved by 1 rank(s)" in line
    assert "no completion marker" not in caplog.text and "written before completion markers" not in caplog.text
    # newer than a marked checkpoint, such a marker is no proof: said so (one that reads as an object but has a
    # field of another type too: taken as complete, with the file checks it feeds skipped)
    shutil.copy(full[0] / "checkpoint-2" / resume.MARKER, path)
    newer = out / "checkpoint-4" / resume.MARKER
    if isinstance(damage, dict):
        marker = {**json.loads(newer.read_text()), **damage}
    newer.write_text(marker if isinstance(marker, str) else json.dumps(marker))
    assert resume.status(str(out / "checkpoint-4")) == "incomplete"
    with pytest.raises(resume.IncompleteCheckpoint, match=said + r".*, nothing else proves it whole: its writer may"):
        resume.check(str(out / "checkpoint-4"))


def test_rotation_waits_for_the_marker(tmp_path):
    _, trainer = _trainer(tmp_path / "rot", save_total_limit=1)
    trainer.train()
    assert sorted(os.listdir(tmp_path / "rot")) == ["checkpoint-4"]
    assert resume.status(str(tmp_path / "rot" / "checkpoint-4")) == "complete"


def test_true_skips_a_damaged_checkpoint_for_the_one_before_it(full, tmp_path, caplog):
    out = _copy(full, tmp_path)
    (out / "checkpoint-4" / "rng_state.pth").unlink()
    model, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=True)
    assert _same(model, full[1])  # from checkpoint-2, bit for bit
    said = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(said) == 1 and "checkpoint-4: damaged (rng_state.pth is missing" in said[0], said


@pytest.mark.parametrize("name", ["checkpoint-4", "checkpoint-2-old"])
def test_a_renamed_checkpoint_is_described_by_the_step_its_marker_records(full, tmp_path, caplog, name):
    """checkpoint-2 renamed checkpoint-4 was said to be at step 4, and to leave nothing to train in a 4-step run
    (transformers, reading trainer_state.json, trained steps 3 and 4 as it should); a name without a step resumes
    from the step it holds too."""
    out = _copy(full, tmp_path)
    shutil.rmtree(out / "checkpoint-4")
    (out / "checkpoint-2").rename(out / name)
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    model, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=str(out / name))
    assert _same(model, full[1])
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "nothing left to train" in m]
    assert any(f"{name} (step 2, complete)" in m for m in messages), messages
