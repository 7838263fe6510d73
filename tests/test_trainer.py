"""The Trainer integration on CPU: a tiny random-init T5 through ZeroOffloadSeq2SeqTrainer."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from transformers import HfArgumentParser, Seq2SeqTrainer, T5ForConditionalGeneration, TrainingArguments

from _t5 import ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload.config import ConfigError
from hf_zero_offload.cli import main as cli_main

OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
COMMON = dict(per_device_train_batch_size=4, num_train_epochs=1, max_steps=6, use_cpu=True, report_to=[],
              logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-3,
              weight_decay=0.01)


def args(tmp_path, name, **kw):
    return ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / name), **{**COMMON, **kw})


def run(trainer_cls, targs, seed=0, **kw):
    model = tiny_t5(seed)
    trainer = trainer_cls(model=model, args=targs, train_dataset=ToyDataset(), **kw)
    trainer.train(resume_from_checkpoint=kw.pop("resume", None))
    return model, trainer


def losses(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def test_flags_parse():
    parser = HfArgumentParser(ZeroOffloadSeq2SeqTrainingArguments)
    (a,) = parser.parse_args_into_dataclasses(["--output_dir", "x", "--zero_offload", "ds_config.json",
                                               "--sharded_ddp", "--predict_with_generate"])
    assert a.zero_offload == "ds_config.json" and a.sharded_ddp and a.predict_with_generate
    (b,) = parser.parse_args_into_dataclasses(["--output_dir", "x"])
    assert b.zero_offload is None and not b.sharded_ddp


# --gradient_checkpointing's name from transformers 5.23 on (before it, the old one is the only one)
_CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing" in
                  {f.name for f in dataclasses.fields(TrainingArguments)} else "gradient_checkpointing")


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "gradient-checkpointing"])
def test_fp32_equals_plain_trainer_with_accumulation_clipping_and_warmup(tmp_path, ckpt):
    # gradient checkpointing recomputes the forward during backward: each gradient still leaves once
    kw = dict(gradient_accumulation_steps=2, max_grad_norm=0.5, warmup_steps=2,
              **({_CHECKPOINTING: True} if ckpt else {}))
    ref_model, ref = run(Seq2SeqTrainer, args(tmp_path, "ref", optim="adamw_torch", **kw))
    model, ours = run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "ours", zero_offload=OFFLOAD, **kw))
    for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert losses(ours) == pytest.approx(losses(ref), rel=1e-6)
    assert losses(ours, "grad_norm") == pytest.approx(losses(ref, "grad_norm"), rel=1e-5)
    assert max(losses(ref, "grad_norm")) > 0.5  # clipping was active
    assert losses(ours, "learning_rate") == pytest.approx(losses(ref, "learning_rate"))


def test_accelerate_does_not_copy_the_optimizer_state(tmp_path, monkeypatch):
    """Accelerate's optimizer device placement would round-trip state_dict() (12 B/param of masters
    and moments) through the GPU at start-up: it must not run."""
    from hf_zero_offload.engine import OffloadAdam

    def refuse(self):
        raise AssertionError("state_dict() called during training")
    monkeypatch.setattr(OffloadAdam, "state_dict", refuse)
    run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "t", zero_offload=OFFLOAD, max_steps=2))


def test_bf16_trains_with_a_16bit_model(tmp_path):
    model, trainer = run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "bf16", bf16=True, max_steps=10,
                                                         learning_rate=3e-3, zero_offload=OFFLOAD))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    seen = losses(trainer)
    assert seen[-1] < seen[0]
    assert all(g > 0 for g in losses(trainer, "grad_norm"))


def test_fp16_overflow_skips_logs_and_holds_the_lr_schedule(tmp_path):
    cfg = {**OFFLOAD, "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 40, "hysteresis": 1,
                                "loss_scale_window": 1000, "min_loss_scale": 1}}
    model, trainer = run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "fp16", fp16=True, max_steps=8, warmup_steps=4,
                                                         zero_offload=cfg))
    scales = losses(trainer, "loss_scale")
    assert scales[0] < 2.0 ** 40 and scales == sorted(scales, reverse=True)  # halved on each overflow
    engine = trainer.zero_engine
    skipped = engine.scaler.cur_iter - int(engine._param_steps.max())
    assert skipped >= 1
    assert trainer.lr_scheduler.last_epoch == trainer.state.global_step - skipped
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert trainer.args.fp16 and trainer.accelerator.scaler is None  # caller's flag kept; no GradScaler


DPU_OFFLOAD = {"zero_optimization": {**OFFLOAD["zero_optimization"],
                                     "delayed_param_update": {"enabled": True, "warmup_steps": 1}}}


@pytest.mark.parametrize("cfg", [OFFLOAD, DPU_OFFLOAD], ids=["sync", "dpu"])
def test_resume_is_exact(tmp_path, cfg):
    # dpu: checkpoint-3 is taken mid-delay (masters one step ahead of the saved model); the resumed
    # run must continue on the same schedule
    kw = dict(gradient_accumulation_steps=2, max_grad_norm=1.0, zero_offload=cfg, save_strategy="steps",
              save_steps=3)
    full_model, full = run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "full", **kw))
    ckpt = tmp_path / "full" / "checkpoint-3"
    assert sorted(os.listdir(ckpt / "zero_offload")) == ["param_names.json", "rank0_of_1.hzo"]
    from hf_zero_offload.engine.checkpoint import read_header
    assert read_header(str(ckpt / "zero_offload" / "rank0_of_1.hzo"))[0]["needs_publish"] == (cfg is DPU_OFFLOAD)
    model = tiny_t5(seed=1)  # different init: everything must come from the checkpoint
    trainer = ZeroOffloadSeq2SeqTrainer(model=model, args=args(tmp_path, "resumed", **kw), train_dataset=ToyDataset())
    trainer.train(resume_from_checkpoint=str(ckpt))
    for a, b in zip(full_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert losses(trainer) == losses(full)  # the first 3 come from the checkpoint's trainer_state.json
    assert len(losses(full)) == 6


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_consolidate_round_trip(tmp_path, state_dtype):
    # the moments' storage does not reach the consolidated model: it is the fp32 masters
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "state_dtype": state_dtype}}
    kw = dict(bf16=True, zero_offload={"zero_optimization": zero}, save_strategy="steps", save_steps=3, max_steps=3)
    model, trainer = run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "run", **kw))
    out = tmp_path / "fp32"
    assert cli_main(["consolidate", str(tmp_path / "run" / "checkpoint-3"), str(out)]) == 0
    loaded = T5ForConditionalGeneration.from_pretrained(out)
    engine = trainer.zero_engine
    assert engine.moments.state_dtype == state_dtype
    assert loaded.lm_head.weight.data_ptr() == loaded.shared.weight.data_ptr()  # still tied
    masters = {}
    for g in engine._slots:
        for p, off, n in g:
            masters[id(p)] = engine.master[off:off + n].view(p.shape)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert q.dtype == torch.float32
        assert torch.equal(q, masters[id(p)]), name


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimiser": {"device": "cpu"}}}))
    with pytest.raises(ConfigError, match=r"offload_optimiser.*did you mean 'offload_optimizer'"):
        ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args(tmp_path, "x", zero_offload=str(path)))


def test_mismatches_are_listed_together(tmp_path):
    cfg = {**OFFLOAD, "gradient_clipping": 2.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}
    with pytest.raises(ConfigError) as err:
        run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "x", zero_offload=cfg))
    assert "gradient_clipping" in str(err.value) and "lr" in str(err.value)


def test_unsupported_feature_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="not supported"):
        ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args(tmp_path, "x", zero_offload={
            "zero_optimization": {"stage": 3}}))


def test_delayed_param_update_through_the_trainer(tmp_path):
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                 "delayed_param_update": {"enabled": True, "warmup_steps": 2}}}
    model, trainer = run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "dpu", max_steps=8, learning_rate=3e-3,
                                                         zero_offload=cfg))
    engine = trainer.zero_engine
    assert not engine.needs_publish  # train() ended with a flush: the model holds the last step
    for g in engine._slots:
        for p, off, n in g:
            assert torch.equal(p.detach().reshape(-1), engine.master[off:off + n])
    seen = losses(trainer)
    assert seen[-1] < seen[0]


@pytest.mark.parametrize("zero", [{"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                  {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                   "delayed_param_update": {"enabled": True, "warmup_steps": 2}}],
                         ids=["sync", "dpu"])
def test_simulated_gpu_pipeline_through_the_trainer(tmp_path, monkeypatch, zero):
    """The GPU code path (staging, deferred copies, events; engine/streams/sim.py) under the Trainer,
    with evaluation in the middle of training, equals the plain CPU path bit for bit."""
    kw = dict(zero_offload={"zero_optimization": zero}, max_steps=6, gradient_accumulation_steps=2,
              eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4)
    cpu_model, cpu = run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "cpu", **kw), eval_dataset=ToyDataset(8))
    monkeypatch.setenv("HF_ZERO_OFFLOAD_SIMULATE_STREAMS", "1")
    sim_model, sim = run(ZeroOffloadSeq2SeqTrainer, args(tmp_path, "sim", **kw), eval_dataset=ToyDataset(8))
    assert sim.zero_engine.streams.async_copies and not cpu.zero_engine.streams.async_copies
    assert sim.zero_engine.streams.copies > 0
    assert len(losses(cpu, "eval_loss")) == 2  # evaluated mid-training (the DPU flush path) and at the end
    assert losses(sim) == losses(cpu) and losses(sim, "eval_loss") == losses(cpu, "eval_loss")
    for a, b in zip(cpu_model.parameters(), sim_model.parameters()):
        assert torch.equal(a, b)


def test_callback_refuses_an_engine_of_several_ranks():
    """A plain Trainer saved rank 0's slice alone as optimizer.pt (2 ranks, ZeRO-1): the resume failed on rank 1,
    and ZeRO-2 under the Trainer's DDP wrapper failed at its first step with a misleading error."""
    from types import SimpleNamespace

    from hf_zero_offload import ZeroOffloadCallback
    engine = SimpleNamespace(world_size=2, grad_norm=lambda: 0.0, flush=lambda: None)
    with pytest.raises(ValueError, match=r"sharded over 2 ranks, and a plain Trainer saves one optimizer.pt from "
                                         r"rank 0.*use ZeroOffloadTrainer"):
        ZeroOffloadCallback().on_train_begin(None, SimpleNamespace(global_step=0), None, optimizer=engine)


