"""The plan as text: the table, and under it what its rows and columns mean."""
from __future__ import annotations

import sys

from . import trace
from .plan import GiB, MAX_BATCH_SEARCHED, SAFETY_BYTES, SAFETY_FRACTION, Plan, device_budget, plan


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"  # a tiny model read "0.000 B"


def _batch(n: int) -> str:
    return f">={n}" if n >= MAX_BATCH_SEARCHED else str(n)  # the search stops there


def _subset(p: Plan) -> str:
    given = [f"--{k.replace('_', '-')} {p.inputs[k]!r}" for k in ("peft_config", "trainable") if p.inputs.get(k)]
    return ", ".join(given) or "frozen in the model given"


def format_plan(p: Plan) -> str:
    g = lambda x: f"{x / GiB:.2f}"  # noqa: E731
    head = ["configuration", "device states GiB", "host GiB", "act/sample GiB", "act const GiB", "max batch",
            "device GiB @max|1"]
    if p.rows and p.rows[0].batch_size:
        head += [f"device GiB @{p.rows[0].batch_size}", "fits"]
    cells = []
    for r in p.rows:
        line = [r.name, g(r.device_bytes_model_states), g(r.host_bytes), f"{r.activation_bytes_per_sample / GiB:.3f}",
                g(r.activation_bytes_const), _batch(r.max_batch_size), g(r.device_bytes_total)]
        if r.batch_size:
            line += [g(r.device_bytes_at_batch_size), "yes" if r.fits else "no"]
        cells.append(line)
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    fmt = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                 for i, (v, w) in enumerate(zip(vals, widths)))
    budget = p.rows[0].device_bytes_budget if p.rows else device_budget(p.gpu_mem_gib)
    where = (f"per rank, {p.gpus} GPU(s) of {p.gpu_mem_gib:g} GiB" if p.cuda else
             f"per rank, {p.gpus} process(es) on the CPU (a CPU run: the device columns are what a GPU of "
             f"{p.gpu_mem_gib:g} GiB would hold)")
    run = f"this run trains in {p.run_dtype}; " if p.run_dtype else ""
    out = [
        f"model: {p.model}" + (f" (planned as {p.model_class})" if p.model_class else ""),
        f"params: {p.params:,} ({_count(p.params)}; tied weights counted once)"
        + (f" trainable, {p.frozen:,} frozen ({_subset(p)})" if p.frozen else "")
        + "; gradient buckets of "
        f"{p.bucket_elements:,} elements (one-process offload rows)",
        f"{where}; {run}16-bit rows in {p.dtype}; seq_len {p.seq_len}, tgt_len {p.tgt_len}; "
        f"{'gradient checkpointing; ' if p.gradient_checkpointing else ''}"
        f"budget {budget / GiB:.2f} GiB = card - {SAFETY_FRACTION:.0%} - {SAFETY_BYTES / GiB:g} GiB "
        f"(CUDA context, allocator fragmentation)",
        fmt(head), fmt(["-" * w for w in widths]), *(fmt(c) for c in cells),
        *_legend(p),
        f"activations: one training step traced on meta tensors at batch {'/'.join(map(str, trace.TRACE_BATCHES))}"
        f"{'' if p.exact_lines else ' (two-point fit)'}; planned in {p.seconds:.1f} s",
    ]
    return "\n".join(out)


def _legend(p: Plan) -> list[str]:
    """What the rows and columns of format_plan's table mean (printed under it)."""
    rows = [f"  {r.name}: {r.description}" for r in p.rows]  # each row's own (its moments' storage included)
    return ["rows (configurations, each per rank):", *rows, "columns:",
            "  device states: parameters, gradients and optimizer state on the device; host: this rank's "
            "offloaded optimizer in host memory (pinned when CUDA is present)",
            "  act/sample: activation bytes each sample adds at the peak; act const: the fixed part of that peak "
            "(< 0 when the peak comes at the end of forward, before the gradients that 'device states' counts "
            "exist)",
            f"  max batch: the largest batch whose peak fits the budget (0: not even batch 1; "
            f">={MAX_BATCH_SEARCHED}: the search stops there); "
            "device GiB @max|1: the peak at that batch (at batch 1 when nothing fits)",
            *([f"  device GiB @{p.rows[0].batch_size}, fits: the peak at the batch size asked for, and whether it "
               "fits the budget"] if p.rows and p.rows[0].batch_size else [])]


def cuda_memory_gib(device=None) -> float:
    """What this process may allocate on ``device`` (default: the current one), in GiB: the card's memory times
    the cap ``torch.cuda.set_per_process_memory_fraction`` set, where this torch can tell (2.8+). The card alone
    planned a 24 GiB-capped run on an H200 against 132 GiB."""
    import torch

    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index  # "cuda" alone: the current device, as torch
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(index)
    return torch.cuda.get_device_properties(index).total_memory * fraction / GiB


def print_plan(model_config_or_plan, *, file=None, **plan_kwargs) -> Plan:
    """Print the plan (``format_plan``) for a model, config or ready ``Plan``; returns the plan."""
    p = model_config_or_plan if isinstance(model_config_or_plan, Plan) else plan(model_config_or_plan, **plan_kwargs)
    print(format_plan(p), file=file or sys.stdout)
    return p
