"""TrainingArguments changed after the Trainer's __init__: a hyperparameter search trial (transformers'
_hp_search_setup sets its values on trainer.args and creates the Accelerator again), or a field set by hand. Each
trial trains as the plain Trainer's trial does, or is refused before any step naming the flag (trainer/later_args.py).

optuna is not needed: the trial is a stand-in with optuna's ``number`` and ``params`` (what transformers reads of
it), and the hyperparameter space returns its params."""
from __future__ import annotations

import pytest
import torch
import transformers.integrations
import transformers.integrations.integration_utils as integration_utils
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers.trainer_utils import HPSearchBackend

from _t5 import OFFLOAD, ToyDataset, logged, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload.config import ConfigError

COMMON = dict(per_device_train_batch_size=4, max_steps=3, use_cpu=True, report_to=[], logging_steps=1,
              save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, weight_decay=0.01,
              max_grad_norm=1.0)


class _Trial:
    """What transformers reads of an optuna trial: its number (the run folder's name) and its params."""
    number = 0

    def __init__(self, **params):
        self.params = params


@pytest.fixture(autouse=True)
def _trial_params(monkeypatch):
    # transformers' hp_params knows optuna's, Ray's and W&B's trials only, by their installed classes
    monkeypatch.setattr(integration_utils, "hp_params", lambda trial: dict(trial.params))
    monkeypatch.setattr(transformers.integrations, "hp_params", integration_utils.hp_params, raising=False)


def _trainer(tmp_path, name, ours=True, **kw):
    model = tiny_t5()
    if ours:
        args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / name),
                                                   **{**COMMON, "zero_offload": OFFLOAD, **kw})
        trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset())
    else:
        args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / name), **{**COMMON, "optim": "adamw_torch", **kw})
        trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset())
    return model, trainer


def _as_search(trainer):
    trainer.hp_search_backend = HPSearchBackend.OPTUNA  # as hyperparameter_search(backend="optuna") sets it
    trainer.hp_space = lambda trial: trial.params
    return trainer


def _assert_same(ref_model, ref, model, ours):
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    for key in ("loss", "grad_norm", "learning_rate"):
        assert logged(ours, key) == pytest.approx(logged(ref, key), rel=1e-5), key
    assert ours.state.global_step == ref.state.global_step == COMMON["max_steps"]


def test_a_trial_trains_as_the_plain_trainers_trial(tmp_path):
    ref_model, ref = _trainer(tmp_path, "ref", ours=False)
    _as_search(ref).train(trial=_Trial(learning_rate=5e-3, weight_decay=0.1))
    model, ours = _trainer(tmp_path, "ours")
    _as_search(ours).train(trial=_Trial(learning_rate=5e-3, weight_decay=0.1))
    _assert_same(ref_model, ref, model, ours)
    assert logged(ours, "learning_rate")[0] == pytest.approx(5e-3)  # the trial's, not the 1e-2 given at __init__
    assert getattr(ours.accelerator, "_zo_patched", False)  # the trial's Accelerator is changed as __init__'s was


def test_a_bf16_trial_trains_as_a_run_created_with_its_values(tmp_path):
    """The trial's Accelerator was created with --bf16's mixed precision over ours (created with "no"): every bf16
    or fp16 trial failed in Accelerate ("AcceleratorState has already been initialized ... mixed_precision='bf16'")."""
    ref_model, ref = _trainer(tmp_path, "ref", bf16=True, learning_rate=5e-3)
    ref.train()
    model, ours = _trainer(tmp_path, "ours", bf16=True)
    _as_search(ours).train(trial=_Trial(learning_rate=5e-3))
    assert ours.accelerator.mixed_precision == "no"  # no autocast, no GradScaler: the model is bf16 itself
    assert model.shared.weight.dtype == torch.bfloat16
    _assert_same(ref_model, ref, model, ours)


