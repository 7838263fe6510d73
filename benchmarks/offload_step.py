"""One training step (forward + backward + optimizer step) with and without optimizer offload.

    python benchmarks/offload_step.py [--params N] [--dtype bf16|fp16|fp32] [--steps S] [--tokens T]
                                      [--gpu_mem_gib G] [--rows a,b,c,d,e] [--deepspeed] [--json PATH|-]

Model: a stack of Linear(w, w) + LayerNorm(w) blocks with about N trainable params (default 20M on a
CPU-only machine, 1B on a GPU), fed a synthetic [T, w] batch; loss = mean(out^2). Rows, one after the
other in this process, each on a fresh copy of the same model:

  (a) no offload   torch.optim.AdamW(fused=True) on the device. 16-bit dtypes use the usual mixed-precision
                   recipe: fp32 params (the masters) + torch.autocast(dtype) (+ GradScaler for fp16).
  (b) ours         OffloadAdam, params held on the device in the 16-bit dtype (fp32 masters/moments on host).
  (c) ours + DPU   the same with OffloadOptions(dpu=True, dpu_warmup_steps=2) (timed steps are all delayed).
  (d) torchao      CPUOffloadOptimizer(AdamW, fused=True) over the 16-bit model (its recipe: no fp32 masters,
                   states in the param dtype); GPU only, when torchao is importable.
  (e) DeepSpeed    ZeRO-2 + offload_optimizer cpu (pinned), one process; when importable and on a GPU, or
                   on CPU with --deepspeed (JIT-builds its CPU Adam; slow to start).

Columns: median (and min) wall time per step over --steps timed steps (after --warmup untimed ones; pooled
over --rounds), ratio to (a), median process CPU time per step (all threads) and its ratio, peak device
memory (torch.cuda.max_memory_allocated; n/a on CPU), device model-state memory between steps per param,
optimizer-state bytes per param and where they live (ours: arena.nbytes / numel, all host; torch AdamW: its
state tensors), and PCIe bytes per param per step counted from the engine's sizes (gradients down in their
dtype, params up in the training dtype).

On a CPU-only machine the "device" is the CPU itself: the table shows the engine's overhead against plain
AdamW on the same cores and its host footprint; with DPU the optimizer thread competes with the forward
and backward for those same cores, so it is expected to be no faster there.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    from _common import hardware, hardware_line, print_table, write_json
except ImportError:  # pragma: no cover - minimal stand-ins when benchmarks/_common.py is absent
    import json
    import platform

    def hardware():
        return {"cpu": platform.processor() or platform.machine(), "logical_cores": os.cpu_count(),
                "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}

    def hardware_line(info=None):
        return " | ".join(f"{k}: {v}" for k, v in (info or hardware()).items())

    def print_table(rows, columns):
        cols = [(c, c, "") if isinstance(c, str) else (c + ("", ""))[:3] for c in columns]
        for row in [{k: h for k, h, _ in cols}] + list(rows):
            print("  ".join(str(row.get(k, "-") if row.get(k) is not None else "-") for k, _, _ in cols))

    def write_json(path, payload):
        text = json.dumps(payload, indent=2, default=str)
        if path == "-":
            print(text)
        elif path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")

from hf_zero_offload.engine import OffloadAdam, OffloadOptions  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LR, WD, BETAS, EPS = 1e-4, 0.01, (0.9, 0.999), 1e-8
class Skip(Exception):
    """A row that cannot run here (reason in the message); not an error."""


TARGETS = {"offload_ratio": 1.3, "dpu_ratio": 1.1, "host_bpp": 18.0, "device_state_bpp": 2.0, "pcie_bpp_16bit": 4}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=None, help="trainable params (default 20M on CPU, 1B on GPU)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row (median reported)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole row list this many times and pool each row's timed steps (noisy hosts)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (at least 3: DPU starts after 2)")
    ap.add_argument("--tokens", type=int, default=None, help="rows of the synthetic batch (default 32 CPU, 4096 GPU)")
    ap.add_argument("--width", type=int, default=None, help="hidden size (default from --params)")
    ap.add_argument("--rows", default="a,b,c,d,e", help="which rows to run, e.g. a,b,c")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--gpu_mem_gib", type=float, default=None,
                    help="cap this process's CUDA memory (torch.cuda.set_per_process_memory_fraction)")
    ap.add_argument("--bucket_numel", type=int, default=None, help="engine gradient bucket (default: engine's)")
    ap.add_argument("--threads", type=int, default=None, help="torch / CPU Adam threads (default: torch's)")
    ap.add_argument("--deepspeed", action="store_true", help="also run row (e) on a CPU-only machine")
    ap.add_argument("--json", default=None, help="write rows + hardware as JSON to PATH, or '-' for stdout")
    return ap.parse_args()


# -- model ---------------------------------------------------------------------------------------
def make_model(n_params: int, width: int, device, dtype=torch.float32, seed: int = 0) -> nn.Sequential:
    per_layer = width * width + width + 2 * width
    layers = max(1, round(n_params / per_layer))
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width, device=device, dtype=dtype), nn.LayerNorm(width, device=device, dtype=dtype)]
    return nn.Sequential(*blocks)


def default_width(n: int) -> int:
    return 1024 if n <= 100e6 else 2048 if n <= 400e6 else 4096


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class Ctx:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        self.dtype = DTYPES[args.dtype]
        self.n_target = int(args.params or (1e9 if self.cuda else 20e6))
        self.width = args.width or default_width(self.n_target)
        self.tokens = args.tokens or (4096 if self.cuda else 32)
        self.steps, self.warmup = args.steps, max(args.warmup, 3)
        g = torch.Generator(device="cpu").manual_seed(1)
        self.x32 = torch.randn(self.tokens, self.width, generator=g).to(self.device)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mem(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def clean(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def timed(self, step) -> list[float]:
        for _ in range(self.warmup):
            step()
        self.sync()
        times, self.cpu_times = [], []
        for _ in range(self.steps):
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            self.sync()
            times.append(time.perf_counter() - t0)
            self.cpu_times.append(time.process_time() - c0)
        return times


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _row(ctx: Ctx, name: str, times, n: int, state_bytes: int | None, where: str, pcie: float, base: int,
         dev_state: int | None, **extra) -> dict:
    return {
        "row": name, "numel": n, "ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
        "times_ms": [round(1e3 * t, 3) for t in times],
        # CPU seconds of this process (all threads) per step: less sensitive than wall time to other
        # processes on a shared host, and on a GPU machine the host cost of the step.
        "cpu_times_ms": [round(1e3 * t, 3) for t in ctx.cpu_times],
        "peak_gib": torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.cuda else None,
        "dev_state_bpp": (dev_state - base) / n if ctx.cuda and dev_state is not None else None,
        "opt_bpp": state_bytes / n if state_bytes is not None else None, "opt_where": where,
        "pcie_bpp": pcie, **extra,
    }


# -- rows ----------------------------------------------------------------------------------------
def row_torch(ctx: Ctx) -> dict:
    base = ctx.mem()
    model = make_model(ctx.n_target, ctx.width, ctx.device)
    n = numel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    amp = ctx.dtype != torch.float32
    scaler = torch.amp.GradScaler(ctx.device.type) if ctx.dtype == torch.float16 else None
    x = ctx.x32

    def step():
        with torch.autocast(ctx.device.type, dtype=ctx.dtype, enabled=amp):
            loss = _loss(model(x))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    times = ctx.timed(step)
    ctx.sync()
    dev_state = ctx.mem()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if torch.is_tensor(t) and t.numel() > 1)
    recipe = "fp32 params + autocast" + (" + GradScaler" if scaler else "") if amp else "fp32"
    out = _row(ctx, "(a) torch AdamW fused, no offload", times, n, state, ctx.device.type, 0.0, base, dev_state,
               recipe=recipe)
    del model, opt
    return out


def row_ours(ctx: Ctx, dpu: bool) -> dict:
    base = ctx.mem()
    model = make_model(ctx.n_target, ctx.width, ctx.device)  # fp32: the engine's masters come from these
    n = numel(model)
    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=16) if ctx.dtype == torch.float16 else None
    extra = {"bucket_numel": ctx.args.bucket_numel} if ctx.args.bucket_numel else {}
    options = OffloadOptions(fp16=fp16, dpu=dpu, dpu_warmup_steps=2, num_threads=ctx.args.threads, **extra)
    opt = OffloadAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, param_dtype=ctx.dtype,
                      options=options)
    model.to(ctx.dtype)  # the engine already cast the trainable params; nothing else is left here
    ctx.sync()
    dev_state = ctx.mem()
    x = ctx.x32.to(ctx.dtype)

    def step():
        loss = _loss(model(x))
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = ctx.timed(step)
    bucket_bytes = opt.pipeline.buckets.numel() * opt.pipeline.buckets.element_size()
    grad_b = opt.pipeline.buckets.element_size()
    param_b = torch.empty((), dtype=opt.param_dtype).element_size()
    # What crosses PCIe per step, from the engine's own sizes: every gradient down once in the
    # bucket dtype, every updated param up once in the training dtype.
    pcie = (n * grad_b + n * param_b) / n if ctx.cuda else 0.0
    name = "(c) ours + DPU" if dpu else "(b) ours OffloadAdam"
    out = _row(ctx, name, times, n, opt.arena.nbytes, "host" + (" pinned" if opt.arena.pinned else ""), pcie, base,
               dev_state, buckets_bpp=bucket_bytes / n, skipped=opt.last.skipped,
               host_regions={k: v for k, v in opt.plan.bytes_by_region().items()})
    opt.flush()
    opt.close()
    del model, opt
    return out


def row_torchao(ctx: Ctx) -> dict:
    from torchao.optim import CPUOffloadOptimizer  # ImportError -> skipped

    if not ctx.cuda:
        raise Skip("needs a GPU (it offloads from a CUDA device)")
    base = ctx.mem()
    model = make_model(ctx.n_target, ctx.width, ctx.device).to(ctx.dtype)
    n = numel(model)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                              fused=True)
    ctx.sync()
    dev_state = ctx.mem()
    x = ctx.x32.to(ctx.dtype)

    def step():
        _loss(model(x)).backward()
        opt.step()
        opt.zero_grad()

    times = ctx.timed(step)
    # Host footprint: every CPU tensor it holds (param copies, their grads, optimizer states).
    seen, host = set(), 0

    def add(t):
        nonlocal host
        if torch.is_tensor(t) and t.device.type == "cpu" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            host += t.numel() * t.element_size()

    for p_cpu in getattr(opt, "param_d2h_map", {}).values():
        add(p_cpu)
        add(p_cpu.grad)
    for o in getattr(opt, "optim_dict", {}).values():
        for s in o.state.values():
            for t in s.values():
                if torch.is_tensor(t) and t.numel() > 1:
                    add(t)
    el = torch.empty((), dtype=ctx.dtype).element_size()
    out = _row(ctx, "(d) torchao CPUOffloadOptimizer", times, n, host or None, "host", 2.0 * el, base, dev_state,
               recipe=f"{ctx.args.dtype} params and states, no fp32 masters")
    del model, opt
    return out


def row_deepspeed(ctx: Ctx) -> dict:
    if not ctx.cuda and not ctx.args.deepspeed:
        raise Skip("CPU-only machine: not run by default (pass --deepspeed; it JIT-builds DeepSpeedCPUAdam and "
                   "initialises torch.distributed)")
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533").items():
        os.environ.setdefault(k, v)
    import deepspeed  # ImportError -> skipped

    base = ctx.mem()
    model = make_model(ctx.n_target, ctx.width, ctx.device)
    n = numel(model)
    bucket = int(ctx.args.bucket_numel or 200_000_000)
    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": ctx.cuda},
                              "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "bf16": {"enabled": ctx.dtype == torch.bfloat16},
        "fp16": {"enabled": ctx.dtype == torch.float16, "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ctx.sync()
    dev_state = ctx.mem()
    x = ctx.x32.to(ctx.dtype)

    def step():
        loss = _loss(engine(x))
        engine.backward(loss)
        engine.step()

    times = ctx.timed(step)
    host = None
    try:  # counted: the fp32 master partition, its fp32 gradient, the Adam moments (not its 16-bit buffers)
        inner = getattr(opt, "optimizer", opt)
        host = 0
        for g in opt.single_partition_of_fp32_groups:
            host += g.numel() * g.element_size()
            if g.grad is not None:
                host += g.grad.numel() * g.grad.element_size()
        host += sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.numel() > 1)
    except Exception:
        host = None
    el = torch.empty((), dtype=ctx.dtype).element_size()
    out = _row(ctx, "(e) DeepSpeed ZeRO-2 + offload", times, n, host, "host", (4.0 + el) if ctx.cuda else 0.0,
               base, dev_state, recipe=f"deepspeed {deepspeed.__version__}; opt B/p counts fp32 partition + its grad + "
               "moments")
    del engine, opt, model
    return out


ROWS = {
    "a": ("(a) torch AdamW fused, no offload", row_torch),
    "b": ("(b) ours OffloadAdam", lambda c: row_ours(c, dpu=False)),
    "c": ("(c) ours + DPU", lambda c: row_ours(c, dpu=True)),
    "d": ("(d) torchao CPUOffloadOptimizer", row_torchao),
    "e": ("(e) DeepSpeed ZeRO-2 + offload", row_deepspeed),
}


def _fmt_targets(rows: list[dict], ctx: Ctx) -> list[str]:
    by = {r["row"][:3]: r for r in rows if r.get("ms") is not None}
    lines = []

    def verdict(ok):
        return "ok" if ok else "MISSED"

    b, c = by.get("(b)"), by.get("(c)")
    if not ctx.cuda:
        lines.append("targets (step-time ratios, device memory, PCIe) apply to a GPU run; on CPU only host B/param:")
        if b:
            lines.append(f"  host optimizer memory {b['opt_bpp']:.2f} B/param (target <= {TARGETS['host_bpp']:.0f}, "
                         f"gas=1, no DPU): {verdict(b['opt_bpp'] <= TARGETS['host_bpp'])}")
        if c:
            lines.append(f"  with DPU {c['opt_bpp']:.2f} B/param (a second gradient store)")
        return lines
    if b and b.get("ratio") is not None:
        lines.append(f"offload step {b['ratio']:.2f}x no-offload (target <= {TARGETS['offload_ratio']}x): "
                     f"{verdict(b['ratio'] <= TARGETS['offload_ratio'])}")
    if c and c.get("ratio") is not None:
        lines.append(f"offload + DPU step {c['ratio']:.2f}x no-offload (target <= {TARGETS['dpu_ratio']}x): "
                     f"{verdict(c['ratio'] <= TARGETS['dpu_ratio'])}")
    if b:
        lines.append(f"host optimizer memory {b['opt_bpp']:.2f} B/param (target <= {TARGETS['host_bpp']:.0f}): "
                     f"{verdict(b['opt_bpp'] <= TARGETS['host_bpp'])}")
        if b.get("dev_state_bpp") is not None:
            params_only = b["dev_state_bpp"] - b["buckets_bpp"]
            lines.append(f"device model states {b['dev_state_bpp']:.2f} B/param = params {params_only:.2f} + buckets "
                         f"{b['buckets_bpp']:.2f} (target 2 B/param + buckets): "
                         f"{verdict(params_only <= TARGETS['device_state_bpp'] + 0.05)}")
        if ctx.dtype != torch.float32:
            lines.append(f"PCIe per step {b['pcie_bpp']:.1f} B/param (target {TARGETS['pcie_bpp_16bit']}: 2 down + 2 "
                         f"up): {verdict(b['pcie_bpp'] <= TARGETS['pcie_bpp_16bit'])}")
    return lines


def main() -> int:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = Ctx(args)
    if ctx.cuda and args.gpu_mem_gib:
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem_gib * 2**30 / total), ctx.device)
    info = hardware()
    print(hardware_line(info))
    per_layer = ctx.width * ctx.width + 3 * ctx.width
    print(f"model: {max(1, round(ctx.n_target / per_layer))} x [Linear({ctx.width}) + LayerNorm], "
          f"{args.dtype}, batch {ctx.tokens} x {ctx.width}, device {ctx.device}, "
          f"{ctx.steps} timed steps after {ctx.warmup}, {args.rounds} round(s)" +
          (f", CUDA memory capped at {args.gpu_mem_gib} GiB" if ctx.cuda and args.gpu_mem_gib else ""), flush=True)
    rows, skipped = {}, {}
    keys = [k.strip() for k in args.rows.split(",") if k.strip()]
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
    for line in _fmt_targets(rows, ctx):
        print(line)
    if args.json:
        write_json(args.json, {
            "benchmark": "offload_step", "hardware": info, "hardware_line": hardware_line(info),
            "config": {"params_target": ctx.n_target, "width": ctx.width, "tokens": ctx.tokens, "dtype": args.dtype,
                       "device": str(ctx.device), "steps": ctx.steps, "warmup": ctx.warmup,
                       "rounds": args.rounds,
                       "gpu_mem_gib": args.gpu_mem_gib, "threads": torch.get_num_threads()},
            "rows": rows, "skipped": skipped, "targets": TARGETS, "target_lines": _fmt_targets(rows, ctx),
        })
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
