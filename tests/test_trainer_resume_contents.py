"""A checkpoint whose contents are not what its save wrote is refused before anything loads, naming the file:
another checkpoint's optimizer state, a damaged trainer_state.json or scheduler.pt, an edited step, another model's
shapes, a file changed or deleted since the save (and consolidate keeps integer tensors integer)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from _t5 import ToyDataset
from _resume import COMMON, OFFLOAD, _copy, _same, _trainer, _without_manifest, full  # noqa: F401 (full is a fixture)
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload import resume
from hf_zero_offload.consolidate import consolidate


@pytest.mark.parametrize("how", ["copied folder", "linked file", "copied folder, marker without manifest"])
def test_an_optimizer_state_of_another_checkpoint_is_refused(full, tmp_path, how):
    """checkpoint-4 with checkpoint-2's zero_offload/ (copied, or its rank file a link) resumed as "step 4,
    complete", restored the step-2 masters over the step-4 weights, and consolidate wrote them as step 4's."""
    out = _copy(full, tmp_path)
    four, two = out / "checkpoint-4" / "zero_offload", out / "checkpoint-2" / "zero_offload"
    if how.startswith("copied folder"):
        shutil.rmtree(four)
        shutil.copytree(two, four)
    else:
        (four / "rank0_of_1.hzo").unlink()
        (four / "rank0_of_1.hzo").symlink_to(two / "rank0_of_1.hzo")
    # the marker's file sizes see it first (the step-2 state is another size); the save ids are the check left for
    # a state of the same size, and for markers written before they recorded the files
    by_size = "without manifest" not in how
    if not by_size:
        _without_manifest(out / "checkpoint-4")
    _, trainer = _trainer(out / "x", seed=1)
    with pytest.raises(ValueError, match=r"checkpoint-4 is damaged \(zero_offload/rank0_of_1.hzo has \d+ bytes where "
                                         r"its save wrote \d+ \(truncated or replaced\).*newest complete checkpoint "
                                         r"is .*checkpoint-2" if by_size else
                       r"checkpoint-4/zero_offload holds the optimizer state of another save .*the state after 2 "
                       r"steps\) than the one recorded for it"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    engine = trainer.zero_engine  # (None: refused before the engine was built)
    assert engine is None or (engine.global_steps == 0 and engine._load_failed is None)  # nothing loaded
    with pytest.raises(ValueError, match=r"checkpoint-4 is damaged: zero_offload/rank0_of_1.hzo has" if by_size else
                       r"another save .*completion marker records"):
        consolidate(str(out / "checkpoint-4"), str(tmp_path / "fp32"))
    assert not (tmp_path / "fp32").exists()
    # the pristine checkpoints load (their ids match), whichever engine saved them
    model, trainer = _trainer(out / "y", seed=1)
    trainer.train(resume_from_checkpoint=str(full[0] / "checkpoint-2"))
    assert _same(model, full[1])


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "older-marker"])
@pytest.mark.parametrize("content", [b'{"global_step": 4, "log_hi', b"[4]"], ids=["cut-short", "a-list"])
def test_a_damaged_trainer_state_is_named_before_anything_loads(full, tmp_path, content, manifest):
    """transformers failed on it after the model and the optimizer state were loaded, with json's error alone."""
    out = _copy(full, tmp_path)
    (out / "checkpoint-4" / resume.TRAINER_STATE).write_bytes(content)
    if not manifest:
        _without_manifest(out / "checkpoint-4")
    _, trainer = _trainer(out / "x", seed=1)
    with pytest.raises(ValueError, match=r"checkpoint-4 is damaged \(trainer_state.json has \d+ bytes.*resume from it"
                       if manifest else r"checkpoint-4/trainer_state.json (cannot be read|is damaged).*earlier "
                                        r"checkpoint") as err:
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert isinstance(err.value, resume.IncompleteCheckpoint if manifest else resume.DamagedFile)
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "older-marker"])
@pytest.mark.parametrize("damage", ["truncated", "not-a-schedule"])
def test_a_damaged_scheduler_file_is_named_before_the_engine_state_is_loaded(full, tmp_path, damage, manifest):
    """It was loaded after the engine's state, failing with torch's error naming no file (or a raw KeyError)."""
    out = _copy(full, tmp_path)
    sched = out / "checkpoint-2" / "scheduler.pt"
    if damage == "truncated":
        with open(sched, "r+b") as f:
            f.truncate(40)
    else:
        torch.save({"last_epoch": "x"}, sched)
    if not manifest:
        _without_manifest(out / "checkpoint-2")
    _, trainer = _trainer(out, seed=1)
    with pytest.raises(ValueError, match=r"checkpoint-2 is damaged \(scheduler.pt (has \d+ bytes|is not the file)"
                       if manifest else r"checkpoint-2/scheduler.pt cannot be loaded \(.*\); resume from an "
                                        r"earlier checkpoint") as err:
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert isinstance(err.value, resume.IncompleteCheckpoint if manifest else resume.DamagedFile)
    engine = trainer.zero_engine
    assert engine is None or engine.global_steps == 0  # the engine's state was not loaded


