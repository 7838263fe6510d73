"""Checkpoints moved between tools and models: a state whose params come in another order, a plain Trainer's or
DeepSpeed's checkpoint handed to our resume, and a plain run's optimizer.pt left in a checkpoint-N we write again."""
from __future__ import annotations

import logging
import os
import shutil
import time

import pytest
import torch
import torch.nn as nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from _t5 import OFFLOAD
from hf_zero_offload import ZeroOffloadTrainer, ZeroOffloadTrainingArguments


class _Cfg(PretrainedConfig):
    model_type = "hzo_two_linears"


class _AB(PreTrainedModel):
    """Two same-shaped layers: their order (and which one trains) can change while every shape stays."""
    config_class = _Cfg

    def __init__(self, config, order="ab"):
        super().__init__(config)
        for name in order:
            setattr(self, name, nn.Linear(8, 8))
        self.post_init()

    def forward(self, x, y):
        out = self.b(torch.tanh(self.a(x)))
        return {"loss": ((out - y) ** 2).mean(), "logits": out}


def _data():
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(8, generator=g), "y": torch.randn(8, generator=g)} for _ in range(16)]


def _train(out, zero, max_steps, order="ab", frozen=None, resume=None, seen=None, **extra):
    torch.manual_seed(0)
    model = _AB(_Cfg(), order)
    if frozen:
        getattr(model, frozen).requires_grad_(False)
    if seen is not None:  # the caller sees the model even when train() raises
        seen.append(model)
    kw = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=max_steps, save_strategy="steps",
              save_steps=2, report_to="none", use_cpu=True, learning_rate=1e-2, disable_tqdm=True, **extra)
    if zero:
        trainer = ZeroOffloadTrainer(model=model, args=ZeroOffloadTrainingArguments(zero_offload=OFFLOAD, **kw),
                                     train_dataset=_data())
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**kw), train_dataset=_data())
    trainer.train(resume_from_checkpoint=resume)
    return model


@pytest.mark.parametrize("order, frozen, named", [
    ("ba", None, r"the same params in another order \(slot 0: a\.weight saved, b\.weight now\)"),
    ("ab", "a", r"trainable now, not in the checkpoint: b\.weight, b\.bias; trainable in the checkpoint, not now: "
                r"a\.weight, a\.bias"),
], ids=["modules registered in another order", "the other layer trains"])
def test_same_shapes_under_other_names_are_refused_before_any_weight_moves(tmp_path, order, frozen, named):
    """The engine matches its state to the params by position and writes the saved masters into them: with the same
    shapes in another order, layer a took layer b's trained weights (0.011 from b's, 0.095 from its own), silently."""
    _train(tmp_path / "run", True, 2, frozen="b" if frozen else None)
    seen = []
    with pytest.raises(ValueError, match=r"was saved for other trainable params than this model's, or the same in "
                                         r"another order: the engine matches its state to the params by position.*"
                                         + named):
        _train(tmp_path / "again", True, 4, order=order, frozen=frozen, resume=str(tmp_path / "run" / "checkpoint-2"),
               seen=seen)
    if frozen:  # other trainable params are refused before transformers loads the checkpoint's weights into the model
        _assert_untouched(seen[0], order, frozen)


def _assert_untouched(model, order="ab", frozen=None):
    torch.manual_seed(0)
    fresh = _AB(_Cfg(), order)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), f"{name} holds the refused checkpoint's weights"


def test_a_plain_runs_optimizer_pt_is_not_left_in_our_checkpoint(tmp_path, caplog):
    """checkpoint-2 of a plain run, written again by ours in the same output_dir, kept that run's optimizer.pt
    (recorded by our marker), which a plain Trainer's resume then loaded onto our weights."""
    _train(tmp_path, False, 2)
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        _train(tmp_path, True, 2)
    ckpt = tmp_path / "checkpoint-2"
    assert not (ckpt / "optimizer.pt").exists() and (ckpt / "zero_offload").is_dir()
    assert "optimizer.pt" not in (ckpt / "hzo_complete.json").read_text()
    assert any("removed optimizer.pt" in r.getMessage() and "an earlier save of that checkpoint" in r.getMessage()
               for r in caplog.records)


