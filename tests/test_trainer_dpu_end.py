"""The end of a run with the delayed parameter update (DPU): the last step reaches the model before anything reads it
there (``hf_zero_offload/trainer/last_step.py``). The reference is the model after ``train()``, which the tests of
the DPU schedule check against hand-written AdamW (test_engine_dpu.py, test_sharding_dpu.py)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

from _t5 import ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadCallback, ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

DPU = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                             "delayed_param_update": {"enabled": True, "warmup_steps": 1}}}
COMMON = dict(per_device_train_batch_size=4, max_steps=5, use_cpu=True, report_to=[], logging_steps=1,
              save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, weight_decay=0.0)


def _snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def _trainer(tmp_path, path: str, callbacks, **kw):
    model = tiny_t5()
    if path == "mixin":
        args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path), zero_offload=DPU, **{**COMMON, **kw})
        return model, ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset(), callbacks=callbacks)
    engine = OffloadAdam(model.parameters(), lr=1e-2, options=OffloadOptions(dpu=True, dpu_warmup_steps=1,
                                                                             max_grad_norm=1.0))
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), **{**COMMON, **kw})
    # the user's callback before ours, where transformers puts report_to's integrations
    return model, Seq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset(), optimizers=(engine, None),
                                 callbacks=[*callbacks, ZeroOffloadCallback()])


class _SeenAtTrainEnd(TrainerCallback):
    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.seen = _snapshot(model)  # what WandbCallback(WANDB_LOG_MODEL=end) or a user's export saves


@pytest.mark.parametrize("path", ["mixin", "callback"])
def test_on_train_end_callbacks_see_the_last_step(tmp_path, path):
    """They saw the weights of one step before (the flush came after every callback's on_train_end)."""
    seen = _SeenAtTrainEnd()
    model, trainer = _trainer(tmp_path, path, [seen])
    trainer.train()
    assert _same(seen.seen, _snapshot(model))


class _StopAt(TrainerCallback):
    def __init__(self, step, event="on_step_end"):
        self.step = step
        setattr(self, event, self._stop)

    def _stop(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("path, stop, event", [("mixin", None, None), ("mixin", 3, "on_step_end"),
                                               ("mixin", 3, "on_log"), ("callback", None, None),
                                               ("callback", 3, "on_step_end"), ("callback", 3, "on_log")],
                         ids=["mixin-max_steps", "mixin-stopped", "mixin-stopped-in-on_log", "callback-max_steps",
                              "callback-stopped", "callback-stopped-in-on_log"])
def test_a_final_save_only_model_checkpoint_holds_the_last_step(tmp_path, path, stop, event):
    """It held the model one step behind (the last step lived only in the masters, which it does not save): a
    from_pretrained of the last checkpoint lost a step without a word. ZeroOffloadCallback sees a stop set by the
    callbacks listed before it (docs/CONFIGURATION.md, the DPU schedule), here in their on_step_end or on_log."""
    model, trainer = _trainer(tmp_path, path, [_StopAt(stop, event)] if stop else [], save_strategy="steps",
                              save_steps=1, save_only_model=True)
    trainer.train()
    last = stop or COMMON["max_steps"]
    saved = load_file(str(tmp_path / f"checkpoint-{last}" / "model.safetensors"))
    now = _snapshot(model)
    assert trainer.state.global_step == last and _same(saved, {k: now[k] for k in saved})
    # mid-run checkpoints keep the DPU schedule's device weights: one step behind, not flushed
    before = load_file(str(tmp_path / f"checkpoint-{last - 1}" / "model.safetensors"))
    assert not _same(before, {k: now[k] for k in before})


class _Boom(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 4:
            raise RuntimeError("boom")


def test_a_failure_out_of_train_leaves_the_last_step_in_the_model(tmp_path):
    """A callback's error (or a Ctrl-C) left the step in flight unpublished: save_model() after it wrote the weights
    of one step before, and only a warning when the engine was collected said so."""
    model, trainer = _trainer(tmp_path, "mixin", [_Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    engine = trainer.zero_engine
    after = _snapshot(model)
    assert not engine.needs_publish
    engine.flush()
    assert _same(_snapshot(model), after)
