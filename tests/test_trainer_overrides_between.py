"""Arguments changed between two train() calls, and the messages around the model's dtype and trainable set:
kept as the plain Trainer keeps them, said in a warning, or refused by name (accumulation raised on a 16-bit store,
another trainable set at resume, a checkpoint name taken by a file, a trainable view of a buffer)."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from _t5 import OFFLOAD, ToyDataset, logged, tiny_t5
from _overrides import _args, _assert_same
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer
from hf_zero_offload.config import ConfigError


# ---------------------------------------------------------------- between two train() calls, and messages

@pytest.mark.parametrize("field, first, second", [("max_grad_norm", 1.0, 0.3),
                                                   ("gradient_accumulation_steps", 1, 2)])
def test_arguments_changed_between_two_train_calls(tmp_path, field, first, second):
    """The engine kept the first train()'s clipping (0.011 off, grad_norm logs differing). An accumulation raised:
    an fp32 store sums the micro-batches in fp32 at any count, as the plain Trainer's .grad does."""
    ref_model, model = tiny_t5(), tiny_t5()
    ref = Seq2SeqTrainer(model=ref_model, args=_args(tmp_path, "r", Seq2SeqTrainingArguments, optim="adamw_torch",
                                                     max_steps=3, **{field: first}), train_dataset=ToyDataset())
    ours = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "o", zero_offload=OFFLOAD, max_steps=3,
                                                             **{field: first}), train_dataset=ToyDataset())
    for t in (ref, ours):
        t.train()
        setattr(t.args, field, second)
        t.train()
    assert getattr(ours.zero_engine.options, field) == second
    _assert_same(ref_model, ref, model, ours)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR"])
def test_a_learning_rate_changed_between_two_train_calls_is_kept_as_the_plain_trainer_keeps_it(tmp_path, caplog,
                                                                                                kind):
    """The plain Trainer keeps its optimizer, and the rebuilt schedule each group's initial_lr: a --learning_rate
    raised between two train() calls is not taken (nor, without a scheduler block, here). With a WarmupLR block its
    "auto" warmup_max_lr was resolved again: the second train() ran at 3x the first's LR (0.08 off the weights)."""
    cfg = {**OFFLOAD, "scheduler": {"type": kind, "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto"}}}
    if kind == "WarmupDecayLR":
        cfg["scheduler"]["params"]["total_num_steps"] = "auto"
    runs = []
    for raised in (False, True):
        model = tiny_t5()
        trainer = ZeroOffloadSeq2SeqTrainer(model=model, train_dataset=ToyDataset(),
                                            args=_args(tmp_path, f"o{raised}", zero_offload=cfg, max_steps=3,
                                                       warmup_steps=2))
        trainer.train()
        trainer.args.learning_rate *= 3 if raised else 1
        with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
            trainer.train()
        runs.append((model, trainer))
    (a, ta), (b, tb) = runs
    assert logged(tb, "learning_rate") == logged(ta, "learning_rate")
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    (msg,) = [r.getMessage() for r in caplog.records if "is not taken" in r.getMessage()]
    assert "warmup_max_lr 0.03 (the learning rate changed since the first train() of this Trainer?) is not taken" in msg


def test_gradient_accumulation_raised_on_a_16_bit_store_is_refused(tmp_path):
    """A bf16 engine built for one micro-batch per step summed 4 in its bf16 store: a bf16 ulp off a new engine's
    weights after 3 steps, without a word."""
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(),
                                        args=_args(tmp_path, "o", zero_offload=OFFLOAD, max_steps=2, bf16=True))
    trainer.train()
    trainer.args.gradient_accumulation_steps = 4
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps 4 with an engine built for 1 micro-batch"
                                          r"\(es\) per step: its host gradient store holds bfloat16 gradients.*"
                                          r"in the first train\(\) of this Trainer\. Build a new Trainer"):
        trainer.train()
    assert trainer.state.global_step == 2  # refused before any step


@pytest.mark.parametrize("flags, said", [({"bf16_full_eval": True}, "--bf16_full_eval without --bf16: the model "
                                                                       "trains in bf16 too"),
                                         ({"bf16_full_eval": True, "bf16": True}, None), ({}, None)])
def test_full_eval_alone_says_the_model_trains_in_16_bits(tmp_path, caplog, flags, said):
    """The plain Trainer trains in fp32 and evaluates in bf16; ours trained in bf16 (as under DeepSpeed), 0.06 off
    the plain run's weights after 4 steps, with no word but the start line's dtype."""
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(),
                                            args=_args(tmp_path, "o", zero_offload=OFFLOAD, **flags))
    got = [r.getMessage() for r in caplog.records if "_full_eval without" in r.getMessage()]
    assert [said in m for m in got] == ([True] if said else [])
    assert trainer._zo_precision[1] == bool(flags)


