"""Trainer features combined with --zero_offload, in the style of transformers' own Trainer tests: each works as
with the plain Trainer (schedulers, float inputs, load_best_model_at_end, empty param groups, a window left part
way). What is refused up front is in test_trainer_features_refused.py, the start line in
test_trainer_features_start_line.py."""
from __future__ import annotations

import pytest
import torch
from transformers import Seq2SeqTrainer, Trainer, TrainerCallback

from _t5 import OFFLOAD, ToyDataset, WithDecoderInputs, best_eval_step, tiny_t5
from _t5 import logged as _logged
from _features import FloatData, FloatRegressor, _args
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadTrainer


@pytest.mark.parametrize("sched", ["reduce_lr_on_plateau", "greedy", "cosine"])
def test_scheduler_types_match_the_plain_trainer(tmp_path, sched):
    from transformers.trainer_utils import SchedulerType

    if sched not in {s.value for s in SchedulerType}:
        pytest.skip(f"this transformers has no {sched!r} scheduler (GreedyLR from 5.4)")
    # the plateau schedulers step on evaluation metrics: evaluate every step; no improvement is ever enough
    # (threshold 100 %) for ReduceLROnPlateau, so its LR drops; GreedyLR moves its LR either way
    plateau = {"patience": 0, "factor": 0.5, "threshold": 1.0}
    greedy = {"patience": 1, "factor": 0.5, "cooldown": 0, "warmup": 0, "min_lr": 1e-5}
    kw = dict(lr_scheduler_type=sched, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
              max_steps=4, max_grad_norm=0.0, lr_scheduler_kwargs={"reduce_lr_on_plateau": plateau, "greedy": greedy}.get(sched, {}))
    ref_model = tiny_t5()
    ref = Seq2SeqTrainer(model=ref_model, args=_args(tmp_path, "ref", optim="adamw_torch", **kw),
                         train_dataset=ToyDataset(), eval_dataset=ToyDataset(8, seed=1))
    ref.train()
    model = tiny_t5()
    ours = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "ours", zero_offload=OFFLOAD, **kw),
                                     train_dataset=ToyDataset(), eval_dataset=ToyDataset(8, seed=1))
    ours.train()
    assert type(ours.lr_scheduler) is type(ref.lr_scheduler)
    assert _logged(ours, "learning_rate") == pytest.approx(_logged(ref, "learning_rate"), rel=1e-6)
    assert _logged(ours, "loss") == pytest.approx(_logged(ref, "loss"), rel=1e-5)
    if sched != "cosine":
        assert len(set(_logged(ours, "learning_rate"))) > 1  # the metric-driven logic did act


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_float_inputs_follow_the_16bit_model(tmp_path, dtype):
    model = FloatRegressor()
    targs = _args(tmp_path, dtype, zero_offload=OFFLOAD, eval_strategy="steps", eval_steps=3,
                  per_device_eval_batch_size=8, **{dtype: True})
    trainer = ZeroOffloadTrainer(model=model, args=targs, train_dataset=FloatData(), eval_dataset=FloatData(8))
    trainer.train()
    want = torch.bfloat16 if dtype == "bf16" else torch.float16
    assert set(model.seen) == {want}  # training and evaluation batches
    assert all(p.dtype == want for p in model.parameters())
    losses = _logged(trainer, "loss")
    assert all(torch.isfinite(torch.tensor(losses)))


def test_plain_trainer_subclass_without_zero_offload_is_untouched(tmp_path):
    trainer = ZeroOffloadTrainer(model=tiny_t5(), args=_args(tmp_path, "p", optim="adamw_torch"),
                                 train_dataset=ToyDataset())
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, torch.optim.AdamW) and isinstance(trainer, Trainer)


DPU = {"zero_optimization": {**OFFLOAD["zero_optimization"],
                             "delayed_param_update": {"enabled": True, "warmup_steps": 1}}}


@pytest.mark.parametrize("cfg", [OFFLOAD, DPU], ids=["sync", "dpu"])
def test_load_best_model_at_end_loads_our_state_of_the_best_checkpoint(tmp_path, cfg):
    # greater_is_better on eval_loss: the best checkpoint is an early one, not the last
    kw = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
              metric_for_best_model="eval_loss", greater_is_better=True, per_device_eval_batch_size=8,
              save_total_limit=1, max_grad_norm=1.0)
    model = tiny_t5()
    ours = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "ours", zero_offload=cfg, **kw),
                                     train_dataset=ToyDataset(), eval_dataset=ToyDataset(8, seed=1))
    ours.train()
    best_step = best_eval_step(ours.state)
    assert ours.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    # the model is the evaluated one (DPU: the train() end flush must not publish the last step over it) ...
    assert ours.evaluate()["eval_loss"] == pytest.approx(ours.state.best_metric, rel=1e-6)
    engine = ours.zero_engine
    assert engine.global_steps == best_step  # ... and the optimizer state is the best checkpoint's, not the last's
    if cfg is OFFLOAD:  # the masters are the weights
        for g in engine._slots:
            for p, off, n in g:
                assert torch.equal(p.detach().reshape(-1), engine.master[off:off + n])
        ref_model = tiny_t5()
        ref = Seq2SeqTrainer(model=ref_model, args=_args(tmp_path, "ref", optim="adamw_torch", **kw),
                             train_dataset=ToyDataset(), eval_dataset=ToyDataset(8, seed=1))
        ref.train()
        for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)  # DEBUG


