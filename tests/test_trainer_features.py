"""Trainer features combined with --zero_offload, in the style of transformers' own Trainer tests: each works as
with the plain Trainer, or is refused up front with a clear message."""
from __future__ import annotations

import pytest
import torch
from transformers import Seq2SeqTrainer, Trainer, TrainerCallback
from transformers.training_args import OptimizerNames

from _t5 import OFFLOAD, ToyDataset, WithDecoderInputs, best_eval_step, tiny_t5
from _t5 import logged as _logged
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments, ZeroOffloadTrainer
from hf_zero_offload.config import ConfigError
from hf_zero_offload.consolidate import consolidate

COMMON = dict(per_device_train_batch_size=4, max_steps=6, use_cpu=True, report_to=[], logging_steps=1,
              save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, weight_decay=0.0)


def _args(tmp_path, name, **kw):
    return ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / name), **{**COMMON, **kw})



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


def test_users_optimizer_is_refused_up_front(tmp_path):
    model = tiny_t5()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"Passing optimizer and lr scheduler .*not allowed with zero_offload.*"
                                          r"ZeroOffloadCallback") as refused:
        ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "x", zero_offload=OFFLOAD),
                                  train_dataset=ToyDataset(),
                                  optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)))
    # (transformers' Seq2SeqTrainer takes no optimizer_cls_and_kwargs: not suggested there, a README audit)
    assert "optimizer_cls_and_kwargs" not in str(refused.value) and "override create_optimizer" in str(refused.value)
    with pytest.raises(ConfigError, match=r"optimizer_cls_and_kwargs=\(torch.optim.AdamW"):
        ZeroOffloadTrainer(model=model, args=_args(tmp_path, "z", zero_offload=OFFLOAD), train_dataset=ToyDataset(),
                           optimizers=(opt, None))
    with pytest.raises(ConfigError, match="optimizer_cls_and_kwargs"):
        ZeroOffloadTrainer(model=model, args=_args(tmp_path, "y", zero_offload=OFFLOAD),
                           optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))


