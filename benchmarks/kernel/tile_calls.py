"""The kernel as the engine calls it: tile after tile, not one big call.

    python -m benchmarks.kernel.tile_calls [--threads T] [--rounds R] [--json PATH|-]

(run from the repository root). The engines step their slice in tiles (``OffloadOptions.tile_numel``,
4M elements by default), one ``ops.adam_step`` call each, with some Python between calls. Every call
hands its parts to the thread pool and waits for them, so a wake-up that costs more than a tile's
share of the work shows here, and not in ``adam_step.py``'s single 50M call. Each row: ``calls``
consecutive calls on 4 tiles of ``tile`` elements (bf16 grad and param out), on 1 thread and on
``T``; ns/param per step (median over the rounds, the two thread counts alternated round by round)
and the speed-up.
"""
from __future__ import annotations

import argparse
import time

ROWS = [(1 << 18, 200, "fp32"), (1 << 20, 60, "fp32"), (1 << 20, 60, "int8"), (1 << 22, 20, "fp32"),
        (1 << 22, 20, "int8")]


def build_parser() -> argparse.ArgumentParser:
    from benchmarks._common import json_target, positive_int

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=positive_int, default=None, help="default: torch.get_num_threads() (all cores)")
    ap.add_argument("--rounds", type=positive_int, default=7, help="timed rounds per thread count")
    ap.add_argument("--json", type=json_target, default=None, help="write the results as JSON to PATH, or '-' for stdout")
    return ap


def _step_fn(tile: int, calls: int, kind: str, threads: int):
    import torch

    from hf_zero_offload import ops

    tiles = []
    for _ in range(4):  # distinct memory, as an engine's consecutive tiles are
        st = ops.make_state(tile, kind)
        tiles.append((torch.randn(tile), torch.randn(tile).bfloat16(), torch.empty(tile, dtype=torch.bfloat16), st))

    def step(s: int) -> None:
        for c in range(calls):
            p, g, out, st = tiles[c % 4]
            ops.adam_step(p, g, param_out=out, step=s, lr=1e-3, num_threads=threads, **st)

    return step


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)  # before torch's import: --help and a usage error need none of it
    import torch

    from benchmarks._common import hardware, hardware_line, median, print_table, provenance, write_json

    threads = args.threads or torch.get_num_threads()
    info = hardware()
    print(hardware_line(info))
    rows = []
    for tile, calls, kind in ROWS:
        steps = {t: _step_fn(tile, calls, kind, t) for t in (1, threads)}
        times = {1: [], threads: []}
        for t in times:
            steps[t](1)  # warm-up: first touch of the memory, the pool's threads
        for r in range(args.rounds):
            for t in times:
                a = time.perf_counter()
                steps[t](r + 2)
                times[t].append(time.perf_counter() - a)
        one, many = (median(times[t]) * 1e9 / (tile * calls) for t in (1, threads))
        rows.append({"tile": tile, "calls": calls, "moments": kind, "ns_1": one, "ns_n": many,
                     "speedup": one / many})
    print_table(rows, [("tile", "tile elements"), "calls", "moments", ("ns_1", "ns/param 1 thread", ".3f"),
                       ("ns_n", f"ns/param {threads} threads", ".3f"), ("speedup", "speed-up", ".2f")])
    write_json(args.json, {**provenance("benchmarks.kernel.tile_calls", argv, info), "threads": threads,
                           "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    from benchmarks._common import json_stdout

    with json_stdout():
        main()