def test_a_newer_plain_checkpoint_is_taken_over_by_resume_true(tmp_path, caplog):
    """ours to 2, a plain run on from it to 4, ours again with `true`: checkpoint-4 was skipped (steps 3-4 trained
    again from checkpoint-2's state); the newest checkpoint is taken over now, as it is when given by path."""
    _train(tmp_path / "a", True, 2)
    _train(tmp_path / "a", False, 4, resume=str(tmp_path / "a" / "checkpoint-2"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        by_true = _train(tmp_path / "a", True, 6, resume=True)
    assert not [r for r in caplog.records if "skipping" in r.getMessage()]
    assert any("a plain Trainer's, its optimizer.pt taken over" in r.getMessage() and "checkpoint-4" in r.getMessage()
               for r in caplog.records)
    by_path = _train(tmp_path / "b", True, 6, resume=str(tmp_path / "b" / "checkpoint-4"))
    for a, b in zip(by_true.parameters(), by_path.parameters()):
        assert torch.equal(a, b)


def test_an_older_plain_runs_higher_checkpoint_is_not_taken_for_the_newest(tmp_path):
    """A plain run's checkpoint-4, then a new run of ours from scratch in the same output_dir to checkpoint-2: `true`
    would take the plain run's higher step (the newer run's steps lost); it is refused as two runs' checkpoints."""
    _train(tmp_path, False, 4)
    time.sleep(0.02)  # the marker's clock after the plain files' times, on a coarse filesystem clock too
    _train(tmp_path, True, 2)
    with pytest.raises(ValueError, match=r"checkpoint-4 has the highest step, but .*checkpoint-2 was written after "
                                         r"it.*--resume_from_checkpoint \S*checkpoint-2"):
        _train(tmp_path, True, 6, resume=True)


def test_a_plain_checkpoint_is_taken_over_and_deepspeeds_refused_with_the_way_forward(tmp_path, caplog):
    """A plain Trainer's checkpoint was refused: its optimizer.pt (AdamW's moments and steps) is taken over now."""
    plain = _train(tmp_path / "plain", False, 4)
    ckpt = tmp_path / "plain" / "checkpoint-2"
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        ours = _train(tmp_path / "ours", True, 4, resume=str(ckpt))
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)  # the plain run's own steps 3-4
    said = [r.getMessage() for r in caplog.records]
    assert any("plain Trainer's checkpoint: its optimizer's state" in m for m in said)
    assert any("a plain Trainer's, its optimizer.pt taken over" in m for m in said)
    assert not any("completion marker" in m for m in said)
    seen = []  # another trainable set: refused before the plain run's weights reach the model
    with pytest.raises(ValueError, match=r"optimizer\.pt is the state of an optimizer over 4 params; this model has 2 "
                                         r"trainable.*train without resume_from_checkpoint"):
        _train(tmp_path / "ours2", True, 4, frozen="a", resume=str(ckpt), seen=seen)
    _assert_untouched(seen[0])
    _train(tmp_path / "sgd", False, 2, optim="sgd")  # another optimizer's state: refused, the model untouched
    seen = []
    with pytest.raises(ValueError, match=r"not the state of torch.optim.Adam/AdamW \(param_groups\[0\] or the state "
                                         r"has momentum, dampening, nesterov"):
        _train(tmp_path / "ours4", True, 4, resume=str(tmp_path / "sgd" / "checkpoint-2"), seen=seen)
    _assert_untouched(seen[0])
    os.rename(ckpt / "optimizer.pt", tmp_path / "moved.pt")  # laid out as transformers + DeepSpeed save it
    (ckpt / "global_step2").mkdir()
    (ckpt / "latest").write_text("global_step2")
    with pytest.raises(FileNotFoundError, match=r"was saved by DeepSpeed \(DeepSpeed's global_step2/ holds its ZeRO "
                                                r"optimizer state.*train without resume_from_checkpoint"):
        _train(tmp_path / "ours3", True, 4, resume=str(ckpt))


@pytest.mark.parametrize("save_only_model", [False, True], ids=["full save", "save_only_model"])
def test_another_tools_optimizer_state_goes_when_we_save_that_checkpoint_again(tmp_path, caplog, save_only_model):
    """A plain run's optimizer.pt (with --save_only_model its scheduler.pt too) and DeepSpeed's ZeRO state stayed
    in a checkpoint-N we saved again, recorded by our marker: a plain or DeepSpeed resume loaded that run's state."""
    _train(tmp_path, False, 2)
    ckpt = tmp_path / "checkpoint-2"
    (ckpt / "global_step2").mkdir()
    (ckpt / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (ckpt / "latest").write_text("global_step2")
    (ckpt / "zero_to_fp32.py").write_text("# DeepSpeed's")
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        _train(tmp_path, True, 2, save_only_model=save_only_model)
    held = set(os.listdir(ckpt))
    assert not held & {"optimizer.pt", "global_step2", "latest", "zero_to_fp32.py"}, held
    assert ("scheduler.pt" in held) is not save_only_model and ("zero_offload" in held) is not save_only_model
    marker = (ckpt / "hzo_complete.json").read_text()
    assert "optimizer.pt" not in marker and "global_step2" not in marker
    assert any("removed" in r.getMessage() and "optimizer.pt" in r.getMessage() for r in caplog.records)


def test_a_plain_run_saved_over_ours_is_named_for_what_it_is(tmp_path):
    """Our marker and zero_offload/ stay beside the plain run's files: it read as 'damaged'."""
    _train(tmp_path, True, 2)
    _train(tmp_path / "x", False, 1)  # (another output_dir: its lock is its own)
    _train(tmp_path, False, 2)  # the plain run writes checkpoint-2 again
    with pytest.raises(ValueError, match=r"checkpoint-2 is saved again by a run without --zero_offload "
                                         r"\(optimizer\.pt, which our save did not write"):
        _train(tmp_path / "ours", True, 4, resume=str(tmp_path / "checkpoint-2"))


def _callback_run(out, max_steps, order="ab", resume=None):
    """A plain Trainer given an engine built from named params (ZeroOffloadCallback): its optimizer.pt is the
    engine's state_dict(), with the names."""
    from hf_zero_offload import ZeroOffloadCallback
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    torch.manual_seed(0)
    model = _AB(_Cfg(), order)
    engine = OffloadAdam(model.named_parameters(), lr=1e-2, options=OffloadOptions())
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=max_steps,
                             save_strategy="steps", save_steps=2, report_to="none", use_cpu=True, disable_tqdm=True,
                             max_grad_norm=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), callbacks=[ZeroOffloadCallback()],
                      optimizers=(engine, torch.optim.lr_scheduler.LambdaLR(engine, lambda _: 1.0)))
    trainer.train(resume_from_checkpoint=resume)
    return model


