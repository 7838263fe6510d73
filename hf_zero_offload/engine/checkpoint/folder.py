"""A checkpoint directory of optimizer state: one state file per rank, re-cut on load.

Layout of a directory written by W ranks::

    rank{r}_of_{W}.hzo   rank r's fp32 master / exp_avg / exp_avg_sq for its slice [start, end) of the
                         flat layout (``checkpoint.write_state``: header = ``state_meta()``)
    meta.json            W > 1 only, written by rank 0 after every rank's file is complete (a barrier
                         in between): world size, numel, the partition map, param slots, dtype

What a state holds, checked against the engine that loads it, is ``contents``. A one-process engine writes
``rank0_of_1.hzo`` alone. Each file is written to a temporary name, fsynced and renamed,
``meta.json`` last: a directory with one (or a lone ``rank0_of_1.hzo``) is complete. Any world size and engine loads
it: each rank reads the elements of every file that overlap its own range, straight into its arena.
"""
from __future__ import annotations

import json
import math
import os
import re
import reprlib

import torch

from ... import ops
from .. import checkpoint
from . import StateFileError
from ..moments import Q, SCALES, moment_regions

STATE_FORMATS = ("hf_zero_offload.state/2", "hf_zero_offload.sharded/1", "hf_zero_offload.offload/1")
META_FORMAT = "hf_zero_offload.sharded-meta/1"
META_FILE = "meta.json"


def save(directory: str, rank: int, world_size: int, meta: dict, tensors: dict, *, barrier, partition: list,
         agree=None) -> None:
    """``agree(failed) -> the ranks that failed``: a collective in place of each barrier (a rank whose folder or
    write failed left its peers in the next barrier until the timeout, silent)."""
    def phase(work, what: str) -> None:  # work on every rank, then every rank learns whether one failed
        try:
            work()
        except Exception:
            if world_size > 1 and agree is not None:  # the peers hear of it where they wait for this rank
                agree(True)
            raise
        if world_size > 1 and (failed := (agree(False) if agree is not None else barrier())):
            raise OSError(f"{directory}: rank(s) {', '.join(map(str, failed))} could not {what}")

    def prepare() -> None:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise NotADirectoryError(f"optimizer checkpoint directory {directory} is a file")
        os.makedirs(directory, exist_ok=True)
        if rank == 0:
            _clear_previous(directory, world_size)

    # no rank writes its new file while the old meta.json still declares the directory complete
    phase(prepare, "make the folder ready for their optimizer state")
    # meta.json marks the checkpoint complete: only after every rank's file is in place
    phase(lambda: checkpoint.write_state(checkpoint.rank_file(directory, rank, world_size), meta, tensors),
          "write their optimizer state")
    if world_size == 1:
        return
    if rank == 0:  # (the world size, numel, partition map, slots and dtype, for a load at any world size)
        with checkpoint.atomic_open(os.path.join(directory, META_FILE), "w") as f:
            json.dump({"format": META_FORMAT, "world_size": world_size, "numel": meta["numel"], "partition": partition,
                       "files": [os.path.basename(checkpoint.rank_file(directory, r, world_size))
                                 for r in range(world_size)], "param_dtype": meta["param_dtype"],
                       "slots": meta["slots"], "save_id": meta.get("save_id")}, f, indent=1)
    barrier()  # on return, every rank sees the whole checkpoint


def _clear_previous(directory: str, world_size: int) -> None:
    """A directory saved again (a restarted run writing the same checkpoint-N): its old ``meta.json`` would declare
    a mix of old and new rank files complete should the save stop part way, and the files of another world size
    would be loaded instead of the new ones (``sources`` reads ``meta.json`` first). Both go before the first write."""
    checkpoint.remove_durably(directory, [META_FILE] + [n for n in os.listdir(directory) if n.startswith(
        "rank") and n.endswith(".hzo") and not n.endswith(f"_of_{world_size}.hzo")])


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
        _check_partition(ranges, w, m.get("numel"), meta_path)
        srcs = [(checkpoint.rank_file(directory, r, w), a, b) for r, (a, b) in enumerate(ranges)]
        return srcs, _check_files(srcs, meta_path, m)
    single = checkpoint.rank_file(directory, 0, 1)
    if os.path.exists(single):
        state, _, _ = checkpoint.read_header(single)
        check_header(state, single)
        return [(single, 0, state["numel"])], state
    if os.path.lexists(single):  # (exists() is False for it)
        raise ValueError(f"{single} is a link to nothing (or a loop of links); use the previous checkpoint")
    partial = sorted(n for n in os.listdir(directory) if n.endswith(".hzo")) if os.path.isdir(directory) else []
    if partial:
        # a save writes only rank<r>_of_<w>.hzo: any other name was renamed or put there by hand, not cut short
        foreign = [n for n in partial if not re.fullmatch(r"rank\d+_of_\d+\.hzo", n)]
        why = (f"{foreign} are not names a save writes (rank<r>_of_<w>.hzo): files renamed or copied in by hand"
               if foreign else "the checkpoint is incomplete (a save was interrupted)")
        raise ValueError(f"{directory} holds {partial} but no {META_FILE}: {why}; use the previous checkpoint")
    raise FileNotFoundError(f"no hf_zero_offload optimizer checkpoint in {directory}")