def test_a_16_bit_model_cast_up_is_a_warning(tmp_path, caplog):
    model = tiny_t5().bfloat16()
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "x", zero_offload=OFFLOAD, max_steps=1),
                                        train_dataset=ToyDataset())
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train()
    (msg,) = [r.getMessage() for r in caplog.records if "were cast to" in r.getMessage()]
    assert "bfloat16 parameters were cast to float32" in msg and "pass --bf16 (bf16=True)" in msg
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("bf16", [False, True])
def test_float64_params_cast_down_are_a_warning(tmp_path, caplog, bf16):
    """The engine's masters are fp32: a float64 param trained in fp32 where the plain Trainer keeps float64, with
    no word (the 16-bit cast up was a warning already). fp32 params in a --bf16 run are the normal path: no word."""
    model = tiny_t5()
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, train_dataset=ToyDataset(),
                                        args=_args(tmp_path, "plain", zero_offload=OFFLOAD, max_steps=1, bf16=bf16))
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train()
    assert not [r for r in caplog.records if "were cast to" in r.getMessage()]
    model = tiny_t5()
    model.encoder.final_layer_norm.double()
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, train_dataset=ToyDataset(),
                                        args=_args(tmp_path, "x", zero_offload=OFFLOAD, max_steps=1, bf16=bf16))
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train()
    (msg,) = [r.getMessage() for r in caplog.records if "float64" in r.getMessage()]
    dtype = "bfloat16" if bf16 else "float32"
    assert f"1 float64 parameter(s) (encoder.final_layer_norm.weight) were cast to {dtype}" in msg
    assert model.encoder.final_layer_norm.weight.dtype == getattr(torch, dtype)


def test_resume_with_another_trainable_set_names_the_params(tmp_path):
    def frozen(name):
        m = tiny_t5()
        m.get_submodule(name).requires_grad_(False)
        return m

    kw = dict(zero_offload=OFFLOAD, save_strategy="steps", save_steps=2)
    ZeroOffloadSeq2SeqTrainer(model=frozen("encoder.final_layer_norm"), train_dataset=ToyDataset(),
                              args=_args(tmp_path, "run", max_steps=2, **kw)).train()
    trainer = ZeroOffloadSeq2SeqTrainer(model=frozen("decoder.final_layer_norm"), train_dataset=ToyDataset(),
                                        args=_args(tmp_path, "run", max_steps=4, **kw))
    with pytest.raises(ValueError, match=r"\(trainable now, not in the checkpoint: "
                                         r"encoder\.final_layer_norm\.weight; trainable in the checkpoint, not now: "
                                         r"decoder\.final_layer_norm\.weight; from .*param_names\.json\)"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))


def test_a_checkpoint_name_taken_by_a_file_is_named_before_training(tmp_path):
    """A file named checkpoint-2 in output_dir was met at that save ("Not a directory"), after the steps since
    the start were lost; finetune_trainer.py names it before any model work, and now the Trainer's train() too."""
    args = _args(tmp_path, "out", zero_offload=OFFLOAD, save_strategy="steps", save_steps=2)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoint-2").write_text("x")
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset())
    with pytest.raises(ValueError, match="checkpoint-2 is a file, not a directory"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("tied", [True, False])
def test_a_trainable_view_of_a_buffer_is_refused_and_a_kept_reference_is_no_tie(tmp_path, caplog, tied):
    """The engine makes params contiguous (copies): a param that views a buffer (a tie through .t()) was untied
    without a word; a user's own reference (a state_dict kept aside) had been taken for such a tie and refused."""
    model = tiny_t5()
    model.register_buffer("basis", torch.randn(4, 6))
    model.extra = torch.nn.Linear(4, 6, bias=False)  # (unused in forward: no gradient, which the engine skips)
    model.extra.weight = torch.nn.Parameter(model.basis.t() if tied else torch.randn(4, 6).t())
    kept = model.state_dict()  # noqa: F841 - the reference that must not read as a tie
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "x", zero_offload=OFFLOAD, max_steps=1),
                                        train_dataset=ToyDataset())
    if tied:
        with pytest.raises(ConfigError, match=r"parameter extra.weight is not contiguous and shares its storage with "
                                              r"basis .*untie"):
            trainer.train()
        return
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        trainer.train()
    assert "1 trainable param(s) were not contiguous" in caplog.text and model.extra.weight.is_contiguous()