class FloatRegressor(torch.nn.Module):
    """A model whose inputs are float features (audio / vision style), with a loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.seen: list[torch.dtype] = []

    def forward(self, features, labels=None):
        self.seen.append(features.dtype)
        out = self.net(features).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out.float(), labels.float()), "logits": out}


class FloatData(torch.utils.data.Dataset):
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(-1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i]}


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


def test_whole_config_is_checked_at_init(tmp_path):
    cfg = {**OFFLOAD, "gradient_clipping": 2.0}
    with pytest.raises(ConfigError, match=r"gradient_clipping=2.0 vs --max_grad_norm"):
        ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, "x", zero_offload=cfg))


def test_a_scheduler_block_does_not_silently_replace_another_lr_scheduler_type(tmp_path):
    # the shipped configs carry WarmupLR: --lr_scheduler_type cosine would otherwise be dropped without a word
    with pytest.raises(ConfigError, match=r"scheduler.type='WarmupLR' vs --lr_scheduler_type cosine"):
        ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, "c", zero_offload="zero2-offload",
                                                              lr_scheduler_type="cosine"))
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(
        tmp_path, "k", zero_offload="zero2-offload", lr_scheduler_type="constant_with_warmup"))
    assert trainer.zero_config is None or trainer.zero_config.scheduler.type == "WarmupLR"


def test_init_check_leaves_unknown_step_counts_to_train_start(tmp_path):
    # epochs, not max_steps: total_num_steps "auto" and a warm-up ratio are known only at train start
    cfg = {**OFFLOAD, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto",
                                                                        "warmup_num_steps": "auto"}}}
    kw = {**COMMON, "max_steps": -1, "num_train_epochs": 1, "warmup_steps": 0.5}
    trainer = ZeroOffloadSeq2SeqTrainer(
        model=tiny_t5(), args=ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / "e"), zero_offload=cfg,
                                                                  **kw),
        train_dataset=ToyDataset())
    trainer.train()
    assert trainer.zero_config.scheduler.total_num_steps == trainer.state.max_steps == 8
    assert trainer.zero_config.scheduler.warmup_num_steps == 4
    # transformers' public create_optimizer_and_scheduler(n) before train(): the schedule takes n (building the
    # optimizer resolved the whole config, and "auto" total_num_steps failed although n was given)
    early = ZeroOffloadSeq2SeqTrainer(
        model=tiny_t5(), args=ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / "c"), zero_offload=cfg,
                                                                  **kw),
        train_dataset=ToyDataset())
    early.create_optimizer_and_scheduler(num_training_steps=6)
    assert early.lr_scheduler.total == 6 and early.zero_config.scheduler.warmup_num_steps == 3
    # a model_init Trainer has no model at __init__: the "auto" bucket size waits for it
    ZeroOffloadSeq2SeqTrainer(model_init=lambda *_: tiny_t5(), args=_args(tmp_path, "mi", zero_offload={
        "zero_optimization": {**OFFLOAD["zero_optimization"], "reduce_bucket_size": "auto"}}))


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
def test_a_step_count_not_known_at_init_gives_no_warm_up_warning(tmp_path, caplog, kind):
    """Epochs and a whole-number warm-up: __init__ stands 1 in for the step count, and the warm-up check said "total_num_steps
    1 is less than warmup_num_steps 5: ... warms up for the whole run" while the run resolved 18 steps and decayed.
    A run really shorter than its warm-up is still told."""
    from hf_zero_offload.config.resolver import reset_warnings
    cfg = {**OFFLOAD, "scheduler": {"type": kind, "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}}

    def build(name, **kw):
        reset_warnings()
        caplog.clear()
        with caplog.at_level("WARNING"):
            ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(), args=ZeroOffloadSeq2SeqTrainingArguments(
                output_dir=str(tmp_path / name), zero_offload=cfg, **{**COMMON, "warmup_steps": 5, **kw}))
        return [r.getMessage() for r in caplog.records if "warmup_num_steps" in r.getMessage()]

    assert build("epochs", max_steps=-1, num_train_epochs=2) == []
    (said,) = build("short", max_steps=3)
    assert "total_num_steps 3 is less than warmup_num_steps 5" in said


def test_auto_bucket_size_of_a_model_without_a_width_is_refused_at_init(tmp_path):
    # a custom nn.Module (no config): "auto" reduce_bucket_size failed at train(), after model work, with no way out
    auto = {"zero_optimization": {**OFFLOAD["zero_optimization"], "reduce_bucket_size": "auto"}}
    with pytest.raises(ConfigError, match=r'reduce_bucket_size: "auto" needs the model\'s hidden_size \(its config\'s '
                                          r'hidden_size, d_model or n_embd\), which is unknown here: replace "auto" '
                                          r"with a value, a number of elements \(DeepSpeed's default: 500000000\)"):
        ZeroOffloadTrainer(model=FloatRegressor(), args=_args(tmp_path, "w", zero_offload=auto),
                           train_dataset=FloatData())


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


_HAS_APEX_NAME = "adamw_apex_fused" in {o.value for o in OptimizerNames}


@pytest.mark.parametrize("extra, match", [
    # only the names this transformers accepts (adamw_hf and adamw_apex_fused were listed: 5.25 refuses both; 5.3, the
    # floor, still has adamw_apex_fused, and trains it in the engine)
    (dict(optim="sgd"), r"--optim sgd: the zero_offload engine is Adam/AdamW only \(accepted: adamw_torch, "
                        r"adamw_torch_fused" + ("" if _HAS_APEX_NAME else r"\)")),
    (dict(optim="adamw_torch_xla"), r"--optim adamw_torch_xla: AdamW for an XLA device, where the zero_offload "
                                    r"engines do not run"),
    (dict(optim="adafactor"), r"--optim adafactor"),
    (dict(save_only_model=True, load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"),
     r"--save_only_model with --load_best_model_at_end"),
])
def test_arguments_the_engine_cannot_honour_are_refused_at_init(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, "x", zero_offload=OFFLOAD, **extra),
                                  train_dataset=ToyDataset(), eval_dataset=ToyDataset(8))


def test_params_unfrozen_between_two_train_calls_are_refused(tmp_path):
    model = tiny_t5()
    model.shared.requires_grad_(False)
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "u", zero_offload=OFFLOAD, max_steps=2),
                                        train_dataset=ToyDataset())
    trainer.train()
    trainer.train()  # the same trainable set: the engine goes on
    model.shared.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"1 parameter\(s\) became trainable after .*\(shared.weight\)"):
        trainer.train()


class _Unfreeze(TrainerCallback):
    def __init__(self, hook, at):
        self.hook, self.at = hook, at

    def _maybe(self, state, model):
        if state.global_step == self.at:
            if self.hook == "swap":  # a submodule swapped in: its params were never seen by the engine
                model.encoder.final_layer_norm = type(model.encoder.final_layer_norm)(model.config.d_model)
            else:
                model.shared.requires_grad_(True)  # gradual unfreezing

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.hook in ("on_step_end", "swap"):
            self._maybe(state, model)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.hook == "on_step_begin":
            self._maybe(state, model)


@pytest.mark.parametrize("hook, gas, at, name", [
    ("on_step_end", 1, 2, "shared.weight"), ("on_step_end", 2, 2, "shared.weight"),
    ("on_step_begin", 1, 4, "shared.weight"),  # after the watch's own on_step_begin, at the last step
    ("swap", 1, 2, "encoder.final_layer_norm.weight"),
])
def test_params_unfrozen_by_a_callback_during_training_are_refused(tmp_path, hook, gas, at, name):
    """The plain Trainer silently never updates such a param (it is in no optimizer group) but counts its gradient in
    its clipping; the engine cannot: refused at that very optimizer step, naming the param, before it runs."""
    model = tiny_t5()
    model.shared.requires_grad_(False)
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "c", zero_offload=OFFLOAD, max_steps=5,
                                                                gradient_accumulation_steps=gas, max_grad_norm=1.0),
                                        train_dataset=ToyDataset(), callbacks=[_Unfreeze(hook, at)])
    with pytest.raises(ConfigError, match=rf"1 parameter\(s\) became trainable after .*\({name}\).*To unfreeze "
                                          r"during training, make them trainable before the Trainer is created"):
        trainer.train()
    assert trainer.state.global_step == at


def test_params_frozen_between_two_train_calls_stay_as_they_are(tmp_path):
    """As with the plain Trainer; the engine's hooks, attached again at every train(), were put on a frozen param,
    which torch refuses. Equal to the plain Trainer element by element."""
    runs = []
    for name, extra in (("ref", dict(optim="adamw_torch")), ("ours", dict(zero_offload=OFFLOAD))):
        model = tiny_t5()
        trainer = (Seq2SeqTrainer if name == "ref" else ZeroOffloadSeq2SeqTrainer)(
            model=model, args=_args(tmp_path, name, max_steps=2, **extra), train_dataset=ToyDataset())
        trainer.train()
        model.decoder.final_layer_norm.requires_grad_(False)
        trainer.train()
        runs.append(model)
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_resuming_a_save_only_model_checkpoint_names_it(tmp_path):
    kw = dict(zero_offload=OFFLOAD, save_only_model=True, save_strategy="steps", save_steps=2, max_steps=2)
    ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, "s", **kw), train_dataset=ToyDataset()).train()
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, "s", **{**kw, "max_steps": 4}),
                                        train_dataset=ToyDataset())
    with pytest.raises(FileNotFoundError, match=r"holds the model only .*--save_only_model.*from_pretrained"):
        trainer.train(resume_from_checkpoint=True)
    # consolidate said the run was not trained with --zero_offload
    with pytest.raises(FileNotFoundError, match=r"saved without one \(--save_only_model\).*from_pretrained"):
        consolidate(str(tmp_path / "s" / "checkpoint-2"), str(tmp_path / "out"))


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


def _start_line(tmp_path, caplog, **kw) -> str:
    """The one start line of a 1-step run with these arguments."""
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=_args(tmp_path, "s", max_steps=1, **kw),
                                        train_dataset=ToyDataset())
    with caplog.at_level("INFO", logger="hf_zero_offload"):
        trainer.train()
    (start,) = [r.getMessage() for r in caplog.records if "hf_zero_offload: config=" in r.getMessage()]
    return start


def test_a_config_path_with_a_space_is_quoted_in_the_start_line(tmp_path, caplog):
    """An outside probe: `config=my cönfig.json ranks=1 ...` read as two values in a key=value line."""
    import json
    cfg = tmp_path / "my cönfig.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    assert f"config='{cfg}' ranks=1 " in _start_line(tmp_path, caplog, zero_offload=str(cfg))


def test_start_line_names_sharded_ddp_alone(tmp_path, caplog):
    """--sharded_ddp without a ds_config logged config=<dict>: the start line now says what was asked for."""
    assert "config=--sharded_ddp (stage 2) " in _start_line(tmp_path, caplog, sharded_ddp=True)


def test_a_ds_config_without_zero_optimization_says_it_offloads_nothing(tmp_path, caplog):
    """--zero_offload with a ds_config that has no "zero_optimization" section ran ZeRO stage 0 without offload (as
    DeepSpeed reads it) with only the start line's stage=0 offload=False to say so (outside probe, session 23)."""
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(),
                                        args=_args(tmp_path, "s", zero_offload={"gradient_clipping": 1.0}, max_steps=1))
    with caplog.at_level("INFO", logger="hf_zero_offload"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and "zero_optimization" in r.getMessage()]
    assert len(said) == 1 and "nothing is offloaded or sharded" in said[0], said
    for name, cfg, extra, warns in (("e", {"zero_optimization": {}}, {}, True),  # empty: the same stage 0
                                    ("t", OFFLOAD, {}, False),
                                    ("u", {"gradient_clipping": 1.0}, {"sharded_ddp": True}, False)):  # stage 2
        caplog.clear()
        trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(),
                                            args=_args(tmp_path, name, zero_offload=cfg, max_steps=1, **extra))
        with caplog.at_level("INFO", logger="hf_zero_offload"):
            trainer.train()
        assert warns == any("nothing is offloaded or sharded" in r.getMessage() for r in caplog.records), name