# What every rank file of one save holds alike: a file that differs in any of them was written by another save (of
# another model, run or step), whatever its range. save_id (a token the ranks of one save share, absent in files
# written before it existed) tells apart two saves of the same model at the same step, as from two runs.
# (int8_codes: the code map each file's codes are written in; a load decodes every file with one map)
_SAME_IN_EVERY_FILE = ("save_id", "numel", "world_size", "slots", "param_dtype", "state_dtype", "int8_codes",
                       "global_steps", "param_steps")
_SAME_IN_MAP = ("save_id", "numel", "slots", "param_dtype")


def _check_files(srcs: list[tuple[str, int, int]], meta_path: str, saved_map: dict) -> dict:
    """Every file the map lists, checked before anything is loaded (its header and trailer, a few KB each, and its
    size against them: ``checkpoint.read_header``),
    and by every rank, also for the files it will not read: a file missing, cut short, holding another range
    or another save's state is then the same clear error on every rank, before the first write, instead of
    one rank failing part way through the load while its peers go on to wait for it in the next collective.
    Returns rank 0's state meta."""
    first = None
    for r, (path, a0, b0) in enumerate(srcs):
        if not os.path.exists(path):
            raise StateFileError(f"{path} is missing: {meta_path} lists it as rank {r}'s slice of the optimizer "
                                 "state (the checkpoint was copied in part or damaged); resume from an earlier "
                                 "checkpoint")
        saved = checkpoint.read_header(path)[0]
        check_header(saved, path)
        held = (saved.get("shard_start", 0), saved.get("shard_end", saved.get("numel")))
        if held != (a0, b0):
            raise StateFileError(f"{path} holds elements [{held[0]}, {held[1]}) of the flat state, but the "
                                 f"checkpoint's map says [{a0}, {b0}); the directory mixes files of different "
                                 "checkpoints or is damaged")
        first = first or saved
        for key, other, whose in ([(k, first, srcs[0][0]) for k in _SAME_IN_EVERY_FILE]
                                  + [(k, saved_map, meta_path) for k in _SAME_IN_MAP if k in saved_map]):
            if saved.get(key, _DEFAULT.get(key)) != other.get(key, _DEFAULT.get(key)):
                steps = "" if key == "global_steps" else (
                    f" (the states after {saved.get('global_steps')} and "
                    f"{other.get('global_steps', first.get('global_steps'))} steps)")
                raise StateFileError(
                    f"{path} and {whose} are of different saves: {key} {_brief(saved.get(key))} against "
                    f"{_brief(other.get(key))}{steps}; the directory mixes files of different checkpoints (copied "
                    "or linked from another run, model or step): resume from an earlier checkpoint")
    return first


_DEFAULT = {"state_dtype": "fp32"}
_REPR = reprlib.Repr()
_REPR.maxlist, _REPR.maxstring = 4, 40


def _brief(value) -> str:
    return _REPR.repr(value)


def check_header(meta, where: str) -> None:
    """The fields of a state file's header that locate its data (``numel``, ``slots``, ranges, counts), checked
    before any is used, without the engine's model at hand (``consolidate`` reads files this way): a damaged or
    foreign header is then one error naming the file and the field, not a KeyError or a 4 PB allocation (the
    tensors' byte counts are checked against ``numel`` by ``check_sources``)."""
    def bad(field: str, want: str, got) -> StateFileError:
        return StateFileError(f"{where}: {field} must be {want}, got {_brief(got)}; this file was not written by "
                              "hf_zero_offload (or is damaged): use an earlier checkpoint")

    if not isinstance(meta, dict):
        raise bad("the header", "a JSON object", meta)
    if meta.get("format") not in STATE_FORMATS:
        raise bad("format", f"one of {STATE_FORMATS}", meta.get("format"))
    numel = meta.get("numel")
    if not is_count(numel):
        raise bad("numel", "an int >= 0", numel)
    lo, hi = meta.get("shard_start", 0), meta.get("shard_end", numel)
    if not (is_count(lo) and is_count(hi) and lo <= hi <= numel):
        raise bad("[shard_start, shard_end)", f"a range within [0, {numel}]", [lo, hi])
    if meta.get("state_dtype", "fp32") not in ops.STATE_DTYPES:
        raise bad("state_dtype", f"one of {ops.STATE_DTYPES}", meta.get("state_dtype"))
    if not is_count(meta.get("global_steps")):
        raise bad("global_steps", "an int >= 0", meta.get("global_steps"))
    slots = meta.get("slots")
    ok = isinstance(slots, list) and all(isinstance(g, list) for g in slots)
    for slot in (s for g in slots for s in g) if ok else ():
        ok = (isinstance(slot, list) and len(slot) == 3 and is_count(slot[0]) and is_count(slot[1])
              and slot[0] + slot[1] <= numel and isinstance(slot[2], list) and all(map(is_count, slot[2]))
              and math.prod(slot[2]) == slot[1])
        if not ok:
            raise bad("slots", f"[offset, numel, shape] entries within [0, {numel})", slot)
    if not ok:
        raise bad("slots", "a list of lists of [offset, numel, shape]", slots)


