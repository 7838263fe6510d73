"""DeepSpeed's bf16 ``check_grad_overflow``: a step whose gradients are not finite is skipped (masters, moments and
step counts untouched, the LR schedule held), on one process and on every rank of a sharded run; without it such a
step is applied as torch's clip_grad_norm_ + AdamW apply it. The key was accepted and ignored: one inf gradient was
applied and the weights went NaN (an outside probe with a real config)."""
from __future__ import annotations

import math

import pytest
import torch

from _dist import run_distributed
from _models import TinyNet, batches, loss_fn, param_groups
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

BAD = 2  # the step whose loss is made inf


def _train(opt, model, data, rank=0, bad_rank=0):
    skipped, finite = [], []
    for k, (ids, labels, use_branch) in enumerate(data):
        loss = loss_fn(model, ids, labels, use_branch)
        if k == BAD and rank == bad_rank:
            loss = loss * float("inf")
        masters = opt.master.clone()
        loss.backward()
        opt.step()
        opt.zero_grad()
        skipped.append(opt.last.skipped)
        finite.append(bool(torch.isfinite(opt.master).all()))
        if opt.last.skipped:
            assert torch.equal(opt.master, masters)
    return skipped, finite


@pytest.mark.parametrize("skip", [True, False])
def test_a_nonfinite_bf16_step_is_skipped_only_when_asked(skip, caplog):
    torch.manual_seed(0)
    model = TinyNet()
    opt = OffloadAdam(param_groups(model, 0.01), lr=1e-2, param_dtype=torch.bfloat16,
                      options=OffloadOptions(num_threads=1, skip_nonfinite=skip))
    model.to(torch.bfloat16)  # frozen params and buffers; the engine cast the trainable ones
    with caplog.at_level("WARNING", logger="hf_zero_offload"):
        skipped, finite = _train(opt, model, batches(5))
    said = [r.getMessage() for r in caplog.records if "step skipped" in r.getMessage()]
    assert said == (["hf_zero_offload: step skipped: its gradients are not finite (bf16.check_grad_overflow); nothing "
                     "moved"] if skip else [])  # (an outside probe: a run skipping every step said nothing)
    if skip:
        assert skipped == [False, False, True, False, False] and all(finite)
        assert int(opt._param_steps.max()) == 4 and opt.last.grad_norm > 0
    else:  # torch's clip_grad_norm_ + AdamW: the inf gradient is applied
        assert not any(skipped) and not finite[-1]
    opt.close()


def test_skip_nonfinite_is_a_bool():
    with pytest.raises(TypeError, match="skip_nonfinite must be True or False"):
        OffloadOptions(skip_nonfinite="true")


def _sharded_job(rank, world):
    out = {}
    for stage, offload in ((2, True), (1, False)):
        torch.manual_seed(0)
        model = TinyNet()
        opt = ShardedAdam(param_groups(model, 0.01), lr=1e-2, param_dtype=torch.bfloat16, stage=stage,
                          offload=offload, options=OffloadOptions(num_threads=1, skip_nonfinite=True))
        model.to(torch.bfloat16)
        torch.manual_seed(rank)
        skipped, finite = _train(opt, model, batches(5), rank=rank, bad_rank=1)
        out[stage] = (skipped, finite, torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]))
        opt.close()
    return out


def test_an_inf_on_one_rank_skips_the_step_on_every_rank():
    r0, r1 = run_distributed(_sharded_job)
    for stage in (1, 2):
        for skipped, finite, _ in (r0[stage], r1[stage]):
            assert skipped == [False, False, True, False, False] and all(finite)
        assert torch.equal(r0[stage][2], r1[stage][2])


def test_the_trainer_skips_holds_the_schedule_and_logs_the_norm(tmp_path):
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    class OneInfStep(ZeroOffloadSeq2SeqTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            loss = super().compute_loss(model, inputs, *a, **kw)
            return loss * float("inf") if self.state.global_step == BAD else loss

    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "bf16": {"enabled": "auto", "check_grad_overflow": True}}
    targs = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=5, use_cpu=True, report_to=[], seed=0,
        logging_steps=1, disable_tqdm=True, learning_rate=1e-3, warmup_steps=3, bf16=True, save_strategy="no",
        zero_offload=cfg)
    model = tiny_t5(0)
    trainer = OneInfStep(model=model, args=targs, train_dataset=ToyDataset())
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert [math.isfinite(n) for n in norms] == [i != BAD for i in range(5)]  # (an inf loss: NaN gradients)
    assert trainer.lr_scheduler.last_epoch == trainer.state.global_step - 1  # the skipped step did not advance it
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _trainer_job(rank, world, out_dir, stage, dpu, gas):
    """The Trainer on ``world`` ranks (1: one process), the inf on the last micro-batch of step BAD of the last rank."""
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    class OneInf(ZeroOffloadSeq2SeqTrainer):
        calls = 0

        def compute_loss(self, model, inputs, *a, **kw):
            loss = super().compute_loss(model, inputs, *a, **kw)
            OneInf.calls += 1
            return loss * float("inf") if (self.state.global_step == BAD and OneInf.calls % gas == 0
                                           and rank == world - 1) else loss

    zo = {"stage": stage, "offload_optimizer": {"device": "cpu" if stage == 2 else "none"}}
    if dpu:
        zo["delayed_param_update"] = {"enabled": True, "warmup_steps": 0}
    targs = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=gas, max_steps=5, use_cpu=True,
        report_to=[], seed=0, logging_steps=1, disable_tqdm=True, learning_rate=1e-3, warmup_steps=3, bf16=True,
        save_strategy="no", sharded_ddp=world > 1, ddp_backend="gloo" if world > 1 else None,
        zero_offload={"zero_optimization": zo, "bf16": {"enabled": "auto", "check_grad_overflow": True}})
    model = tiny_t5(0)
    trainer = OneInf(model=model, args=targs, train_dataset=ToyDataset(64))
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert [math.isfinite(n) for n in norms] == [i != BAD for i in range(5)], norms
    assert trainer.lr_scheduler.last_epoch == trainer.state.global_step - 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return True


@pytest.mark.parametrize("stage, dpu, gas, world", [(2, True, 2, 1), (1, False, 2, 2), (2, True, 2, 2)])
def test_accumulation_dpu_and_zero1_skip_alike(tmp_path, stage, dpu, gas, world):
    """A review ran these beside the tests above: the skip with accumulation (the inf on one micro-batch), with the
    delayed update, and at ZeRO-1 (which reduces .grad at the step) on 2 ranks."""
    if world == 1:
        assert _trainer_job(0, 1, str(tmp_path), stage, dpu, gas)
    else:
        assert run_distributed(_trainer_job, str(tmp_path), stage, dpu, gas, timeout=200) == [True, True]
