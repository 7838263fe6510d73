"""A user's Trainer that overrides create_optimizer (below the mixin, or above it), create_scheduler, or passes
optimizer_cls_and_kwargs: each as the plain Trainer with torch AdamW, element by element, or refused by name (the
plain Trainer's ZeroOffloadCallback: test_trainer_overrides_callback.py; arguments changed between two train()
calls: test_trainer_overrides_between.py)."""
from __future__ import annotations

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer

from _t5 import OFFLOAD, ToyDataset, tiny_t5
from _overrides import _args, _assert_same
from hf_zero_offload import ZeroOffloadMixin, ZeroOffloadSeq2SeqTrainer, ZeroOffloadTrainer
from hf_zero_offload.config import ConfigError


def _layerwise(self, opt_cls=torch.optim.AdamW, **extra):
    """A layer-wise optimizer: the decoder at lr/10 with its own betas/eps, weight decay on the encoder only."""
    named = list(self.model.named_parameters())
    lr = self.args.learning_rate
    return opt_cls([{"params": [p for n, p in named if not n.startswith("decoder.")], "weight_decay": 0.1},
                    {"params": [p for n, p in named if n.startswith("decoder.")], "lr": lr * 0.1,
                     "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}], lr=lr, **extra)


class LayerwiseTrainer(Seq2SeqTrainer):
    opt_cls, extra = torch.optim.AdamW, {}

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = _layerwise(self, self.opt_cls, **self.extra)
        return self.optimizer


class MixedIn(ZeroOffloadMixin, LayerwiseTrainer):
    pass


class Above(ZeroOffloadSeq2SeqTrainer):  # transformers' "subclass and override create_optimizer"
    opt_cls, extra = torch.optim.AdamW, {}

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = _layerwise(self, self.opt_cls, **self.extra)
        return self.optimizer


class LayerwiseLR:  # a helper class of the user's, before ZeroOffloadSeq2SeqTrainer in the bases
    opt_cls, extra = torch.optim.AdamW, {}
    create_optimizer = Above.__dict__["create_optimizer"].__wrapped__


class Helper(LayerwiseLR, ZeroOffloadSeq2SeqTrainer):
    pass


@pytest.mark.parametrize("ours_cls", [MixedIn, Above, Helper])
def test_users_create_optimizer_groups_run_in_the_engine(tmp_path, ours_cls):
    """Below the mixin its groups were dropped for the mixin's own two (silently: 0.033 off after 6 steps);
    above it, train() failed deep in torch (AttributeError: 'function' object has no attribute '__func__'); inherited
    from a helper class before the mixin it was refused as "not built by create_optimizer" (an outside probe)."""
    kw = dict(max_grad_norm=0.5)
    ref_model, model = tiny_t5(), tiny_t5()
    ref = LayerwiseTrainer(model=ref_model, args=_args(tmp_path, "ref", Seq2SeqTrainingArguments, optim="adamw_torch",
                                                      **kw), train_dataset=ToyDataset())
    ref.train()
    ours = ours_cls(model=model, args=_args(tmp_path, "ours", zero_offload=OFFLOAD, **kw), train_dataset=ToyDataset())
    ours.train()
    groups = ours.zero_engine.param_groups
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in groups] == \
        [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in ref.optimizer.param_groups]
    _assert_same(ref_model, ref, model, ours)


def test_users_adam_with_l2_weight_decay_runs_as_adam(tmp_path):
    class L2(LayerwiseTrainer):
        opt_cls = torch.optim.Adam

    class Ours(ZeroOffloadMixin, L2):
        pass

    ref_model, model = tiny_t5(), tiny_t5()
    ref = L2(model=ref_model, args=_args(tmp_path, "r", Seq2SeqTrainingArguments, optim="adamw_torch"),
             train_dataset=ToyDataset())
    ref.train()
    ours = Ours(model=model, args=_args(tmp_path, "o", zero_offload=OFFLOAD), train_dataset=ToyDataset())
    ours.train()
    assert [g["adamw_mode"] for g in ours.zero_engine.param_groups] == [False, False]
    _assert_same(ref_model, ref, model, ours)


@pytest.mark.parametrize("base", ["below", "above"])
@pytest.mark.parametrize("opt_cls, extra, match", [
    (torch.optim.SGD, {}, r"returned a torch\.optim\.sgd\.SGD: with zero_offload"),
    (torch.optim.AdamW, {"amsgrad": True}, r"returned a torch\.optim\.adamw\.AdamW with amsgrad=True \(the kernel "
                                          r"keeps no max\(exp_avg_sq\) state\) in param group 0"),
])
def test_users_create_optimizer_the_engine_cannot_run_is_refused_by_name(tmp_path, base, opt_cls, extra, match):
    class Other(LayerwiseTrainer):
        pass

    Other.opt_cls, Other.extra = opt_cls, extra

    class MyAbove(Above):
        pass

    MyAbove.opt_cls, MyAbove.extra = opt_cls, extra
    cls, where = (type("Mine", (ZeroOffloadMixin, Other), {}), "LayerwiseTrainer") if base == "below" else (MyAbove, "Above")
    trainer = cls(model=tiny_t5(), args=_args(tmp_path, "x", zero_offload=OFFLOAD), train_dataset=ToyDataset())
    with pytest.raises(ConfigError, match=rf"{where}\.create_optimizer {match}"):
        trainer.train()


def test_users_groups_leaving_a_trainable_param_out_are_refused(tmp_path):
    class Partial(ZeroOffloadSeq2SeqTrainer):
        def create_optimizer(self, model=None):
            self.optimizer = torch.optim.AdamW([p for n, p in self.model.named_parameters() if "decoder" in n])
            return self.optimizer

    trainer = Partial(model=tiny_t5(), args=_args(tmp_path, "x", zero_offload=OFFLOAD), train_dataset=ToyDataset())
    with pytest.raises(ConfigError, match=r"Partial\.create_optimizer left \d+ trainable parameter\(s\) out of its "
                                          r"param groups \(shared\.weight, encoder"):
        trainer.train()


def test_an_explicit_optimizer_block_and_users_groups_are_refused(tmp_path):
    cfg = {**OFFLOAD, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": "auto"}}}
    trainer = MixedIn(model=tiny_t5(), args=_args(tmp_path, "x", zero_offload=cfg), train_dataset=ToyDataset())
    with pytest.raises(ConfigError, match=r"the \"optimizer\" block sets lr and LayerwiseTrainer\.create_optimizer "
                                          r"builds its own param groups"):
        trainer.train()


class KwargsBase(Trainer):  # a base that forwards everything: the argument names are hidden from the mixin
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


class KwargsMixedIn(ZeroOffloadMixin, KwargsBase):
    pass


def test_optimizer_cls_and_kwargs_through_a_kwargs_base_is_refused(tmp_path):
    """Passed through a base's (*args, **kwargs) __init__ (or set after __init__), optimizer_cls_and_kwargs was not
    seen: the run trained with the engine's AdamW instead of the user's SGD (lr 0.01 logged instead of 0.5)."""
    kw = dict(optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.5}))
    with pytest.raises(ConfigError, match=r"optimizer_cls_and_kwargs names torch\.optim\.sgd\.SGD"):
        KwargsMixedIn(model=tiny_t5(), args=_args(tmp_path, "a", zero_offload=OFFLOAD), train_dataset=ToyDataset(),
                      **kw)
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, "b", zero_offload=OFFLOAD),
                                        train_dataset=ToyDataset())
    trainer.optimizer_cls_and_kwargs = kw["optimizer_cls_and_kwargs"]
    with pytest.raises(ConfigError, match="optimizer_cls_and_kwargs"):
        trainer.train()