def test_callback_with_a_plain_trainer(tmp_path):
    from hf_zero_offload import ZeroOffloadCallback
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    ref_model, ref = run(Seq2SeqTrainer, args(tmp_path, "ref", optim="adamw_torch", max_grad_norm=0.0,
                                              weight_decay=0.0, lr_scheduler_type="constant"))
    model = tiny_t5()
    engine = OffloadAdam(model.parameters(), lr=1e-3, options=OffloadOptions())
    sched = torch.optim.lr_scheduler.LambdaLR(engine, lambda _: 1.0)
    trainer = Seq2SeqTrainer(model=model, args=args(tmp_path, "cb", max_grad_norm=0.0, weight_decay=0.0),
                             train_dataset=ToyDataset(), optimizers=(engine, sched), callbacks=[ZeroOffloadCallback()])
    trainer.train()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert all(g > 0 for g in losses(trainer, "zero_grad_norm"))
    # a second train() after a stray backward (the engine took its gradients: they were summed into the next
    # first step) and with weights changed in between (the engine's stale masters overwrote them): as the plain one
    batch = {k: torch.stack([ToyDataset()[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    for m, t in ((ref_model, ref), (model, trainer)):
        m(**batch).loss.backward()
        with torch.no_grad():
            m.lm_head.weight.mul_(0.5)
        t.train()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_callback_refuses_a_param_unfrozen_during_training(tmp_path):
    """As the mixin: a param made trainable after the engine was built (here by a callback at step 2) has no slot in
    it; the plain Trainer's clipping would count its gradient, the engine's cannot. Refused at the next step."""
    from transformers import TrainerCallback

    from hf_zero_offload import ZeroOffloadCallback
    from hf_zero_offload.config import ConfigError
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    class Unfreeze(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                model.encoder.final_layer_norm.requires_grad_(True)

    model = tiny_t5()
    model.encoder.final_layer_norm.requires_grad_(False)
    engine = OffloadAdam([p for p in model.parameters() if p.requires_grad], lr=1e-3, options=OffloadOptions())
    trainer = Seq2SeqTrainer(model=model, args=args(tmp_path, "cb", max_grad_norm=0.0, max_steps=4),
                             train_dataset=ToyDataset(), optimizers=(engine, None),
                             callbacks=[ZeroOffloadCallback(), Unfreeze()])
    with pytest.raises(ConfigError,
                       match=r"1 parameter\(s\) became trainable after .*\(encoder.final_layer_norm.weight\)"):
        trainer.train()
    assert trainer.state.global_step == 2


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_callback_with_an_engine_over_some_trainable_params(tmp_path, clip):
    """An engine its user built over some of the trainable params: the others are not updated, as with a plain
    Trainer whose AdamW holds the same subset. Without clipping that is the same run; with clipping the plain Trainer's
    norm counts their gradients and the engine's cannot: refused, saying so (not 'became trainable': they were)."""
    from hf_zero_offload import ZeroOffloadCallback
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    model = tiny_t5()
    left_out = model.encoder.final_layer_norm.weight
    engine = OffloadAdam([p for p in model.parameters() if p is not left_out], lr=1e-3,
                         options=OffloadOptions(max_grad_norm=clip))
    before = left_out.detach().clone()
    trainer = Seq2SeqTrainer(model=model, args=args(tmp_path, "sub", max_grad_norm=clip, max_steps=3),
                             train_dataset=ToyDataset(), optimizers=(engine, None), callbacks=[ZeroOffloadCallback()])
    if clip:
        with pytest.raises(ConfigError, match=r"1 trainable parameter\(s\) the engine does not hold got gradients "
                                              r"\(encoder.final_layer_norm.weight\): with --max_grad_norm"):
            trainer.train()
        assert trainer.state.global_step == 0
    else:
        trainer.train()
        assert trainer.state.global_step == 3 and torch.equal(left_out, before)
