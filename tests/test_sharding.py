"""ShardedAdam (ZeRO stage 1/2, with and without offload) on 2 gloo processes against DDP + AdamW.

Each spawned job runs several scenarios (a spawn costs seconds on 2 cores); the checks that need
both ranks' results compare them in the parent.
"""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_distributed
from _models import TinyNet, batches, loss_fn, param_groups
from hf_zero_offload.engine import OffloadAdam, OffloadOptions
from hf_zero_offload.engine.sharded import optimizer as sharding
from hf_zero_offload.engine import ShardedAdam
from hf_zero_offload.engine.streams import SimStreams

LR, WD = 1e-2, 0.1
# several buckets, rounds and gather rounds even on a tiny model (the largest param has 1200 elements)
SMALL = dict(bucket_numel=1200, tile_numel=300, num_threads=1)
GATHER = 1000
TIGHT = dict(rtol=1e-5, atol=1e-6)
CONFIGS = {"s1": dict(stage=1, offload=False), "s1-off": dict(stage=1, offload=True),
           "s2": dict(stage=2, offload=False), "s2-off": dict(stage=2, offload=True),
           "s2-torch": dict(stage=2, offload=False, device_adam="torch"),
           # the reduce-scatter that NCCL gets (gloo reduces to owners): stage 1 rounds, and a stage 2
           # model in one bucket, which splits into equal owner pieces
           "s1-rs": dict(stage=1, offload=True, rs=True), "s2-rs": dict(stage=2, offload=False, rs=True, bucket=10**6),
           # the GPU offload path (updated tiles up through staging, events) on the stream simulator
           "s2-off-sim": dict(stage=2, offload=True, sim=True)}


def rank_data(rank: int, n: int, mixed: bool = False):
    """Per-rank batches; ``mixed``: the branch is used on different steps on the two ranks."""
    data = batches(n, seed=10 + rank)
    if mixed:
        data = [(ids, labels, (i + rank) % 3 != 2) for i, (ids, labels, _) in enumerate(data)]
    return data


def train(model, opt, data, gas=1, clip=0.0, grad_bytes=None):
    """Micro-batches ids[i::gas]; returns the grad norms (DDP: clip_grad_norm_, ours: opt.last)."""
    norms = []
    for ids, labels, use_branch in data:
        for i in range(gas):
            (loss_fn(model, ids[i::gas], labels[i::gas], use_branch) / gas).backward()
        if grad_bytes is not None:  # .grad memory alive when backward is done
            grad_bytes.append(sum(p.grad.numel() * p.grad.element_size()
                                  for p in model.parameters() if p.grad is not None))
        if isinstance(opt, torch.optim.AdamW):
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else None)
        opt.step()
        opt.zero_grad()
        if not isinstance(opt, torch.optim.AdamW):
            norms.append(opt.last.grad_norm)
    return norms


def ddp_run(data, gas=1, clip=0.0, device="cpu"):
    torch.manual_seed(0)
    model = TinyNet().to(device)
    ddp = DDP(model, find_unused_parameters=True, device_ids=[device] if device != "cpu" else None)
    opt = torch.optim.AdamW(param_groups(model, WD), lr=LR, foreach=False)
    grad_bytes = []
    norms = train(ddp, opt, data, gas, clip, grad_bytes)
    return model, norms, grad_bytes


def sharded(model, fp16=None, gas=1, clip=0.0, rs=False, bucket=None, sim=False, **cfg):
    opts = OffloadOptions(gradient_accumulation_steps=gas, max_grad_norm=clip, fp16=fp16,
                          **{**SMALL, **({"bucket_numel": bucket} if bucket else {})})
    sharding.FORCE_REDUCE_SCATTER = rs
    try:
        opt = ShardedAdam(param_groups(model, WD), lr=LR, options=opts, allgather_bucket_numel=GATHER,
                          streams=SimStreams() if sim else None, **cfg)
    finally:
        sharding.FORCE_REDUCE_SCATTER = False
    if not dist.is_initialized() or dist.get_backend() == "gloo":
        assert opt.reducer.use_rs == (rs and dist.is_initialized())
    return opt


def flat_params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def assert_models_close(ref, model, **tol):
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.detach().float(), a.detach().float(), msg=name, **tol)


