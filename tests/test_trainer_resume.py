"""Nothing lost, nothing silent on resume: the completion marker, the choice of checkpoint, the one-line account
of what was restored, the warnings for what is not, and the output_dir's run lock."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from transformers import Seq2SeqTrainer

from _t5 import ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadCallback, ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload import resume
from hf_zero_offload.consolidate import consolidate
from hf_zero_offload.run_lock import LOCK_NAME, RunLock, RunLockError

OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
COMMON = dict(per_device_train_batch_size=4, max_steps=4, use_cpu=True, report_to=[], logging_steps=1, seed=0,
              disable_tqdm=True, learning_rate=1e-3, weight_decay=0.01, warmup_steps=3, save_strategy="steps",
              save_steps=2)


def _trainer(out, seed=0, eval_dataset=None, **kw):
    model = tiny_t5(seed)
    targs = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(out), **{**COMMON, "zero_offload": OFFLOAD, **kw})
    return model, ZeroOffloadSeq2SeqTrainer(model=model, args=targs, train_dataset=ToyDataset(),
                                            eval_dataset=eval_dataset)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """A 4-step run with checkpoints at 2 and 4, kept pristine: tests work on copies."""
    out = tmp_path_factory.mktemp("full")
    model, trainer = _trainer(out)
    trainer.train()
    return out, [p.detach().clone() for p in model.parameters()]


def _copy(full, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(full[0], dst)
    return dst


def _same(model, params):
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), params))


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


def _without_manifest(checkpoint) -> None:
    """The marker as written before it recorded the checkpoint's files: the checks of each file's own loader."""
    marker = json.loads((checkpoint / resume.MARKER).read_text())
    del marker["files"]
    (checkpoint / resume.MARKER).write_text(json.dumps(marker))


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


def test_resume_logs_one_line_of_what_it_restored(full, tmp_path, caplog):
    out = _copy(full, tmp_path)
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    model, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert _same(model, full[1])
    (line,) = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert "checkpoint-2 (step 2, complete)" in line
    assert "hf_zero_offload.state/2 saved by 1 rank(s), loaded on 1" in line and "dtype float32 -> float32" in line


def test_missing_scheduler_file_is_a_warning_with_the_learning_rates(full, tmp_path, caplog):
    out = _copy(full, tmp_path)
    (out / "checkpoint-2" / "scheduler.pt").unlink()
    _, trainer = _trainer(out, seed=1)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    (msg,) = [r.getMessage() for r in caplog.records if "scheduler.pt" in r.getMessage()]
    # warm-up over 3 steps: the schedule restarts at lr 0 instead of continuing from step 2's lr
    assert "restarts from its first step (lr=0)" in msg and "the saved run was at lr=0.000333333" in msg


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
def test_resume_with_more_steps_follows_this_runs_auto_schedule(tmp_path, kind):
    """A ds_config scheduler block with "auto" total_num_steps resumed with a larger max_steps: scheduler.pt held
    the saved run's total, loaded over this run's, so the steps past the old end ran at warmup_min_lr. Now equal to
    the uninterrupted longer run, element by element (the checkpoint is in the warm-up, whose LRs do not depend on
    the total)."""
    cfg = {**OFFLOAD, "scheduler": {"type": kind, "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                                              "warmup_type": "linear"}}}
    kw = dict(zero_offload=cfg, warmup_steps=2, save_steps=1, learning_rate=1e-2)
    _trainer(tmp_path / "short", max_steps=3, **kw)[1].train()
    model, resumed = _trainer(tmp_path / "resumed", seed=1, max_steps=6, **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "short" / "checkpoint-1"))
    ref_model, ref = _trainer(tmp_path / "long", max_steps=6, **kw)
    ref.train()
    assert resumed.lr_scheduler.total == 6
    lrs = [h["learning_rate"] for h in ref.state.log_history if "learning_rate" in h]
    assert [h["learning_rate"] for h in resumed.state.log_history if "learning_rate" in h] == lrs  # step 1 restored
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


_WARMUP_LR = {**OFFLOAD, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
_DECAY = {**OFFLOAD, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto",
                                                                     "total_num_steps": "auto"}}}


@pytest.mark.parametrize("saved, now", [(dict(zero_offload=_WARMUP_LR), dict(lr_scheduler_type="linear")),
                                        # a plateau scheduler counts evaluations (1 by step 2), not steps
                                        (dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps",
                                              eval_steps=2, eval_dataset=ToyDataset(4, seed=1)),
                                         dict(zero_offload=_DECAY))],
                         ids=["block->linear", "plateau->block"])
def test_a_checkpoint_of_another_kind_of_schedule_goes_on_from_its_step(tmp_path, saved, now, caplog):
    """The README tells users of the shipped configs to drop the "scheduler" block for a decaying schedule: a resume
    that did so was refused as a damaged scheduler.pt (and "resume from an earlier checkpoint" failed alike). As
    transformers goes from one --lr_scheduler_type to another, the new schedule now goes on from the saved step:
    its rates from the second resumed step on are those of an uninterrupted run of it."""
    kw = dict(warmup_steps=2, save_steps=1, learning_rate=1e-2)
    _trainer(tmp_path / "a", max_steps=3, **kw, **saved)[1].train()
    _, resumed = _trainer(tmp_path / "b", seed=1, max_steps=6, **kw, **now)
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert any("was saved by another kind of LR schedule: this run's" in r.getMessage() for r in caplog.records)
    _, straight = _trainer(tmp_path / "c", max_steps=6, **kw, **now)
    straight.train()
    def lrs(t):
        return {h["step"]: h["learning_rate"] for h in t.state.log_history if "learning_rate" in h}
    got, want = lrs(resumed), lrs(straight)
    assert [got[k] for k in (4, 5, 6)] == [want[k] for k in (4, 5, 6)]


def test_a_schedule_saved_for_fewer_param_groups_goes_on_from_its_step(tmp_path):
    """A scheduler.pt of one group (the Trainer's empty group was dropped until session 19) loaded into a run of two:
    torch took the saved list of rates and the first step failed in a strict zip."""
    one = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    saved = torch.optim.lr_scheduler.LambdaLR(one, lambda s: 1.0 - s / 10)
    for _ in range(3):
        saved.step()
    torch.save(saved.state_dict(), tmp_path / "scheduler.pt")
    two = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": []}], lr=1e-2)
    mine = torch.optim.lr_scheduler.LambdaLR(two, lambda s: 1.0 - s / 10)
    note = resume.load_scheduler(mine, str(tmp_path / "scheduler.pt"), 3)
    assert "saved for 1 param group(s), and this run has 2" in note and "goes on from step 3" in note
    assert mine.get_last_lr() == saved.get_last_lr() * 2  # what the Trainer logs at the first resumed step
    mine.step()
    saved.step()
    assert mine.get_last_lr() == saved.get_last_lr() * 2


def test_a_schedule_made_of_others_does_not_take_another_kinds_step(tmp_path):
    """A user's SequentialLR took the step as its own outer count and left its inner schedules at their start."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    saved = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
    for _ in range(6):
        saved.step()
    torch.save(saved.state_dict(), tmp_path / "scheduler.pt")
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
    mine = torch.optim.lr_scheduler.SequentialLR(opt, [warm, torch.optim.lr_scheduler.CosineAnnealingLR(opt, 6)], [4])
    with pytest.raises(resume.OtherSchedule, match=r"saved by another kind of LR schedule, and this run's SequentialLR "
                                                   r"cannot take its step .*resume with the schedule that saved it"):
        resume.load_scheduler(mine, str(tmp_path / "scheduler.pt"), 6)


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


def test_an_fp32_run_resumed_in_fp16_scales_its_loss(full, tmp_path, caplog):
    """The checkpoint's loss scaler (off: saved by an fp32 run) replaced the fp16 config's: the resumed fp16 run
    trained at scale 1 without overflow skips."""
    out = _copy(full, tmp_path)
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    _, trainer = _trainer(out, seed=1, fp16=True, zero_offload={**OFFLOAD, "fp16": {"initial_scale_power": 10}})
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert [h["loss_scale"] for h in trainer.state.log_history if "loss_scale" in h] == [1024.0, 1024.0]
    assert "the saved state ran without loss scaling; this run's config applies: dynamic loss scaling from 1024" \
        in caplog.text


DPU = {"zero_optimization": {**OFFLOAD["zero_optimization"],
                              "delayed_param_update": {"enabled": True, "warmup_steps": 1}}}


@pytest.mark.parametrize("saved, now, said", [
    (OFFLOAD, DPU, "delayed_param_update was off in the saved run and is on in this one: each step after "
                   "warmup_steps=1"),
    (DPU, OFFLOAD, "delayed_param_update was on in the saved run and is off in this one: a step in flight"),
    (DPU, DPU, None),
], ids=["off-on", "on-off", "on-on"])
def test_a_resume_that_switches_the_delayed_param_update_is_a_warning(full, tmp_path, caplog, saved, now, said):
    """It was said only in the INFO line of what was restored ("dpu False -> True"), though the steps after it run
    another schedule than the saved run's."""
    out = _copy(full, tmp_path) if saved is OFFLOAD else tmp_path / "run"
    if saved is not OFFLOAD:
        _trainer(out, zero_offload=saved)[1].train()
    _, trainer = _trainer(out, seed=1, zero_offload=now)
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    warned = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING and "delayed_param_update" in r.getMessage()]
    assert len(warned) == (0 if said is None else 1), warned
    if said is not None:
        assert said in warned[0] and "differs from the saved one's" in warned[0], warned


