"""Hostile probes of the Trainer integration: TrainingArguments a user sets together with --zero_offload that touch the
optimizer, the schedule or the checkpoints. Each either equals the plain Trainer / a documented result, or is one
clear error naming the argument before any training."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from transformers import Seq2SeqTrainer

from _t5 import OFFLOAD, ToyDataset, tiny_t5
from _t5 import logged as _logged
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload import resume
from hf_zero_offload.resume import report as resume_report
from hf_zero_offload.config import ConfigError

COMMON = dict(per_device_train_batch_size=4, max_steps=4, use_cpu=True, report_to=[], logging_steps=1,
              save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, weight_decay=0.01)


def _args(tmp_path, name, **kw):
    return ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / name), **{**COMMON, **kw})


def _trainer(cls, tmp_path, name, seed=0, **kw):
    model = tiny_t5(seed)
    return model, cls(model=model, args=_args(tmp_path, name, **kw), train_dataset=ToyDataset(),
                      eval_dataset=ToyDataset(8, seed=1))


def _close(a_model, b_model, **tol):
    for (name, a), b in zip(a_model.named_parameters(), b_model.parameters()):
        torch.testing.assert_close(b, a, **(tol or dict(rtol=1e-5, atol=1e-6)), msg=name)


@pytest.mark.parametrize("config_bf16", ["auto", True])
def test_bf16_full_eval_means_bf16_as_with_deepspeed(tmp_path, config_bf16):
    """transformers' DeepSpeed integration reads bf16.enabled "auto" as --bf16 or --bf16_full_eval (the model it
    evaluates is the one it trains): we trained in fp32, and refused an explicit "enabled": true as a contradiction."""
    cfg = {**OFFLOAD, "bf16": {"enabled": config_bf16}}
    _, trainer = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "e", zero_offload=cfg, bf16_full_eval=True)
    trainer.train()
    assert trainer.zero_config.bf16 and not trainer.zero_config.fp16.enabled
    assert next(trainer.model.parameters()).dtype == torch.bfloat16


# ---- resume_from_checkpoint -----------------------------------------------------------------------------------------

def test_resume_true_with_no_checkpoint_names_the_folder(tmp_path):
    _, trainer = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "none", zero_offload=OFFLOAD)
    # transformers' words first (its own test suite matches them), the folder named
    with pytest.raises(resume.IncompleteCheckpoint, match=r"No valid checkpoint found in output directory \(\S*none\): "
                                                          r"resume_from_checkpoint=True found no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 0 and trainer.zero_engine is None


def test_checkpoint_of_a_plain_trainer_resumed_with_offload_takes_its_state_over(tmp_path):
    """It was refused by name (no zero_offload/); its AdamW state is taken over now (tests/test_resume_foreign.py
    compares the run with the plain one's own continuation)."""
    kw = dict(save_strategy="steps", save_steps=2, max_steps=2)
    _, plain = _trainer(Seq2SeqTrainer, tmp_path, "plain", optim="adamw_torch", **kw)
    plain.train()
    ckpt = tmp_path / "plain" / "checkpoint-2"
    _, ours = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "ours", zero_offload=OFFLOAD, **{**kw, "max_steps": 4})
    ours.train(resume_from_checkpoint=str(ckpt))
    assert ours.state.global_step == 4
    assert int(ours.zero_engine._param_steps.max()) == 4  # Adam's step counts went on from the plain run's 2


