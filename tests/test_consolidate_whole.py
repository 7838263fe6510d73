"""consolidate (and a resume) judge a checkpoint as a resume does before reading it (an outside probe): a save cut
short into a checkpoint-N written before (the new run's weights beside the old run's optimizer state, no marker), a
damaged or deleted marker, a file the operation needs that its save wrote and that is gone. Each was consolidated
without a word (the other run's masters as the weights, 3.2e-3 off the folder's own), or its output was said to be
resumable and was not; a resume by True stopped at a missing trainer_state.json instead of passing over it."""
from __future__ import annotations

import json
import re

import pytest

from hf_zero_offload import resume
from hf_zero_offload.consolidate import consolidate
from hf_zero_offload.resume.marker import MARKER
from test_crash_safety import _trainer


@pytest.fixture
def cut_short(tmp_path, monkeypatch):
    """checkpoint-2 written by a first run, then again by a second (another max_grad_norm) stopped after its model."""
    out = tmp_path / "out"
    _trainer(out).train()
    again = _trainer(out, max_grad_norm=0.05)

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(again, "_save_optimizer_and_scheduler", stop)
    with pytest.raises(KeyboardInterrupt):
        again.train()
    return out / "checkpoint-2"


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_a_save_cut_short_over_an_earlier_one_is_not_consolidated(cut_short, tmp_path, with_optimizer):
    assert resume.status(str(cut_short)) == "incomplete"
    with pytest.raises(ValueError, match=rf"checkpoint-2 is incomplete \(no {MARKER}: .*consolidate an earlier"):
        consolidate(str(cut_short), str(tmp_path / "cons"), with_optimizer=with_optimizer)
    assert not (tmp_path / "cons").exists()


@pytest.fixture
def whole(tmp_path):
    out = tmp_path / "out"
    _trainer(out, max_steps=4).train()
    return out


@pytest.mark.parametrize("damage, match", [
    ("delete", rf"incomplete \(no {MARKER}"),
    ("truncate", rf"damaged \(its {MARKER} cannot be read"),
    ("not complete", rf"damaged \(its {MARKER} is damaged \(\"complete\" is False"),
])
def test_a_damaged_or_deleted_marker_is_not_consolidated(whole, tmp_path, damage, match):
    ckpt = whole / "checkpoint-4"
    marker = ckpt / MARKER
    if damage == "delete":
        marker.unlink()
    elif damage == "truncate":
        marker.write_bytes(marker.read_bytes()[:40])
    else:
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "complete": False}))
    with pytest.raises(ValueError, match=match):
        consolidate(str(ckpt), str(tmp_path / "cons"), with_optimizer=True)


@pytest.mark.parametrize("name, with_optimizer", [("config.json", False), ("trainer_state.json", True),
                                                  ("scheduler.pt", True)])
def test_a_file_consolidate_needs_missing_is_named(whole, tmp_path, name, with_optimizer):
    """A missing config.json gave an output from_pretrained could not load; a missing trainer_state.json a
    --with-optimizer output said to be resumable that the plain Trainer could not resume."""
    ckpt = whole / "checkpoint-4"
    (ckpt / name).unlink()
    with pytest.raises(ValueError, match=rf"checkpoint-4 is damaged: {name} is missing"):
        consolidate(str(ckpt), str(tmp_path / "cons"), with_optimizer=with_optimizer)
    assert not (tmp_path / "cons").exists()


def test_trainer_state_missing_without_with_optimizer_still_consolidates(whole, tmp_path):
    """consolidate without --with-optimizer does not read it: the weights are whole."""
    ckpt = whole / "checkpoint-4"
    (ckpt / "trainer_state.json").unlink()
    consolidate(str(ckpt), str(tmp_path / "cons"))
    assert (tmp_path / "cons" / "model.safetensors").is_file()


def test_resume_true_passes_over_a_checkpoint_without_its_trainer_state(whole):
    """Every other file missing was passed over with a warning; this one stopped the run with DamagedFile."""
    (whole / "checkpoint-4" / "trainer_state.json").unlink()
    assert resume.status(str(whole / "checkpoint-4")) == "incomplete"
    chosen, state, notes = resume.target(True, str(whole))
    assert chosen.endswith("checkpoint-2") and state == "complete"
    assert any("skipping" in m and "trainer_state.json is missing" in m for _, m in notes)


def test_a_run_folder_with_the_output_inside_it_is_named_as_a_run_folder(tmp_path):
    """`consolidate . fp32` from the run folder said "output fp32 is inside the checkpoint ." (an outside probe): the
    folder's kind is told first."""
    from hf_zero_offload.consolidate import consolidate

    (tmp_path / "checkpoint-5" / "zero_offload").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"is a run folder, not a checkpoint: pass one of the checkpoint "
                                                r"folders inside it \(checkpoint-5\)"):
        consolidate(str(tmp_path), str(tmp_path / "fp32"))