@pytest.mark.parametrize("edited", ["trainer_state", "marker"])
def test_a_step_edited_out_of_agreement_with_its_save_is_refused(full, tmp_path, edited):
    """trainer_state.json's global_step and the marker's step come from one save: one edited (its manifest entry
    dropped) resumed the engine's state under the Trainer's other count and trained on, 0.011 off an uninterrupted
    run in an outside probe, without a word."""
    out = _copy(full, tmp_path)
    ckpt = out / "checkpoint-2"
    marker = json.loads((ckpt / resume.MARKER).read_text())
    del marker["files"][resume.TRAINER_STATE]
    if edited == "trainer_state":
        state = json.loads((ckpt / resume.TRAINER_STATE).read_text())
        (ckpt / resume.TRAINER_STATE).write_text(json.dumps({**state, "global_step": 1}))
    else:
        marker["step"] = 3
    (ckpt / resume.MARKER).write_text(json.dumps(marker))
    _, trainer = _trainer(out / "x", seed=1)
    with pytest.raises(resume.DamagedFile, match=r"checkpoint-2/trainer_state.json says global_step \d, while its save "
                                                 r"recorded step \d in hzo_complete.json: the files are not one save's"):
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 0


def test_a_checkpoint_of_another_models_shapes_is_refused_in_one_line(tmp_path, full):
    """Another config's model with the same names (d_model 64 vs 32) got transformers' RuntimeError with ~60 "size
    mismatch" lines: param_names.json compares names only (an outside probe)."""
    from transformers import T5Config, T5ForConditionalGeneration

    from _t5 import TINY
    from hf_zero_offload.engine.checkpoint.contents import LayoutMismatch

    model = T5ForConditionalGeneration(T5Config(**{**TINY, "d_model": 64}))
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=str(tmp_path / "out"), **{**COMMON, "zero_offload": OFFLOAD}), train_dataset=ToyDataset())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LayoutMismatch, match=r"checkpoint-2 was saved for another model: \d+ tensor\(s\) of another "
                                             r"shape \(decoder.block.0.layer.0.SelfAttention.k.weight \(saved \(32, 32\), this "
                                             r"model \(32, 64\)\); .*Resume with that run's model config"):
        trainer.train(resume_from_checkpoint=str(_copy(full, tmp_path) / "checkpoint-2"))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded


