"""Shared by the ``test_engine_peer_suite*`` files: the engines' small buckets and tolerances, groups with their
own hyperparameters, a run of steps (with an lr change, kept zero gradients, dropped gradients), the sharded
engine kinds, and the closeness of compact moments."""
from __future__ import annotations

import torch

from _models import batches, loss_fn, param_groups
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

LR, WD = 1e-2, 0.1

SMALL = dict(bucket_numel=1200, tile_numel=300, num_threads=1)
TIGHT = dict(rtol=1e-5, atol=1e-6)
DTYPES = ["fp32", "bf16", "int8"]


def own_groups(model):
    """Two groups with their own lr, betas, eps and weight decay (DeepSpeed's multi-group test)."""
    g = param_groups(model, WD)
    g[0].update(lr=3e-3, betas=(0.8, 0.99), eps=1e-6)
    g[1].update(weight_decay=0.05)
    return g


def run(model, opt, data, *, lr_at=3, keep_zero=False, explicit_zero=False, drops=None):
    """One step per batch; group 1's lr changes before step ``lr_at`` (a scheduler would). ``keep_zero``:
    zero_grad(set_to_none=False); ``explicit_zero``: the unused branch gets an explicit zero gradient;
    ``drops``: each window starts with a backward (through the branch where ``drops[i]``) that
    zero_grad(set_to_none=False) drops, leaving a zero .grad on the params it reached."""
    for i, (ids, labels, use_branch) in enumerate(data):
        if i == lr_at:
            opt.param_groups[1]["lr"] = 5e-3
        if drops is not None:
            loss_fn(model, labels, ids, drops[i]).backward()
            opt.zero_grad(set_to_none=False)
        loss = loss_fn(model, ids, labels, use_branch)
        if explicit_zero and not use_branch:
            loss = loss + 0 * sum(p.sum() for p in model.branch.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=not keep_zero)
    if hasattr(opt, "flush"):
        opt.flush()


def flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def assert_compact_close(got, want):
    """bf16/int8 moments of the same gradients summed in another order (the sharded path): the last bit
    may move an int8 code by one step, and that code its param by a few % of lr (test_compact_states)."""
    d = (got - want).abs()
    assert d.max() <= LR / 4, d.max()
    assert (d <= 1e-6 + 1e-5 * want.abs()).float().mean() >= 0.99


def offload(model, groups=own_groups, **opts):
    return OffloadAdam(groups(model), lr=LR, options=OffloadOptions(**{**SMALL, **opts}))


# The branch per step: in the batch (BRANCH), in the dropped backward that starts the window (DROPS). Steps 1
# and 5: only the dropped gradient reaches it (torch steps its zero .grad; the engines skipped it). Steps 2 and
# 4: neither, after a step that updated it (torch: None since zero_grad(); the engines stepped it with zeros).
BRANCH = [True, False, False, True, False, False]
DROPS = [False, True, False, True, False, True]
BRANCH_STEPS = 4


def dropping_data(seed=0):
    return [(ids, labels, use) for (ids, labels, _), use in zip(batches(6, seed=seed), BRANCH)]


# -- two ranks -------------------------------------------------------------------------------------
SHARDED = {"s1-off": dict(stage=1, offload=True), "s2-off": dict(stage=2, offload=True),
           "s2-off-dpu": dict(stage=2, offload=True, dpu=True), "s1": dict(stage=1, offload=False),
           "s2": dict(stage=2, offload=False)}


def _sharded(model, groups, cfg, state_dtype="fp32"):
    cfg = dict(cfg)
    dpu = cfg.pop("dpu", False)
    opts = OffloadOptions(**SMALL, state_dtype=state_dtype, dpu=dpu, dpu_warmup_steps=2)
    return ShardedAdam(groups(model), lr=LR, options=opts, allgather_bucket_numel=1000, **cfg)
