"""A checkpoint directory of optimizer state: one state file per rank, re-cut on load.

Layout of a directory written by W ranks::

    rank{r}_of_{W}.hzo   rank r's fp32 master / exp_avg / exp_avg_sq for its slice [start, end) of the
                         flat layout (``checkpoint.write_state``: header = ``state_meta()``)
    meta.json            W > 1 only, written by rank 0 after every rank's file is complete (a barrier
                         in between): world size, numel, the partition map, param slots, dtype

A one-process engine writes ``rank0_of_1.hzo`` alone. Each file is written to a temporary name, fsynced and renamed,
``meta.json`` last: a directory with one (or a lone ``rank0_of_1.hzo``) is complete. Any world size and engine loads
it: each rank reads the elements of every file that overlap its own range, straight into its arena.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import reprlib

import torch

from .. import ops
from ..ops.moments import check_code_range, check_second_moment
from . import checkpoint
from .checkpoint import StateFileError
from .moments import Q, SCALES, moment_regions

STATE_FORMATS = ("hf_zero_offload.state/2", "hf_zero_offload.sharded/1", "hf_zero_offload.offload/1")
META_FORMAT = "hf_zero_offload.sharded-meta/1"
META_FILE = "meta.json"


def save(directory: str, rank: int, world_size: int, meta: dict, tensors: dict, *, barrier, partition: list,
         agree=None) -> None:
    """``agree(failed) -> the ranks that failed``: a collective in place of the barrier after the writes (a rank
    whose write failed left its peers in that barrier until the timeout)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"optimizer checkpoint directory {directory} is a file")
    os.makedirs(directory, exist_ok=True)
    if rank == 0:
        _clear_previous(directory, world_size)
    if world_size > 1:
        barrier()  # no rank writes its new file while the old meta.json still declares the directory complete
    try:
        checkpoint.write_state(checkpoint.rank_file(directory, rank, world_size), meta, tensors)
    except Exception:
        if world_size > 1 and agree is not None:  # the peers hear of it where they wait for every rank's file
            agree(True)
        raise
    if world_size == 1:
        return
    # meta.json marks the checkpoint complete: only after every rank's file is in place
    if failed := (agree(False) if agree is not None else barrier()):
        raise OSError(f"{directory}: rank(s) {', '.join(map(str, failed))} could not write their optimizer state")
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
        raise ValueError(f"{directory} holds {partial} but no {META_FILE}: the checkpoint is "
                         "incomplete (a save was interrupted); use the previous checkpoint")
    raise FileNotFoundError(f"no hf_zero_offload optimizer checkpoint in {directory}")