@pytest.mark.parametrize("saved, now", [("fp32", "int8"), ("int8", "bf16")])
def test_checkpoint_of_another_state_dtype_converts_and_says_so(tmp_path, caplog, saved, now):
    def cfg(dtype):
        return {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "state_dtype": dtype}}}
    kw = dict(save_strategy="steps", save_steps=2)
    _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "a", zero_offload=cfg(saved), **kw)[1].train()
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    model, trainer = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "b", seed=1, zero_offload=cfg(now), **kw)
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert trainer.zero_engine.moments.state_dtype == now and trainer.state.global_step == 4
    assert f"converted to state_dtype={now}" in caplog.text
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_save_total_limit_keeps_whole_checkpoints_with_their_state(tmp_path):
    _, trainer = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "lim", zero_offload=OFFLOAD, save_strategy="steps",
                          save_steps=1, save_total_limit=2, max_steps=5)
    trainer.train()
    kept = sorted(os.listdir(tmp_path / "lim"))
    assert [k for k in kept if k.startswith("checkpoint-")] == ["checkpoint-4", "checkpoint-5"]
    for k in ("checkpoint-4", "checkpoint-5"):
        assert resume.status(str(tmp_path / "lim" / k)) == "complete"
        assert os.path.isfile(tmp_path / "lim" / k / "zero_offload" / "rank0_of_1.hzo")


# ---- arguments that meet the optimizer ------------------------------------------------------------------------------

@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "adamw_torch_4bit", "lion_32bit", "rmsprop", "adamw_anyprecision"])
def test_other_optimizers_are_refused_by_name(tmp_path, optim):
    with pytest.raises(ConfigError, match=rf"--optim {optim}: the zero_offload engine is Adam/AdamW only") as e:
        _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "o", zero_offload=OFFLOAD, optim=optim)
    # a low-bit optimizer's user is pointed at the engine's int8 states (the others are not)
    assert ("zero2-offload-int8" in str(e.value)) == (optim in ("adamw_bnb_8bit", "adamw_torch_4bit"))


@pytest.mark.parametrize("name", ["HF_ZERO_OFFLOAD_SIMULATE_STREAMS", "HF_ZERO_OFFLOAD_BLOCKING_WAITS"])
def test_a_switch_the_engine_reads_at_train_is_checked_at_init(tmp_path, monkeypatch, name):
    """A typo in a switch the engine reads when it builds its streams (at train()) was found only after the model
    and the data were loaded; now with the arguments, before any model work."""
    monkeypatch.setenv(name, "ture")
    with pytest.raises(ConfigError, match=rf"^{name}='ture' is not an on/off value"):
        _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "s", zero_offload=OFFLOAD)
    monkeypatch.setenv(name, "off")
    _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "s2", zero_offload=OFFLOAD)


def test_max_grad_norm_none_is_refused_at_init_naming_it(tmp_path):
    # transformers' loop compares max_grad_norm with 0 after the first backward (TypeError); say it up front
    with pytest.raises(ConfigError, match=r"--max_grad_norm None: .*use 0 to turn clipping off"):
        _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "n", zero_offload=OFFLOAD, max_grad_norm=None)


@pytest.mark.parametrize("flag, value, rule", [("gradient_accumulation_steps", 0, "an int >= 1"),
                                               ("gradient_accumulation_steps", -1, "an int >= 1"),
                                               ("per_device_train_batch_size", 0, "an int >= 1"),
                                               ("learning_rate", -1.0, "a finite number >= 0"),
                                               ("learning_rate", float("nan"), "a finite number >= 0"),
                                               ("weight_decay", -0.1, "a finite number >= 0"),
                                               ("adam_beta2", 1.0, r"a number in \[0, 1\)"),
                                               ("adam_epsilon", -1e-8, "a finite number >= 0")])
def test_bad_training_argument_values_are_refused_at_init_naming_the_flag(tmp_path, flag, value, rule):
    """--gradient_accumulation_steps 0 divided by zero inside train(); -1 was named as OffloadOptions' field, a
    negative learning rate as "OffloadAdam param group 0: lr": neither is what the user wrote."""
    with pytest.raises(ConfigError, match=rf"--{flag} {value!r}: must be {rule}"):
        _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "bad", zero_offload=OFFLOAD, **{flag: value})


