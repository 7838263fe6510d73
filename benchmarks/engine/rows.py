"""What ``offload_step.py`` measures: the model, the timing context and one function per row.

Each ``row_*`` builds a fresh copy of the same model on ``ctx.device``, runs ``ctx.warmup`` untimed and
``ctx.steps`` timed steps and returns the row's dict (``_row``); a row that cannot run here raises
``Skip`` (or ImportError for a missing library). The columns are described in offload_step.py's docstring.
"""
from __future__ import annotations

import gc
import os
import statistics
import threading
import time

import torch
from torch import nn

from benchmarks._common import backward_and_step
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LR, WD, BETAS, EPS = 1e-4, 0.01, (0.9, 0.999), 1e-8


class Skip(Exception):
    """A row that cannot run here (reason in the message); not an error."""


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


class PhaseClock:
    """Host wall time of the offload engine's step phases, per step, by wrapping methods of one engine instance
    (nothing in the library is timed): where a step's time goes beyond the CPU Adam (the first H200 run left 75-160
    ms a step unexplained). ``fwd+bwd``: the forward and backward (gradients leave during backward): on CUDA the
    compute stream's time from the forward's first kernel to the backward's last (events: a host clock saw only
    the launches), on a CPU the calls;
    ``wait grads``: the step's wait for the last gradient copies (``pipeline.drain``); ``norm``: the rest of
    ``_gradients`` (the fused squared-norm pass over the gradient store); ``adam``: ``_adam_pass`` (the CPU Adam,
    queuing each tile's upload; with DPU on the worker, beside the next forward); ``step``: all of ``step()``;
    ``end sync``: the wait for the device at the step's end (the last uploads, the device's queue)."""
    NAMES = ("fwd+bwd", "wait grads", "norm", "adam", "step", "end sync")

    def __init__(self, opt):
        self._lock = threading.Lock()  # a DPU step's Adam pass adds from the worker thread
        self.now: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self._wrap(opt.pipeline, "drain", "wait grads")
        self._wrap(opt, "_gradients", "_gradients")
        self._wrap(opt, "_adam_pass", "adam")

    def _wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - t0)
        setattr(obj, attr, timed)

    def add(self, key: str, seconds: float) -> None:
        with self._lock:
            self.now[key] = self.now.get(key, 0.0) + seconds

    def end_step(self) -> None:
        with self._lock:
            now, self.now = self.now, {}
        now["norm"] = max(0.0, now.pop("_gradients", 0.0) - now.get("wait grads", 0.0))
        self.steps.append(now)

    def medians_ms(self, last: int) -> dict[str, float]:
        steps = self.steps[-last:]
        return {k: round(1e3 * statistics.median(s.get(k, 0.0) for s in steps), 3) for k in self.NAMES}


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
        backward_and_step(loss, opt, scaler)

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
    # fp32 on the CPU, as the Trainer now leaves it: the engine takes the masters, then moves each param to the
    # device in the training dtype (the device never holds the fp32 model)
    model = make_model(ctx.n_target, ctx.width, "cpu")
    n = numel(model)
    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=16) if ctx.dtype == torch.float16 else None
    extra = {"bucket_numel": ctx.args.bucket_numel} if ctx.args.bucket_numel else {}
    options = OffloadOptions(fp16=fp16, dpu=dpu, dpu_warmup_steps=2, num_threads=ctx.args.threads, **extra)
    opt = OffloadAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, param_dtype=ctx.dtype,
                      options=options, device=ctx.device)
    model.to(device=ctx.device, dtype=ctx.dtype)  # the engine already placed the trainable params: nothing is left
    ctx.sync()
    dev_state = ctx.mem()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)  # the training peak, not the build's
    x = ctx.x32.to(ctx.dtype)

    bus = []  # host<->device bytes the engine queued, per step
    clock = PhaseClock(opt)

    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if ctx.cuda else None

    def step():
        before = opt.streams.bytes_down + opt.streams.bytes_up
        t0 = time.perf_counter()
        if marks:
            marks[0].record()
        loss = _loss(model(x))
        opt.scale_loss(loss).backward()
        if marks:
            marks[1].record()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        ctx.sync()
        clock.add("fwd+bwd", marks[0].elapsed_time(marks[1]) / 1e3 if marks else t1 - t0)
        clock.add("step", t2 - t1)
        clock.add("end sync", time.perf_counter() - t2)
        opt.zero_grad(set_to_none=True)  # (its drain is this step's: counted before the step ends)
        clock.end_step()
        bus.append(opt.streams.bytes_down + opt.streams.bytes_up - before)

    times = ctx.timed(step)
    bucket_bytes = opt.pipeline.buckets.numel() * opt.pipeline.buckets.element_size()
    # What crossed PCIe per timed step, counted by the engine's Streams (0 on CPU: no bus).
    pcie = statistics.median(bus[-ctx.steps:]) / n
    name = "(c) ours + DPU" if dpu else "(b) ours OffloadAdam"
    out = _row(ctx, name, times, n, opt.arena.nbytes, "host" + (" pinned" if opt.arena.pinned else ""), pcie, base,
               dev_state, buckets_bpp=bucket_bytes / n, skipped=opt.last.skipped, phases_ms=clock.medians_ms(ctx.steps),
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
