"""A resume into a run that differs from the saved one: the one-line account of what was restored, the LR
schedule carried over (another kind, more steps, other param groups), and the warnings for settings the resumed
run changes (fp16, the delayed parameter update, no --zero_offload)."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import Seq2SeqTrainer

from _t5 import ToyDataset, tiny_t5
from _resume import COMMON, OFFLOAD, _copy, _same, _trainer, full  # noqa: F401 (full is a fixture)
from hf_zero_offload import ZeroOffloadCallback, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload import resume


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
