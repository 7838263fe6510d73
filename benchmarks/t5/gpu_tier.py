"""The planner validation's GPU tier (``python -m benchmarks.t5.planner_validate --gpu``): real CUDA training steps
against the planner, and the planner's activation trace under CUDA's kernel choices.

Why the variants: session 40's t5-3b recipe on one H100 (fp16, ZeRO-2 + offload, 128/128 tokens) kept 1.42 GiB of
activations per sample (17.99 GiB at batch 9, 22.24 at 12), where the planner plans 1.81. The trace runs on the meta
device, whose ops take the CPU's paths: ``dropout`` keeps its mask in the input's dtype (CUDA's fused
``native_dropout``: a 1-byte mask), and ``scaled_dot_product_attention`` with dropout or a mask that needs a gradient
(T5's learned position bias) takes the math path, with the heads x seq x seq probabilities, where CUDA's
memory-efficient kernel keeps only its output and a logsumexp. Traced those CUDA ways, t5-3b plans 1.70 (the 1-byte
masks alone) and 1.04 GiB (both): the measurement lies between, so which kernels a CUDA step really runs is
measured here, by running the same step with each SDPA backend forced (``--gpu-attention``), at two batch sizes
(the slope is the per-sample cost, whatever the fixed part)."""
from __future__ import annotations

import contextlib

import torch

from hf_zero_offload import planner
from hf_zero_offload.fp32_logits import widen_logits
from hf_zero_offload.planner import trace

from benchmarks._common import backward_and_step, model_config

GPU_ROWS = ("baseline", "fp16", "zero2_offload")  # what gpu_measure trains (any other ran plain AdamW)
ATTENTION = ("default", "math", "efficient")       # --gpu-attention: the SDPA backend a step runs under
GiB = 2 ** 30


@contextlib.contextmanager
def cuda_like_trace(native_dropout: bool, efficient_attention: bool):
    """The meta trace with CUDA's kernel choices: dropout through ``native_dropout`` (a bool mask), attention
    through the memory-efficient kernel's meta function (dropout and a mask with a gradient included)."""
    f = torch.nn.functional
    dropout0, sdpa0 = f.dropout, f.scaled_dot_product_attention

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and input.numel() and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return dropout0(input, p, training, inplace)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta" or enable_gqa:
            return sdpa0(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None:  # (a view: the kernel reads a broadcast bias in place)
            attn_mask = attn_mask.to(query.dtype) if attn_mask.dtype == torch.bool else attn_mask
            attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]

    if native_dropout:
        f.dropout = dropout
    if efficient_attention:
        f.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        f.dropout, f.scaled_dot_product_attention = dropout0, sdpa0


TRACES = {"as planned": (False, False), "1-byte dropout masks": (True, False),
          "+ efficient attention": (True, True)}


def traced_per_sample(config, seq_len: int, tgt_len: int, half=torch.float16) -> dict:
    """GiB per sample of the 16-bit engines' step (gradients freed), traced each way of ``TRACES``."""
    out = {}
    for label, (drop, attn) in TRACES.items():
        with cuda_like_trace(drop, attn):
            prof = trace.profile_modes(config, ("half",), half_dtype=half, seq_len=seq_len, tgt_len=tgt_len)["half"]
        out[label] = round(prof.asymptote(keep=False)[1] / GiB, 6)
    return out


def _backend(attention: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if attention == "default":
        return contextlib.nullcontext()
    return sdpa_kernel({"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION}[attention])


def gpu_measure(name: str, row: str, batch: int, seq_len: int, tgt_len: int, attention: str = "default",
                steps: int = 3) -> dict:
    """max_memory_allocated over steps 2..steps of real training on cuda:0, vs the planner."""
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    dev = torch.device("cuda", 0)
    config = trace.load_config(model_config(name))
    p = planner.plan(config, gpus=1, dtype="fp16", seq_len=seq_len, tgt_len=tgt_len, batch_size=batch, configs=[row])
    pred = p.rows[0].device_bytes_at_batch_size
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(0)
    model = trace.build_model(config, device=dev)
    batch_t = trace.dummy_batch(config, batch, seq_len, tgt_len, dev)
    batch_t["input_ids"].random_(2, config.vocab_size)
    batch_t["labels"].random_(2, config.vocab_size)
    scaler, amp = None, None
    if row == "zero2_offload":  # the engine's step as the Trainer runs it: 16-bit model, logits widened to fp32
        opt = OffloadAdam(model.parameters(), lr=1e-5, param_dtype=torch.float16,
                          options=OffloadOptions(fp16={"enabled": True}))
        widen_logits(model)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        scaler = torch.amp.GradScaler("cuda") if row == "fp16" else None
        amp = torch.float16 if row == "fp16" else None
    try:
        with _backend(attention):
            for step in range(steps):
                if step == 1:
                    torch.cuda.synchronize(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
                    loss = model(**batch_t).loss
                backward_and_step(loss, opt, scaler)
                del loss
        torch.cuda.synchronize(dev)
        real = torch.cuda.max_memory_allocated(dev)
    finally:
        if isinstance(opt, OffloadAdam):
            opt.close()  # its host arena and pinning go now, not at the next garbage collection
        del opt, model, batch_t
        torch.cuda.empty_cache()
    return {"model": name, "row": row, "attention": attention, "batch": batch,
            "measured_GiB": round(real / GiB, 3), "planned_GiB": round(pred / GiB, 3), "err_%": pct_error(pred, real)}


def pct_error(pred, real):
    """How far a prediction is from the measurement, in % of the measurement."""
    return round(100.0 * (pred - real) / real, 2)


def per_sample(rows: list) -> list:
    """Measured GiB per sample of each (model, row, attention) measured at two or more batch sizes: the slope
    between its smallest and largest batch."""
    out, groups = [], {}
    for r in rows:
        if "measured_GiB" in r:
            groups.setdefault((r["model"], r["row"], r["attention"]), []).append(r)
    for (model, row, attention), rs in groups.items():
        if len(rs) >= 2:
            lo, hi = min(rs, key=lambda r: r["batch"]), max(rs, key=lambda r: r["batch"])
            out.append({"model": model, "row": row, "attention": attention,
                        "measured_GiB_per_sample": round((hi["measured_GiB"] - lo["measured_GiB"])
                                                         / (hi["batch"] - lo["batch"]), 3)})
    return out