# What every rank file of one save holds alike: a file that differs in any of them was written by another save (of
# another model, run or step), whatever its range. save_id (a token the ranks of one save share, absent in files
# written before it existed) tells apart two saves of the same model at the same step, as from two runs.
_SAME_IN_EVERY_FILE = ("save_id", "numel", "world_size", "slots", "param_dtype", "state_dtype", "global_steps",
                       "param_steps")
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
    if not _count(numel):
        raise bad("numel", "an int >= 0", numel)
    lo, hi = meta.get("shard_start", 0), meta.get("shard_end", numel)
    if not (_count(lo) and _count(hi) and lo <= hi <= numel):
        raise bad("[shard_start, shard_end)", f"a range within [0, {numel}]", [lo, hi])
    if meta.get("state_dtype", "fp32") not in ops.STATE_DTYPES:
        raise bad("state_dtype", f"one of {ops.STATE_DTYPES}", meta.get("state_dtype"))
    if not _count(meta.get("global_steps")):
        raise bad("global_steps", "an int >= 0", meta.get("global_steps"))
    slots = meta.get("slots")
    ok = isinstance(slots, list) and all(isinstance(g, list) for g in slots)
    for slot in (s for g in slots for s in g) if ok else ():
        ok = (isinstance(slot, list) and len(slot) == 3 and _count(slot[0]) and _count(slot[1])
              and slot[0] + slot[1] <= numel and isinstance(slot[2], list) and all(map(_count, slot[2]))
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
    ok = (_count(world_size) and world_size >= 1 and _count(numel) and isinstance(ranges, list)
          and len(ranges) == world_size and all(isinstance(r, list) and len(r) == 2 and all(map(_count, r))
                                                for r in ranges))
    if ok:
        ends = [0] + [b for _, b in ranges]
        ok = all(a == ends[i] and a <= b for i, (a, b) in enumerate(ranges)) and ends[-1] == numel
    if not ok:
        raise ValueError(f"{where} is damaged: its partition {reprlib.repr(ranges)} does not cut [0, {numel}) into "
                         f"{reprlib.repr(world_size)} consecutive ranks' ranges; resume from an earlier checkpoint")


def json_value(v, where: str):
    """A param group's value as the state's JSON header holds it. A step takes numbers of any kind (numpy
    scalars from a scheduler's lambda, one-element tensors), which json.dumps refused only once the save had
    begun: they are written as Python numbers; what JSON cannot hold is refused by name before any write."""
    if v is None or isinstance(v, (bool, str, int, float)):
        return int(v) if type(v) is not bool and isinstance(v, int) else v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if torch.is_tensor(v) and v.numel() == 1 and not v.is_complex():
        return v.item()
    if isinstance(v, (list, tuple)) or (torch.is_tensor(v) and v.dim() == 1):
        return [json_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    raise TypeError(f"{where} is {reprlib.repr(v)} ({type(v).__name__}): an optimizer checkpoint holds a param "
                    "group's values as numbers, strings or lists of them; remove or convert that key before saving")


class LayoutMismatch(ValueError):
    """A state of another set (or order, or shapes) of trainable params than this model's."""


class GroupingMismatch(LayoutMismatch):
    """A state of the same params in the same order, split into other param groups."""


def with_empty_groups(meta: dict, slots: list, groups: list[dict]) -> dict:
    """``meta`` as this engine's groups (``slots``, ``groups``) hold it, when the two differ only by empty param
    groups: states saved before the Trainer's empty group was kept (it was dropped until session 19: a model whose
    norms and biases are all frozen, or only they train) load into an engine that has it (and the reverse). The
    saved groups are this engine's non-empty ones, in order; an empty one keeps this engine's values."""
    saved_slots, saved_groups = meta.get("slots"), meta.get("param_groups")
    if (not isinstance(saved_slots, list) or not isinstance(saved_groups, list) or saved_slots == slots
            or len(saved_slots) != len(saved_groups) or [g for g in saved_slots if g] != [g for g in slots if g]):
        return meta
    kept = iter([g for s, g in zip(saved_slots, saved_groups) if s])
    return {**meta, "slots": slots,
            "param_groups": [next(kept) if s else {k: v for k, v in g.items() if k != "params"}
                             for s, g in zip(slots, groups)]}


def check_model(meta: dict, numel: int, slots: list) -> None:
    if meta.get("format") not in STATE_FORMATS:
        raise ValueError(f"not an hf_zero_offload optimizer state (format={meta.get('format')!r})")
    if meta.get("numel") != numel or meta.get("slots") != slots:
        saved = meta.get("slots")
        grouped = isinstance(saved, list) and all(isinstance(g, list) for g in saved)
        params = sum(map(len, saved)) if grouped else "?"
        if grouped and [s for g in saved for s in g] == [s for g in slots for s in g]:
            raise GroupingMismatch(f"optimizer state does not match this model's param groups: the same params, in "
                                 f"{len(saved)} group(s) of {[len(g) for g in saved]} params when saved and "
                                 f"{len(slots)} of {[len(g) for g in slots]} here (another weight-decay split, or a "
                                 "create_optimizer of another grouping): group them as the run that saved it did")
        raise LayoutMismatch(f"optimizer state does not match this model: saved {meta.get('numel')} trainable elements "
                         f"in {params} params, this model has {numel} in {sum(map(len, slots))}")


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_meta(meta: dict, where: str, *, numel: int, slots: list, groups: int, steps: int) -> None:
    """The small fields of a saved state (a file header or a state dict), checked before anything is
    loaded, so a foreign or tampered state is refused by name and the engine stays as it was."""
    check_model(meta, numel, slots)

    def bad(field: str, want: str, got) -> StateFileError:
        return StateFileError(f"{where}: {field} must be {want}, got {reprlib.repr(got)}; this state was not "
                              "written by hf_zero_offload (or is damaged)")

    if meta.get("state_dtype", "fp32") not in ops.STATE_DTYPES:
        raise bad("state_dtype", f"one of {ops.STATE_DTYPES}", meta.get("state_dtype"))
    saved = meta.get("param_groups")
    if not isinstance(saved, list) or len(saved) != groups or not all(isinstance(g, dict) for g in saved):
        raise bad("param_groups", f"a list of {groups} dicts", saved)
    for i, g in enumerate(saved):
        try:  # the values a step would check (ops.check_hyperparameters); a missing key is left to the defaults
            ops.check_hyperparameters(lr=g.get("lr", 0.0), betas=g.get("betas", (0.0, 0.0)), eps=g.get("eps", 0.0),
                                      weight_decay=g.get("weight_decay", 0.0))
        except ValueError as e:
            raise StateFileError(f"{where}: param_groups[{i}].{e}; this state was not written by hf_zero_offload "
                                 "(or is damaged)") from None
        if not isinstance(g.get("adamw_mode", True), bool):
            raise bad(f"param_groups[{i}].adamw_mode", "a bool", g["adamw_mode"])
    counts = meta.get("param_steps")
    if not isinstance(counts, list) or len(counts) != steps or not all(map(_count, counts)):
        raise bad("param_steps", f"a list of {steps} ints >= 0", counts)
    if not _count(meta.get("global_steps")):
        raise bad("global_steps", "an int >= 0", meta.get("global_steps"))
    if not isinstance(meta.get("needs_publish", False), bool):
        raise bad("needs_publish", "a bool", meta["needs_publish"])


def check_tensors(state: dict, n: int, where: str) -> None:
    """The tensors of a state dict of an ``n``-element slice: each one its ``state_dtype`` stores
    (``moment_regions``), of that dtype and at least that long, before any is copied."""
    saved = state.get("state_dtype", "fp32")
    want = {"master": (n, torch.float32), **moment_regions(n, saved)}
    for key, (count, dtype) in want.items():
        t = state.get(key)
        if not torch.is_tensor(t):
            raise StateFileError(f"{where}: {key} is missing or not a tensor ({saved} states hold {', '.join(want)})")
        if t.dtype != dtype:
            raise StateFileError(f"{where}: {key} is {str(t.dtype)[6:]}, expected {str(dtype)[6:]} ({saved} state)")
        if t.numel() < count:
            raise StateFileError(f"{where}: {key} has {t.numel()} elements, expected {count} ({n} in this slice)")
    # the values the kernels rely on, here before anything is written (a checkpoint's: once streamed in)
    flat = {k: state[k].reshape(-1)[:count] for k, (count, _) in want.items()}
    if saved != "int8":
        return check_second_moments(flat["exp_avg_sq"], where)
    try:
        ops.check_scales(*(flat[k] for k in SCALES))
        for k in ("exp_avg", "exp_avg_sq"):
            check_code_range(f"{k} codes", flat[k])
    except ValueError as e:
        raise StateFileError(f"{where}: {e}; use an earlier checkpoint") from None


def check_second_moments(exp_avg_sq: torch.Tensor, where: str) -> None:
    """fp32/bf16 ``exp_avg_sq`` of a load is >= 0 (``check_second_moment``), refused as ``where``'s error."""
    try:
        check_second_moment("exp_avg_sq", exp_avg_sq)
    except ValueError as e:
        raise StateFileError(f"{where}: {e}; use an earlier checkpoint") from None


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