@pytest.mark.parametrize("value", ["zero_dp_2", "zero_dp_3 offload", "simple"])
def test_transformers_4_sharded_ddp_values_are_refused_with_the_way(tmp_path, value):
    with pytest.raises(ConfigError, match=f"--sharded_ddp {value}: transformers 4.x's fairscale values .* here "
                                          "--sharded_ddp is a switch"):
        ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, sharded_ddp=value)
    with pytest.raises(ConfigError, match="sharded_ddp must be True or False, got 'zero'"):
        ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, sharded_ddp="zero")
    with pytest.raises(ConfigError, match="--sharded_ddp zero_dp_2 offload: transformers 4.x's fairscale values"):
        ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                            sharded_ddp=["zero_dp_2", "offload"])
    for given, want in (("false", False), (None, False), ("yes", True)):  # JSON files and code, as argparse takes them
        assert ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                   sharded_ddp=given).sharded_ddp is want


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
    (ref_model, ref), (model, ours) = runs
    assert ours._train_batch_size == ref._train_batch_size  # the same retry as the plain Trainer's
    assert _logged(ours, "grad_norm") == pytest.approx(_logged(ref, "grad_norm"), rel=1e-5)
    # batches of 7 (the retry's) differ from the plain Trainer by up to 3.8e-6 without any OOM, by reduction order
    atol = 1e-5 if how == "oom-retry" else 1e-6
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("dpu", [True, False])
def test_an_embedding_with_max_norm_is_refused_with_dpu(tmp_path, dpu):
    """nn.Embedding(max_norm=...) renormalises its weight in place at every forward, which the delayed update takes as
    a write that keeps its values over the step's update: the embedding never trained past the DPU warm-up (an outside
    probe: it moved 0.008 where the plain Trainer moved it 0.85). Refused by name with DPU; without, it trains."""
    model = tiny_t5()
    model.shared.max_norm = 100.0  # far above every row's norm: the renormalisation changes no value
    zero = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                  "delayed_param_update": {"enabled": dpu, "warmup_steps": 0}}}
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "m", zero_offload=zero, max_steps=2),
                                        train_dataset=ToyDataset())
    if dpu:
        with pytest.raises(ConfigError, match=r"delayed_param_update with nn.Embedding\(max_norm=...\) \(shared\): "
                                              r"the embedding renormalises its weight in place at every forward"):
            trainer.train()
    else:
        trainer.train()
        assert trainer.state.global_step == 2