def test_our_state_resumed_without_zero_offload_is_a_warning(full, tmp_path, caplog):
    out = _copy(full, tmp_path)
    _, trainer = _trainer(out, seed=1, zero_offload=None, optim="adamw_torch")
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    (msg,) = [r.getMessage() for r in caplog.records if "that this run drops" in r.getMessage()]
    assert "no --zero_offload" in msg and "Adam restarts from zero moments" in msg and "LR schedule restarts" in msg
    # a plain Trainer with the callback: the callback says it
    caplog.clear()
    model = tiny_t5(1)
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions
    engine = OffloadAdam(model.parameters(), lr=1e-3, options=OffloadOptions())
    plain = Seq2SeqTrainer(model=model, args=ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(out), **COMMON,
                                                                                 max_grad_norm=0.0),
                           train_dataset=ToyDataset(), callbacks=[ZeroOffloadCallback()],
                           optimizers=(engine, torch.optim.lr_scheduler.LambdaLR(engine, lambda _: 1.0)))
    plain.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert any("a plain Trainer does not load it" in r.getMessage() for r in caplog.records)


def test_rotation_waits_for_the_marker(tmp_path):
    _, trainer = _trainer(tmp_path / "rot", save_total_limit=1)
    trainer.train()
    assert sorted(os.listdir(tmp_path / "rot")) == ["checkpoint-4"]
    assert resume.status(str(tmp_path / "rot" / "checkpoint-4")) == "complete"