def test_an_engine_of_named_params_refuses_a_state_of_other_names_through_a_plain_trainer(tmp_path):
    """ZeroOffloadCallback's optimizer.pt is loaded by the plain Trainer through the engine's load_state_dict, which
    matched by position and wrote the saved masters into the swapped layers (the README's limitation until now)."""
    _callback_run(tmp_path / "run", 2)
    with pytest.raises(ValueError, match=r"saved for other params than this engine's, of the same shapes: "
                                         r"trainable param 0 is 'a\.weight' in the state and 'b\.weight' here"):
        _callback_run(tmp_path / "again", 4, order="ba", resume=str(tmp_path / "run" / "checkpoint-2"))
    _callback_run(tmp_path / "same", 4, resume=str(tmp_path / "run" / "checkpoint-2"))  # the same model goes on


class _Named(ZeroOffloadTrainer):
    def create_optimizer(self, model=None):  # a user's optimizer of named params, a frozen layer among them
        self.optimizer = torch.optim.AdamW(self.model.named_parameters(), lr=1e-2)
        return self.optimizer


@pytest.mark.parametrize("user_optimizer", [False, True], ids=["the mixin's groups", "a user's named AdamW"])
def test_the_mixins_engine_names_its_trainable_params(tmp_path, user_optimizer):
    torch.manual_seed(0)
    model = _AB(_Cfg())
    model.a.requires_grad_(False)
    cls = _Named if user_optimizer else ZeroOffloadTrainer
    trainer = cls(model=model, args=ZeroOffloadTrainingArguments(
        output_dir=str(tmp_path), zero_offload=OFFLOAD, per_device_train_batch_size=4, max_steps=1, report_to="none",
        use_cpu=True, disable_tqdm=True, save_strategy="no"), train_dataset=_data())
    trainer.train()
    groups = trainer.zero_engine.param_groups
    # the frozen layer's names left out with its params (AdamW built from named_parameters() names them too)
    assert [n for g in groups for n in g["param_names"]] == ["b.weight", "b.bias"]
    assert all(len(g["param_names"]) == len(g["params"]) for g in groups)


class _TiedCfg(PretrainedConfig):
    model_type = "hzo_tied_two_orders"


class _Tied(PreTrainedModel):
    """An output head tied to the embedding, the two registered in either order: named_parameters() then names the
    shared weight by whichever comes first."""
    config_class = _TiedCfg
    _tied_weights_keys = {"head.weight": "emb.weight", "aux.weight": "emb.weight"}

    def __init__(self, config, order="eh"):
        super().__init__(config)
        for c in order:  # "a": a third alias, aux, whose name sorts before the others
            setattr(self, {"e": "emb", "h": "head", "a": "aux"}[c],
                    nn.Embedding(16, 8) if c == "e" else nn.Linear(8, 16, False))
        self.mid = nn.Linear(8, 8)
        self.head.weight = self.emb.weight
        if "a" in order:
            self.aux.weight = self.emb.weight

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.mid(self.emb(x))))
        return {"loss": nn.functional.cross_entropy(logits.view(-1, 16), y.view(-1)), "logits": logits}