def test_modules_a_model_keeps_in_fp32_are_named_when_trained_in_16_bit(tmp_path, caplog):
    """A model's _keep_in_fp32_modules (T5's wo) and _keep_in_fp32_modules_strict (a router it requires in fp32) train
    in the one training dtype, as under DeepSpeed; the strict ones were cast without a word."""
    import logging

    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    model = tiny_t5()
    model._keep_in_fp32_modules_strict = ["lm_head"]
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=_args(tmp_path, "k", zero_offload=OFFLOAD, max_steps=1,
                                                                bf16=True), train_dataset=ToyDataset())
    trainer.train()
    said = {r.levelno: r.getMessage() for r in caplog.records if "keeps" in r.getMessage()}
    assert said[logging.INFO].startswith("hf_zero_offload: T5ForConditionalGeneration keeps wo in fp32 "
                                         "(_keep_in_fp32_modules); the engine trains every parameter in bfloat16")
    assert "keeps lm_head in fp32 (_keep_in_fp32_modules_strict)" in said[logging.WARNING]


def test_start_line_says_a_stage_1_offload_file_runs_as_stage_2_on_one_process(tmp_path, caplog):
    """'"stage": 1' with offload on one process read stage=2 (the engine's) with no word of the file's 1."""
    zero = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    assert " engine=OffloadAdam stage=2(config:1) " in _start_line(tmp_path, caplog, zero_offload=zero)