def _frozen_t5():
    model = tiny_t5()
    model.shared.requires_grad_(False)  # tied: the lm_head is frozen with it
    return model


@pytest.mark.parametrize("kw, model_fn, data", [
    # 8 micro-batches in windows of 3: the last window of the epoch has 2
    (dict(max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=3), tiny_t5, ToyDataset),
    (dict(label_smoothing_factor=0.1, lr_scheduler_type="cosine", warmup_steps=0.3), tiny_t5, WithDecoderInputs),
    (dict(max_steps=4), _frozen_t5, ToyDataset),
], ids=["partial-accumulation-window", "label-smoothing-cosine-warmup-fraction", "frozen-tied-embedding"])
def test_trainer_features_equal_the_plain_trainer(tmp_path, kw, model_fn, data):
    kw = {"max_grad_norm": 1.0, "weight_decay": 0.01, **kw}
    ref_model, ours_model = model_fn(), model_fn()
    ref = Seq2SeqTrainer(model=ref_model, args=_args(tmp_path, "ref", optim="adamw_torch", **kw), train_dataset=data())
    ref.train()
    ours = ZeroOffloadSeq2SeqTrainer(model=ours_model, args=_args(tmp_path, "ours", zero_offload=OFFLOAD, **kw),
                                     train_dataset=data())
    ours.train()
    for (name, a), b in zip(ref_model.named_parameters(), ours_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)  # DEBUG
    for key in ("loss", "grad_norm", "learning_rate"):
        assert _logged(ours, key) == pytest.approx(_logged(ref, key), rel=1e-5), key
    assert len(_logged(ours, "loss")) == ours.state.global_step == ref.state.global_step == (
        3 if "num_train_epochs" in kw else kw.get("max_steps", 6))


def _only(kind):
    def make():
        model = tiny_t5()
        for n, p in model.named_parameters():  # T5's no-decay params: the layer norms and the relative attention bias
            p.requires_grad_(("layer_norm" in n or "bias" in n) == (kind == "no-decay"))
        return model
    return make


class _PerGroupSchedule:
    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None:  # one factor per group of the Trainer's layout: decay, no-decay
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, [lambda s: 1.0, lambda s: 0.3])
            self._created_lr_scheduler = True
        return self.lr_scheduler


