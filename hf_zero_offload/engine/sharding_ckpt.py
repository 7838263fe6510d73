"""Checkpoints of ``ShardedAdam``: one state file per rank plus a partition map, re-cut on load.

Layout of a checkpoint directory written by W ranks::

    rank{r}_of_{W}.hzo   this rank's fp32 master / exp_avg / exp_avg_sq slice [start, end) of the flat
                         layout (``checkpoint.write_state``: JSON header = ``state_meta()``, raw tensors)
    meta.json            written by rank 0 after every rank's file is complete (a barrier in between):
                         world size, numel, the partition map [[start, end], ...], param slots, dtype

Every file is written to a temporary name, fsynced and renamed, and ``meta.json`` comes last, so a
directory with a ``meta.json`` holds a complete checkpoint. Loading at any world size: each rank
reads, from every saved file whose range overlaps its own, just the overlapping elements
(``checkpoint.read_into(..., start=...)``), straight into its arena. The same reader accepts an
``OffloadAdam`` checkpoint (``rank0_of_1.hzo``, the range [0, numel)), and ``load_into_offload``
loads a sharded checkpoint into a one-process ``OffloadAdam``.
"""
from __future__ import annotations

import json
import os

import torch.distributed as dist

from . import checkpoint

FORMAT = "hf_zero_offload.sharded/1"
META_FORMAT = "hf_zero_offload.sharded-meta/1"
OFFLOAD_FORMAT = "hf_zero_offload.offload/1"
META_FILE = "meta.json"
_TENSORS = ("master", "exp_avg", "exp_avg_sq")


def write_json_atomic(path: str, obj) -> None:
    with checkpoint.atomic_open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _barrier(opt) -> None:
    if opt.world_size > 1:
        dist.barrier(group=opt.process_group)


def state_meta(opt) -> dict:
    """Everything of ``opt``'s state but the big tensors (JSON-serialisable; the state file's header)."""
    return {
        "format": FORMAT,
        "numel": opt.numel,
        "world_size": opt.world_size,
        "rank": opt.rank,
        "shard_start": opt.shard_start,
        "shard_end": opt.shard_end,
        "stage": opt.stage,
        "offload": opt.offload,
        "param_dtype": str(opt.param_dtype).replace("torch.", ""),
        "param_groups": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                         for g in opt.param_groups],
        "slots": opt._slot_meta(),
        "param_steps": list(opt._param_steps),
        "loss_scaler": opt.scaler.state_dict(),
        "global_steps": opt.global_steps,
        "needs_publish": opt.needs_publish,
    }


def apply_meta(opt, meta: dict) -> None:
    """The small state of ``meta`` into ``opt`` (hyperparameters, step counts, loss scaler)."""
    for group, saved in zip(opt.param_groups, meta["param_groups"]):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
    opt._param_steps = list(meta["param_steps"])
    opt.scaler.load_state_dict(meta["loss_scaler"])
    opt.global_steps = meta["global_steps"]


def save(opt, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    checkpoint.write_state(checkpoint.rank_file(directory, opt.rank, opt.world_size), opt.state_meta(),
                           opt.state_tensors())
    _barrier(opt)  # meta.json marks the checkpoint complete: only after every rank's file is in place
    if opt.rank == 0:
        write_json_atomic(os.path.join(directory, META_FILE), {
            "format": META_FORMAT,
            "world_size": opt.world_size,
            "numel": opt.numel,
            "partition": opt.partition.ranges(),
            "files": [os.path.basename(checkpoint.rank_file(directory, r, opt.world_size))
                      for r in range(opt.world_size)],
            "param_dtype": str(opt.param_dtype).replace("torch.", ""),
            "slots": opt._slot_meta(),
        })
    _barrier(opt)  # on return, every rank sees the whole checkpoint


def sources(directory: str) -> tuple[list[tuple[str, int, int]], dict]:
    """The saved files with the flat range each holds, and the (rank 0) state meta."""
    meta_path = os.path.join(directory, META_FILE)
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            m = json.load(f)
        if m.get("format") != META_FORMAT:
            raise ValueError(f"{meta_path} is not an hf_zero_offload sharded checkpoint map")
        w = m["world_size"]
        srcs = [(checkpoint.rank_file(directory, r, w), a, b) for r, (a, b) in enumerate(m["partition"])]
        state, _, _ = checkpoint.read_header(srcs[0][0])
        return srcs, state
    single = checkpoint.rank_file(directory, 0, 1)
    if os.path.exists(single):
        state, _, _ = checkpoint.read_header(single)
        if state.get("format") == OFFLOAD_FORMAT:
            return [(single, 0, state["numel"])], state
    partial = sorted(n for n in os.listdir(directory) if n.endswith(".hzo")) if os.path.isdir(directory) else []
    if partial:
        raise ValueError(f"{directory} holds {partial} but no {META_FILE}: the checkpoint is incomplete "
                         "(a save was interrupted); use the previous checkpoint")
    raise FileNotFoundError(f"no hf_zero_offload optimizer checkpoint in {directory}")


def check_model(meta: dict, numel: int, slots: list) -> None:
    if meta.get("format") not in (FORMAT, OFFLOAD_FORMAT):
        raise ValueError(f"not an hf_zero_offload optimizer state (format={meta.get('format')!r})")
    if meta["numel"] != numel or meta["slots"] != slots:
        raise ValueError(f"optimizer state does not match this model: saved {meta['numel']} trainable elements "
                         f"in {sum(map(len, meta['slots']))} params, this model has {numel} in "
                         f"{sum(map(len, slots))}")


def read_range(srcs: list[tuple[str, int, int]], lo: int, dst: dict) -> None:
    """Fill ``dst`` (flat tensors covering [lo, lo + n)) from the saved files that overlap it."""
    n = next(iter(dst.values())).numel()
    hi = lo + n
    for path, a0, b0 in srcs:
        a, b = max(lo, a0), min(hi, b0)
        if b > a:
            checkpoint.read_into(path, {k: v[a - lo:b - lo] for k, v in dst.items()},
                                 start={k: a - a0 for k in dst})


def load(opt, directory: str) -> None:
    srcs, meta = sources(directory)
    opt.load_state_meta(meta)  # checks the model first
    if opt._real:
        read_range(srcs, opt.shard_start, {k: v for k, v in opt.state_tensors().items()})
    if opt.shard_out is not None:
        opt.shard_out.copy_(opt.master)  # params not updated in the next step are gathered from here
    # A DPU state: its masters are one step ahead of the saved parameters. With DPU on, the next step
    # publishes them (the schedule of an uninterrupted run); without, they are published now.
    opt.needs_publish, opt._uploaded = False, None
    if meta.get("needs_publish"):
        if opt.options.dpu:
            opt.needs_publish = True
        else:
            opt.publish_masters()


def load_into_offload(opt, directory: str) -> None:
    """Load a ``ShardedAdam`` checkpoint (any world size) into a one-process ``OffloadAdam``."""
    srcs, meta = sources(directory)
    keys = ("numel", "param_dtype", "param_groups", "slots", "param_steps", "loss_scaler", "global_steps")
    opt.load_state_meta({"format": OFFLOAD_FORMAT, "needs_publish": bool(meta.get("needs_publish")),
                         **{k: meta[k] for k in keys}})
    read_range(srcs, 0, opt.state_tensors())
    opt.finish_load()