@pytest.mark.parametrize("opt_cls, kwargs", [
    (torch.optim.AdamW, {"lr": 5e-3, "betas": (0.8, 0.99), "eps": 1e-6}),
    (torch.optim.Adam, {"lr": 5e-3, "weight_decay": 0.1}),  # L2 decay, as torch's Adam
])
@pytest.mark.parametrize("when", ["init", "after init"])
def test_optimizer_cls_and_kwargs_with_torch_adam_runs_in_the_engine(tmp_path, opt_cls, kwargs, when):
    """optimizer_cls_and_kwargs was refused whatever it named (an outside probe: a create_optimizer override returning
    the same AdamW was taken over). The Trainer builds it over its own groups and the engine takes them over: equal
    to the plain Trainer given the same."""
    kw = dict(optimizer_cls_and_kwargs=(opt_cls, kwargs))
    ref_model, model = tiny_t5(), tiny_t5()
    ref = Trainer(model=ref_model, args=_args(tmp_path, "ref", Seq2SeqTrainingArguments, weight_decay=0.01),
                  train_dataset=ToyDataset(), **kw)  # (Seq2SeqTrainer's __init__ does not take the argument)
    ref.train()
    ours = ZeroOffloadTrainer(model=model, args=_args(tmp_path, "ours", zero_offload=OFFLOAD, weight_decay=0.01),
                              train_dataset=ToyDataset(), **(kw if when == "init" else {}))
    if when == "after init":
        ours.optimizer_cls_and_kwargs = kw["optimizer_cls_and_kwargs"]
    ours.train()
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in ours.zero_engine.param_groups] == \
        [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in ref.optimizer.param_groups]
    assert [g["adamw_mode"] for g in ours.zero_engine.param_groups] == [opt_cls is torch.optim.AdamW] * 2
    # torch < 2.7's Adam adds the L2 term with a second rounding (no fused multiply-add, which ours and later torch
    # use): 1 ulp apart where g and wd * p nearly cancel, which Adam's first step turns into 1e-5 (an outside probe
    # at the floors, torch 2.6)
    l2_rounded_twice = opt_cls is torch.optim.Adam and torch.torch_version.TorchVersion(torch.__version__) < "2.7"
    _assert_same(ref_model, ref, model, ours, atol=2e-5 if l2_rounded_twice else 5e-7)