# ---------------------------------------------------------------- the run lock

def _foreign_lock(directory, proc, host=None):
    import psutil
    os.makedirs(directory, exist_ok=True)
    owner = {"pid": proc.pid, "host": host or __import__("socket").gethostname(),
             "process_start": psutil.Process(proc.pid).create_time(), "started": "earlier"}
    (directory / LOCK_NAME).write_text(json.dumps(owner))


def test_a_second_live_run_is_an_error_before_any_work(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _foreign_lock(tmp_path / "busy", other)
        model = tiny_t5()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RunLockError, match=rf"another run \(pid {other.pid}.*is training in this output_dir"):
            ZeroOffloadSeq2SeqTrainer(model=model, args=ZeroOffloadSeq2SeqTrainingArguments(
                output_dir=str(tmp_path / "busy"), **{**COMMON, "zero_offload": OFFLOAD}), train_dataset=ToyDataset())
        assert _same(model, before) and os.listdir(tmp_path / "busy") == [LOCK_NAME]
    finally:
        other.kill()
        other.wait()


def test_the_lock_is_held_while_train_runs_only(tmp_path, monkeypatch):
    """It was taken in __init__ and released at the end of train() or at exit: a Trainer built for evaluate(), dropped,
    or whose __init__ failed kept any other process off its output_dir until the notebook's kernel exited; and with a
    relative output_dir and a chdir before train() the lock stayed in the first directory."""
    from transformers import TrainerCallback

    def build(out, **kw):
        return ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(), args=(
            ZeroOffloadSeq2SeqTrainingArguments(output_dir=out, **{**COMMON, "zero_offload": OFFLOAD, **kw})))

    seen = []

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(os.path.exists(os.path.join(os.path.abspath(args.output_dir), LOCK_NAME)))

    monkeypatch.chdir(tmp_path)
    trainer = build("run", max_steps=1)
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # built: nothing held
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the outputs go to elsewhere/run now, and so does the lock
    trainer.add_callback(Look())
    trainer.train()
    assert seen == [True] and not (tmp_path / "elsewhere" / "run" / LOCK_NAME).exists()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(ToyDataset())

    with pytest.raises(ValueError):  # refused in transformers' __init__, after ours took the lock
        ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=Stream(), args=(
            ZeroOffloadSeq2SeqTrainingArguments(output_dir="failed", **{**COMMON, "zero_offload": OFFLOAD,
                                                                      "max_steps": -1})))
    assert not (tmp_path / "elsewhere" / "failed" / LOCK_NAME).exists()