@pytest.mark.parametrize("edit, said", [
    (lambda m: m["engine"].update(save_id=5), r'"engine.save_id" is 5, not a string'),
    (lambda m: m.update(step="4"), r"\"step\" is '4', not an int >= 0"),
    (lambda m: m["files"].update({"config.json": [757]}), r'the "files" entry of config.json is \[757\], not \{"size"'),
    (lambda m: m["files"]["config.json"].update(size="757"), r"the \"files\" entry of config.json is \{'size': '757'"),
], ids=["save-id-int", "step-str", "entry-list", "size-str"])
def test_a_marker_field_of_another_type_is_damage_not_nothing_recorded(whole, tmp_path, edit, said):
    """A field of the wrong type (a hand edit: docs/CHECKPOINTS.md has users delete entries of "files") was read as nothing
    recorded and the check it feeds passed over in silence: a save id of 5 let consolidate take any save's optimizer
    state, a "files" entry that is no object left its file unchecked, and a size of "757" was refused as "757 bytes
    where its save wrote 757"."""
    ckpt = whole / "checkpoint-4"
    marker = ckpt / MARKER
    content = json.loads(marker.read_text())
    edit(content)
    marker.write_text(json.dumps(content))
    assert re.search(said, resume.marker_problem(str(ckpt)))  # what a resume's summary names
    with pytest.raises(ValueError, match=rf"checkpoint-4 is damaged \(its {MARKER} is damaged \({said}"):
        consolidate(str(ckpt), str(tmp_path / "cons"))
    assert not (tmp_path / "cons").exists()
    if "entry" in said:  # a resume cannot check that file: it says so, not a count of bytes
        with pytest.raises(resume.IncompleteCheckpoint, match=r"its entry in the marker is damaged \(config.json: .*\): "
                                                              r"its marker no longer holds what its save wrote"):
            resume.check(str(ckpt))


def test_a_damaged_marker_still_has_its_files_checked(whole):
    """A marker whose "step" is "2" (damage: it proves nothing) on the oldest checkpoint resumes as legacy, with the
    damage named; the files its marker records were no longer checked then: a deleted rng_state.pth (another dropout
    and data order after the resume) resumed without a word, where the same folder was refused before."""
    ckpt = whole / "checkpoint-2"
    marker = ckpt / MARKER
    content = json.loads(marker.read_text())
    content["step"] = "2"
    marker.write_text(json.dumps(content))
    assert resume.status(str(ckpt)) == "legacy"  # (damage alone: resumed as is, as before)
    next(ckpt.glob("rng_state*")).unlink()
    assert resume.status(str(ckpt)) == "incomplete"
    with pytest.raises(resume.IncompleteCheckpoint, match=r"checkpoint-2 is damaged \(rng_state\S* is missing"):
        resume.check(str(ckpt))


def test_a_weight_file_a_resume_cannot_read_is_named(whole):
    """A resume reads every model*.safetensors header before the weights load (other_shapes): a stray or damaged one
    (a file added beside a marked checkpoint is no manifest problem) failed with safetensors' "Error while
    deserializing header", naming no file, where consolidate names it (weight_files.open_weights)."""
    from hf_zero_offload.weight_files import WeightFileError
    from test_crash_safety import _trainer

    ckpt = whole / "checkpoint-4"
    (ckpt / "model-notes.safetensors").write_bytes(b"not a weight file")
    with pytest.raises(WeightFileError, match=r"model-notes\.safetensors cannot be read as safetensors model weights"
                                              r".*resume from an earlier checkpoint"):
        _trainer(whole, max_steps=6).train(resume_from_checkpoint=str(ckpt))


def _marked(tmp_path):
    """A checkpoint folder its marker declares whole (no optimizer state: a --save_only_model save's outline)."""
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / resume.TRAINER_STATE).write_text("{}")
    (ckpt / "config.json").write_text("{}")
    resume.write_marker(str(ckpt), {"step": 2, "world_size": 1, "engine": None})
    return ckpt


@pytest.mark.parametrize("judge", ["status", "not_whole", "consolidate"])
def test_a_checkpoints_marker_is_read_once_per_judgement(tmp_path, monkeypatch, judge):
    """A review: resume.status read the marker three times (read_marker, changed_files, marker_problem), so a marker
    replaced between the reads (that checkpoint saved again, a hand edit) was whole to the first and damaged to the
    next: here the file is cut short just after its first read, and status said "legacy" (3 reads). Read once, the
    answers are one marker's (so are not_whole's and consolidate's checks)."""
    import builtins
    import io

    from hf_zero_offload import consolidate as consolidate_module
    from hf_zero_offload.resume import marker as marker_module

    ckpt = _marked(tmp_path)
    reads = []

    def open_then_damage(path, *a, **k):
        if not str(path).endswith(MARKER):
            return builtins.open(path, *a, **k)
        reads.append(path)
        with builtins.open(path, *a, **k) as f:
            text = f.read()
        with builtins.open(path, "w", encoding="utf-8") as f:
            f.write(text[:10])  # (the next read of it: damaged)
        return io.StringIO(text)

    monkeypatch.setattr(marker_module, "open", open_then_damage, raising=False)
    if judge == "status":
        assert resume.status(str(ckpt)) == "complete"
    elif judge == "not_whole":
        assert resume.not_whole(str(ckpt)).startswith("incomplete")
    else:
        consolidate_module._check_whole(str(ckpt), False)  # (whole: raises nothing)
    assert len(reads) == 1


def test_consolidates_advice_is_one_sentence_in_one_place():
    """A review: "consolidate an earlier checkpoint" was written out in consolidate.py and peft_names.py (and in
    three of consolidate's messages beside its own constant): defined once (peft_names.EARLIER), used by both."""
    from pathlib import Path

    import hf_zero_offload
    from hf_zero_offload import peft_names

    package = Path(hf_zero_offload.__file__).parent
    holding = sorted(p.name for p in package.rglob("*.py") if "consolidate an earlier checkpoint" in p.read_text()
                     or "consolidate an \"\n" in p.read_text())
    assert holding == ["peft_names.py"], holding
    assert peft_names.EARLIER == "consolidate an earlier checkpoint"