def test_a_scheduler_block_replacing_the_lr_of_optimizer_cls_and_kwargs_says_so(tmp_path, caplog):
    """An outside probe: optimizer_cls_and_kwargs' lr 5e-3 with the shipped WarmupLR block ("auto": --learning_rate
    1e-2) trained at 1e-2 without a word (the warning looked only for groups of different LRs); as DeepSpeed, the
    block's LR runs, said now. A malformed pair is named as such."""
    trainer = ZeroOffloadTrainer(model=tiny_t5(), args=_args(tmp_path, "x", zero_offload="zero2-offload", max_steps=1),
                                 train_dataset=ToyDataset(), optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 5e-3}))
    with caplog.at_level("WARNING", logger="hf_zero_offload"):
        trainer.train()
    assert "gives its param groups the learning rate(s) 0.005, and zero2-offload" in caplog.text.replace(
        presets_path(), "zero2-offload")
    assert "sets one LR for every group, warmup_max_lr 0.01" in caplog.text
    with pytest.raises(ConfigError, match=r"optimizer_cls_and_kwargs is \(<class 'torch.optim.adamw.AdamW'>,\): it "
                                          r"takes a pair \(optimizer class, dict of keyword arguments\)"):
        ZeroOffloadTrainer(model=tiny_t5(), args=_args(tmp_path, "y", zero_offload=OFFLOAD),
                           optimizer_cls_and_kwargs=(torch.optim.AdamW,))


def presets_path():
    from hf_zero_offload import presets
    return presets.preset_path("zero2-offload")


def _constant_lambda(self, num_training_steps, optimizer=None):  # a user's own schedule on self.optimizer
    if self.lr_scheduler is None:
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lambda i: 0.5 ** i)
        self._created_lr_scheduler = True
    return self.lr_scheduler


