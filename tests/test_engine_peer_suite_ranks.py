"""The engines probed the way peer suites probe ZeRO optimizers, on two ranks: param groups with their own
hyperparameters, an lr changed mid-run and kept zero gradients against DDP + AdamW; bf16/int8 moments against the
one-process engine of the same state dtype; a model smaller than one shard's int8 block trained and reloaded on one
process; ZeRO-2 summing a gradient that arrives in two pieces after its bucket went (one process:
test_engine_peer_suite.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_distributed
from _models import TinyNet, batches
from _peer_suite import (LR, DROPS, DTYPES, SHARDED, SMALL, TIGHT, _sharded, assert_compact_close, dropping_data, flat,
                         offload, own_groups, run)
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam


def _two_rank_job(rank, world, ckpt):
    out = {}
    same = batches(6)                   # the same data on both ranks: the one-process gradient
    own = batches(6, seed=10 + rank)    # each rank its own: against DDP
    torch.manual_seed(0)
    ddp_model = TinyNet()
    # drop: each window starts with a backward through the branch that zero_grad(set_to_none=False) drops
    for keep, drop in ((False, False), (True, False), (False, True)):
        data, drops = (dropping_data(seed=10 + rank), DROPS) if drop else (own, None)
        m = copy.deepcopy(ddp_model)
        ref = torch.optim.AdamW(own_groups(m), lr=LR, foreach=False)
        run(DDP(m, find_unused_parameters=True), ref, data, keep_zero=keep, drops=drops)
        for name, cfg in SHARDED.items():
            if cfg.get("dpu"):
                continue  # one step behind AdamW by design (test_sharding_dpu.py has its reference)
            torch.manual_seed(0)
            model = TinyNet()
            opt = _sharded(model, own_groups, cfg)
            run(model, opt, data, keep_zero=keep, drops=drops)
            torch.testing.assert_close(flat(model), flat(m), **TIGHT, msg=f"{name} keep_zero={keep} drop={drop}")
            opt.close()
    for st in ("bf16", "int8"):
        for name in ("s1-off", "s2-off", "s2-off-dpu"):
            torch.manual_seed(0)
            model = TinyNet()
            opt = _sharded(model, own_groups, SHARDED[name], st)
            run(model, opt, same)
            out[(st, name)] = flat(model)
            opt.close()
    # a model smaller than one int8 block (and than the ranks, in elements): rank 1's shard is all
    # padding; stage 2 delivered its piece past the end of its store, inside backward
    for st in DTYPES:
        for name in ("s1-off", "s2-off", "s2-off-dpu"):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(5))
            opt = _sharded(p, lambda q: [q], SHARDED[name], st)
            for _ in range(4):
                (p * p * torch.arange(5.0)).sum().backward()
                opt.step()
                opt.zero_grad()
            opt.flush()
            out[("tiny", st, name)] = p.detach().clone()
            if name == "s2-off":
                opt.save_checkpoint(f"{ckpt}/{st}")
            opt.close()
    dist.barrier()
    return out


def _tiny_one_process(state_dtype, dpu, load=None):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    opt = OffloadAdam([p], lr=LR, options=OffloadOptions(**SMALL, state_dtype=state_dtype, dpu=dpu,
                                                        dpu_warmup_steps=2))
    if load:
        opt.load_checkpoint(load)
        return opt
    for _ in range(4):
        (p * p * torch.arange(5.0)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    return opt, p


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    return run_distributed(_two_rank_job, str(ckpt), timeout=150, collective_timeout=30), ckpt


def test_sharded_own_groups_lr_change_and_kept_zero_grads_match_ddp(two_ranks):
    """Stage 1/2, with and without offload, with set_to_none True and False (asserted on the ranks)."""
    (r0, r1), _ = two_ranks
    for key in r0:
        if key[0] != "tiny":
            assert torch.equal(r0[key], r1[key]), key  # both ranks hold the same params


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_sharded_compact_states_with_own_groups_match_one_process(two_ranks, state_dtype):
    (r0, _), _ = two_ranks
    for name in ("s1-off", "s2-off", "s2-off-dpu"):
        torch.manual_seed(0)
        model = TinyNet()
        opt = offload(model, state_dtype=state_dtype, dpu=name.endswith("dpu"), dpu_warmup_steps=2)
        run(model, opt, batches(6))
        assert_compact_close(r0[(state_dtype, name)], flat(model))
        opt.close()


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_a_model_smaller_than_a_shard_block_trains_and_reloads_on_one_process(two_ranks, state_dtype):
    (r0, r1), ckpt = two_ranks
    for name in ("s1-off", "s2-off", "s2-off-dpu"):
        opt, p = _tiny_one_process(state_dtype, name.endswith("dpu"))
        for r in (r0, r1):
            assert torch.equal(r[("tiny", state_dtype, name)], p.detach()), name
        if name == "s2-off":
            loaded = _tiny_one_process(state_dtype, False, load=f"{ckpt}/{state_dtype}")
            for k, t in opt.state_tensors().items():
                assert torch.equal(loaded.state_tensors()[k], t), k
            loaded.close()
        opt.close()


class _SharedInTwoSegments(torch.nn.Module):
    """A layer used by two segments checkpointed with use_reentrant=True: each segment's backward accumulates
    its piece of that layer's gradient on its own, so the gradient reaches the engine twice in one backward."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.mid, self.out = (torch.nn.Linear(8, 16), torch.nn.Linear(16, 16),
                                                     torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        self.aux = torch.nn.Linear(16, 16)  # used on some ranks only: holds back its bucket there

    def forward(self, x, aux=False):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(lambda t: torch.tanh(self.shared(t)), self.inp(x), use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.shared(self.mid(t))), h, use_reentrant=True)
        return self.out(self.aux(h) if aux else h)