# -- job 1: parity with DDP, memory, clipping, accumulation ---------------------------------------
def _parity_job(rank, world):
    out = {}
    n_trainable = sum(p.numel() for p in TinyNet().parameters() if p.requires_grad)
    shard = math.ceil(n_trainable / world)
    for mixed in (False, True):
        data = rank_data(rank, 10, mixed)
        ref, _, ddp_grad_bytes = ddp_run(data)
        for name, cfg in CONFIGS.items():
            if mixed and name not in ("s1", "s2-off", "s2-rs"):
                continue
            torch.manual_seed(0)
            model = TinyNet()
            if rank == 1:  # rank 1 starts elsewhere: the engine must broadcast rank 0's weights
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0) if p.requires_grad else None
            opt = sharded(model, **cfg)
            grad_bytes = []
            train(model, opt, data, grad_bytes=grad_bytes)
            assert_models_close(ref, model, **TIGHT)
            if cfg.get("sim"):
                # each step the updated part of the fp32 shard went up (params without a gradient stay)
                assert 0.5 * 10 * 4 * shard < opt.streams.bytes_up <= 10 * 4 * shard
            mem = opt.memory_bytes()
            # what is really allocated is the plan: the arena (page-rounded regions) and device tensors
            assert opt.arena is None or opt.arena.nbytes == opt.plan.host_bytes
            assert sum(t.numel() * t.element_size() for k, t in opt.regions.items()
                       if opt.plan.regions[k][2] == "device") == opt.plan.device_bytes
            assert mem["optimizer_state"] == 12 * shard, mem
            assert mem["grad_store"] == 4 * shard, mem
            if cfg["stage"] == 2:
                assert grad_bytes == [0] * 10  # every .grad left during backward
                assert mem["grad_buffers"] <= 2 * 4 * (cfg.get("bucket", SMALL["bucket_numel"]) + world)
            else:
                assert max(grad_bytes) == max(ddp_grad_bytes) == 4 * n_trainable  # full .grad until step()
            out[(name, mixed)] = dict(mem=mem, params=flat_params(model))
            opt.close()
    # clipping: same global norm as DDP + clip_grad_norm_, on both ranks
    data = rank_data(rank, 10)
    ref, ref_norms, _ = ddp_run(data, clip=0.05)
    for name in ("s1", "s2-off", "s2-torch"):
        torch.manual_seed(0)
        model = TinyNet()
        norms = train(model, sharded(model, clip=0.05, **CONFIGS[name]), data)
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert min(norms) > 0.05  # clipping was active
        assert_models_close(ref, model, **TIGHT)
        out[("clip", name)] = norms
    # gradient accumulation 2: two micro-batches of 2 per step, against DDP doing the same
    ref, _, _ = ddp_run(data, gas=2)
    for name in ("s1", "s2", "s2-off"):
        torch.manual_seed(0)
        model = TinyNet()
        train(model, sharded(model, gas=2, **CONFIGS[name]), data, gas=2)
        assert_models_close(ref, model, **TIGHT)
    return out, n_trainable


def _ddp_and_overflow_job(rank, world):
    return _parity_job(rank, world), _overflow_job(rank, world)  # one spawn for both


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_ddp_and_overflow_job)


def test_matches_ddp_adamw_memory_clipping_accumulation(two_rank_results):
    ((r0, n), _), ((r1, _), _) = two_rank_results
    for key, v in r0.items():
        if key[0] == "clip":
            assert v == r1[key]  # identical norm (and clip decision) on both ranks
            continue
        assert torch.equal(v["params"], r1[key]["params"]), key  # replicas stay identical
        # each rank holds half of the optimizer state a single process would (12 B/param)
        assert v["mem"]["optimizer_state"] + r1[key]["mem"]["optimizer_state"] == 12 * n
        assert v["mem"]["grad_store"] == r1[key]["mem"]["grad_store"] == 4 * n // 2


# -- job 2: fp16 overflow injected on one rank -----------------------------------------------------
FP16 = dict(enabled=True, loss_scale=0, initial_scale_power=8, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)


def _overflow_job(rank, world):
    out = {}
    for cfg in (dict(stage=2, offload=True), dict(stage=1, offload=False)):
        torch.manual_seed(0)
        model = TinyNet()
        opt = sharded(model, fp16=FP16, **cfg)
        model.half()
        skipped, scales = [], []
        for k, (ids, labels, use_branch) in enumerate(rank_data(rank, 6)):
            loss = opt.scale_loss(loss_fn(model, ids, labels, use_branch))
            if k in (2, 3) and rank == 1:
                loss = loss * float("inf")  # overflow on rank 1 only
            masters = opt.master.clone()
            params = flat_params(model)
            loss.backward()
            opt.step()
            opt.zero_grad()
            skipped.append(opt.last.skipped)
            scales.append(opt.loss_scale)
            if k in (2, 3):
                assert torch.equal(opt.master, masters) and torch.equal(flat_params(model), params)
        assert max(opt._param_steps) == 4
        out[cfg["stage"]] = (skipped, scales, flat_params(model))
    return out