def test_numpy_training_argument_values_are_taken_as_the_plain_trainer_takes_them(tmp_path):
    """A sweep's np.float32 learning rate or np.int64 accumulation count was refused by the value checks (isinstance
    float/int); the plain Trainer trains with them."""
    import numpy as np

    _, trainer = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "np", zero_offload=OFFLOAD, adam_beta2=0.0,
                          learning_rate=np.float32(1e-3), weight_decay=np.float32(0.01),
                          gradient_accumulation_steps=np.int64(2))
    trainer.train()
    assert trainer.zero_config.gradient_accumulation_steps == 2 and trainer.state.global_step > 0


@pytest.mark.parametrize("ga", [2, "auto"])
def test_accumulation_given_through_accelerator_config_equals_the_plain_trainer(tmp_path, ga):
    """accelerator_config's gradient_accumulation_kwargs num_steps, which the Trainer copies into
    --gradient_accumulation_steps inside its __init__: a ds_config saying the same (2) was refused before it, as
    contradicting "--gradient_accumulation_steps 1"."""
    def acc():  # a new dict each: transformers sets its num_steps to 1 in place once it has copied it
        return {"gradient_accumulation_kwargs": {"num_steps": 2}}
    ref_model, ref = _trainer(Seq2SeqTrainer, tmp_path, "ref", optim="adamw_torch", accelerator_config=acc())
    ref.train()
    cfg = {**OFFLOAD, "gradient_accumulation_steps": ga}
    model, ours = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "ours", zero_offload=cfg, accelerator_config=acc())
    ours.train()
    assert ours.zero_config.gradient_accumulation_steps == ref.args.gradient_accumulation_steps == 2
    _close(ref_model, model)
    assert _logged(ours, "loss") == pytest.approx(_logged(ref, "loss"), rel=1e-5)


@pytest.mark.parametrize("steps", [0, "2", 1.5])
def test_a_bad_accumulation_in_accelerator_config_is_named_as_such(tmp_path, steps):
    acc = {"gradient_accumulation_kwargs": {"num_steps": steps}}
    with pytest.raises(ConfigError, match=rf"^accelerator_config gradient_accumulation_kwargs num_steps {steps!r}: "
                                          r"must be an int >= 1"):
        _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "n", zero_offload=OFFLOAD, accelerator_config=acc)


def test_max_grad_norm_zero_equals_the_plain_trainer(tmp_path):
    ref_model, ref = _trainer(Seq2SeqTrainer, tmp_path, "ref", optim="adamw_torch", max_grad_norm=0.0)
    ref.train()
    model, ours = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "ours", zero_offload=OFFLOAD, max_grad_norm=0.0)
    ours.train()
    _close(ref_model, model)
    assert _logged(ours, "grad_norm") == pytest.approx(_logged(ref, "grad_norm"), rel=1e-5)


@pytest.mark.parametrize("key, arg, value", [("lr", "learning_rate", 3e-3), ("weight_decay", "weight_decay", 0.1),
                                             ("eps", "adam_epsilon", 1e-6)])
def test_optimizer_values_given_twice_must_agree(tmp_path, key, arg, value):
    cfg = {**OFFLOAD, "optimizer": {"type": "AdamW", "params": {key: value}}}
    with pytest.raises(ConfigError, match=rf"{key}.*--{arg}"):
        _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "x", zero_offload=cfg)
    # the same value in both: the config's optimizer block is what trains, and equals the plain Trainer's AdamW
    kw = {arg: value}
    _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "y", zero_offload=cfg, **kw)


def test_lr_scheduler_kwargs_next_to_a_scheduler_block_are_not_dropped_silently(tmp_path):
    cfg = {**OFFLOAD, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}}
    with pytest.raises(ConfigError, match=r"--lr_scheduler_kwargs.*scheduler"):
        _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "k", zero_offload=cfg, lr_scheduler_type="cosine_with_min_lr",
                 lr_scheduler_kwargs={"min_lr": 1e-4})


# ---- evaluate / predict / train twice -------------------------------------------------------------------------------

