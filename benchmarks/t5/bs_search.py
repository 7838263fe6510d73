"""The largest batch size of a t5 table row: ``find_max_bs`` (gallop by 1.5x from a start, then bisect, on a
probe that answers ok / oom / error) and ``planner_guesses`` (hf_zero_offload.planner's prediction, the start).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from benchmarks.t5.runs import RowSpec


def round_bs(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def find_max_bs(probe: Callable[[int], str], start: int, multiple: int = 1, max_bs: int = 4096,
                log: Callable[[str], None] = print, rel_tol: float = 0.0) -> tuple:
    """Largest multiple of ``multiple`` (<= max_bs) for which ``probe(bs)`` returns "ok"; 0 when even ``multiple``
    fails. ``probe`` returns "ok", "oom" or "error" (an error that is not out-of-memory stops the search). Gallops
    by 1.5x from ``start`` to bracket the answer, then bisects until the failing size is within
    max(multiple, rel_tol * passing size) of the passing one. Returns (bs, {bs: status}, error_or_None)."""
    seen: Dict[int, str] = {}

    def ok(bs: int) -> Optional[bool]:
        if bs not in seen:
            seen[bs] = probe(bs)
            log(f"    probe bs={bs}: {seen[bs]}")
        return None if seen[bs] == "error" else seen[bs] == "ok"

    bs = min(round_bs(start, multiple), max_bs)
    first = ok(bs)
    if first is None:
        return 0, seen, f"probe at bs={bs} failed (not out-of-memory)"
    if first:
        lo, hi = bs, None
        while hi is None and lo < max_bs:
            nxt = min(max_bs, max(lo + multiple, round_bs(lo * 1.5, multiple)))
            r = ok(nxt)
            if r is None:
                return lo, seen, f"probe at bs={nxt} failed (not out-of-memory)"
            lo, hi = (nxt, None) if r else (lo, nxt)
        if hi is None:
            return lo, seen, None  # max_bs fits
    else:
        hi, lo = bs, None
        while lo is None:
            if hi <= multiple:
                return 0, seen, None
            nxt = max(multiple, min(hi - multiple, round_bs(hi / 1.5, multiple)))
            r = ok(nxt)
            if r is None:
                return 0, seen, f"probe at bs={nxt} failed (not out-of-memory)"
            hi, lo = (hi, nxt) if r else (nxt, None)
    while hi - lo > max(multiple, rel_tol * lo):
        mid = round_bs((lo + hi) / 2, multiple)
        if mid <= lo or mid >= hi:
            mid = lo + multiple
        r = ok(mid)
        if r is None:
            return lo, seen, f"probe at bs={mid} failed (not out-of-memory)"
        lo, hi = (mid, hi) if r else (lo, mid)
    return lo, seen, None


_PLANNER_ROW = {"baseline": "baseline", "half": None, "sharded_ddp": "sharded_stage1_fp32",
                "sharded_ddp_half": "sharded_stage1_{dtype}", "zero2": "zero2", "zero2_offload": "zero2_offload",
                "zero2_offload_dpu": "zero2_offload_dpu"}


def planner_guesses(args, rows: List[RowSpec], dtype: str) -> Dict[str, int]:
    """hf_zero_offload.planner's largest batch per row (the search's starting point); {} when it fails."""
    out: Dict[str, int] = {}
    try:
        from hf_zero_offload.planner import plan
    except Exception as e:  # noqa: BLE001
        print(f"planner unavailable ({e}); the search starts at --batch_size")
        return out
    for nproc in sorted({r.nproc for r in rows}):
        try:
            p = plan(args.model, gpus=nproc, gpu_mem_gib=args.gpu_mem_gib or 24.0, dtype=dtype,
                     seq_len=args.max_source_length, tgt_len=args.max_target_length)
        except Exception as e:  # noqa: BLE001
            print(f"planner failed for {nproc} process(es) ({type(e).__name__}: {e}); the search starts at "
                  "--batch_size")
            continue
        by_name = {r.name: r.max_batch_size for r in p.rows}
        for r in rows:
            key = _PLANNER_ROW.get(r.name)
            key = dtype if key is None else key.format(dtype=dtype)
            if r.name.startswith("sharded") and args.sharded_stage != 1:
                continue  # the planner's sharded rows are ZeRO-1
            if r.nproc == nproc and key in by_name:
                out[r.name] = by_name[key]
    return out
