"""The second half of a ``ShardedAdam`` step, once the gradients are reduced: the global statistics,
Adam over this rank's shard, and the all-gather of the updated shards into the model's parameters.

Functions of the optimizer (``opt``), like ``sharding_ckpt``'s: ``ShardedAdam`` owns the buffers
and the order of the phases (``step()``); these are the phases.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def global_stats(opt) -> list[float]:
    """[sum of squares of the summed gradient, then per param: ranks that produced a gradient]."""
    real = opt.store[:opt._real]
    if opt.store.device.type == "cpu":
        sq = torch.tensor([ops.grad_norm_sq(real, num_threads=opt.options.num_threads)], dtype=torch.float64)
    else:
        sq = torch.linalg.vector_norm(real, dtype=torch.float64).square().reshape(1)
    counts = torch.tensor(opt.reducer.received, dtype=torch.float64)
    stats = torch.cat([sq.to(opt.device), counts.to(opt.device)])
    if opt.world_size > 1:
        dist.all_reduce(stats, group=opt.process_group)
    return stats.tolist()


def adam(opt, runs, grad_scale: float, hyper: list[dict], store: torch.Tensor, final_wait: bool = True):
    """Adam over this rank's part of every run (gradients from ``store``): torch's fused kernel on the
    device, the CPU kernel in place, or (offload on CUDA) the CPU kernel tile by tile into two staging
    tiles, each uploaded into ``shard_out`` while the next one is computed. Returns the event of the
    last upload (None without uploads); ``final_wait``: the compute stream waits for it here (a DPU
    step on the worker leaves that to the publish on the main thread)."""
    lo, hi = opt.shard_start, opt.shard_end
    parts = [(max(r.start, lo) - lo, min(r.end, hi) - lo, r) for r in runs if r.start < hi and r.end > lo]
    s = opt.streams
    tiled = opt.offload and s.async_copies
    if tiled:
        # shard_out was read by the last all-gather (queued on the compute stream): the uploads
        # that overwrite it are queued after that.
        s.wait(s.h2d, s.event())
    k = 0
    for a, b, run in parts:
        h = hyper[run.group]
        kw = dict(lr=h["lr"], weight_decay=h["weight_decay"], eps=h["eps"])
        if opt._torch_adam:
            fused = torch._fused_adamw_ if h["adamw_mode"] else torch._fused_adam_
            fused([opt.master[a:b]], [store[a:b]], [opt.exp_avg[a:b]], [opt.exp_avg_sq[a:b]], [],
                  # torch.full, not torch.tensor: a fill kernel, no host-to-device copy that would
                  # wait for the device's queue on every run
                  [torch.full((), float(run.step), device=opt.device)], beta1=h["betas"][0],
                  beta2=h["betas"][1], amsgrad=False, maximize=False, found_inf=None,
                  grad_scale=torch.full((), 1.0 / grad_scale, device=opt.device), **kw)  # it divides
            if opt.shard_out is not None:
                opt.shard_out[a:b].copy_(opt.master[a:b])
            continue
        step_kw = dict(step=run.step, beta1=h["betas"][0], beta2=h["betas"][1], adamw=h["adamw_mode"],
                       grad_scale=grad_scale, num_threads=opt.options.num_threads, **kw)
        if not tiled:
            out = None if opt.shard_out is None else opt.shard_out[a:b]
            ops.adam_step(opt.master[a:b], store[a:b], opt.exp_avg[a:b], opt.exp_avg_sq[a:b],
                          param_out=out, **step_kw)
            continue
        tile = opt._tiles.shape[1]
        for t in range(a, b, tile):
            e = min(b, t + tile)
            slot = k % 2
            k += 1
            # A staging tile is rewritten only after its previous upload finished.
            s.host_wait(opt._tile_events[slot])
            out = opt._tiles[slot, :e - t]
            ops.adam_step(opt.master[t:e], store[t:e], opt.exp_avg[t:e], opt.exp_avg_sq[t:e],
                          param_out=out, **step_kw)
            s.copy(opt.shard_out[t:e], out, s.h2d)
            opt._tile_events[slot] = s.event(s.h2d)
    if not tiled:
        return None
    done = s.event(s.h2d)
    if final_wait:
        # The all-gather (compute stream) reads shard_out: it waits for the last upload.
        s.wait(s.compute(), done)
    return done


@torch.no_grad()
def gather(opt, src: torch.Tensor) -> None:
    """Every rank's updated shard into the model's parameters, ``allgather_bucket_numel`` at a time."""
    W, S, g, N = opt.world_size, opt.partition.shard_numel, opt._gchunk, opt.numel
    if W == 1:
        _write_params(opt, 0, N, src[:N])
        return
    for k0 in range(0, S, g):
        gk = min(g, S - k0)
        out = opt._gather_buf[:W * gk]
        # Reusing ``out``: a collective starts after the work already queued on the current
        # stream, so the previous round's copies into the params have read it by then.
        _all_gather(out, src[k0:k0 + gk], group=opt.process_group)
        for r in range(W):
            a = r * S + k0
            b = min(a + gk, N)
            if b > a:
                _write_params(opt, a, b, out[r * gk:r * gk + b - a])


def _write_params(opt, a: int, b: int, src: torch.Tensor) -> None:
    for p, off, lo, hi in opt._index.pieces(a, b):
        p.data.view(-1)[lo - off:hi - off].copy_(src[lo - a:hi - a])
