"""Engine choice from typed options, without transformers (``engine/factory.py``)."""
from __future__ import annotations

import copy
import sys

import pytest
import torch

from _models import TinyNet, batches, loss_fn, param_groups
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam, ShardOptions
from hf_zero_offload.engine.factory import build_engine, choose

SMALL = dict(bucket_numel=1200, tile_numel=300, num_threads=1)


@pytest.mark.parametrize("world,stage,offload,sharded_ddp,expect", [
    (1, 2, True, False, (OffloadAdam, 2)),
    (1, 1, True, True, (OffloadAdam, 2)),
    (2, 1, True, False, (ShardedAdam, 1)),
    (2, 2, False, False, (ShardedAdam, 2)),
    (1, 2, False, False, (ShardedAdam, 2)),
    (2, 0, False, True, (ShardedAdam, 2)),     # --sharded_ddp asks for partitioning
    (1, 0, False, False, (ShardedAdam, 0)),    # DeepSpeed's stage 0: nothing partitioned
])
def test_choice_table(world, stage, offload, sharded_ddp, expect):
    assert choose(world, ShardOptions(stage=stage, offload=offload), sharded_ddp=sharded_ddp) == expect


def test_stage_zero_is_never_reported_while_running_another_stage():
    with pytest.raises(ValueError, match="stage 0 .*2 ranks.*plain DDP"):
        choose(2, ShardOptions(stage=0, offload=False))
    with pytest.raises(ValueError, match="offload needs ZeRO stage 1 or 2"):
        choose(1, ShardOptions(stage=0, offload=True))


def test_stage_zero_on_one_process_trains_like_stage_one_and_says_stage_0():
    data = batches(4)
    torch.manual_seed(0)
    a, b = TinyNet(), None
    b = copy.deepcopy(a)
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, adamw_mode=True, param_dtype=torch.float32,
                 options=OffloadOptions(**SMALL))
    e0 = build_engine(param_groups(a, 0.01), world_size=1, shard=ShardOptions(stage=0, offload=False), **hyper)
    e1 = ShardedAdam(param_groups(b, 0.01), stage=1, offload=False, **hyper)
    assert e0.stage == 0 and e0.state_meta()["stage"] == 0
    for model, opt in ((a, e0), (b, e1)):
        for ids, labels, use_branch in data:
            loss_fn(model, ids, labels, use_branch).backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_reduce_scatter_off_is_passed_to_the_engine():
    e = build_engine(param_groups(TinyNet(), 0.0), world_size=1, param_dtype=torch.float32, lr=1e-3,
                     betas=(0.9, 0.999), eps=1e-8, adamw_mode=True, options=OffloadOptions(**SMALL),
                     shard=ShardOptions(stage=2, offload=False, reduce_scatter=False))
    assert isinstance(e, ShardedAdam) and not e.reducer.use_rs


def test_the_engine_package_imports_no_transformers_config_or_planner():
    import subprocess
    code = ("import sys, hf_zero_offload.engine, hf_zero_offload.engine.factory; "
            "bad = [m for m in sys.modules if m.startswith(('transformers', 'hf_zero_offload.config', "
            "'hf_zero_offload.planner', 'hf_zero_offload.trainer'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("stage,dtype,gas,warned", [(1, "bf16", 4, True), (1, "fp16", 2, True), (1, "fp32", 4, False),
                                                   (1, "bf16", 1, False), (2, "bf16", 4, False)])
def test_stage1_says_it_sums_16bit_micro_batches_in_grad(caplog, stage, dtype, gas, warned):
    """Stage 1 reduces the full .grad once a step, so autograd sums the micro-batches there in bf16, where stage 2
    and the one-process engine sum them in fp32: that was said nowhere."""
    from types import SimpleNamespace
    from hf_zero_offload import config
    from hf_zero_offload.engine_setup import build_engine as build_from_config
    raw = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
           "fp16": {"enabled": dtype == "fp16"}}
    args = SimpleNamespace(learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, world_size=1,
                           sharded_ddp=True)
    with caplog.at_level("WARNING", logger="hf_zero_offload"):
        engine = build_from_config(param_groups(TinyNet(), 0.0), config.resolve(raw), args)
    said = [r.getMessage() for r in caplog.records if "stage 1 sums" in r.getMessage()]
    assert engine.stage == stage and len(said) == warned
    if warned:
        assert f"ZeRO stage 1 sums the {gas} micro-batches of a step in the params' .grad, in " in said[0]
    engine.close()


@pytest.mark.parametrize("stage,dtype,gas,refused", [(1, "bf16", 4, True), (1, "fp32", 4, False), (1, "bf16", 1, False),
                                                     (2, "bf16", 4, False)])
def test_grad_accum_dtype_fp32_at_stage1_with_a_16bit_model_is_refused(stage, dtype, gas, refused, monkeypatch):
    """data_types.grad_accum_dtype "fp32" was accepted as what the engines do, but ZeRO-1 sums a 16-bit model's
    micro-batches in .grad, in 16 bits (DeepSpeed's BF16_Optimizer sums them in fp32 there): an outside probe. Refused
    before an engine (its host arena) is built."""
    from types import SimpleNamespace
    from hf_zero_offload import config
    from hf_zero_offload.engine_setup import build_engine as build_from_config
    raw = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
           "data_types": {"grad_accum_dtype": "fp32"}}
    args = SimpleNamespace(learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, world_size=1,
                           sharded_ddp=True)
    if refused:
        from hf_zero_offload.engine import factory

        monkeypatch.setattr(factory, "build_engine", lambda *a, **k: pytest.fail("an engine was built"))
        with pytest.raises(config.ConfigError, match=r"data_types\.grad_accum_dtype \"fp32\" with ZeRO stage 1, a "
                                                     r"bfloat16 model and gradient_accumulation_steps 4"):
            build_from_config(param_groups(TinyNet(), 0.0), config.resolve(raw), args)
    else:
        build_from_config(param_groups(TinyNet(), 0.0), config.resolve(raw), args).close()
