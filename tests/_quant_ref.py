"""A plain-torch reference of the compact-moment Adam step (bf16 and blockwise 8-bit moments),
written from the specification in csrc/quant.h, not from the kernel's code: the code values are
built from their formula, quantization is "the code float nearest to fp32(|x| * fp32(1/absmax) + c),
ties up" (or stochastically rounded between the two around it) found by a search of the whole table, and the kernel's fused multiply-adds are evaluated exactly in fp64.
"""
from __future__ import annotations

import math

import torch

BLOCK = 256  # csrc/quant.h kQBlock; ops.QUANT_BLOCK must agree (tested)
# exponent bias of each code: exp_avg (int8, signed) and exp_avg_sq (uint8)
BIAS = {"exp_avg": 16, "exp_avg_sq": 32}


def shift(moment: str) -> float:
    """c = 2^(1 - bias): the codes' floats start at c, and n is coded through fp32(n + c)."""
    return 2.0 ** (1 - BIAS[moment])


def code_floats(moment: str) -> torch.Tensor:
    """The float of every magnitude code 0..max, c * 2^(mag >> 3) * (1 + (mag & 7) / 8), as fp64
    (exact): the top one is 1.0."""
    eb = BIAS[moment]
    return torch.tensor([2.0 ** ((mag >> 3) + 1 - eb) * (1 + (mag & 7) / 8) for mag in range(((eb - 1) << 3) + 1)],
                        dtype=torch.float64)


def magnitudes(moment: str) -> torch.Tensor:
    """Value of every magnitude code: fp32(its float - c) (exact but where c is under the float's
    fp32 ulp: 1.0 stays 1.0), as fp64."""
    return (code_floats(moment).float() - torch.tensor(shift(moment), dtype=torch.float32)).double()


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """Unscaled fp32 value of int8 (exp_avg) or uint8 (exp_avg_sq) codes."""
    moment = "exp_avg" if codes.dtype == torch.int8 else "exp_avg_sq"
    c = codes.long()
    return (magnitudes(moment)[c.abs()] * torch.where(c < 0, -1.0, 1.0).double()).float()


def _shifted(n: torch.Tensor, moment: str) -> torch.Tensor:
    """s = fp32(n + c), as fp64 (NaN stays NaN)."""
    return (n.float() + torch.tensor(shift(moment), dtype=torch.float32)).double()


def nearest_mag(n: torch.Tensor, moment: str) -> torch.Tensor:
    """The code whose float is nearest to s = fp32(n + c) (n >= 0), ties to the larger; 1.0 and
    above, and NaN: 1.0's code. Found by a search of the whole table."""
    table = code_floats(moment)
    s = _shifted(n, moment)
    top = torch.isnan(s) | (s >= 1.0)
    s = torch.where(top, 1.0, s)
    hi = torch.searchsorted(table, s).clamp(max=len(table) - 1)  # the smallest code >= s
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = s - table[lo], table[hi] - s  # exact: fp32 values in fp64
    return torch.where(top, len(table) - 1, torch.where(d_hi <= d_lo, hi, lo))


def stochastic_mag(n: torch.Tensor, moment: str, r20: torch.Tensor) -> torch.Tensor:
    """The code at or below s = fp32(n + c), rounded up with probability k / 2^20, k =
    floor(2^20 * (s - that code) / (the code step)): up where k + r20 >= 2^20; 1.0 and above (and
    NaN): 1.0's code."""
    table = code_floats(moment)
    s = _shifted(n, moment)
    top = torch.isnan(s) | (s >= 1.0)
    s = torch.where(top, table[0], s)
    lo = torch.searchsorted(table, s, right=True) - 1  # the largest code <= s (s >= c: lo >= 0)
    hi = (lo + 1).clamp(max=len(table) - 1)
    frac = (s - table[lo]) / (table[hi] - table[lo]).clamp(min=2.0 ** -60)  # exact: a power-of-two step
    up = torch.floor(frac * 2**20).long() + r20 >= 2**20
    return torch.where(top, len(table) - 1, torch.where(up, hi, lo))