@pytest.mark.parametrize("damage, named", [
    ("rng deleted", r"rng_state.pth is missing"),
    ("trainer state of step 4", r"trainer_state.json (has \d+ bytes where its save wrote \d+|is not the file its save)"),
    ("scheduler of step 4", r"scheduler.pt is not the file its save wrote \(damaged, or copied from another save\)"),
    ("rng truncated", r"rng_state.pth has 100 bytes where its save wrote"),
    ("weights truncated", r"model.safetensors has 100 bytes where its save wrote \d+ \(truncated or replaced\)"),
    ("optimizer shard deleted", r"zero_offload/rank0_of_1.hzo is missing"),
    ("param names deleted", r"zero_offload/param_names.json is missing"),
])
def test_a_checkpoint_that_no_longer_holds_what_its_save_wrote_is_refused_naming_the_file(full, tmp_path, caplog,
                                                                                        damage, named):
    """The marker proved the save finished, not that the folder still held what it wrote. An outside probe: a
    deleted rng_state.pth resumed as "complete" (transformers logs its absence at INFO) and the run went elsewhere
    (loss 4.000 instead of 3.933 at the next step); trainer_state.json, scheduler.pt or rng_state.pth of step 6 in
    checkpoint-3 resumed silently (the schedule 3 steps ahead, 6 updates in a run "at step 9"); a truncated weight
    file failed in safetensors' header parser; a deleted shard named no earlier checkpoint; a deleted
    param_names.json showed only at consolidate. Each is now named from the marker's record of the files, before
    anything loads; resume_from_checkpoint=True skips the checkpoint and resumes the one before, bit for bit."""
    out = _copy(full, tmp_path)
    two, four = out / "checkpoint-2", out / "checkpoint-4"
    (target, source) = {"rng deleted": ("rng_state.pth", None), "trainer state of step 4": ("trainer_state.json", four),
                        "scheduler of step 4": ("scheduler.pt", four), "rng truncated": ("rng_state.pth", None),
                        "weights truncated": ("model.safetensors", None),
                        "optimizer shard deleted": ("zero_offload/rank0_of_1.hzo", None),
                        "param names deleted": ("zero_offload/param_names.json", None)}[damage]
    for c in (two, four):  # the same damage in both: the explicit path and the fallback are both refused
        if c is four and source is four:
            continue
        path = c / target
        if source is not None:
            shutil.copy(source / target, path)
        elif damage in ("weights truncated", "rng truncated"):
            with open(path, "r+b") as f:
                f.truncate(100)
        else:
            path.unlink()
    _, trainer = _trainer(out / "x", seed=1)
    with pytest.raises(resume.IncompleteCheckpoint, match=rf"checkpoint-2 is damaged \({named}.*it no longer holds "
                                                          r"what its save wrote\)"):
        trainer.train(resume_from_checkpoint=str(two))
    assert trainer.state.global_step == 0
    # consolidate reads the optimizer state, the weights and the model's files only: an RNG or trainer state of another
    # step is no reason to refuse it
    if target.startswith("zero_offload/") or target == "model.safetensors":
        with pytest.raises(ValueError, match=r"checkpoint-2 is damaged:"):
            consolidate(str(two), str(tmp_path / "fp32"))
    else:
        old = os.umask(0o022)
        try:
            consolidate(str(two), str(tmp_path / "fp32"))
        finally:
            os.umask(old)
        # safetensors 0.8 writes 0600 whatever the umask (an outside probe: a shared run folder's weights unreadable)
        assert (tmp_path / "fp32" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_a_file_no_resume_reads_may_come_from_another_save(full, tmp_path):
    """training_args.bin is written for reference; another run's copy there blocked an explicit resume, and made
    resume_from_checkpoint=True fall back two steps with only a warning."""
    out = _copy(full, tmp_path)
    shutil.copy(out / "checkpoint-2" / "training_args.bin", out / "checkpoint-4" / "training_args.bin")
    model, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert _same(model, full[1])


def test_consolidate_keeps_integer_tensors_integer(full, tmp_path):
    """Every tensor of the model file was written as float32: a BatchNorm's num_batches_tracked (int64) became 6.0
    (exact only up to 2**24; an outside probe on 2 ranks)."""
    from safetensors.torch import load_file, save_file

    out = _copy(full, tmp_path)
    path = out / "checkpoint-4" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["bn.num_batches_tracked"] = torch.tensor(2**24 + 1, dtype=torch.int64)
    save_file(tensors, str(path), metadata={"format": "pt"})
    _without_manifest(out / "checkpoint-4")  # the model file was changed on purpose
    consolidate(str(out / "checkpoint-4"), str(tmp_path / "fp32"))
    got = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert got["bn.num_batches_tracked"].dtype == torch.int64 and got["bn.num_batches_tracked"].item() == 2**24 + 1
    assert all(t.dtype == torch.float32 for k, t in got.items() if k != "bn.num_batches_tracked")


def test_a_deleted_optimizer_file_of_a_marked_checkpoint_is_named(tmp_path):
    """A run without zero_offload keeps torch's optimizer.pt: deleted from a marked checkpoint, the resume went on
    "complete" with a fresh optimizer, without a word (an outside probe); scheduler.pt may go (said at the resume)."""
    from hf_zero_offload.resume import manifest

    for name in ("optimizer.pt", "scheduler.pt", "trainer_state.json"):
        (tmp_path / name).write_bytes(b"x" * 10)
    recorded = manifest.build(str(tmp_path))
    (tmp_path / "optimizer.pt").unlink()
    (tmp_path / "scheduler.pt").unlink()
    assert manifest.problems(str(tmp_path), recorded) == ["optimizer.pt is missing"]
