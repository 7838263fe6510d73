"""ZeroOffloadCallback at a resume: a plain Trainer loads a checkpoint's optimizer.pt and scheduler.pt only when both
are there, so a resume from a ZeroOffloadTrainer checkpoint (its state is in zero_offload/), a --save_only_model one or
one missing either file trained on with the engine's moments and the LR schedule restarted. The callback said so only
when the checkpoint was output_dir/checkpoint-N or args.resume_from_checkpoint: train(resume_from_checkpoint=PATH) of
a checkpoint in another folder (the usual case) went on without a word (4.8e-3 off the uninterrupted run after 3 more steps)."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from _t5 import OFFLOAD, ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadCallback, ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

COMMON = dict(per_device_train_batch_size=4, max_steps=4, use_cpu=True, report_to=[], logging_steps=1, seed=0,
              disable_tqdm=True, learning_rate=1e-2, weight_decay=0.0, max_grad_norm=0.0, save_strategy="steps",
              save_steps=2)
NOT_LOADED = "its optimizer state was not loaded into the OffloadAdam"


def _callback_trainer(out, seed=0, **kw):
    model = tiny_t5(seed)
    engine = OffloadAdam(model.named_parameters(), lr=1e-2, options=OffloadOptions())
    args = Seq2SeqTrainingArguments(output_dir=str(out), **{**COMMON, **kw})
    return model, Seq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset(), optimizers=(engine, None),
                                 callbacks=[ZeroOffloadCallback()])


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and NOT_LOADED in r.getMessage()
            or "that this run drops" in r.getMessage()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """checkpoint-2 of a ZeroOffloadTrainer run, and of callback runs (one --save_only_model)."""
    root = tmp_path_factory.mktemp("saved")
    ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=str(root / "mixin"), zero_offload=OFFLOAD, **COMMON), train_dataset=ToyDataset()).train()
    _callback_trainer(root / "cb")[1].train()
    _callback_trainer(root / "cb-model-only", save_only_model=True)[1].train()
    return root


@pytest.mark.parametrize("given", ["train", "args"])
@pytest.mark.parametrize("source, damage, said", [
    ("mixin", None, "holds hf_zero_offload optimizer state (zero_offload/"),
    ("cb-model-only", None, "no optimizer.pt and no scheduler.pt"),
    ("cb", "scheduler.pt", "no scheduler.pt"),
    ("cb", "optimizer.pt", "no optimizer.pt"),
])
def test_a_resume_that_leaves_the_engine_as_it_was_is_said(saved, tmp_path, caplog, source, damage, said, given):
    """given "train": the path reaches no callback (a checkpoint in another folder than output_dir), so the message
    names the step; "args": as the example scripts pass it (--resume_from_checkpoint), the checkpoint is named."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / source / "checkpoint-2", ckpt)
    if damage:
        os.remove(ckpt / damage)
    _, trainer = _callback_trainer(tmp_path / "out", seed=1,
                                   **({"resume_from_checkpoint": str(ckpt)} if given == "args" else {}))
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train(resume_from_checkpoint=str(ckpt))
    (msg,) = _said(caplog)
    assert "(step 2)" in msg and "Adam restarts from zero moments" in msg and "LR schedule restarts" in msg, msg
    if given == "args":
        assert str(ckpt) in msg and said in msg, msg
    else:
        assert "optimizer.pt and scheduler.pt together or neither" in msg, msg


def test_the_same_engine_trained_before_and_resumed_from_a_state_it_does_not_load_is_said(saved, tmp_path, caplog):
    """A second train() of the same Trainer: the engine goes on with the moments of its first run, not the
    checkpoint's."""
    _, trainer = _callback_trainer(tmp_path / "out", seed=1)
    trainer.train()
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train(resume_from_checkpoint=str(saved / "mixin" / "checkpoint-2"))
    (msg,) = _said(caplog)  # output_dir's own checkpoint-2 would load: it is not named as the one resumed
    assert "resumed a checkpoint (step 2)" in msg and "own moments (its step count is 4)" in msg, msg


def test_a_resume_the_engine_loads_says_nothing_and_is_exact(saved, tmp_path, caplog):
    full, _ = _callback_trainer(tmp_path / "full")
    _.train()
    model, trainer = _callback_trainer(tmp_path / "out", seed=1)
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train(resume_from_checkpoint=str(saved / "cb" / "checkpoint-2"))
    assert not _said(caplog)
    for a, b in zip(full.parameters(), model.parameters()):
        assert torch.equal(a, b)




@pytest.mark.parametrize("given", ["train", "args"])
def test_a_loaded_checkpoint_of_a_second_train_says_nothing(tmp_path, caplog, given):
    """A Trainer's second train() saves the engine's count of both runs (6 at checkpoint-2): resumed, its optimizer.pt
    loaded, the count is not the global_step, and that was said as a state left unloaded."""
    _, first = _callback_trainer(tmp_path / "out")
    first.train()
    first.train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    assert torch.load(ckpt / "optimizer.pt", weights_only=True)["global_steps"] == 6
    _, trainer = _callback_trainer(tmp_path / "out", seed=1,
                                   **({"resume_from_checkpoint": str(ckpt)} if given == "args" else {}))
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert not _said(caplog)
    assert trainer.optimizer.optimizer.global_steps == 8  # (AcceleratedOptimizer around the engine)
