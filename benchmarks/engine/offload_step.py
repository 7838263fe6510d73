"""One training step (forward + backward + optimizer step) with and without optimizer offload.

    python -m benchmarks.engine.offload_step [--params N] [--dtype auto|bf16|fp16|fp32] [--steps S] [--tokens T]
                                      [--gpu_mem_gib G] [--rows a,b,c,d,e] [--deepspeed] [--json PATH|-]

Model: a stack of Linear(w, w) + LayerNorm(w) blocks with about N trainable params (default 20M on a
CPU-only machine, 1B on a GPU), fed a synthetic [T, w] batch; loss = mean(out^2). Rows, one after the
other in this process, each on a fresh copy of the same model:

  (a) no offload   torch.optim.AdamW(fused=True) on the device. 16-bit dtypes use the usual mixed-precision
                   recipe: fp32 params (the masters) + torch.autocast(dtype) (+ GradScaler for fp16).
  (b) ours         OffloadAdam, params held on the device in the 16-bit dtype (fp32 masters/moments on host);
                   built over the fp32 model on the CPU with device=..., as the Trainer builds it (the engine places
                   each param, cast, once its master is taken). ``--blocking_waits``: host waits sleep.
  (c) ours + DPU   the same with OffloadOptions(dpu=True, dpu_warmup_steps=2) (timed steps are all delayed).
  (d) torchao      CPUOffloadOptimizer(AdamW, fused=True) over the 16-bit model (its recipe: no fp32 masters,
                   states in the param dtype); GPU only, when torchao is importable.
  (e) DeepSpeed    ZeRO-2 + offload_optimizer cpu (pinned), one process; when importable and on a GPU, or
                   on CPU with --deepspeed (JIT-builds its CPU Adam; slow to start).

Columns: median (and min) wall time per step over --steps timed steps (after --warmup untimed ones; pooled
over --rounds), ratio to (a), median process CPU time per step (all threads) and its ratio, peak device
memory (torch.cuda.max_memory_allocated; n/a on CPU), device model-state memory between steps per param,
optimizer-state bytes per param and where they live (ours: arena.nbytes / numel, all host; torch AdamW: its
state tensors), and PCIe bytes per param per step as counted by the engine's Streams during the timed steps
(gradients down in their dtype, params up in the training dtype; 0 on CPU, where nothing crosses a bus;
``HF_ZERO_OFFLOAD_SIMULATE_STREAMS=1`` runs the engine's GPU code path on the stream simulator and counts
them there: 4.0 B/param for bf16, 8.0 for fp32; times are then meaningless).

On a CPU-only machine the "device" is the CPU itself: the table shows the engine's overhead against plain
AdamW on the same cores and its host footprint; with DPU the optimizer thread competes with the forward
and backward for those same cores, so it is expected to be no faster there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

from benchmarks._common import (NOT_HERE, beside, hardware, hardware_line, int_at_least, json_stdout,  # noqa: E402
                                json_target, name_list, phases_text, positive_float, positive_int, print_table,
                                provenance, target_line, torch_device, verdict, write_json)
from benchmarks.engine.rows import DTYPES, ROWS, Ctx, Skip  # noqa: E402

SMALL = 20_000_000  # params under which the host bytes per param are not the model's (_fmt_targets)
TARGETS = {"offload_ratio": 1.3, "dpu_ratio": 1.1, "host_bpp": 18.0, "device_state_bpp": 2.0, "pcie_bpp_16bit": 4}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=positive_float, default=None, help="trainable params (default 20M on CPU, 1B on GPU)")
    ap.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                    help="the training dtype (default auto: bf16 on a GPU or a CPU with AVX512-BF16/AMX, else fp32, "
                         "since torch emulates bf16 on other CPUs: ~6 s a step at 20M params on a 2-core AVX2 EPYC)")
    ap.add_argument("--steps", type=positive_int, default=10, help="timed steps per row (median reported)")
    ap.add_argument("--rounds", type=positive_int, default=1,
                    help="run the whole row list this many times and pool each row's timed steps (noisy hosts)")
    ap.add_argument("--warmup", type=int_at_least(3), default=3, help="untimed steps first (at least 3: DPU starts after 2)")
    ap.add_argument("--tokens", type=positive_int, default=None, help="rows of the synthetic batch (default 32 CPU, 4096 GPU)")
    ap.add_argument("--width", type=positive_int, default=None, help="hidden size (default from --params)")
    ap.add_argument("--rows", type=name_list(ROWS, "row"), default=",".join(ROWS), help="which rows to run, e.g. a,b,c")
    ap.add_argument("--device", type=torch_device, default=None,
                    help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--gpu_mem_gib", type=positive_float, default=None,
                    help="cap this process's CUDA memory (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--bucket_numel", type=positive_int, default=None, help="engine gradient bucket (default: engine's)")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch / CPU Adam threads (default: torch's)")
    ap.add_argument("--deepspeed", action="store_true", help="also run row (e) on a CPU-only machine")
    ap.add_argument("--blocking_waits", action="store_true",
                    help="our rows' host waits sleep instead of spinning (HF_ZERO_OFFLOAD_BLOCKING_WAITS=1)")
    ap.add_argument("--json", type=json_target, default=None, help="write rows + hardware as JSON to PATH, or '-' for stdout")
    return ap


def _auto_dtype(device: str | None) -> str:
    from hf_zero_offload.launch_checks import cpu_has_native_bf16
    on_cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
    return "fp32" if on_cpu and cpu_has_native_bf16() is False else "bf16"


def _fmt_targets(rows: list[dict], ctx: Ctx) -> list[str]:
    """One line per target: met / NOT MET / not meaningful here (with the reason)."""
    by = {r["row"][:3]: r for r in rows if r.get("ms") is not None}
    b, c = by.get("(b)"), by.get("(c)")
    lines = []
    cpu_why = "on a CPU-only machine the 'device' is the CPU: offload only adds copies; a GPU run measures this"
    for row, key, label in ((b, "offload_ratio", "offload step vs no offload"),
                            (c, "dpu_ratio", "offload + DPU step vs no offload")):
        target = f"target <= {TARGETS[key]}x"
        if row is None or row.get("ratio") is None:
            lines.append(target_line(label, target, NOT_HERE, "row not run"))
        elif not ctx.cuda:
            lines.append(target_line(label, f"{row['ratio']:.2f}x, {target}", NOT_HERE, cpu_why))
        else:
            lines.append(target_line(label, f"{beside(row['ratio'], TARGETS[key])}x, {target}",
                                     verdict(row["ratio"] <= TARGETS[key])))
            if row.get("phases_ms"):  # what bounds it: the host's Adam, or the device's work
                ph = row["phases_ms"]
                lines.append(f"  (of its {row['ms']:.0f} ms: the CPU Adam pass {ph['adam']:.0f} ms, the device's "
                             f"forward+backward {ph['fwd+bwd']:.0f} ms)")
    if b is None:
        return lines + [target_line("host optimizer memory", f"target <= {TARGETS['host_bpp']:.0f} B/param", NOT_HERE,
                                    "row (b) not run")]
    measured = f"{beside(b['opt_bpp'], TARGETS['host_bpp'])} B/param, target <= {TARGETS['host_bpp']:.0f}"
    if ctx.n_target < SMALL:  # (fp32, session 34: 24.0 B/param at 2M params, 22.4 at 5M, 19.2 at 10M, 17.7 at 20M)
        lines.append(target_line("host optimizer memory (no DPU)", measured, NOT_HERE, "under 20M params the engine's "
                                 "fixed-size buffers (about 30 MB: its tile staging) weigh per param: measure at >= 20M"))
    else:
        lines.append(target_line("host optimizer memory (no DPU)", measured, verdict(b["opt_bpp"] <= TARGETS["host_bpp"])))
    if c:
        lines.append(f"  (with DPU {c['opt_bpp']:.2f} B/param: a second gradient store and parameter staging)")
    if b.get("dev_state_bpp") is None or not ctx.cuda:
        lines.append(target_line("device model states", "target 2 B/param + buckets", NOT_HERE,
                                 "no device memory to measure without a GPU"))
    else:
        params_only = b["dev_state_bpp"] - b["buckets_bpp"]
        lines.append(target_line("device model states", f"{b['dev_state_bpp']:.2f} B/param = params "
                                 f"{params_only:.2f} + buckets {b['buckets_bpp']:.2f}, target 2 B/param + buckets",
                                 verdict(params_only <= TARGETS["device_state_bpp"] + 0.05)))
    target = f"target {TARGETS['pcie_bpp_16bit']} B/param (2 down + 2 up)"
    if not ctx.cuda:
        lines.append(target_line("PCIe traffic per step", target, NOT_HERE, "no PCIe link without a GPU"))
    elif ctx.dtype == torch.float32:
        lines.append(target_line("PCIe traffic per step", target, NOT_HERE,
                                 "the target is for 16-bit models; an fp32 model moves 4 + 4 B/param"))
    else:
        lines.append(target_line("PCIe traffic per step",
                                 f"{beside(b['pcie_bpp'], TARGETS['pcie_bpp_16bit'], 1)} B/param, {target}",
                                 verdict(b["pcie_bpp"] <= TARGETS["pcie_bpp_16bit"])))
    return lines


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.dtype == "auto":
        args.dtype = _auto_dtype(args.device)
    if args.blocking_waits:
        os.environ["HF_ZERO_OFFLOAD_BLOCKING_WAITS"] = "1"  # read when each engine makes its Streams
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = Ctx(args)
    if ctx.cuda and args.gpu_mem_gib:
        # torch's cap takes a device index: torch.device("cuda") has none (rejected there, ValueError)
        index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem_gib * 2**30 / total), index)
    info = hardware()
    print(hardware_line(info))
    per_layer = ctx.width * ctx.width + 3 * ctx.width
    print(f"model: {max(1, round(ctx.n_target / per_layer))} x [Linear({ctx.width}) + LayerNorm], "
          f"{args.dtype}, batch {ctx.tokens} x {ctx.width}, device {ctx.device}, "
          f"{ctx.steps} timed steps after {ctx.warmup}, {args.rounds} round(s)" +
          (f", CUDA memory capped at {args.gpu_mem_gib} GiB" if ctx.cuda and args.gpu_mem_gib else ""), flush=True)
    rows, skipped = {}, {}
    keys = args.rows
    for rnd in range(max(1, args.rounds)):
        for key in keys:
            name, fn = ROWS[key]
            if name in skipped:
                continue
            ctx.clean()
            t0 = time.perf_counter()
            try:
                row = fn(ctx)
                row["setup_and_run_s"] = round(time.perf_counter() - t0, 1)
                print(f"  round {rnd + 1}: {name}: {row['ms']:.1f} ms/step ({row['setup_and_run_s']} s)", flush=True)
                if name in rows:  # pool the timed steps of every round
                    prev = rows[name]
                    row["times_ms"] = prev["times_ms"] + row["times_ms"]
                    row["cpu_times_ms"] = prev["cpu_times_ms"] + row["cpu_times_ms"]
                    row["peak_gib"] = max(filter(None, [prev["peak_gib"], row["peak_gib"]]), default=None)
                    row["setup_and_run_s"] += prev["setup_and_run_s"]
                row["ms"] = statistics.median(row["times_ms"])
                row["ms_min"] = min(row["times_ms"])
                row["cpu_ms"] = statistics.median(row["cpu_times_ms"])
                rows[name] = row
            except Skip as exc:
                skipped[name] = str(exc)
            except ImportError as exc:
                skipped[name] = f"not importable ({exc})"
            except torch.cuda.OutOfMemoryError:
                skipped[name] = "CUDA out of memory" + (f" under the {args.gpu_mem_gib} GiB cap" if args.gpu_mem_gib
                                                         else "")
            except Exception as exc:  # keep going: one failing row must not hide the others
                skipped[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                traceback.print_exc(limit=4)
            finally:
                ctx.clean()
    rows = list(rows.values())
    base = next((r for r in rows if r["row"].startswith("(a)")), None)
    for r in rows:
        r["ratio"] = r["ms"] / base["ms"] if base else None
        r["cpu_ratio"] = r["cpu_ms"] / base["cpu_ms"] if base and base["cpu_ms"] else None
    print()
    print_table(rows, [("row", "row"), ("ms", "ms/step", ".1f"), ("ms_min", "min ms", ".1f"), ("ratio", "vs (a)", ".2f"),
                       ("cpu_ms", "CPU ms/step", ".0f"), ("cpu_ratio", "CPU vs (a)", ".2f"),
                       ("peak_gib", "peak dev GiB", ".2f"), ("dev_state_bpp", "dev state B/p", ".2f"),
                       ("opt_bpp", "opt B/p", ".2f"), ("opt_where", "opt mem on"), ("pcie_bpp", "PCIe B/p", ".1f")])
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    for r in rows:  # where the offload rows' time goes (rows.PhaseClock)
        if r.get("phases_ms"):
            print(f"phases of {r['row']}, median ms: " + phases_text(r["phases_ms"]))
    for line in _fmt_targets(rows, ctx):
        print(line)
    if args.json:
        write_json(args.json, {
            **provenance("benchmarks.engine.offload_step", argv, info),
            "config": {"params_target": ctx.n_target, "width": ctx.width, "tokens": ctx.tokens, "dtype": args.dtype,
                       "blocking_waits": args.blocking_waits,
                       "device": str(ctx.device), "steps": ctx.steps, "warmup": ctx.warmup,
                       "rounds": args.rounds,
                       "gpu_mem_gib": args.gpu_mem_gib, "threads": torch.get_num_threads()},
            "rows": rows, "skipped": skipped, "targets": TARGETS, "target_lines": _fmt_targets(rows, ctx),
        })
    # a row that failed (not one skipped for want of a peer or a device) fails the run: it exited 0 with tracebacks
    return 0 if rows and not any(why.startswith("failed: ") for why in skipped.values()) else 1


if __name__ == "__main__":
    with json_stdout():
        code = main()
    sys.exit(code)
