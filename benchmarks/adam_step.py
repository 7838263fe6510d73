"""One optimizer step over a flat array of N parameters: our fused CPU Adam against its peers.

    python benchmarks/adam_step.py [--numel N] [--threads T] [--repeat R] [--json PATH|-]

Rows (all in this process, same N, same thread count):
  ours fp32        fp32 grad in, fp32 param/exp_avg/exp_avg_sq updated in place          28 B/param
  ours mixed       bf16 grad in, fp32 state, bf16 param copy written in the same pass    28 B/param
  torch fused      torch.optim.AdamW(fused=True), fp32
  torch foreach    torch.optim.AdamW(foreach=True), fp32
  torch mixed      bf16 grad -> fp32 copy pass, fused AdamW step, fp32 -> bf16 param copy pass
  DeepSpeed fp32 / mixed   DeepSpeedCPUAdam, the same two pipelines (when importable)
  torchao          (when importable; its CPU step is torch's fused AdamW on CPU copies)
  stream bound     a C++ loop moving fp32 Adam's bytes (4 reads, 3 writes) with no sqrt/div

GB/s is the bytes a single fused pass must move (28 B/param) divided by the time, so for the
multi-pass pipelines it is an effective rate; "moved B/p" counts what each pipeline really moves
(without write-allocate reads).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--threads", type=int, default=None, help="default: torch.get_num_threads()")
    ap.add_argument("--repeat", type=int, default=12, help="timed steps per row (the median is reported)")
    ap.add_argument("--json", default=None, help="write the rows as JSON to PATH, or '-' for stdout")
    return ap.parse_args()


ARGS = _parse()
if ARGS.threads is not None:  # before torch (and DeepSpeed's own OpenMP runtime) start their pools
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ForeignLoad, hardware, hardware_line, median, print_table, write_json  # noqa: E402

from hf_zero_offload import _C, ops  # noqa: E402

LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8
FUSED_BYTES = 28  # param r/w 8, exp_avg r/w 8, exp_avg_sq r/w 8, grad r 4 (fp32); bf16 grad 2 + bf16 out 2


class Bufs:
    """Arrays shared by the rows (the param's values drift under every row's updates, which does not
    change the cost); every optimizer keeps its own exp_avg/exp_avg_sq."""

    def __init__(self, n: int):
        gen = torch.Generator().manual_seed(0)
        self.p = torch.randn(n, generator=gen)
        self.g32 = torch.randn(n, generator=gen)
        self.g16 = self.g32.to(torch.bfloat16)
        self.out16 = torch.empty(n, dtype=torch.bfloat16)
        self.grad_buf = torch.zeros(n)  # fp32 target of the peers' bf16 -> fp32 conversion pass
        self.m, self.v = torch.zeros(n), torch.zeros(n)


def ours(b: Bufs, n: int, threads: int, mixed: bool):
    step = [0]
    g, out = (b.g16, b.out16) if mixed else (b.g32, None)

    def fn():
        step[0] += 1
        ops.adam_step(b.p, g, b.m, b.v, step=step[0], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                      weight_decay=WD, adamw=True, param_out=out, num_threads=threads)

    return fn


def peer(b: Bufs, make_opt, mixed: bool):
    """An optimizer over the shared fp32 param; mixed: bf16 grad -> fp32 pass, step, fp32 -> bf16 pass."""
    opt = make_opt([b.p])
    if not mixed:
        def fn():
            b.p.grad = b.g32
            opt.step()
        return fn

    def fn_mixed():
        b.grad_buf.copy_(b.g16)  # bf16 -> fp32 conversion pass
        b.p.grad = b.grad_buf
        opt.step()
        b.out16.copy_(b.p)  # fp32 -> bf16 param copy pass

    return fn_mixed


def stream(n: int, threads: int):
    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    return lambda: _C.stream_ref(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, threads)


def run_blocks(fns: dict, repeat: int, passes: int = 3, slow: tuple = ()) -> dict:
    """Each row runs in short blocks (one untimed call, then timed calls), the rows in turn, over a
    few passes: a change in machine load during the run (other processes, neighbours' memory
    traffic) hits every row alike, while consecutive calls of one row never interleave with
    another's. The pause between blocks lets the OpenMP workers of the previous row (torch's, or
    DeepSpeed's separate runtime) stop spinning before the next row starts."""
    times = {k: [] for k in fns}
    for pss in range(passes):
        for name, fn in fns.items():
            want = max(1, repeat // 3) if name in slow else repeat
            k = want // passes + (1 if pss < want % passes else 0)
            if k == 0:
                continue
            time.sleep(0.2)
            fn()  # untimed: first touch, caches, thread wake-up
            for _ in range(k):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> int:
    n, repeat = ARGS.numel, ARGS.repeat
    threads = ARGS.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    info = hardware()
    out_stream = sys.stderr if ARGS.json == "-" else sys.stdout

    def say(*a):
        print(*a, file=out_stream, flush=True)

    say(hardware_line(info))
    say(f"numel={n:,}  threads={threads}  repeat={repeat} (median)  simd={ops.simd_level()}")

    rows, skipped = [], {}
    b = Bufs(n)
    torch_fused = lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)  # noqa
    torch_foreach = lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)  # noqa
    # name -> (kind, bytes per param the pipeline really moves, callable)
    # (conversion pass 2 r + 4 w, step 28, param copy pass 4 r + 2 w = 40)
    spec = {
        "stream bound": ("bound", 28, stream(n, threads)),
        "ours fp32": ("fp32", 28, ours(b, n, threads, mixed=False)),
        "ours mixed": ("mixed", 28, ours(b, n, threads, mixed=True)),
        "torch fused fp32": ("fp32", 28, peer(b, torch_fused, mixed=False)),
        "torch foreach fp32": ("fp32", 28, peer(b, torch_foreach, mixed=False)),
        "torch fused mixed": ("mixed", 40, peer(b, torch_fused, mixed=True)),
    }
    versions = {"torch": torch.__version__}
    try:
        # DeepSpeed logs (and JIT-builds) on stdout: keep stdout clean for --json -
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            versions["deepspeed"] = deepspeed.__version__
            ds = lambda ps: DeepSpeedCPUAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)  # noqa
            spec["DeepSpeed fp32"] = ("fp32", 28, peer(b, ds, mixed=False))
            spec["DeepSpeed mixed"] = ("mixed", 40, peer(b, ds, mixed=True))
    except Exception as exc:  # not installed, or its CPU Adam failed to build
        skipped["DeepSpeed"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    try:
        from torchao.optim import CPUOffloadOptimizer  # noqa: F401

        skipped["torchao"] = ("CPUOffloadOptimizer's CPU step is torch's fused AdamW (the row above); its"
                              " device-transfer pipeline needs CUDA and belongs to the offload benchmark")
    except Exception as exc:
        skipped["torchao"] = f"not importable ({type(exc).__name__}: {exc})".splitlines()[0][:200]

    say(f"running {len(spec)} rows, {repeat} timed steps each, in 3 passes ...")
    with ForeignLoad() as load:
        times = run_blocks({k: v[2] for k, v in spec.items()}, repeat, slow=("torch foreach fp32",))
    for name, (kind, moved, _) in spec.items():
        ts = times[name]
        ms = median(ts) * 1e3
        rows.append(dict(name=name, kind=kind, ms=ms, min_ms=min(ts) * 1e3, samples=len(ts),
                         mparam_s=n / ms / 1e3, gb_s=FUSED_BYTES * n / ms / 1e6, moved_b_per_param=moved))

    by = {r["name"]: r for r in rows}
    ours32, oursmx, bound = by["ours fp32"], by["ours mixed"], by["stream bound"]
    for r in rows:
        ref = oursmx if r["kind"] == "mixed" else ours32
        r["speedup_of_ours"] = None if r is ref or r["kind"] == "bound" else r["ms"] / ref["ms"]
        r["frac_of_bound"] = bound["ms"] / r["ms"]

    say("")
    print_table(rows, [("name", "row"), ("ms", "ms/step", ".2f"), ("min_ms", "min ms", ".2f"),
                       ("mparam_s", "Mparam/s", ".0f"), ("gb_s", "GB/s", ".1f"), ("moved_b_per_param", "moved B/p"),
                       ("frac_of_bound", "bound/this", ".2f"), ("speedup_of_ours", "this/ours", ".2f")],
                file=out_stream)
    for name, why in skipped.items():
        say(f"skipped {name}: {why}")
    if load.cores is not None:
        say(f"other processes kept {load.cores:.2f} cores busy on average during the timed runs"
            + ("  (WARNING: shared machine, timings disturbed)" if load.cores > 0.2 else ""))

    # targets (the issue's, stated for 50M params / 2 threads on the 2-core build machine)
    checks = []
    peers32 = [by[k]["ms"] for k in ("DeepSpeed fp32",) if k in by]
    if peers32:
        checks.append(("fp32 <= DeepSpeed fp32", ours32["ms"] <= peers32[0], ours32["ms"] / peers32[0]))
    checks.append(("fp32 <= 0.85 x torch fused", ours32["ms"] <= 0.85 * by["torch fused fp32"]["ms"],
                   ours32["ms"] / by["torch fused fp32"]["ms"]))
    best_mixed_peer = min(r["ms"] for r in rows if r["kind"] == "mixed" and r is not oursmx)
    checks.append(("mixed >= 1.6x faster than best peer mixed", best_mixed_peer / oursmx["ms"] >= 1.6,
                   best_mixed_peer / oursmx["ms"]))
    checks.append(("fp32 >= 90% of stream bound", bound["ms"] / ours32["ms"] >= 0.9, bound["ms"] / ours32["ms"]))
    checks.append(("mixed >= 90% of stream bound", bound["ms"] / oursmx["ms"] >= 0.9, bound["ms"] / oursmx["ms"]))
    say("")
    for label, ok, value in checks:
        say(f"  [{'PASS' if ok else 'MISS'}] {label}: {value:.3f}")

    write_json(ARGS.json, {
        "benchmark": "adam_step",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "hardware_line": hardware_line(info),
        "hardware": info,
        "numel": n,
        "threads": threads,
        "repeat": repeat,
        "bytes_per_param_fused": FUSED_BYTES,
        "rows": rows,
        "skipped": skipped,
        "peer_versions": versions,
        "foreign_load_cores": load.cores,
        "targets": [dict(target=label, met=bool(ok), value=value) for label, ok, value in checks],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