def test_fp16_overflow_on_one_rank_skips_on_both(two_rank_results):
    (_, r0), (_, r1) = two_rank_results
    for stage in (1, 2):
        for r in (r0, r1):
            skipped, scales, _ = r[stage]
            assert skipped == [False, False, True, True, False, False]
            assert scales == [256, 256, 256, 128, 128, 128]  # hysteresis 2, the same on both ranks
        assert torch.equal(r0[stage][2], r1[stage][2])
        assert torch.isfinite(r0[stage][2]).all()


# -- job 3: checkpoints: resume exact, world size 2 -> 1 and 1 -> 2 ---------------------------------
def _resume_job(rank, world, root, one_proc_dir, one_proc_model):
    out = {}
    data = rank_data(rank, 10)
    for name, cfg, gas in (("s2-off", dict(stage=2, offload=True), 1), ("s1-gas2", dict(stage=1, offload=False), 2)):
        torch.manual_seed(0)
        init = TinyNet()
        full = copy.deepcopy(init)
        train(full, sharded(full, gas=gas, **cfg), data, gas)
        first = copy.deepcopy(init)
        o1 = sharded(first, gas=gas, **cfg)
        train(first, o1, data[:5], gas)
        ckpt = os.path.join(root, name)
        o1.save_checkpoint(ckpt)
        state5 = copy.deepcopy(first.state_dict())
        o1.close()
        second = copy.deepcopy(init)
        second.load_state_dict(state5)
        o2 = sharded(second, gas=gas, **cfg)
        o2.load_checkpoint(ckpt)
        train(second, o2, data[5:], gas)
        for a, b in zip(full.parameters(), second.parameters()):
            assert torch.equal(a, b), name  # 5 + save/load + 5 == 10, bit for bit
        out[name] = dict(state5=state5, final=flat_params(full), ckpt=ckpt)
    if rank == 0:
        assert sorted(os.listdir(out["s2-off"]["ckpt"])) == ["meta.json", "rank0_of_2.hzo", "rank1_of_2.hzo"]
    # 1 -> 2: continue a one-process OffloadAdam checkpoint on two ranks (each with half the batch)
    model = TinyNet()
    model.load_state_dict(one_proc_model)
    opt = sharded(model, stage=2, offload=True)
    opt.load_checkpoint(one_proc_dir)
    train(model, opt, [(ids[rank::2], labels[rank::2], ub) for ids, labels, ub in both_ranks_data(5, 10)])
    out["from1"] = flat_params(model)
    return out


def both_ranks_data(lo, hi):
    """Rank 0's and rank 1's batches as one batch, rows interleaved (rank r = rows r::2)."""
    r0, r1 = rank_data(0, hi)[lo:], rank_data(1, hi)[lo:]
    return [(torch.stack([a, b], 1).flatten(0, 1), torch.stack([la, lb], 1).flatten(0, 1), u)
            for (a, la, u), (b, lb, _) in zip(r0, r1)]


def test_checkpoint_resume_and_world_size_change(tmp_path):
    # a one-process run over both ranks' data: its 5-step checkpoint seeds the 1 -> 2 case
    torch.manual_seed(0)
    single = TinyNet()
    so = OffloadAdam(param_groups(single, WD), lr=LR, options=OffloadOptions(**SMALL))
    train(single, so, both_ranks_data(0, 5))
    so.save_checkpoint(str(tmp_path / "one"))
    state5 = copy.deepcopy(single.state_dict())
    train(single, so, both_ranks_data(5, 10))
    r0, r1 = run_distributed(_resume_job, str(tmp_path), str(tmp_path / "one"), state5)
    # 1 -> 2 equals continuing on one process (same global batch; only summation order differs)
    assert torch.equal(r0["from1"], r1["from1"])
    torch.testing.assert_close(r0["from1"], flat_params(single), rtol=1e-4, atol=1e-5)
    # 2 -> 1: one process re-partitions the two shards and continues on the global batch
    for name in ("s2-off", "s1-gas2"):
        res = r0[name]
        assert torch.equal(res["final"], r1[name]["final"])
        for make in ("sharded", "offload"):
            model = TinyNet()
            model.load_state_dict(res["state5"])
            if make == "sharded":
                opt = sharded(model, stage=2, offload=True)  # no process group: world size 1
                opt.load_checkpoint(res["ckpt"])
            else:
                opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL))
                opt.load_checkpoint(res["ckpt"])  # any engine loads any world size
            assert opt.global_steps == 5
            train(model, opt, both_ranks_data(5, 10))
            torch.testing.assert_close(flat_params(model), res["final"], rtol=1e-4, atol=1e-5, msg=(name, make))