@pytest.mark.parametrize("how, field, value, match", [
    ("trial", "optim", "sgd", r"--optim sgd: the zero_offload engine is Adam/AdamW only"),
    ("by hand", "optim", "sgd", r"--optim sgd: the zero_offload engine is Adam/AdamW only"),
    ("by hand", "max_grad_norm", None, r"--max_grad_norm None: .*use 0"),  # (a trial casts to the field's type)
])
def test_arguments_set_after_init_are_checked_before_the_first_step(tmp_path, how, field, value, match):
    """--optim sgd set by a trial (or by hand) after __init__ trained as AdamW without a word (learning_rate logged
    as AdamW's schedule), where the plain Trainer's trial trains SGD."""
    model, trainer = _trainer(tmp_path, "ours")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=match):
        if how == "trial":
            _as_search(trainer).train(trial=_Trial(**{field: value}))
        else:
            setattr(trainer.args, field, value)
            trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_lr_scheduler_kwargs_set_after_init_next_to_a_scheduler_block_are_refused(tmp_path):
    cfg = {**OFFLOAD, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}}
    _, trainer = _trainer(tmp_path, "ours", zero_offload=cfg)
    trainer.args.lr_scheduler_kwargs = {"num_cycles": 2}
    with pytest.raises(ConfigError, match=r"--lr_scheduler_kwargs .*\(WarmupLR\) replaces the Trainer's schedule"):
        trainer.train()


@pytest.mark.parametrize("first, trial, match", [
    ({}, {"bf16": True}, r"fp32 \(no --bf16/--fp16\) then, --bf16 now"),
    ({"bf16": True}, {"bf16": False}, r"--bf16 then, fp32 \(no --bf16/--fp16\) now"),
])
def test_a_trial_changing_the_training_precision_is_refused(tmp_path, first, trial, match):
    """The engine's dtype is read at __init__: a trial's bf16 trained in fp32 (or the other way) without a word."""
    _, trainer = _trainer(tmp_path, "ours", **first)
    with pytest.raises(ConfigError, match=r"training precision changed after the Trainer was created \(" + match):
        _as_search(trainer).train(trial=_Trial(**trial))
    assert trainer.state.global_step == 0


_INT8 = {"zero_optimization": {**OFFLOAD["zero_optimization"],
                               "offload_optimizer": {"device": "cpu", "state_dtype": "int8"}}}
_DPU = {"zero_optimization": {**OFFLOAD["zero_optimization"], "delayed_param_update": {"enabled": True}}}


@pytest.mark.parametrize("how, first, later, match", [
    ("trial", OFFLOAD, _INT8, r"zero_offload\.zero_optimization\.offload_optimizer\.state_dtype: absent then, "
                              r"'int8' now"),
    ("by hand", OFFLOAD, _DPU, r"zero_offload\.zero_optimization\.delayed_param_update\.enabled: absent then, True"),
    ("by hand", OFFLOAD, None, r"zero_offload: \{.*\} then, None now"),
    ("by hand", None, OFFLOAD, r"zero_offload: None then, \{.*\} now"),
    ("in place", OFFLOAD, None, r"zero_offload\.zero_optimization\.stage: 2 then, 1 now"),
    ("sharded_ddp", None, None, r"sharded_ddp: True then, False now"),
])
def test_an_engine_config_changed_after_init_is_refused(tmp_path, how, first, later, match):
    """zero_offload and sharded_ddp decide at __init__ whether there is an engine, and which: changed since (a
    trial's int8 moments or DPU, a config removed, or given to a Trainer made without one) the run trained with
    __init__'s choice without a word (a plain AdamW where zero_offload was asked for)."""
    import copy
    first = copy.deepcopy(first)
    model, trainer = _trainer(tmp_path, "ours", zero_offload=first, sharded_ddp=how == "sharded_ddp")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"changed after the Trainer was created \(" + match):
        if how == "trial":
            _as_search(trainer).train(trial=_Trial(zero_offload=later))
        else:
            if how == "in place":
                trainer.args.zero_offload["zero_optimization"]["stage"] = 1
            elif how == "sharded_ddp":
                trainer.args.sharded_ddp = False
            else:
                trainer.args.zero_offload = later
            trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