def test_evaluate_and_predict_before_training_equal_the_plain_trainer(tmp_path):
    _, ref = _trainer(Seq2SeqTrainer, tmp_path, "ref", optim="adamw_torch", per_device_eval_batch_size=4)
    _, ours = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "ours", zero_offload=OFFLOAD, per_device_eval_batch_size=4)
    assert ours.evaluate()["eval_loss"] == ref.evaluate()["eval_loss"]
    a, b = ref.predict(ToyDataset(4)), ours.predict(ToyDataset(4))
    assert b.metrics["test_loss"] == a.metrics["test_loss"]
    ours.train()  # and training still starts from there
    assert ours.state.global_step == 4


@pytest.mark.parametrize("cfg", [OFFLOAD, {**OFFLOAD, "scheduler": {"type": "WarmupDecayLR", "params": {
    "total_num_steps": "auto", "warmup_num_steps": "auto"}}}], ids=["trainer-schedule", "scheduler-block"])
def test_train_twice_restarts_the_schedule_as_the_plain_trainer_does(tmp_path, cfg):
    # transformers recreates the LR schedule it created at every train() (its parameters may differ); the
    # config's schedule was kept, already at its end: the second train() ran at lr=0 (WarmupDecayLR)
    _, trainer = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "t", zero_offload=cfg, warmup_steps=2)
    trainer.train()
    first = _logged(trainer, "learning_rate")
    trainer.train()
    second = _logged(trainer, "learning_rate")  # a new TrainerState: the log starts again
    assert second == pytest.approx(first)
    assert trainer.zero_engine.global_steps == 8  # the optimizer state goes on, as AdamW's does


def test_train_twice_equals_the_plain_trainer(tmp_path):
    ref_model, ref = _trainer(Seq2SeqTrainer, tmp_path, "ref", optim="adamw_torch", warmup_steps=2)
    model, ours = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "ours", zero_offload=OFFLOAD, warmup_steps=2)
    for t in (ref, ours, ref, ours):
        t.train()
    _close(ref_model, model)
    assert _logged(ours, "learning_rate") == pytest.approx(_logged(ref, "learning_rate"))


@pytest.mark.parametrize("cfg", [OFFLOAD, {"zero_optimization": {"stage": 1}}], ids=["offload", "zero1"])
def test_weights_changed_between_two_train_calls_are_trained_on(tmp_path, caplog, cfg):
    """Weights loaded (or trained by another optimizer) between two train() calls were overwritten by the engine's
    stale masters at the next step, silently; the plain Trainer's AdamW steps from the model's weights."""
    ref_model, ref = _trainer(Seq2SeqTrainer, tmp_path, "ref", optim="adamw_torch", warmup_steps=2)
    model, ours = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "ours", zero_offload=cfg, warmup_steps=2)
    for m, t in ((ref_model, ref), (model, ours)):
        t.train()
        with torch.no_grad():
            m.lm_head.weight.mul_(0.5)  # T5's tied embedding: one of the engine's params
            m.encoder.block[0].layer[0].layer_norm.weight.add_(0.25)
        t.train()
    _close(ref_model, model)
    assert any("2 parameter(s) changed since this optimizer last set them" in r.getMessage() for r in caplog.records)


def test_second_train_with_more_steps_resolves_the_auto_schedule_again(tmp_path):
    # "auto" total_num_steps is this train()'s step count, as for the first one (it kept the first's: 4)
    cfg = {**OFFLOAD, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}
    _, trainer = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "t", zero_offload=cfg, warmup_steps=2)
    trainer.train()
    trainer.args.max_steps = 6
    trainer.train()
    _, fresh = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "f", zero_offload=cfg, warmup_steps=2, max_steps=6)
    fresh.train()
    assert trainer.zero_config.scheduler.total_num_steps == 6
    assert _logged(trainer, "learning_rate") == pytest.approx(_logged(fresh, "learning_rate"))