def test_a_tied_weight_named_first_by_its_other_alias_resumes(tmp_path):
    """The mixin's names check takes any alias of a tied param; the engine's compared one name per param and refused
    a resume whose modules were registered in the other order, or with an alias added that sorts first (the same
    params, the same flat order)."""
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randint(0, 16, (4,), generator=g), "y": torch.randint(0, 16, (4,), generator=g)}
            for _ in range(16)]
    weights = []
    runs = (("run", "eh", 2, None), ("he", "he", 4, "run"), ("eh", "eh", 4, "run"), ("eha", "eha", 4, "run"))
    for out, order, steps, resume in runs:
        torch.manual_seed(0)
        model = _Tied(_TiedCfg(), order)
        args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path / out), zero_offload=OFFLOAD, max_steps=steps,
                                            per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
                                            report_to="none", use_cpu=True, learning_rate=1e-2, disable_tqdm=True)
        ZeroOffloadTrainer(model=model, args=args, train_dataset=data).train(
            resume_from_checkpoint=str(tmp_path / resume / "checkpoint-2") if resume else None)
        weights.append((model.emb.weight.detach().clone(), model.mid.weight.detach().clone()))
    for other in (weights[1], weights[3]):  # either order, and with the alias added, go on alike
        assert all(torch.equal(a, b) for a, b in zip(other, weights[2]))


class _Beside(PreTrainedModel):
    """A submodule called ``module`` holding a layer ``a``, beside a same-shaped layer ``a``."""
    config_class = _Cfg

    def __init__(self, config, trainable):
        super().__init__(config)
        self.module = nn.Module()
        self.module.a = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.post_init()
        for n, p in self.named_parameters():
            p.requires_grad_(n.startswith(trainable + "."))

    def forward(self, x, y):
        out = self.a(torch.tanh(self.module.a(x)))
        return {"loss": ((out - y) ** 2).mean(), "logits": out}


def test_a_submodule_called_module_keeps_its_name_in_the_resume_check(tmp_path):
    """Saved with module.a trainable, resumed with the layer a beside it trainable: the check took 'module.' for
    DDP's prefix and a took module.a's trained weights."""
    for out, trainable, resume in (("run", "module.a", None), ("again", "a", "run")):
        torch.manual_seed(0)
        trainer = ZeroOffloadTrainer(model=_Beside(_Cfg(), trainable), args=ZeroOffloadTrainingArguments(
            output_dir=str(tmp_path / out), zero_offload=OFFLOAD, per_device_train_batch_size=4, max_steps=2,
            save_strategy="steps", save_steps=2, report_to="none", use_cpu=True, disable_tqdm=True),
            train_dataset=_data())
        if resume is None:
            trainer.train()
            continue
        with pytest.raises(ValueError, match=r"trainable now, not in the checkpoint: a\.weight, a\.bias"):
            trainer.train(resume_from_checkpoint=str(tmp_path / resume / "checkpoint-2"))


def test_the_callback_says_once_that_an_engine_of_unnamed_params_loads_by_position(tmp_path, caplog):
    from hf_zero_offload import ZeroOffloadCallback
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    for named in (False, True):
        torch.manual_seed(0)
        model = _AB(_Cfg())
        engine = OffloadAdam(model.named_parameters() if named else model.parameters(), options=OffloadOptions())
        args = TrainingArguments(output_dir=str(tmp_path / str(named)), per_device_train_batch_size=4, max_steps=1,
                                 report_to="none", use_cpu=True, disable_tqdm=True, max_grad_norm=0.0,
                                 save_strategy="no")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
            Trainer(model=model, args=args, train_dataset=_data(), callbacks=[ZeroOffloadCallback()],
                    optimizers=(engine, torch.optim.lr_scheduler.LambdaLR(engine, lambda _: 1.0))).train()
        said = [r for r in caplog.records if "built from unnamed params" in r.getMessage()]
        assert len(said) == (0 if named else 1), [r.getMessage() for r in said]


def test_a_save_without_an_engine_removes_an_earlier_saves_state_folder(tmp_path):
    """A review: checkpoint-2 of a --zero_offload run saved again by ZeroOffloadTrainer without --zero_offload kept
    the first run's zero_offload/ (its marker recording no engine), and a --zero_offload resume then loaded that run's
    moments and step count onto the second run's weights, without a word."""
    _train(tmp_path, True, 2)
    torch.manual_seed(0)
    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, save_strategy="steps",
              save_steps=2, report_to="none", use_cpu=True, learning_rate=1e-2, disable_tqdm=True)
    ZeroOffloadTrainer(model=_AB(_Cfg(), "ab"), args=ZeroOffloadTrainingArguments(**kw), train_dataset=_data()).train()
    assert not (tmp_path / "checkpoint-2" / "zero_offload").exists()
    assert (tmp_path / "checkpoint-2" / "optimizer.pt").exists()
