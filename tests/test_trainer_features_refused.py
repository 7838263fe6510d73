"""What --zero_offload cannot honour is refused at init, naming the argument (the user's optimizer, --optim,
the config's step counts, transformers 4's sharded_ddp values, an embedding with max_norm under the delayed
parameter update), and params unfrozen between or during train() calls are refused (frozen ones stay frozen)."""
from __future__ import annotations

import pytest
import torch
from transformers import Seq2SeqTrainer, TrainerCallback
from transformers.training_args import OptimizerNames

from _t5 import OFFLOAD, ToyDataset, tiny_t5
from _features import COMMON, FloatData, FloatRegressor, _args
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments, ZeroOffloadTrainer
from hf_zero_offload.config import ConfigError
from hf_zero_offload.consolidate import consolidate


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