def check_save_id(meta: dict, expected: str | None, where: str) -> None:
    """The state ``where`` (rank 0's meta) is of the save ``expected`` records (None: nothing recorded, as before
    save ids): one copied or linked from another checkpoint would stand for this one's weights."""
    if expected is not None and meta.get("save_id") != expected:
        raise StateFileError(
            f"{where} holds the optimizer state of another save (save id {meta.get('save_id')!r}, the state after "
            f"{meta.get('global_steps')} steps) than the one recorded for it (the checkpoint's completion marker "
            f"records {expected!r}): it was copied or linked from another checkpoint, and would roll the model back "
            "to that state; use a checkpoint whose optimizer state is its own")


def _check_partition(ranges, world_size, numel, where: str) -> None:
    """The saved ranks' ranges tile [0, numel) in rank order: a gap, an overlap or a shift would
    leave part of the state as it was, or read it from the wrong offsets, without a word."""
    ok = (is_count(world_size) and world_size >= 1 and is_count(numel) and isinstance(ranges, list)
          and len(ranges) == world_size and all(isinstance(r, list) and len(r) == 2 and all(map(is_count, r))
                                                for r in ranges))
    if ok:
        ends = [0] + [b for _, b in ranges]
        ok = all(a == ends[i] and a <= b for i, (a, b) in enumerate(ranges)) and ends[-1] == numel
    if not ok:
        raise ValueError(f"{where} is damaged: its partition {reprlib.repr(ranges)} does not cut [0, {numel}) into "
                         f"{reprlib.repr(world_size)} consecutive ranks' ranges; resume from an earlier checkpoint")


def is_count(x) -> bool:
    """An int >= 0 (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_sources(srcs: list[tuple[str, int, int]], saved: str, lo: int, hi: int) -> None:
    """Before the first write of a checkpoint load: each file this slice [lo, hi) reads holds every
    tensor its ``saved`` state_dtype stores, of that dtype and long enough for the file's range (read
    from its header), and, for int8, the scales of the blocks read are absmax values (>= 0; read here,
    CRC-checked: 8 bytes per 256 elements). Without this a checksum-valid but foreign file (a tensor of
    another dtype or length) failed part way through the streamed load, after the optimizer's state was
    overwritten; and negative scales, checked only after the load into an int8 engine, went unchecked
    into a fp32/bf16 engine, where they decode to negative exp_avg_sq (NaN updates)."""
    if saved == "int8":  # the blocks the conversion decodes (``_convert_loaded``)
        lo, hi = lo // Q * Q, -(-hi // Q) * Q
    for path, a0, b0 in srcs:
        # every file, not only the ones this slice reads: so every rank refuses, before any rank writes
        if saved == "int8" and a0 % Q and b0 > a0:  # its scales are read per block of the flat index (``read_range``)
            raise StateFileError(f"{path}: its int8 state starts at element {a0}, not on a {Q}-element block: the "
                                 "engines cut int8 states on blocks, so this file was not written by hf_zero_offload "
                                 "(or its partition is damaged); use an earlier checkpoint")
        a, b = max(lo, a0), min(hi, b0)
        if b <= a:
            continue
        entries = checkpoint.read_header(path)[1]
        for key, (count, dtype) in {"master": (b0 - a0, torch.float32), **moment_regions(b0 - a0, saved)}.items():
            e, name = entries.get(key), str(dtype).replace("torch.", "")
            if e is None or e.get("dtype") != name or e.get("nbytes", 0) != count * dtype.itemsize:
                got = "missing" if e is None else f"{e.get('dtype')}, {e.get('nbytes')} bytes"
                raise StateFileError(f"{path}: {key} is {got}, expected {name}, {count * dtype.itemsize} bytes (the "
                                     f"{saved} state of elements [{a0}, {b0})): this file was not written by "
                                     "hf_zero_offload (or is damaged); use an earlier checkpoint")
        if saved == "int8":
            k0, k1 = (a - a0) // Q, -(-(b - a0) // Q)
            scales = {k: torch.empty(k1 - k0) for k in SCALES}
            checkpoint.read_into(path, scales, start=dict.fromkeys(SCALES, k0))
            try:
                ops.check_scales(*scales.values())
            except ValueError as e:
                raise StateFileError(f"{path}: {e}; use an earlier checkpoint") from None


def read_range(srcs: list[tuple[str, int, int]], lo: int, dst: dict) -> None:
    """Fill ``dst`` (flat tensors covering [lo, lo + n)) from the saved files that overlap it."""
    n = next(v for k, v in dst.items() if not k.endswith("_scale")).numel()
    hi = lo + n
    for path, a0, b0 in srcs:
        a, b = max(lo, a0), min(hi, b0)
        if b > a:  # (``sources`` checked that each file holds the range the map gives it)
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