def test_a_users_create_scheduler_on_the_engine_runs_as_on_torch_adamw(tmp_path):
    """A torch LR scheduler built on the Trainer's optimizer (create_scheduler overridden above the mixin) died in
    torch: 'function' object has no attribute '__func__' (the patched step was a plain function, not a method)."""
    ref_model, model = tiny_t5(), tiny_t5()
    ref = type("Ref", (Seq2SeqTrainer,), {"create_scheduler": _constant_lambda})(
        model=ref_model, args=_args(tmp_path, "r", cls=Seq2SeqTrainingArguments), train_dataset=ToyDataset())
    ref.train()
    ours = type("Ours", (ZeroOffloadSeq2SeqTrainer,), {"create_scheduler": _constant_lambda})(
        model=model, args=_args(tmp_path, "o", zero_offload=OFFLOAD, max_grad_norm=1.0), train_dataset=ToyDataset())
    ours.train()
    _assert_same(ref_model, ref, model, ours)


def _with_groups(groups_of):
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(groups_of(self), lr=self.args.learning_rate, weight_decay=0.0)
        return self.optimizer
    return create_optimizer


def test_user_groups_keep_their_indices_and_hold_only_the_models_params(tmp_path):
    """A group with no trainable param (all frozen) was dropped: the groups after it moved up one, so the logged
    learning_rate (group 0's) was another group's (0.001 for 5.0) and a per-group LambdaLR counted one group too few.
    A param that is not the model's (a loss temperature held by the Trainer) was counted and clipped by the engine
    (grad_norm 8.29 for 4.35), then the first save died with a KeyError: now refused by name."""
    def frozen_first(self):
        named = list(self.model.named_parameters())
        for n, p in named:
            p.requires_grad_(not n.startswith("shared."))
        return [{"params": [p for n, p in named if n.startswith("shared.")], "lr": 5.0},
                {"params": [p for n, p in named if not n.startswith("shared.")]}]

    ref_model, model = tiny_t5(), tiny_t5()
    ref = type("Ref", (Seq2SeqTrainer,), {"create_optimizer": _with_groups(frozen_first)})(
        model=ref_model, args=_args(tmp_path, "r", cls=Seq2SeqTrainingArguments), train_dataset=ToyDataset())
    ref.train()
    ours = type("Ours", (ZeroOffloadSeq2SeqTrainer,), {"create_optimizer": _with_groups(frozen_first)})(
        model=model, args=_args(tmp_path, "o", zero_offload=OFFLOAD, max_grad_norm=1.0), train_dataset=ToyDataset())
    ours.train()
    assert len(ours.zero_engine.param_groups) == 2
    _assert_same(ref_model, ref, model, ours, atol=2e-6)  # the logged learning_rate included; fp32 rounding

    temperature = torch.nn.Parameter(torch.ones(()))
    outside = type("Outside", (ZeroOffloadSeq2SeqTrainer,), {"create_optimizer": _with_groups(
        lambda self: [{"params": list(self.model.parameters()) + [temperature]}])})(
        model=tiny_t5(), args=_args(tmp_path, "x", zero_offload=OFFLOAD, max_grad_norm=1.0), train_dataset=ToyDataset())
    with pytest.raises(ConfigError, match=r"1 parameter\(s\) that are not the model's"):
        outside.train()


def test_a_helpers_create_optimizer_is_looked_up_when_called(tmp_path, monkeypatch):
    """Captured when the class was made, a helper's method patched later (a plugin's monkeypatch) was not the one run:
    the old single group trained, 0.026 off the plain Trainer's layer-wise run, without a word (outside probe R2)."""
    class Late:
        def create_optimizer(self, model=None):
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.args.learning_rate)
            return self.optimizer

    class Ours(Late, ZeroOffloadSeq2SeqTrainer):
        pass

    monkeypatch.setattr(Late, "create_optimizer", Above.__dict__["create_optimizer"].__wrapped__)
    monkeypatch.setattr(Late, "opt_cls", torch.optim.AdamW, raising=False)
    monkeypatch.setattr(Late, "extra", {}, raising=False)
    ours = Ours(model=tiny_t5(), args=_args(tmp_path, "ours", zero_offload=OFFLOAD), train_dataset=ToyDataset())
    ours.train()
    assert [(g["initial_lr"], g["weight_decay"]) for g in ours.zero_engine.param_groups] == [(1e-2, 0.1), (1e-3, 0.0)]