def _shared_layer_steps(model, opt, aux):
    """``aux``: per rank, whether it runs the aux layer (one process: the mean of the ranks' losses)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g).requires_grad_(True), torch.randn(4, 4, generator=g)
        sum(((model(x, a) - y) ** 2).mean() for a in aux).div(len(aux)).backward()
        opt.step()
        opt.zero_grad()
    return flat(model)


def _shared_layer_job(rank, world, aux):
    out = {}
    # buckets of 100 and 300 elements: the shared layer's bucket goes before its second piece, on the rank that
    # runs aux only where aux shares that bucket (on the other it waits for the end of backward)
    for offload, bucket in ((True, 100), (False, 100), (True, 300), (False, 300)):
        torch.manual_seed(0)
        model = _SharedInTwoSegments()
        opt = ShardedAdam(model.parameters(), lr=LR, stage=2, offload=offload, allgather_bucket_numel=1000,
                          options=OffloadOptions(bucket_numel=bucket, tile_numel=300, num_threads=1))
        out[(offload, bucket)] = _shared_layer_steps(model, opt, [aux[rank]])
        opt.close()
    return out


@pytest.mark.parametrize("aux", [(False, False), (True, False)], ids=["same-graph", "aux-on-rank-0"])
def test_zero2_sums_a_gradient_that_arrives_in_two_pieces_after_its_bucket_went(aux):
    """ZeRO-2 left the second piece in .grad once the param's bucket had been reduced, and the step refused it as
    "a .grad that did not come from backward()". Equal to AdamW on one process (the mean of the ranks' losses);
    with a layer one rank skips, the ranks see the late piece at different points and still reduce alike."""
    torch.manual_seed(0)
    ref_model = _SharedInTwoSegments()
    want = _shared_layer_steps(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.0,
                                                                    foreach=False), list(aux))
    for r in run_distributed(_shared_layer_job, aux, timeout=120, collective_timeout=30):
        for key, got in r.items():
            torch.testing.assert_close(got, want, **TIGHT, msg=f"offload, bucket={key}")