def quantize(x: torch.Tensor, moment: str, step: int | None = None, round_index: int = 0,
             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and block scales of fp32 ``x``; with ``step``, the codes' magnitudes are rounded
    stochastically with ``q8_random_bits(step, round_index, n, moment)`` (what a step stores). ``scale``:
    one block's given scale instead of its absmax."""
    n = x.numel()
    nb = -(-n // BLOCK)
    a = torch.zeros(nb * BLOCK)
    a[:n] = x.abs()
    absmax = a.view(nb, BLOCK).amax(dim=1) if scale is None else torch.tensor([scale], dtype=torch.float32)
    # |x| times the block's fp32 reciprocal (0 for a max below the smallest normal fp32), each
    # product rounded once
    inv = torch.where(absmax >= torch.finfo(torch.float32).tiny, (1.0 / absmax.double()).float(), 0.0)
    scaled = (x.abs().double() * inv.repeat_interleave(BLOCK)[:n].double()).float()
    if step is not None:
        mag = stochastic_mag(scaled, moment, q8_random_bits(step, round_index, n, moment))
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


def step_seed(step: int) -> int:
    """The kernels' round_seed of a step: mix32(uint32(step) ^ 0x9e3779b9)."""
    return int(mix32(torch.tensor([(step & M32) ^ 0x9E3779B9]))[0])


def flat_indices(round_index: int, n: int) -> torch.Tensor:
    """uint32(round_index + i) of each element i: what the random bits are keyed by."""
    return (torch.arange(n, dtype=torch.int64) + round_index) & M32


def random_bits(step: int, round_index: int, n: int) -> torch.Tensor:
    """bf16 moments: element i's 32 random bits, mix32(index ^ seed)."""
    return mix32(flat_indices(round_index, n) ^ step_seed(step))


def q8_random_bits(step: int, round_index: int, n: int, moment: str = "exp_avg_sq") -> torch.Tensor:
    """int8 moments: element i's 20 random bits, the high 20 of (index * 0x9e3779b1 mod 2^32) ^ seed, the
    seed the step's for exp_avg_sq and mix32(it ^ 0x7f4a7c15) for exp_avg (its own stream)."""
    seed = step_seed(step)
    if moment == "exp_avg":
        seed = int(mix32(torch.tensor([seed ^ 0x7F4A7C15]))[0])
    return (((flat_indices(round_index, n) * 0x9E3779B1) & M32) ^ seed) >> 12


def bf16_stochastic(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16: the 16 random bits ``r16`` added to the fp32 bits, truncated; NaN -> quiet NaN."""
    u = x.view(torch.int32).long() & M32
    out = ((u + r16) >> 16) & 0xFFFF
    out = torch.where(torch.isnan(x), (u >> 16) | 0x40, out)
    return out.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def m_bound(beta1: float, beta2: float, step: int) -> float:
    """(1-beta1) sqrt(sum_{j<step} (beta1^2/beta2)^j / (1-beta2)): max |m| / sqrt(v) of exact Adam
    after ``step`` steps (Cauchy-Schwarz), plus 1/64; inf where it does not exist or overflows."""
    r = beta1 * beta1 / beta2 if beta2 > 0 else math.inf
    try:
        total = float(step) if r == 1.0 else 1.0 if r == 0.0 else (r**step - 1.0) / (r - 1.0)
    except OverflowError:
        return math.inf
    bound = (1.0 - beta1) * math.sqrt(total / (1.0 - beta2)) * (1.0 + 1.0 / 64)  # 1/64 to spare
    return bound if math.isfinite(bound) else math.inf


def adam_step(p, g, state: dict, *, step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale=1.0,
              round_index=0, compact_math=False):
    """One step on fp32 ``p`` (in place) with moments stored as the kernel stores them; ``state``
    holds fp32/bf16 exp_avg/exp_avg_sq, or int8/uint8 codes with exp_avg_scale/exp_avg_sq_scale.
    bf16 and int8 moments (and fp32 ones with ``compact_math``) use the compact denominator,
    fma(sqrt(v), fp32(1 / sqrt(1 - beta2^step)), eps); bf16 and int8 moments are stored with
    stochastic rounding keyed by (step, round_index + i)."""
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
    w = f32(1.0 - beta1)  # torch's lerp: from m0 when |w| < 0.5, else from g with w - 1
    m = fma32(w, g - m0, m0) if abs(float(w)) < 0.5 else fma32(w - 1, g - m0, g)
    v = fma32(f32(1.0 - beta2) * g, g, v0 * f32(beta2))  # torch's addcmul as ATen's vector loop fuses it
    if compact:  # csrc/adam.h bound_m: |m| <= bound * sqrt(v), exact Adam's Cauchy-Schwarz bound
        bound = m_bound(beta1, beta2, step)
        lim = f32(bound) * v.double().sqrt().float()  # the clamp with x86 max/min's NaN rule, as bound_m
        t = torch.where(-lim > m, -lim, m)
        m = torch.where(lim < t, lim, t)
    # sqrt and / evaluated in fp64 then rounded once: correctly rounded fp32 results (fp64 has more
    # than 2 * 24 + 2 bits, so the double rounding is innocuous), whatever torch's own kernels do
    if compact:
        denom = fma32(v.double().sqrt().float(), f32(1.0 / math.sqrt(1.0 - beta2**step)), f32(eps))
    else:
        denom = (v.double().sqrt().float().double() / f32(math.sqrt(1.0 - beta2**step)).double()).float() + f32(eps)
    neg_step = f32(-(lr / (1.0 - beta1**step)))
    if compact:
        p.copy_(fma32(neg_step, (m.double() / denom.double()).float(), p1))
    else:  # torch's addcdiv: (value * m) / denom, then the add
        p.copy_(p1 + ((neg_step * m).double() / denom.double()).float())
    if q8:  # both stochastically, each with its own bits (q8_random_bits)
        state["exp_avg"], state["exp_avg_scale"] = quantize(m, "exp_avg", step, round_index)
        state["exp_avg_sq"], state["exp_avg_sq_scale"] = quantize(v, "exp_avg_sq", step, round_index)
    elif state["exp_avg"].dtype == torch.bfloat16:  # exp_avg: the low 16 random bits, exp_avg_sq the high
        r = random_bits(step, round_index, m.numel())
        state["exp_avg"], state["exp_avg_sq"] = bf16_stochastic(m, r & 0xFFFF), bf16_stochastic(v, r >> 16)
    else:
        state["exp_avg"], state["exp_avg_sq"] = m, v