# -- one process: no spawn --------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
def test_world_size_one_matches_adamw_with_frozen_tied_and_unused(cfg):
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    opt = sharded(model, **CONFIGS[cfg])
    data = batches(12)
    train(ref_model, ref, data)
    train(model, opt, data)
    assert_models_close(ref_model, model, **TIGHT)
    assert model.head.weight is model.embed.weight
    assert opt._param_steps[opt._slot_of[id(model.branch.weight)]] == 8  # skipped when unused, like AdamW


def test_bad_arguments_and_incomplete_checkpoint(tmp_path):
    model = TinyNet()
    with pytest.raises(ValueError, match="stage"):
        sharded(model, stage=3)
    with pytest.raises(ValueError, match="delayed parameter update"):
        ShardedAdam(model.parameters(), options=OffloadOptions(dpu=True), offload=False)
    with pytest.raises(ValueError, match="offload=False"):
        sharded(model, offload=True, device_adam="torch")
    opt = sharded(model)
    (tmp_path / "rank0_of_2.hzo").write_bytes(b"")
    with pytest.raises(ValueError, match="incomplete"):
        opt.load_checkpoint(str(tmp_path))
    opt.save_checkpoint(str(tmp_path / "ok"))
    other = ShardedAdam(torch.nn.Linear(3, 3).parameters(), options=OffloadOptions(**SMALL))
    with pytest.raises(ValueError, match="does not match this model"):
        other.load_checkpoint(str(tmp_path / "ok"))


def test_the_dist_helper_reports_a_failing_rank():
    from _dist import DistributedError
    with pytest.raises(DistributedError, match="rank 1"):
        run_distributed(_fail_on_rank_1, timeout=60)


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("boom")
    dist.barrier()  # rank 0 waits for a peer that is gone: the helper must not hang


def test_bf16_world_size_one_is_offload_adam_bit_for_bit():
    data = batches(6)
    torch.manual_seed(0)
    init = TinyNet()
    ref = copy.deepcopy(init)
    ro = OffloadAdam(param_groups(ref, WD), lr=LR, param_dtype=torch.bfloat16, options=OffloadOptions(**SMALL))
    ref.bfloat16()
    train(ref, ro, data)
    for name in ("s1", "s2-off"):
        model = copy.deepcopy(init)
        opt = sharded(model, param_dtype=torch.bfloat16, **CONFIGS[name])
        model.bfloat16()
        train(model, opt, data)
        assert torch.equal(opt.master, ro.master[:opt.numel]) and torch.equal(flat_params(model), flat_params(ref))


# -- CUDA (opt-in: -m cuda) ----------------------------------------------------------------------------
CUDA_CONFIGS = ("s1", "s2", "s2-off", "s1-rs")


def _cuda_parity(rank, world, device):
    data = [(ids.to(device), labels.to(device), ub) for ids, labels, ub in rank_data(rank, 10)]
    ref, _, _ = ddp_run(data, device=device)
    for name in CUDA_CONFIGS:
        torch.manual_seed(0)
        model = TinyNet().to(device)
        opt = sharded(model, **CONFIGS[name])
        grad_bytes = []
        train(model, opt, data, grad_bytes=grad_bytes)
        torch.cuda.synchronize()
        assert_models_close(ref, model, rtol=1e-4, atol=1e-5)
        if CONFIGS[name]["stage"] == 2:
            assert grad_bytes == [0] * 10
        opt.close()
    return True


def _cuda_job(rank, world):
    return _cuda_parity(rank, world, f"cuda:{torch.cuda.current_device()}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_world_size_one_matches_adamw():
    device = "cuda"
    data = [(ids.to(device), labels.to(device), ub) for ids, labels, ub in batches(10)]
    torch.manual_seed(0)
    ref_model = TinyNet().to(device)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    train(ref_model, ref, data)
    for name in ("s1", "s2", "s2-off", "s1-off"):
        torch.manual_seed(0)
        model = TinyNet().to(device)
        train(model, sharded(model, **CONFIGS[name]), data)
        torch.cuda.synchronize()
        assert_models_close(ref_model, model, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_gpus_match_ddp():
    assert run_distributed(_cuda_job, backend="nccl", timeout=300) == [True, True]
