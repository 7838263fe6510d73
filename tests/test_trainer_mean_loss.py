"""A model computing its own mean loss while its forward takes **kwargs (T5): transformers then scales its loss by
the accumulation steps (and ranks), under the plain Trainer as under ours; our Trainers say so once, with the fix,
and change nothing (trainer/mean_loss.py)."""
from __future__ import annotations

import logging

import pytest
import torch

from _t5 import OFFLOAD, ToyDataset, logged, tiny_t5
from hf_zero_offload import ZeroOffloadTrainer, ZeroOffloadTrainingArguments
from hf_zero_offload.trainer.mean_loss import loss_scale_note, mean_loss_only

COMMON = dict(per_device_train_batch_size=4, max_steps=2, use_cpu=True, report_to=[], logging_steps=1,
              save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-3, weight_decay=0.0)


def _train(tmp_path, name, caplog, accumulation, mean=False, zero_offload=OFFLOAD):
    model = tiny_t5()
    if mean:
        model.accepts_loss_kwargs = False
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path / name), zero_offload=zero_offload,
                                        gradient_accumulation_steps=accumulation, **COMMON)
    trainer = ZeroOffloadTrainer(model=model, args=args, train_dataset=ToyDataset(16))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train()
    notes = [r.getMessage() for r in caplog.records if "computes its own mean loss" in r.getMessage()]
    return trainer, notes


@pytest.mark.parametrize("zero_offload", [OFFLOAD, None], ids=["offload", "no-engine"])
def test_said_once_with_the_factor_that_the_run_shows(tmp_path, caplog, zero_offload):
    scaled, notes = _train(tmp_path, "scaled", caplog, 2, zero_offload=zero_offload)
    assert len(notes) == 1, notes
    assert "T5ForConditionalGeneration" in notes[0] and "gradient_accumulation_steps=2" in notes[0]
    assert "2x the averaged ones" in notes[0] and "model.accepts_loss_kwargs = False" in notes[0]
    averaged, none = _train(tmp_path, "mean", caplog, 2, mean=True, zero_offload=zero_offload)
    assert none == []
    # what the note claims: the first step's grad_norm (same weights, same batches) twice the averaged run's
    first, ref = logged(scaled, "grad_norm")[0], logged(averaged, "grad_norm")[0]
    assert first == pytest.approx(2 * ref, rel=1e-4)
    scaled.train()  # a second train() of the same Trainer: said once per Trainer
    assert not [r for r in caplog.records if "computes its own mean loss" in r.getMessage()]


def test_nothing_said_when_nothing_is_scaled(tmp_path, caplog):
    _, notes = _train(tmp_path, "one", caplog, 1)
    assert notes == []


class _SumsItself(torch.nn.Module):
    def forward(self, x, labels=None, **kwargs):
        return self.loss_function(x, labels, **kwargs)


class _SumsInAHelper(torch.nn.Module):
    def forward(self, x, labels=None, **kwargs):
        return self._loss(x, labels, **kwargs)

    def _loss(self, x, labels, **kwargs):
        return self.loss_function(x, labels, **kwargs)


def test_the_rule():
    t5 = tiny_t5()
    assert mean_loss_only(t5) and not mean_loss_only(_SumsItself()) and not mean_loss_only(torch.nn.Linear(2, 2))
    assert not mean_loss_only(_SumsInAHelper())  # (a review's false positive)
    note = loss_scale_note(t5, True, False, None, 1, 4, True)
    assert "4 ranks with average_tokens_across_devices" in note and "4x" in note
    assert "8x" in loss_scale_note(t5, True, False, None, 2, 4, True)
    assert loss_scale_note(t5, True, False, None, 1, 4, False) is None  # ranks averaged by DDP, not multiplied
    assert loss_scale_note(t5, True, False, False, 3, 1, True) is None  # the Trainer told the loss is not GA-scaled
    assert loss_scale_note(t5, False, False, None, 3, 2, True) is None  # accepts_loss_kwargs = False
    assert loss_scale_note(t5, True, True, None, 3, 2, True) is None  # a compute_loss_func of the user's
    assert loss_scale_note(_SumsItself(), True, False, None, 3, 2, True) is None
