"""ShardedAdam with the delayed parameter update (ZeRO-2/1 + offload + DPU) on 2 gloo processes.

The reference is written by hand: DDP averages the gradients, ``torch.optim.AdamW`` steps fp32
masters, and the model's parameters lag one step behind the masters after the warm-up, as in
OffloadAdam's DPU (test_engine_dpu.py). Also: the simulated GPU upload path under DPU, resume in the
middle of a delayed run, and cross-loading with OffloadAdam.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_distributed
from _models import TinyNet, delayed_update_reference, loss_fn, param_groups, write_some_params
from hf_zero_offload.engine import OffloadAdam, OffloadOptions
from hf_zero_offload.engine import ShardedAdam
from hf_zero_offload.engine.streams import SimStreams
from test_sharding import GATHER, LR, SMALL, WD, flat_params, rank_data, train

SIMS = {"cpu": None, "sim-lazy": dict(executor="lazy"), "sim-eager": dict(executor="eager")}


def ddp_dpu_reference(data, warmup: int, gas: int = 1, edit=None):
    """(device model, master model) after ``data``: DDP gradients, the delayed update on the masters."""
    torch.manual_seed(0)
    device_model = TinyNet()
    return delayed_update_reference(device_model, data, warmup, lr=LR, weight_decay=WD, gas=gas,
                                    forward=DDP(device_model, find_unused_parameters=True), edit=edit)


def dpu_engine(model, *, stage=2, warmup=2, gas=1, sim=None):
    opts = OffloadOptions(dpu=True, dpu_warmup_steps=warmup, gradient_accumulation_steps=gas, **SMALL)
    return ShardedAdam(param_groups(model, WD), lr=LR, options=opts, stage=stage, offload=True,
                       allgather_bucket_numel=GATHER, streams=None if sim is None else SimStreams(**sim))


def _schedule_job(rank, world):
    out = {}
    for stage, warmup, gas, sim, mixed in [(2, 0, 1, "cpu", False), (2, 3, 1, "cpu", True), (1, 2, 1, "cpu", False),
                                           (2, 2, 2, "cpu", False), (2, 1, 1, "sim-lazy", False),
                                           (1, 1, 1, "sim-eager", True)]:
        data = rank_data(rank, 8, mixed)
        ref_device, ref_master = ddp_dpu_reference(data, warmup, gas)
        torch.manual_seed(0)
        model = TinyNet()
        opt = dpu_engine(model, stage=stage, warmup=warmup, gas=gas, sim=SIMS[sim])
        train(model, opt, data, gas=gas)
        key = f"s{stage}-w{warmup}-gas{gas}-{sim}{'-mixed' if mixed else ''}"
        res = {"needs_publish": opt.needs_publish, "lagging": flat_params(model),
               "ref_lagging": flat_params(ref_device)}
        opt.flush()
        res.update(final=flat_params(model), ref_final=flat_params(ref_master), needs_publish_after=opt.needs_publish)
        if sim != "cpu":
            res["bytes_up"] = opt.streams.bytes_up
        opt.close()
        out[key] = res
    return out


def test_dpu_follows_the_delayed_schedule_on_two_ranks():
    r0, r1 = run_distributed(_schedule_job)
    for key, res in r0.items():
        assert torch.equal(res["final"], r1[key]["final"]), key  # ranks stay identical
        assert res["needs_publish"] and not res["needs_publish_after"], key
        torch.testing.assert_close(res["lagging"], res["ref_lagging"], rtol=1e-5, atol=1e-6, msg=key)
        torch.testing.assert_close(res["final"], res["ref_final"], rtol=1e-5, atol=1e-6, msg=key)
        assert not torch.equal(res["lagging"], res["final"]), key  # the device really was one step behind
        if "bytes_up" in res:
            assert res["bytes_up"] > 0, key  # the simulated GPU upload path ran


def _write_job(rank, world):
    out = {}
    for stage, sim in [(2, "cpu"), (1, "cpu"), (2, "sim-lazy")]:
        data = rank_data(rank, 7, False)
        ref_device, ref_master = ddp_dpu_reference(data, 2, edit=(4, write_some_params))
        torch.manual_seed(0)
        model = TinyNet()
        opt = dpu_engine(model, stage=stage, warmup=2, sim=SIMS[sim])
        for k, (ids, labels, use_branch) in enumerate(data, start=1):
            loss_fn(model, ids, labels, use_branch).backward()
            opt.step()
            opt.zero_grad()
            if k == 4:
                if sim != "cpu":
                    opt.streams.run_compute_waits()  # a GPU queues the write after the compute stream's waits
                write_some_params(model)
        lagging = flat_params(model)
        opt.flush()
        out[f"s{stage}-{sim}"] = dict(lagging=lagging, ref_lagging=flat_params(ref_device), final=flat_params(model),
                                      ref_final=flat_params(ref_master))
        opt.close()
    return out


def test_params_written_while_a_delayed_step_is_in_flight_are_what_the_next_step_starts_from():
    """Each rank's publish wrote over them (with a warning to flush() first); now they are kept and every rank's
    shard of masters takes them, against DDP + AdamW with the write made on the device model."""
    r0, r1 = run_distributed(_write_job)
    for key, res in r0.items():
        assert torch.equal(res["final"], r1[key]["final"]), key
        torch.testing.assert_close(res["lagging"], res["ref_lagging"], rtol=1e-5, atol=1e-6, msg=key)
        torch.testing.assert_close(res["final"], res["ref_final"], rtol=1e-5, atol=1e-6, msg=key)


def _overflow_job(rank, world):
    """fp16 + DPU, an overflow on rank 1 only at step 4: both ranks skip it synchronously (the delayed
    step in flight is published, no Adam); the model then holds exactly the masters, rounded."""
    torch.manual_seed(0)
    model = TinyNet()
    opts = OffloadOptions(dpu=True, dpu_warmup_steps=1, fp16=dict(enabled=True, loss_scale=0, initial_scale_power=8),
                          **SMALL)
    opt = ShardedAdam(param_groups(model, WD), lr=LR, options=opts, stage=2, offload=True,
                      allgather_bucket_numel=GATHER)
    model.half()
    seen = []
    for k, (ids, labels, use_branch) in enumerate(rank_data(rank, 6), start=1):
        loss = opt.scale_loss(loss_fn(model, ids, labels, use_branch))
        (loss * float("inf") if (k == 4 and rank == 1) else loss).backward()
        opt.step()
        opt.zero_grad()
        if k == 4:
            flat = torch.cat([p.detach().reshape(-1) for g in opt.slot_params() for p in g])
            n = opt.shard_end - opt.shard_start
            seen.append(torch.equal(flat[opt.shard_start:opt.shard_end], opt.master[:n].half()))
        seen.append((opt.last.skipped, opt.needs_publish))
    opt.close()
    return seen, flat_params(model)


def test_an_overflow_on_one_rank_is_a_synchronous_skip_on_both():
    (s0, p0), (s1, p1) = run_distributed(_overflow_job)
    assert s0 == s1 and torch.equal(p0, p1)
    # steps 1 (warm-up) .. 6: step 4 skipped and published (the model = the masters), DPU again after
    assert s0 == [(False, False), (False, True), (False, True), True, (True, False), (False, True),
                  (False, True)], s0


def _resume_job(rank, world, tmp):
    data = rank_data(rank, 10)
    torch.manual_seed(0)
    init = TinyNet()
    full = copy.deepcopy(init)
    o_full = dpu_engine(full, warmup=2)
    train(full, o_full, data)
    first = copy.deepcopy(init)
    o_first = dpu_engine(first, warmup=2)
    train(first, o_first, data[:5])
    o_first.save_checkpoint(f"{tmp}/ckpt")
    assert o_first.state_meta()["needs_publish"]  # saved mid-delay: masters one step ahead
    state5 = copy.deepcopy(first.state_dict())
    o_first.close()
    second = copy.deepcopy(init)
    second.load_state_dict(state5)
    o_second = dpu_engine(second, warmup=2)
    o_second.load_checkpoint(f"{tmp}/ckpt")
    train(second, o_second, data[5:])
    # the engine's state first, then the model's weights (they dropped the in-flight step's update, 1.5e-2 off)
    torch.manual_seed(1)
    third = TinyNet()
    o_third = dpu_engine(third, warmup=2)
    o_third.load_checkpoint(f"{tmp}/ckpt")
    third.load_state_dict(state5)
    train(third, o_third, data[5:])
    lag = (flat_params(full), flat_params(second))
    o_full.flush()
    o_second.flush()
    o_third.flush()
    return {"lag": lag, "final": (flat_params(full), flat_params(second)), "state5": state5,
            "master": (o_full.master.clone(), o_second.master.clone()),
            "engine_first": (flat_params(full), flat_params(third))}


def test_resume_in_the_middle_of_a_delayed_run_is_bit_exact(tmp_path):
    r0, r1 = run_distributed(_resume_job, str(tmp_path))
    for r in (r0, r1):
        for pair in (r["lag"], r["final"], r["master"], r["engine_first"]):
            assert torch.equal(*pair), (pair[0] - pair[1]).abs().max()
    # the same checkpoint into one process without DPU: the masters (one step ahead) are published
    model = TinyNet()
    model.load_state_dict(r0["state5"])
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL))
    opt.load_checkpoint(str(tmp_path / "ckpt"))
    assert not opt.needs_publish
    for g in opt._slots:
        for p, off, n in g:
            assert torch.equal(p.detach().reshape(-1), opt.master[off:off + n])


def test_offload_adam_dpu_state_into_a_non_dpu_engine_publishes_the_masters(tmp_path):
    from _models import batches
    torch.manual_seed(0)
    model = TinyNet()
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(dpu=True, dpu_warmup_steps=0, **SMALL))
    for ids, labels, use_branch in batches(3):
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
    opt.save_checkpoint(str(tmp_path))
    saved = copy.deepcopy(model.state_dict())
    masters = opt.master.clone()
    opt.close()
    again = TinyNet()
    again.load_state_dict(saved)
    plain = OffloadAdam(param_groups(again, WD), lr=LR, options=OffloadOptions(**SMALL))
    plain.load_checkpoint(str(tmp_path))
    assert not plain.needs_publish
    names = {id(p): n for n, p in again.named_parameters()}
    behind = 0
    for g in plain._slots:
        for p, off, n in g:
            assert torch.equal(p.detach().reshape(-1), masters[off:off + n])
            behind += not torch.equal(saved[names[id(p)]].reshape(-1), masters[off:off + n])
    assert behind > 0  # the saved parameters were one step behind the masters


def test_dpu_without_offload_is_refused():
    with pytest.raises(ValueError, match="needs offload=True"):
        ShardedAdam(TinyNet().parameters(), options=OffloadOptions(dpu=True), offload=False)


def _upload_tiles_job(rank, world, state_dtype, width, sim):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 1))
    opts = OffloadOptions(dpu=True, dpu_warmup_steps=1, state_dtype=state_dtype, tile_numel=300, bucket_numel=200,
                          num_threads=1)
    opt = ShardedAdam(list(model.parameters()), lr=LR, options=opts, stage=2, offload=True,
                      streams=SimStreams() if sim else None)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(5):
        model(torch.randn(8, width, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    staging = opt.regions.get("param_staging")
    out = {"params": flat_params(model), "state": opt.state_dict(), "shard": opt.plan.numel,
           "staging": None if staging is None else staging.numel()}
    opt.close()
    return out


@pytest.mark.parametrize("state_dtype", ["int8", "fp32"])
@pytest.mark.parametrize("width", [20, 60])  # shards of 256 elements (one int8 block), and of several tiles
def test_dpu_upload_tiles_equal_the_cpu_path(state_dtype, width):
    """The simulated GPU path of a delayed step uploads through two staging tiles of tile_numel (int8:
    whole blocks) and equals the CPU path bit for bit. A full-size staging cut in halves made tiles of
    half a 256-element shard, so each half encoded the int8 block alone (the params drifted)."""
    cpu = run_distributed(_upload_tiles_job, state_dtype, width, False)
    sim = run_distributed(_upload_tiles_job, state_dtype, width, True)
    tile = 512 if state_dtype == "int8" else 300  # int8 tiles round up to whole blocks
    for c, s in zip(cpu, sim):
        assert torch.equal(c["params"], s["params"])
        for k, v in c["state"].items():
            assert torch.equal(v, s["state"][k]) if isinstance(v, torch.Tensor) else v == s["state"][k], k
        assert c["staging"] is None and s["staging"] == 2 * min(tile, s["shard"]), (s["staging"], s["shard"])
