"""Per-rank memory and step time of ZeRO sharding against DDP + AdamW, on W local gloo processes.

    python -m benchmarks.sharding.sharded_step [--numel N] [--world W] [--repeat R] [--json PATH|-]

The model is a stack of Linear(width, width) layers with about N parameters (default ~20M), fp32,
each rank on its own batch. Rows (same model, data and thread count per rank):
  ddp             DistributedDataParallel(gradient_as_bucket_view=True) + torch.optim.AdamW(fused=True)
  stage1          ShardedAdam(stage=1, offload=False)
  stage2          ShardedAdam(stage=2, offload=False)
  stage2+offload  ShardedAdam(stage=2, offload=True)
On a CPU-only machine "device" and "host" are the same RAM, so offload changes where the state is
accounted, not where it is.

Memory columns are bytes each rank allocates for the optimizer and gradients, counted from the
tensors themselves: "state" = Adam moments (+ fp32 master shard for ShardedAdam; DDP's AdamW steps
the fp32 params in place, so it has none), "grads" = the gradients alive after backward (DDP: its
bucket-view .grad; stage 1: .grad plus the shard's gradient store; stage 2: the store) plus the
engine's reduce buffers, "param bufs" = the engine's all-gather buffer (and a param-dtype shard for
16-bit models). "iter ms" = forward + backward + step, the median over R iterations, the slower
rank; "step ms" = the optimizer step alone (the DDP reduction happens inside backward, as does
stage 2's).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    from benchmarks._common import json_target, positive_int

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=positive_int, default=20_000_000, help="approximate model size in parameters")
    ap.add_argument("--width", type=positive_int, default=1024)
    ap.add_argument("--batch", type=positive_int, default=16, help="rows per rank per step")
    ap.add_argument("--world", type=positive_int, default=2)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads per rank (default: cores / world)")
    ap.add_argument("--repeat", type=positive_int, default=10)
    ap.add_argument("--bucket", type=positive_int, default=1 << 21, help="reduce bucket, elements")
    ap.add_argument("--allgather-bucket", type=positive_int, default=1 << 22, help="all-gather bucket, elements")
    ap.add_argument("--json", type=json_target, default=None, help="write the rows as JSON to PATH, or '-' for stdout")
    return ap


def _model(args):
    import torch

    layers = max(1, round(args.numel / (args.width * args.width + args.width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(layers)])


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(rank, world, args, name):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_zero_offload.engine import OffloadOptions
    from hf_zero_offload.engine import ShardedAdam

    model = _model(args)
    n = sum(p.numel() for p in model.parameters())
    if name == "ddp":
        net = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket * 4 / 2**20)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        net = model
        opt = ShardedAdam(model.parameters(), lr=1e-4, stage=1 if name == "stage1" else 2,
                          offload=name.endswith("offload"), allgather_bucket_numel=args.allgather_bucket,
                          options=OffloadOptions(bucket_numel=args.bucket))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    iters, steps, live_grads = [], [], 0
    for i in range(args.repeat + 2):  # two untimed warm-up iterations
        dist.barrier()
        t0 = time.perf_counter()
        net(x).pow(2).mean().backward()
        live_grads = max(live_grads, _bytes(p.grad for p in model.parameters() if p.grad is not None))
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=name != "ddp")  # DDP's grads are its buckets: keep them
        t2 = time.perf_counter()
        if i >= 2:
            iters.append(t2 - t0)
            steps.append(t2 - t1)
    if name == "ddp":
        state = _bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        grads, pbufs = live_grads, 0
    else:
        m = opt.memory_bytes()
        state = m["optimizer_state"]
        grads = live_grads + m["grad_store"] + m["grad_buffers"]
        pbufs = m["param_buffers"]
        opt.close()
    return dict(name=name, params=n, state_b=state, grads_b=grads, pbufs_b=pbufs,
                iter_ms=1e3 * statistics.median(iters), step_ms=1e3 * statistics.median(steps))


def _rank_main(rank, world, port, args, out_q):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = [_measure(rank, world, args, name) for name in ("ddp", "stage1", "stage2", "stage2+offload")]
        out_q.put((rank, rows))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch.multiprocessing as mp

    from benchmarks._common import hardware, hardware_line, print_table, provenance, write_json

    info = hardware()
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json == "-" else print
    say(hardware_line(info))
    load_before = os.getloadavg()[0]  # other work on the machine skews times, not memory
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    per_rank = dict(q.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    rows = []
    for i, base in enumerate(per_rank[0]):
        row = dict(base)
        for key in ("iter_ms", "step_ms", "state_b", "grads_b", "pbufs_b"):  # the slower / larger rank
            row[key] = max(per_rank[r][i][key] for r in per_rank)
        row["total_b"] = row["state_b"] + row["grads_b"] + row["pbufs_b"]
        rows.append(row)
    ddp = rows[0]
    for row in rows:
        row["state_MB"], row["grads_MB"], row["pbufs_MB"], row["total_MB"] = (
            row[k] / 2**20 for k in ("state_b", "grads_b", "pbufs_b", "total_b"))
        row["mem_vs_ddp"] = row["total_b"] / ddp["total_b"]
        row["time_vs_ddp"] = row["iter_ms"] / ddp["iter_ms"]
    say(f"model: {rows[0]['params'] / 1e6:.1f}M params (Linear {args.width}x{args.width} stack), fp32, "
        f"{args.world} ranks x {args.threads} threads, gloo, batch {args.batch}/rank, reduce bucket {args.bucket}, "
        f"all-gather bucket {args.allgather_bucket}; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print_table(rows, [("name", "row"), ("state_MB", "state MB", ".1f"), ("grads_MB", "grads MB", ".1f"),
                       ("pbufs_MB", "param bufs MB", ".1f"), ("total_MB", "total MB", ".1f"),
                       ("mem_vs_ddp", "mem/ddp", ".2f"), ("iter_ms", "iter ms", ".1f"), ("step_ms", "step ms", ".1f"),
                       ("time_vs_ddp", "time/ddp", ".2f")], file=sys.stderr if args.json == "-" else None)
    write_json(args.json, {**provenance("benchmarks.sharding.sharded_step", argv, info), "args": vars(args),
                           "load_average": [load_before, os.getloadavg()[0]], "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
