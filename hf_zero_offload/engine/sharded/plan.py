"""What one rank of ``ShardedAdam`` allocates, as a ``HostPlan`` (host and device regions).

``ShardedAdam`` allocates exactly ``make_plan(...)``; ``plan_for`` computes the same plan from the
trainable parameters' sizes alone, which is what the memory planner (``hf_zero_offload.planner``)
uses, so the two cannot disagree.
"""
from __future__ import annotations

import torch

from ..buffers import HostPlan, plan_host_memory
from ..moments import moment_regions
from ..options import OffloadOptions
from .layout import Partition
from .reduce import buffer_layout


def make_plan(S: int, seg: int, buffer_numel: int, gchunk: int, world_size: int, *, param_dtype: torch.dtype,
              options: OffloadOptions, stage: int, offload: bool, cuda: bool, tiled: bool,
              torch_adam: bool) -> HostPlan:
    """What one rank allocates: ``plan_host_memory`` over its shard of S elements, adapted: without
    offload the state lives on the device; the bucket/staging sizes are the reducer's (``seg``,
    ``buffer_numel``); the param-dtype shard and the all-gather buffer are added."""
    o = options
    base = plan_host_memory(S, param_dtype=param_dtype,
                            gradient_accumulation_steps=o.gradient_accumulation_steps if stage == 2 else 1,
                            delayed_param_update=o.dpu, bucket_numel=o.bucket_numel, tile_numel=o.tile_numel,
                            cuda=cuda, state_dtype=o.state_dtype).regions
    where = "host" if offload else "device"
    regions = {k: (base[k][0], base[k][1], where) for k in ("master", *moment_regions(1, o.state_dtype), "grad_store")}
    if torch_adam:  # torch's fused kernels want the gradient in the state's dtype
        regions["grad_store"] = (S, torch.float32, where)
    if offload and cuda:
        regions["grad_staging"] = (seg, param_dtype, "host")  # the host waits for each copy
    if tiled:
        # Updated tiles go up through two staging tiles, with or without DPU: a delayed step writes the
        # device shard (shard_out), which nothing reads before the publish's all-gather, so it needs no
        # full-size staging as OffloadAdam's does (whose targets are the params the device computes with).
        # A full-size one, cut in halves, made tiles of S/2: under one int8 block when S < 512 (each half
        # then encoded the block alone) and, for a large shard, no copy until half the shard was stepped.
        regions["param_staging"] = plan_host_memory(S, param_dtype=param_dtype, bucket_numel=o.bucket_numel,
                                                    tile_numel=o.tile_numel, cuda=cuda).regions["param_staging"]
    regions["grad_buckets"] = (buffer_numel, param_dtype, "device")
    if param_dtype != torch.float32 or tiled:
        regions["shard_out"] = (S, param_dtype, "device")  # the updated shard, ready to gather
    regions["gather_buffer"] = (world_size * gchunk if world_size > 1 else 0, param_dtype, "device")
    return HostPlan(numel=S, regions=regions)


def plan_for(numels: list[int], world_size: int, *, param_dtype: torch.dtype, options: OffloadOptions = OffloadOptions(),
             stage: int = 2, offload: bool = True, allgather_bucket_numel: int = 200_000_000,
             cuda: bool = True) -> HostPlan:
    """``make_plan`` for a model given only its trainable parameters' sizes in flat-layout order,
    as ``ShardedAdam`` on ``world_size`` ranks would allocate it (NCCL's reduce-scatter layout on
    CUDA, gloo's otherwise; torch's fused AdamW on CUDA without offload). For the memory planner."""
    slots, off = [], 0
    for n in numels:
        slots.append((None, off, n))
        off += n
    part = Partition(off, world_size, options.shard_align)
    S = part.shard_numel
    _, seg, buffer_numel = buffer_layout(slots, part, stage, options.bucket_numel, use_rs=cuda and world_size > 1)
    gchunk = max(1, min(allgather_bucket_numel // world_size, S))
    return make_plan(S, seg, buffer_numel, gchunk, world_size, param_dtype=param_dtype, options=options, stage=stage,
                     offload=offload, cuda=cuda, tiled=offload and cuda, torch_adam=not offload and cuda)
