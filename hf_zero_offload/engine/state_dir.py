"""A checkpoint directory of optimizer state: one state file per rank, re-cut on load.

Layout of a directory written by W ranks::

    rank{r}_of_{W}.hzo   rank r's fp32 master / exp_avg / exp_avg_sq for its slice [start, end) of the
                         flat layout (``checkpoint.write_state``: header = ``state_meta()``)
    meta.json            W > 1 only, written by rank 0 after every rank's file is complete (a barrier
                         in between): world size, numel, the partition map, param slots, dtype

A one-process engine writes ``rank0_of_1.hzo`` alone: its header names its range [0, numel). Every
file is written to a temporary name, fsynced and renamed, and ``meta.json`` comes last, so a
directory with a ``meta.json`` (or a lone ``rank0_of_1.hzo``) holds a complete checkpoint. Loading at
any world size, into any engine: each rank reads, from every saved file whose range overlaps its own,
just the overlapping elements, straight into its arena. Files of the first formats
(``hf_zero_offload.offload/1``, ``hf_zero_offload.sharded/1``) load the same way.
"""
from __future__ import annotations

import json
import os

from . import checkpoint
from .moments import Q

STATE_FORMATS = ("hf_zero_offload.state/2", "hf_zero_offload.sharded/1", "hf_zero_offload.offload/1")
META_FORMAT = "hf_zero_offload.sharded-meta/1"
META_FILE = "meta.json"


def write_json_atomic(path: str, obj) -> None:
    with checkpoint.atomic_open(path, "w") as f:
        json.dump(obj, f, indent=1)


def save(directory: str, rank: int, world_size: int, meta: dict, tensors: dict, *, barrier, partition: list) -> None:
    os.makedirs(directory, exist_ok=True)
    checkpoint.write_state(checkpoint.rank_file(directory, rank, world_size), meta, tensors)
    if world_size == 1:
        return
    barrier()  # meta.json marks the checkpoint complete: only after every rank's file is in place
    if rank == 0:
        write_json_atomic(os.path.join(directory, META_FILE), {
            "format": META_FORMAT, "world_size": world_size, "numel": meta["numel"], "partition": partition,
            "files": [os.path.basename(checkpoint.rank_file(directory, r, world_size)) for r in range(world_size)],
            "param_dtype": meta["param_dtype"], "slots": meta["slots"],
        })
    barrier()  # on return, every rank sees the whole checkpoint


def sources(directory: str) -> tuple[list[tuple[str, int, int]], dict]:
    """The saved files with the flat range each holds, and the (rank 0) state meta."""
    meta_path = os.path.join(directory, META_FILE)
    if os.path.exists(meta_path):
        try:
            with open(meta_path) as f:
                m = json.load(f)
            w = m["world_size"]
            ranges = m["partition"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{meta_path} is damaged ({type(e).__name__}: {e}); resume from an earlier "
                             "checkpoint") from None
        if m.get("format") != META_FORMAT:
            raise ValueError(f"{meta_path} is not an hf_zero_offload sharded checkpoint map")
        srcs = [(checkpoint.rank_file(directory, r, w), a, b) for r, (a, b) in enumerate(ranges)]
        state, _, _ = checkpoint.read_header(srcs[0][0])
        return srcs, state
    single = checkpoint.rank_file(directory, 0, 1)
    if os.path.exists(single):
        state, _, _ = checkpoint.read_header(single)
        return [(single, 0, state["numel"])], state
    partial = sorted(n for n in os.listdir(directory) if n.endswith(".hzo")) if os.path.isdir(directory) else []
    if partial:
        raise ValueError(f"{directory} holds {partial} but no {META_FILE}: the checkpoint is incomplete "
                         "(a save was interrupted); use the previous checkpoint")
    raise FileNotFoundError(f"no hf_zero_offload optimizer checkpoint in {directory}")


def check_model(meta: dict, numel: int, slots: list) -> None:
    if meta.get("format") not in STATE_FORMATS:
        raise ValueError(f"not an hf_zero_offload optimizer state (format={meta.get('format')!r})")
    if meta["numel"] != numel or meta["slots"] != slots:
        raise ValueError(f"optimizer state does not match this model: saved {meta['numel']} trainable elements "
                         f"in {sum(map(len, meta['slots']))} params, this model has {numel} in "
                         f"{sum(map(len, slots))}")


def read_range(srcs: list[tuple[str, int, int]], lo: int, dst: dict) -> None:
    """Fill ``dst`` (flat tensors covering [lo, lo + n)) from the saved files that overlap it."""
    n = next(v for k, v in dst.items() if not k.endswith("_scale")).numel()
    hi = lo + n
    for path, a0, b0 in srcs:
        a, b = max(lo, a0), min(hi, b0)
        if b > a:
            views, start = {}, {}
            for k, v in dst.items():
                if k.endswith("_scale"):  # int8 scales, one per block: saved slices start on a block
                    views[k], start[k] = v[(a - lo) // Q:-(-(b - lo) // Q)], (a - a0) // Q
                else:
                    views[k], start[k] = v[a - lo:b - lo], a - a0
            checkpoint.read_into(path, views, start=start)


def summary(meta: dict, files: int) -> dict:
    """What a load restored, for one log line."""
    fmt = meta.get("format")
    stage = meta.get("stage", 2 if fmt == "hf_zero_offload.sharded/1" else None)
    return {"format": fmt, "world_size": meta.get("world_size", files), "stage": stage,
            "offload": meta.get("offload", True), "param_dtype": meta.get("param_dtype"),
            "global_steps": meta.get("global_steps"), "needs_publish": bool(meta.get("needs_publish"))}
