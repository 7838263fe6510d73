"""The engines' cost per parameter tensor: models of many small tensors (norms, biases, per-expert weights).

    python -m benchmarks.engine.many_tensors [--tensors 1000,4000,16000] [--state-dtype fp32|bf16|int8] [--world 2]
                                             [--json PATH|-]

Tensors of 5..39 elements (seeded), so the per-tensor work, not the per-element work, is what is timed. Rows per
tensor count, all in one process and interleaved round by round, medians of ``--rounds``:
- ``OffloadAdam`` build, and its step with every tensor getting a gradient, against torch's
  ``AdamW(foreach=False)`` step (the reference every test compares with) on the same tensors;
- the same after one step in which every other tensor got no gradient (``fragmented``): torch.optim's per-param
  step counts then differ between neighbours for good, so each tensor is its own run of the kernel (with int8
  moments each 256-element block then holds several runs, decoded and re-encoded in Python per run);
- ``ShardedAdam`` (stage 2, offload) build on ``--world`` gloo ranks: the slower rank's time (a build whose rank-0
  broadcast summed its chunk again per tensor took 27 s for 16000 tensors on 2 ranks, session 19).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch

from benchmarks._common import (hardware, hardware_line, int_list, json_stdout, json_target, nonnegative_int,
                               positive_int, print_table, provenance, write_json)


def _tensors(n: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(int(torch.randint(5, 40, (1,), generator=g)), generator=g))
            for _ in range(n)]


def _backward(params, use) -> None:
    sum((params[i] * params[i]).sum() for i in use).backward()


def _step_ms(opt, params, rounds: int) -> float:
    times = []
    every = range(len(params))
    for _ in range(rounds):
        _backward(params, every)
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
        opt.zero_grad(set_to_none=True)
    return 1e3 * statistics.median(times)


def _one_process(n: int, rounds: int, state_dtype: str) -> dict:
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    row = {"tensors": n, "state_dtype": state_dtype}
    options = OffloadOptions(state_dtype=state_dtype)
    params = _tensors(n)
    t = time.perf_counter()
    ours = OffloadAdam(params, lr=1e-3, options=options)
    row["build_s"] = time.perf_counter() - t
    ref_params = _tensors(n)
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.0, foreach=False)
    row["ours_ms"] = _step_ms(ours, params, rounds)
    row["torch_ms"] = _step_ms(ref, ref_params, rounds)
    ours.close()
    params = _tensors(n)
    frag = OffloadAdam(params, lr=1e-3, options=options)
    _backward(params, range(0, n, 2))  # every other tensor without a gradient, once
    frag.step()
    frag.zero_grad(set_to_none=True)
    row["fragmented_ms"] = _step_ms(frag, params, rounds)
    frag.close()
    row["ours_vs_torch"] = row["ours_ms"] / row["torch_ms"]
    row["fragmented_vs_torch"] = row["fragmented_ms"] / row["torch_ms"]
    return row


def _rank_build(rank: int, world: int, port: int, counts: list[int], out_q) -> None:
    import torch.distributed as dist

    from hf_zero_offload.engine import ShardedAdam

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ShardedAdam(_tensors(10), lr=1e-3, stage=2, offload=True).close()  # first-use costs, untimed
        times = []
        for n in counts:
            params = _tensors(n)
            dist.barrier()
            t = time.perf_counter()
            opt = ShardedAdam(params, lr=1e-3, stage=2, offload=True)
            times.append(time.perf_counter() - t)
            opt.close()
        out_q.put((rank, times))
    finally:
        dist.destroy_process_group()


def _sharded_builds(counts: list[int], world: int) -> list[float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_build, args=(r, world, port, counts, q)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(q.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return [max(per_rank[r][i] for r in per_rank) for i in range(len(counts))]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int_list(1), default=[1000, 4000, 16000], help="comma-separated tensor counts")
    ap.add_argument("--rounds", type=positive_int, default=5, help="timed steps per row (median reported)")
    ap.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                    help="OffloadAdam's moments (offload_optimizer.state_dtype)")
    ap.add_argument("--world", type=nonnegative_int, default=2, help="ranks of the ShardedAdam build (0 or 1: skip it)")
    ap.add_argument("--json", type=json_target, default=None, help="write the rows as JSON to PATH, or '-' for stdout")
    return ap


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    counts = a.tensors
    with json_stdout(argv):
        info = hardware()
        print(hardware_line(info))
        from hf_zero_offload.engine import OffloadAdam
        OffloadAdam(_tensors(10), lr=1e-3).close()  # first-use costs (the thread pool, the arena), untimed
        rows = [_one_process(n, a.rounds, a.state_dtype) for n in counts]
        if a.world > 1:
            for row, s in zip(rows, _sharded_builds(counts, a.world)):
                row[f"sharded_build_s_{a.world}ranks"] = s
        cols = ["tensors", ("build_s", "build s", ".2f"), ("ours_ms", "step ms", ".1f"),
                ("torch_ms", "torch AdamW ms", ".1f"), ("ours_vs_torch", "x torch", ".2f"),
                ("fragmented_ms", "fragmented ms", ".1f"), ("fragmented_vs_torch", "x torch", ".2f")]
        if a.world > 1:
            cols.append((f"sharded_build_s_{a.world}ranks", f"sharded build s ({a.world} ranks)", ".2f"))
        print_table(rows, cols)
    write_json(a.json, {**provenance("benchmarks.engine.many_tensors", argv, info), "rows": rows})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
