"""A plain-torch reference of the compact-moment Adam step (bf16 and blockwise 8-bit moments),
written from the specification in csrc/quant.h, not from the kernel's code: the code values are
built from their formula, quantization is "nearest code to |x| * fp32(1/absmax), ties to the even magnitude" found
by a search of the whole table, and the kernel's fused multiply-adds are evaluated exactly in fp64.
"""
from __future__ import annotations

import math

import torch

BLOCK = 256  # csrc/quant.h kQBlock; ops.QUANT_BLOCK must agree (tested)
# exponent bias of each code: exp_avg (int8, signed) and exp_avg_sq (uint8)
BIAS = {"exp_avg": 15, "exp_avg_sq": 31}


def magnitudes(moment: str) -> torch.Tensor:
    """Value of every magnitude code 0..max (the max is 1.0), as fp64 (all exact in fp32)."""
    eb = BIAS[moment]
    out = []
    for mag in range((eb << 3) + 1):
        if mag < 8:
            out.append(mag * 2.0 ** (-2 - eb))
        else:
            out.append(2.0 ** ((mag >> 3) - eb) * (1 + (mag & 7) / 8))
    return torch.tensor(out, dtype=torch.float64)


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """Unscaled fp32 value of int8 (exp_avg) or uint8 (exp_avg_sq) codes."""
    moment = "exp_avg" if codes.dtype == torch.int8 else "exp_avg_sq"
    c = codes.long()
    return (magnitudes(moment)[c.abs()] * torch.where(c < 0, -1.0, 1.0).double()).float()


def nearest_mag(n: torch.Tensor, moment: str) -> torch.Tensor:
    """Nearest magnitude code of n >= 0 (fp32), ties to the even code; above 1.0: 1.0's code."""
    table = magnitudes(moment)
    x = n.double().clamp(max=1.0)
    hi = torch.searchsorted(table, x).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = x - table[lo], table[hi] - x  # exact: fp32 values in fp64
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, hi, lo)


def stochastic_mag(n: torch.Tensor, moment: str, r16: torch.Tensor) -> torch.Tensor:
    """Magnitude code of n >= 0 rounded up with probability k / 2^16, k = floor(2^16 * (n - the
    code below) / (the code step)): up where k + r16 >= 2^16; 1.0 and above (and NaN): 1.0's code."""
    table = magnitudes(moment)
    x = n.double()
    top = torch.isnan(x) | (x >= 1.0)
    x = torch.where(top, 0.0, x)
    lo = torch.searchsorted(table, x, right=True) - 1  # the largest code <= x
    hi = (lo + 1).clamp(max=len(table) - 1)
    frac = (x - table[lo]) / (table[hi] - table[lo]).clamp(min=2.0 ** -40)  # exact: a power-of-two step
    up = torch.floor(frac * 2**16).long() + r16 >= 2**16
    return torch.where(top, len(table) - 1, torch.where(up, hi, lo))


def quantize(x: torch.Tensor, moment: str, step: int | None = None,
             round_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and block scales of fp32 ``x``; with ``step``, exp_avg_sq's codes are rounded
    stochastically with ``q8_random_bits(step, round_index, n)`` (what a step stores)."""
    n = x.numel()
    nb = -(-n // BLOCK)
    a = torch.zeros(nb * BLOCK)
    a[:n] = x.abs()
    absmax = a.view(nb, BLOCK).amax(dim=1)
    # |x| times the block's fp32 reciprocal (0 for a max below the smallest normal fp32), each
    # product rounded once
    inv = torch.where(absmax >= torch.finfo(torch.float32).tiny, (1.0 / absmax.double()).float(), 0.0)
    scaled = (x.abs().double() * inv.repeat_interleave(BLOCK)[:n].double()).float()
    if step is not None and moment == "exp_avg_sq":
        mag = stochastic_mag(scaled, moment, q8_random_bits(step, round_index, n))
    else:
        mag = nearest_mag(scaled, moment)
    if moment == "exp_avg":
        codes = torch.where(torch.signbit(x), -mag, mag).to(torch.int8)
    else:
        codes = mag.to(torch.uint8)
    return codes, absmax


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return code_values(codes) * scales.repeat_interleave(BLOCK)[: codes.numel()]


def fma32(a, b, c) -> torch.Tensor:
    """fp32 a*b + c with one rounding (the hardware fma), evaluated exactly: the product is exact
    in fp64, TwoSum gives the fp64 sum's error, and that error breaks the rare fp64 -> fp32 tie."""
    a, b, c = (torch.as_tensor(t, dtype=torch.float32).double() for t in (a, b, c))
    ab = a * b
    s = ab + c
    bb = s - ab
    err = (ab - (s - bb)) + (c - bb)
    r = s.float()
    other = torch.nextafter(r, torch.where(s > r.double(), torch.inf, -torch.inf).float())
    mid = (r.double() + other.double()) / 2
    tie = (s == mid) & (err != 0)
    toward = torch.where((err > 0) == (other.double() > r.double()), other, r)
    return torch.where(tie, toward, r)


M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons) on uint32 values held in int64: xor-shift, multiply mod 2^32, ..."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def keyed_indices(step: int, round_index: int, n: int) -> torch.Tensor:
    """uint32(round_index + i) ^ seed for each element i, seed = mix32(uint32(step) ^ 0x9e3779b9)
    (the kernels' round_seed): what both kinds of random bits are made from."""
    seed = int(mix32(torch.tensor([(step & M32) ^ 0x9E3779B9]))[0])
    return ((torch.arange(n, dtype=torch.int64) + round_index) & M32) ^ seed


