"""Which engine runs, from typed options and the world size: torch only (no transformers, no config
module), so the choice is tested on its own.

=====================================  ============================================================
asked                                  engine
=====================================  ============================================================
offload, one process                   ``OffloadAdam`` (gradients leave during backward: stage 2)
offload, W > 1, stage 1/2              ``ShardedAdam(offload=True)``
no offload, stage 1/2 (any W)          ``ShardedAdam(offload=False)``
``--sharded_ddp``, stage 0 or unset    stage 2 (the flag asks for partitioning)
stage 0, no offload, one process       ``ShardedAdam(stage=0)``: nothing to partition, state on the
                                       device, gradients taken from ``.grad`` at ``step()`` (DeepSpeed's
                                       stage 0 on one process)
stage 0 on W > 1 ranks                 an error: a replicated optimizer is plain DDP without
                                       ``--zero_offload``
=====================================  ============================================================
"""
from __future__ import annotations

import torch

from .core import AdamCore
from .offload import OffloadAdam
from .options import OffloadOptions, ShardOptions
from .sharded import ShardedAdam


def choose(world_size: int, shard: ShardOptions, *, sharded_ddp: bool = False) -> tuple[type, int]:
    """(engine class, the ZeRO stage it runs)."""
    stage = shard.stage
    if stage == 0 and sharded_ddp:
        stage = 2
    if stage == 0:
        if shard.offload:
            raise ValueError("optimizer offload needs ZeRO stage 1 or 2, got 0")
        if world_size > 1:
            raise ValueError(f"ZeRO stage 0 (no partitioning) on {world_size} ranks: hf_zero_offload has no "
                             "replicated-optimizer engine; use stage 1 or 2 (the same math with the optimizer "
                             "state sharded), or train without --zero_offload (plain DDP)")
        return ShardedAdam, 0
    if stage not in (1, 2):
        raise ValueError(f"ZeRO stage must be 0, 1 or 2, got {stage!r}")
    if shard.offload and world_size == 1:
        return OffloadAdam, OffloadAdam.stage
    return ShardedAdam, stage


def build_engine(param_groups: list[dict], *, world_size: int, shard: ShardOptions, options: OffloadOptions,
                 param_dtype: torch.dtype, lr: float, betas, eps: float, adamw_mode: bool,
                 sharded_ddp: bool = False, device=None) -> AdamCore:
    """The engine for these options and this world size (``param_groups`` carry their weight decay); ``device``:
    where the params train, when they are not there yet."""
    cls, stage = choose(world_size, shard, sharded_ddp=sharded_ddp)
    hyper = dict(lr=lr, betas=betas, eps=eps, adamw_mode=adamw_mode, param_dtype=param_dtype, options=options,
                 device=device)
    if cls is OffloadAdam:
        return OffloadAdam(param_groups, **hyper)
    return ShardedAdam(param_groups, stage=stage, offload=shard.offload, reduce_scatter=shard.reduce_scatter,
                       allgather_bucket_numel=shard.allgather_bucket_numel, **hyper)