def test_save_only_model_checkpoint_claims_no_optimizer_state(tmp_path, caplog):
    # its marker recorded the engine although no zero_offload/ was written: a plain Trainer resuming it was told
    # the checkpoint "holds hf_zero_offload optimizer state ... that this run drops"
    kw = dict(save_only_model=True, save_strategy="steps", save_steps=2, max_steps=2)
    _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "s", zero_offload=OFFLOAD, **kw)[1].train()
    ckpt = tmp_path / "s" / "checkpoint-2"
    assert not (ckpt / "zero_offload").exists()
    assert resume_report.saved_engine(str(ckpt), "zero_offload") is None
    _, plain = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "p", optim="adamw_torch", **{**kw, "max_steps": 4})
    plain.train(resume_from_checkpoint=str(ckpt))
    assert "that this run drops" not in caplog.text


def test_torch_compile_equals_the_plain_trainer(tmp_path):
    kw = dict(torch_compile=True, torch_compile_backend="eager", max_steps=2)
    ref_model, ref = _trainer(Seq2SeqTrainer, tmp_path, "ref", optim="adamw_torch", **kw)
    ref.train()
    model, ours = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "ours", zero_offload=OFFLOAD, **kw)
    ours.train()
    _close(ref_model, model)
    assert _logged(ours, "loss") == pytest.approx(_logged(ref, "loss"), rel=1e-5)


def test_model_init_trains_each_new_model_with_a_new_engine(tmp_path):
    # model_init (hyperparameter search): every train() starts from a new model; the engine must follow it
    targs = dict(optim="adamw_torch", max_steps=2)
    ref = Seq2SeqTrainer(model_init=lambda *_: tiny_t5(), args=_args(tmp_path, "ref", **targs),
                         train_dataset=ToyDataset())
    ours = ZeroOffloadSeq2SeqTrainer(model_init=lambda *_: tiny_t5(), args=_args(tmp_path, "ours", zero_offload=OFFLOAD,
                                                                                **targs), train_dataset=ToyDataset())
    for t in (ref, ours, ref, ours):
        t.train()
    _close(ref.model, ours.model)
    assert ours.zero_engine.global_steps == 2


def test_unknown_preset_name_is_one_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"zero2-ofload"):
        _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "p", zero_offload="zero2-ofload")


@pytest.mark.parametrize("kw", [dict(neftune_noise_alpha=5.0), dict(include_num_input_tokens_seen="all"),
                                dict(eval_on_start=True, eval_strategy="steps", eval_steps=2)],
                         ids=["neftune", "tokens-seen", "eval-on-start"])
def test_readme_listed_features_equal_the_plain_trainer(tmp_path, kw):
    ref_model, ref = _trainer(Seq2SeqTrainer, tmp_path, "ref", optim="adamw_torch", **kw)
    ref.train()
    model, ours = _trainer(ZeroOffloadSeq2SeqTrainer, tmp_path, "ours", zero_offload=OFFLOAD, **kw)
    ours.train()
    _close(ref_model, model)
    for key in ("loss", "eval_loss", "num_input_tokens_seen"):
        assert _logged(ours, key) == pytest.approx(_logged(ref, key), rel=1e-5), key


# ---- another Trainer (or a plain optimizer) on the same model object ------------------------------------------------

_DPU = {"zero_optimization": {**OFFLOAD["zero_optimization"], "delayed_param_update": {"enabled": True,
                                                                                        "warmup_steps": 1}}}
_AFTER = {"offload": OFFLOAD, "dpu": _DPU, "zero2": {"zero_optimization": {"stage": 2}},
          "zero1": {"zero_optimization": {"stage": 1}}}


@pytest.mark.parametrize("first, second", [("offload", "offload"), ("dpu", "dpu"), ("zero2", "zero2"),
                                           ("zero1", "offload"), ("offload", "plain")])