def random_bits(step: int, round_index: int, n: int) -> torch.Tensor:
    """bf16 moments: element i's 32 random bits, mix32 of its keyed index."""
    return mix32(keyed_indices(step, round_index, n))


def q8_random_bits(step: int, round_index: int, n: int) -> torch.Tensor:
    """int8 exp_avg_sq: element i's 16 random bits, the high half of its keyed index times
    0x9e3779b1 mod 2^32."""
    return ((keyed_indices(step, round_index, n) * 0x9E3779B1) & M32) >> 16


def bf16_stochastic(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16: the 16 random bits ``r16`` added to the fp32 bits, truncated; NaN -> quiet NaN."""
    u = x.view(torch.int32).long() & M32
    out = ((u + r16) >> 16) & 0xFFFF
    out = torch.where(torch.isnan(x), (u >> 16) | 0x40, out)
    return out.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def adam_step(p, g, state: dict, *, step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale=1.0,
              round_index=0, compact_math=False):
    """One step on fp32 ``p`` (in place) with moments stored as the kernel stores them; ``state``
    holds fp32/bf16 exp_avg/exp_avg_sq, or int8/uint8 codes with exp_avg_scale/exp_avg_sq_scale.
    bf16 and int8 moments (and fp32 ones with ``compact_math``) use the compact denominator,
    fma(sqrt(v), fp32(1 / sqrt(1 - beta2^step)), eps); bf16 moments and int8's exp_avg_sq are stored
    with stochastic rounding keyed by (step, round_index + i)."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    q8 = "exp_avg_scale" in state
    compact = compact_math or q8 or state["exp_avg"].dtype == torch.bfloat16
    if q8:
        m0 = dequantize(state["exp_avg"], state["exp_avg_scale"])
        v0 = dequantize(state["exp_avg_sq"], state["exp_avg_sq_scale"])
    else:
        m0, v0 = state["exp_avg"].float(), state["exp_avg_sq"].float()
    g = g.float() * f32(grad_scale)
    l2 = 0.0 if adamw else weight_decay
    if l2 != 0.0:
        g = fma32(f32(l2), p, g)
    p1 = p * f32(1.0 - lr * weight_decay if adamw else 1.0)
    m = fma32(f32(1.0 - beta1), g - m0, m0)
    v = fma32(f32(1.0 - beta2), g * g, v0 * f32(beta2))
    # sqrt and / evaluated in fp64 then rounded once: correctly rounded fp32 results (fp64 has more
    # than 2 * 24 + 2 bits, so the double rounding is innocuous), whatever torch's own kernels do
    if compact:
        denom = fma32(v.double().sqrt().float(), f32(1.0 / math.sqrt(1.0 - beta2**step)), f32(eps))
    else:
        denom = (v.double().sqrt().float().double() / f32(math.sqrt(1.0 - beta2**step)).double()).float() + f32(eps)
    p.copy_(fma32(f32(-(lr / (1.0 - beta1**step))), (m.double() / denom.double()).float(), p1))
    if q8:  # exp_avg to nearest, exp_avg_sq stochastically (q8_random_bits)
        state["exp_avg"], state["exp_avg_scale"] = quantize(m, "exp_avg")
        state["exp_avg_sq"], state["exp_avg_sq_scale"] = quantize(v, "exp_avg_sq", step, round_index)
    elif state["exp_avg"].dtype == torch.bfloat16:  # exp_avg: the low 16 random bits, exp_avg_sq the high
        r = random_bits(step, round_index, m.numel())
        state["exp_avg"], state["exp_avg_sq"] = bf16_stochastic(m, r & 0xFFFF), bf16_stochastic(v, r >> 16)
    else:
        state["exp_avg"], state["exp_avg_sq"] = m, v