@pytest.mark.parametrize("meanwhile", ["deleted", "another run started"])
def test_a_lock_deleted_mid_run_is_checked_at_each_save(tmp_path, caplog, meanwhile):
    """An outside probe deleted the lock of a running job: a second run then started in the output_dir and each saved
    over the other's checkpoints. Each save checks the lock first: taken again when missing; another live run's is
    an error before this save writes anything."""
    from transformers import TrainerCallback
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    out = tmp_path / "run"

    class Meddle(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                os.unlink(out / LOCK_NAME)
                if meanwhile != "deleted":
                    _foreign_lock(out, other)

    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(), callbacks=[Meddle()], args=(
        ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(out), **{**COMMON, "zero_offload": OFFLOAD})))
    try:
        with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
            if meanwhile == "deleted":
                trainer.train()
                assert any("was deleted while this run trained; taken again" in r.getMessage() for r in caplog.records)
                assert resume.status(str(out / "checkpoint-4")) == "complete"
                assert not (out / LOCK_NAME).exists()  # released at the end, as the lock taken at the start
            else:
                with pytest.raises(RunLockError, match=rf"another run \(pid {other.pid}.*is training in this "
                                                       r"output_dir.*stops before its save would write over"):
                    trainer.train()
                assert not (out / "checkpoint-4").exists()
                assert json.loads((out / LOCK_NAME).read_text())["pid"] == other.pid  # the other run's, kept
    finally:
        other.kill()
        other.wait()


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


def test_an_unwritable_output_dir_is_named_as_such(tmp_path, monkeypatch):
    """A read-only output_dir gave "[Errno 30] Read-only file system: '.../hzo-run.lock'" (an outside probe)."""
    import errno

    real = os.open

    def read_only(path, *args, **kw):
        if str(path).endswith(LOCK_NAME):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path, *args, **kw)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OSError, match=r"output_dir .* is not writable \(the run lock hzo-run.lock cannot be created "
                                      r"there: Read-only file system\); .* give a writable --output_dir"):
        RunLock(str(tmp_path)).acquire()


def test_a_second_lock_of_the_same_process_leaves_the_first_ones_file(tmp_path):
    first, second = RunLock(str(tmp_path)), RunLock(str(tmp_path))
    first.acquire()
    second.acquire()  # re-entrant: another Trainer of the same script
    second.release()
    assert (tmp_path / LOCK_NAME).exists()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_stale_lock_is_taken_over_and_foreign_host_is_an_error(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    _foreign_lock(tmp_path / "stale", dead)
    dead.wait()
    lock = RunLock(str(tmp_path / "stale"))
    assert "took over the stale run lock" in lock.acquire()
    assert json.loads((tmp_path / "stale" / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert RunLock(str(tmp_path / "stale")).acquire() is None  # same process: re-entrant
    lock.release()
    assert not (tmp_path / "stale" / LOCK_NAME).exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _foreign_lock(tmp_path / "far", alive, host="another-host")
        with pytest.raises(RunLockError, match="on host another-host.*delete the lock file if that run is dead"):
            RunLock(str(tmp_path / "far")).acquire()
    finally:
        alive.kill()
        alive.wait()


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