def test_a_second_trainer_on_the_same_model_trains_it(tmp_path, first, second):
    """The notebook pattern ``t1.train(); t2 = Trainer(model=model, ...); t2.train()``: the first engine's backward
    hooks stayed on the params and took every gradient, so the second Trainer (ours or a plain one) changed nothing
    and logged grad_norm 0 (ZeRO-2: crashed in backward). Now it equals the same Trainer run on a copy of the model
    (the plain Trainer, or with DPU a fresh one of ours) element by element, the first engine's memory is freed when
    ours replaces it (``del t1`` after a plain one), and the first Trainer refuses to train again, saying why."""
    import copy
    import gc
    import weakref

    model = tiny_t5()
    t1 = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "t1", zero_offload=_AFTER[first], max_steps=2),
                                   train_dataset=ToyDataset())
    t1.train()
    holder = weakref.ref(getattr(t1.zero_engine, "pipeline", None) or t1.zero_engine.reducer)  # the gradient store's
    copied = copy.deepcopy(model)
    kw = dict(max_steps=3, learning_rate=5e-3)
    ours = dict(zero_offload=_AFTER[second]) if second != "plain" else dict(optim="adamw_torch")
    t2 = (Seq2SeqTrainer if second == "plain" else ZeroOffloadSeq2SeqTrainer)(
        model=model, args=_args(tmp_path, "t2", **ours, **kw), train_dataset=ToyDataset())
    t2.train()
    ref_kw = dict(zero_offload=_DPU) if second == "dpu" else dict(optim="adamw_torch")
    ref = (ZeroOffloadSeq2SeqTrainer if second == "dpu" else Seq2SeqTrainer)(
        model=copied, args=_args(tmp_path, "ref", **ref_kw, **kw), train_dataset=ToyDataset())
    ref.train()
    _close(copied, model)
    assert _logged(t2, "grad_norm") == pytest.approx(_logged(ref, "grad_norm"), rel=1e-5)
    engine = t1.zero_engine
    if second != "plain":
        with pytest.raises(RuntimeError, match=r"was replaced by a new \w+ built on the same parameters \(e.g. another "
                                               r"Trainer on this model\)"):
            t1.train()
        assert holder() is None  # released at the replacement, t1 still alive
    del t1, engine  # (a plain Trainer replaced nothing)
    gc.collect()
    assert holder() is None


@pytest.mark.parametrize("cls", ["ZeroOffloadTrainingArguments", "ZeroOffloadSeq2SeqTrainingArguments"])
def test_output_dir_is_the_first_positional_argument_as_in_transformers(tmp_path, cls):
    """TrainingArguments(output_dir, ...) (transformers' own tests and many scripts): our fields came first, so the
    folder was taken as zero_offload (a ds_config file that could not be read), or, beside zero_offload=, a TypeError."""
    import dataclasses

    import hf_zero_offload
    from transformers import TrainingArguments

    args_cls = getattr(hf_zero_offload, cls)
    args = args_cls(str(tmp_path / "out"), zero_offload=OFFLOAD, use_cpu=True, report_to=[])
    assert args.output_dir == str(tmp_path / "out") and args.zero_offload == OFFLOAD
    names = [f.name for f in dataclasses.fields(args_cls)]
    assert names[:len(dataclasses.fields(TrainingArguments))] == [f.name for f in dataclasses.fields(TrainingArguments)]


def test_a_config_dict_with_numpy_numbers_still_serializes_with_the_arguments(tmp_path):
    """The config takes numpy scalars as numbers, but args.to_json_string() (report_to's integrations, the saved
    training args' JSON) failed on them: "Object of type float32 is not JSON serializable" (an outside probe)."""
    import json

    import numpy as np

    from hf_zero_offload import ZeroOffloadTrainingArguments
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                 "reduce_bucket_size": np.int64(2 ** 20)},
           "optimizer": {"type": "AdamW", "params": {"lr": np.float32(1e-3), "betas": [np.float64(0.9), 0.999]}}}
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], zero_offload=cfg)
    back = json.loads(args.to_json_string())["zero_offload"]
    assert back["optimizer"]["params"]["lr"] == float(np.float32(1e-3))
    assert back["zero_optimization"]["reduce_bucket_size"] == 2 ** 20 and back["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert isinstance(cfg["optimizer"]["params"]["lr"], np.float32)  # the caller's dict is left as it was