@pytest.mark.parametrize("kind", ["decay", "no-decay"], ids=["frozen-norms", "bitfit-style"])
def test_an_empty_param_group_is_kept_as_the_plain_trainer_keeps_it(tmp_path, kind):
    """The engine dropped the empty group: a per-group LambdaLR failed ("Expected 1 lr_lambdas, but got 2") and
    param_groups[0] named the other group."""
    kw = dict(weight_decay=0.1, max_steps=4, save_strategy="steps", save_steps=2)
    ref_model, ours_model = _only(kind)(), _only(kind)()
    ref = type("Ref", (_PerGroupSchedule, Seq2SeqTrainer), {})(
        model=ref_model, args=_args(tmp_path, "ref", optim="adamw_torch", **kw), train_dataset=ToyDataset())
    ref.train()
    ours_cls = type("Ours", (_PerGroupSchedule, ZeroOffloadSeq2SeqTrainer), {})
    ours = ours_cls(model=ours_model, args=_args(tmp_path, "ours", zero_offload=OFFLOAD, **kw),
                    train_dataset=ToyDataset())
    ours.train()
    assert [len(g["params"]) for g in ours.optimizer.param_groups] == [len(g["params"]) for g in ref.optimizer.param_groups]
    for (name, a), b in zip(ref_model.named_parameters(), ours_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    resumed_model = _only(kind)()
    resumed = ours_cls(model=resumed_model, args=_args(tmp_path, "resumed", zero_offload=OFFLOAD, **kw),
                       train_dataset=ToyDataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-2"))
    for a, b in zip(ours_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


class SharedLayerNet(torch.nn.Module):
    """One layer applied three times, each in a reentrant-checkpointed segment: its gradient reaches the engine in
    three pieces per backward (ALBERT-style sharing with gradient checkpointing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.layer, self.out = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 64)

    def forward(self, input_ids, labels=None, attention_mask=None):
        h = self.emb(input_ids)
        for _ in range(3):
            h = h + torch.utils.checkpoint.checkpoint(self.layer, h, use_reentrant=True)
        logits = self.out(h)
        return {"loss": torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), labels.reshape(-1)),
                "logits": logits}


def test_bf16_gradient_in_pieces_within_one_backward(tmp_path):
    # was: RuntimeError "a parameter received a second gradient before step()" at the first backward
    trainer = ZeroOffloadTrainer(model=SharedLayerNet(), train_dataset=ToyDataset(), args=_args(
        tmp_path, "s", zero_offload=OFFLOAD, bf16=True, max_steps=2, train_sampling_strategy="sequential"))
    trainer.train()
    ref = SharedLayerNet().bfloat16()  # autograd sums the pieces into a bf16 .grad: the engine must see the same
    batch = {k: torch.stack([ToyDataset()[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    ref(**batch)["loss"].backward()
    norm = torch.stack([p.grad.double().norm() for p in ref.parameters()]).norm().item()
    assert _logged(trainer, "grad_norm")[0] == pytest.approx(norm, rel=1e-6)


# ---- a training loop left part way: its gradients must not reach the next one ---------------------------------------

class _OOMInBackward:
    """A CPU out-of-memory error raised once from inside backward (a hook on the encoder's output), after the
    decoder's gradients already reached the engine: where an OOM usually happens."""

    def __init__(self, model):
        self.fired = False
        model.encoder.register_forward_hook(self._forward)

    def _forward(self, module, inputs, out):
        if out.last_hidden_state.requires_grad:
            out.last_hidden_state.register_hook(self._backward)

    def _backward(self, grad):
        if not self.fired:
            self.fired = True
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes.")
        return grad


class _StopMidWindow(TrainerCallback):
    """After the first micro-batch of step 3: a callback stopping the run, or the notebook's stop button."""

    def __init__(self, how):
        self.how, self.done = how, False

    def on_substep_end(self, args, state, control, **kwargs):
        if not self.done and state.global_step == 2:
            self.done = True
            if self.how == "interrupt":
                raise KeyboardInterrupt
            control.should_training_stop = True


_ZERO2 = {"zero_optimization": {"stage": 2}}
_PLAIN: dict = {}  # how -> the plain Trainer's (model, trainer) of the test below


# each way of leaving a window with each engine (a stop and an interrupt leave it alike: one engine each, for time)
@pytest.mark.parametrize("how, cfg", [("oom-retry", OFFLOAD), ("oom-retry", _ZERO2), ("stop", _ZERO2),
                                      ("interrupt", OFFLOAD)],
                         ids=["oom-retry-offload", "oom-retry-zero2", "stop-zero2", "interrupt-offload"])
def test_a_window_left_part_way_is_dropped_as_the_plain_trainer_drops_it(tmp_path, how, cfg):
    """auto_find_batch_size retrying after an OOM in backward, or train() again after a stop or an interrupt in the
    middle of an accumulation window: transformers' model.zero_grad() at the top of the loop drops the partial
    gradients, but not those the engine had already taken from .grad, which were summed into the next first step
    (its grad_norm too large). Equal to the plain Trainer element by element."""
    kw = dict(max_steps=4, max_grad_norm=1.0, weight_decay=0.01)
    kw.update(auto_find_batch_size=True, per_device_train_batch_size=8) if how == "oom-retry" else \
        kw.update(gradient_accumulation_steps=2)
    runs = []
    for name, extra in (("ref", dict(optim="adamw_torch")), ("ours", dict(zero_offload=cfg))):
        if name == "ref" and how in _PLAIN:  # the plain run depends on `how` alone: oom-retry's two engines share it
            runs.append(_PLAIN[how])
            continue
        model = tiny_t5()
        trainer = (Seq2SeqTrainer if name == "ref" else ZeroOffloadSeq2SeqTrainer)(
            model=model, args=_args(tmp_path, name, **extra, **kw), train_dataset=ToyDataset())
        if how == "oom-retry":
            _OOMInBackward(model)
            trainer.train()
            assert trainer._train_batch_size < 8  # it did retry (to 7: accelerate cuts by 10%; 1.3 halved it: 4)
        else:
            trainer.add_callback(_StopMidWindow(how))
            try:
                trainer.train()
            except KeyboardInterrupt:
                pass
            assert trainer.state.global_step == 2
            trainer.train()
        runs.append((model, trainer))
    _PLAIN.setdefault(how, runs[0])
    (ref_model, ref), (model, ours) = runs
    assert ours._train_batch_size == ref._train_batch_size  # the same retry as the plain Trainer's
    assert _logged(ours, "grad_norm") == pytest.approx(_logged(ref, "grad_norm"), rel=1e-5)
    # batches of 7 (the retry's) differ from the plain Trainer by up to 3.8e-6 without any OOM, by reduction order
    atol = 1e-5 if how == "oom-retry" else 1e-6
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=atol, msg=name)
