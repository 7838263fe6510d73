"""Compact moments in the fused kernel: bf16 and blockwise 8-bit exp_avg/exp_avg_sq.

The kernel against the plain-torch reference of tests/_quant_ref.py (built from the spec, not the
kernel): codes, scales and bf16 moments exactly, the fp32 master exactly (the reference evaluates
the kernel's fused multiply-adds exactly); every instruction set and thread count bit for bit.
The codes themselves (quantization, conversions) are in test_ops_quant_codes.py, the arguments
refused by name in test_ops_quant_args.py.
"""
from __future__ import annotations

import pytest
import torch
import _quant_ref as ref
from _kernels import GRAD_DTYPES, LEVELS
from _kernels import dtname as _dtname
from _ops_quant import _args, _wide

from hf_zero_offload import ops

SIZES = [1, 17, 256, 257, 4097, 3 * 2**16 + 5]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


def _state(n, kind, seed):
    """A non-trivial starting state of the given kind (as if after a few steps)."""
    m, v = _wide(n, seed) * 1e-3, _wide(n, seed + 1).abs() * 1e-6
    return ops.state_from_fp32(m, v, kind)


def _clone(st):
    return {k: t.clone() for k, t in st.items()}


_REF_CACHE: dict = {}


def _reference_trajectory(n, kind, adamw, grad_dtype):
    """(initial param, initial state, [(grad, param, state) after each step]) of the plain-torch reference; the last
    one is cached so the instruction sets (the fastest-varying parameter) share it: it does not depend on them."""
    key = (n, kind, adamw, grad_dtype)
    if key not in _REF_CACHE:
        _REF_CACHE.clear()
        gen = torch.Generator().manual_seed(n)
        p0 = torch.randn(n, generator=gen)
        st0 = _state(n, kind, seed=n + 7)
        p_ref, st_ref, traj = p0.clone(), _clone(st0), []
        for step in range(1, 5):
            g = (torch.randn(n, generator=gen) * 10.0 ** -step).to(grad_dtype)
            ref.adam_step(p_ref, g, st_ref, step=step, adamw=adamw, grad_scale=0.5, **HP)
            traj.append((g, p_ref.clone(), _clone(st_ref)))
        _REF_CACHE[key] = (p0, st0, traj)
    return _REF_CACHE[key]


@pytest.mark.parametrize("simd", LEVELS, indirect=True)  # top: varies fastest, reuses the cached reference
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_dtname)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("n", SIZES)
def test_compact_step_matches_reference(simd, n, kind, adamw, grad_dtype):
    p0, st0, traj = _reference_trajectory(n, kind, adamw, grad_dtype)
    p, st = p0.clone(), _clone(st0)
    outs = [None, torch.bfloat16, torch.float16, torch.float32]
    for step, (g, p_ref, st_ref) in enumerate(traj, start=1):
        out_dtype = outs[step % len(outs)]
        out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)
        ops.adam_step(p, g, st["exp_avg"], st["exp_avg_sq"], step=step, adamw=adamw, grad_scale=0.5,
                      param_out=out, exp_avg_scale=st.get("exp_avg_scale"),
                      exp_avg_sq_scale=st.get("exp_avg_sq_scale"), **HP)
        for k in st:
            assert torch.equal(st[k], st_ref[k]), (k, step)
        assert torch.equal(p, p_ref), step
        if out is not None:
            assert torch.equal(out, p.to(out_dtype))


def _bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16 if t.element_size() == 2 else torch.uint8)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_dtname)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=_dtname)
def test_compact_step_with_nans_and_infs_is_bit_identical_across_isas(kind, out_dtype, grad_dtype):
    """NaN params, NaN gradients of both signs and payloads, infinities, and vectors where one lane alone is NaN:
    every instruction set writes the scalar reference's bits (params, param out, moments, codes, scales). The
    vector kernels take their NaN fix-ups only for vectors with a NaN lane, so those vectors must be exact too."""
    n = 4 * 256 + 77
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(n, generator=gen)
    nan_bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF], dtype=torch.int64)
    # one NaN lane in a vector; payloads whose rounding would carry into the exponent or the sign without the fix-up
    p0[[3, 300, 700, 701]] = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF, 0xFFC0FFFF]).to(torch.int32).view(
        torch.float32)
    p0[[5, 6]] = torch.tensor([float("inf"), -float("inf")])
    st0 = _state(n, kind, seed=8)
    grads = []
    for step in range(1, 4):
        g = torch.randn(n, generator=gen) * 1e-2
        if step == 2:
            idx = torch.tensor([17, 18, 40, 511, 512, 1000, n - 1])
            g[idx[:5]] = nan_bits.to(torch.int32).view(torch.float32)
            g[idx[5:]] = torch.tensor([float("inf"), -float("inf")])
        grads.append(g.to(grad_dtype))
    results, before = {}, ops.simd_level()
    try:
        for level in LEVELS:
            ops.set_simd_level(level)
            p, st = p0.clone(), _clone(st0)
            outs = []
            for step, g in enumerate(grads, start=1):
                out = torch.empty(n, dtype=out_dtype)
                ops.adam_step(p, g, st["exp_avg"], st["exp_avg_sq"], step=step, adamw=True, param_out=out,
                              exp_avg_scale=st.get("exp_avg_scale"), exp_avg_sq_scale=st.get("exp_avg_sq_scale"),
                              **HP)
                outs.append(_bits(out).clone())
            results[level] = [_bits(p)] + outs + [_bits(st[k]) for k in sorted(st)]
    finally:
        ops.set_simd_level(before)
    for level in LEVELS:
        for i, (a, b) in enumerate(zip(results["scalar"], results[level])):
            assert torch.equal(a, b), (level, i)


@pytest.mark.parametrize("simd", LEVELS, indirect=True)
@pytest.mark.parametrize("beta1", [0.5, 0.3, 0.0])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_compact_step_with_small_beta1_matches_reference(simd, kind, beta1):
    """1 - beta1 >= 0.5: torch's lerp interpolates from the gradient (fma(w - 1, g - m, g)); the vector
    loops and the scalar tail of a partial block take that form too."""
    n, hp = 4097, {**HP, "beta1": beta1}
    gen = torch.Generator().manual_seed(11)
    p = torch.randn(n, generator=gen)
    p_ref, st = p.clone(), _state(n, kind, seed=12)
    st_ref = _clone(st)
    for step in range(1, 4):
        g = torch.randn(n, generator=gen).to(torch.bfloat16)
        ops.adam_step(p, g, st["exp_avg"], st["exp_avg_sq"], step=step, adamw=True,
                      exp_avg_scale=st.get("exp_avg_scale"), exp_avg_sq_scale=st.get("exp_avg_sq_scale"), **hp)
        ref.adam_step(p_ref, g, st_ref, step=step, adamw=True, **hp)
        for k in st:
            assert torch.equal(st[k], st_ref[k]), (k, step)
        assert torch.equal(p, p_ref), step


@pytest.mark.parametrize("offset", [0, 1, 8, 16, 32])
def test_int8_param_out_at_any_alignment(offset):
    """A bf16 param out at an element offset: 64-byte aligned (the AVX512 int8 loop streams it two vectors at a
    time), 32-byte (so does the AVX2 loop; AVX512 stores it plainly), 16-byte or unaligned; every level equals
    the reference."""
    n = 3 * 256 + 40  # full blocks and a partial one
    gen = torch.Generator().manual_seed(offset)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    st0 = _state(n, "int8", seed=offset + 3)
    p_ref, st_ref = p0.clone(), _clone(st0)
    for step in (1, 2):
        ref.adam_step(p_ref, g, st_ref, step=step, adamw=True, **HP)
    for level in LEVELS:
        ops.set_simd_level(level)
        p, st = p0.clone(), _clone(st0)
        base = torch.empty(n + 32, dtype=torch.bfloat16)
        assert base.data_ptr() % 64 == 0
        out = base[offset:offset + n]
        for step in (1, 2):
            ops.adam_step(p, g, st["exp_avg"], st["exp_avg_sq"], step=step, param_out=out,
                          exp_avg_scale=st["exp_avg_scale"], exp_avg_sq_scale=st["exp_avg_sq_scale"], **HP)
        assert torch.equal(p, p_ref) and torch.equal(out, p_ref.to(torch.bfloat16)), level
        for k in st:
            assert torch.equal(st[k], st_ref[k]), (level, k)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_compact_bit_identical_across_levels_and_threads(kind):
    n = 2**20 + 300  # several threads' worth, a partial last block
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    st0 = _state(n, kind, seed=5)
    results = []
    for level in LEVELS:
        ops.set_simd_level(level)
        for threads in (1, 2, 3, 5):
            p, st, out = p0.clone(), _clone(st0), torch.empty(n, dtype=torch.bfloat16)
            for step in (1, 2):
                ops.adam_step(p, g, st["exp_avg"], st["exp_avg_sq"], step=step, param_out=out, num_threads=threads,
                              exp_avg_scale=st.get("exp_avg_scale"), exp_avg_sq_scale=st.get("exp_avg_sq_scale"),
                              **HP)
            results.append(((level, threads), p, st, out))
    (_, p_a, st_a, out_a) = results[0]
    for who, p, st, out in results[1:]:
        assert torch.equal(p, p_a) and torch.equal(out, out_a), who
        for k in st:
            assert torch.equal(st[k], st_a[k]), (who, k)


def test_sliced_steps_equal_one_call():
    """The engine steps tiles of a shard: block-aligned slices, each given its offset as round_index
    (the moments' stochastic rounding), give the bits of one whole call; without the offsets they do not."""
    n = 5 * 256 + 77
    gen = torch.Generator().manual_seed(11)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    whole, tiled = _state(n, "int8", seed=2), None
    tiled = _clone(whole)
    p_whole, p_tiled = p0.clone(), p0.clone()
    ops.adam_step(p_whole, g, whole["exp_avg"], whole["exp_avg_sq"], step=1, exp_avg_scale=whole["exp_avg_scale"],
                  exp_avg_sq_scale=whole["exp_avg_sq_scale"], **HP)
    unkeyed = _clone(tiled)
    for a, b in ((0, 512), (512, 768), (768, n)):
        ops.adam_step(p_tiled[a:b], g[a:b], **ops.state_slice(tiled, a, b), step=1, round_index=a, **HP)
        ops.adam_step(p0.clone()[a:b], g[a:b], **ops.state_slice(unkeyed, a, b), step=1, **HP)
    assert torch.equal(p_whole, p_tiled)
    for k in whole:
        assert torch.equal(whole[k], tiled[k]), k
    assert not torch.equal(whole["exp_avg_sq"], unkeyed["exp_avg_sq"])
    assert not torch.equal(whole["exp_avg"], unkeyed["exp_avg"])  # exp_avg is keyed too, by its own bits


def test_bf16_moments_tiled_with_round_index_equal_one_call():
    """Stochastic rounding is keyed by (step, round_index + i): calls over slices that pass their
    offset give the bits of one whole call, and a wrong offset gives other bits (the key matters)."""
    n = 3000
    gen = torch.Generator().manual_seed(4)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    whole, tiled, shifted = (ops.make_state(n, "bf16") for _ in range(3))
    p_whole, p_tiled, p_shifted = p0.clone(), p0.clone(), p0.clone()
    for step in (1, 2, 3):
        ops.adam_step(p_whole, g, whole["exp_avg"], whole["exp_avg_sq"], step=step, **HP)
        for a, b in ((0, 700), (700, 701), (701, n)):
            ops.adam_step(p_tiled[a:b], g[a:b], tiled["exp_avg"][a:b], tiled["exp_avg_sq"][a:b], step=step,
                          round_index=a, **HP)
            ops.adam_step(p_shifted[a:b], g[a:b], shifted["exp_avg"][a:b], shifted["exp_avg_sq"][a:b], step=step,
                          **HP)
    assert torch.equal(p_whole, p_tiled)
    for k in whole:
        assert torch.equal(whole[k], tiled[k]), k
    assert not torch.equal(whole["exp_avg_sq"], shifted["exp_avg_sq"])


def test_bf16_exp_avg_sq_does_not_freeze():
    """A constant gradient: exp_avg_sq must follow g^2 (1 - beta2^t). Its per-step change (0.1% at
    beta2 = 0.999, shrinking) soon falls under half a bf16 ulp, where round-to-nearest freezes it
    (about 10% low after 1000 steps, checked below); stochastic rounding keeps the mean on course."""
    n, g = 8192, torch.ones(8192)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    st = ops.make_state(n, "bf16")
    v_rne = torch.zeros((), dtype=torch.bfloat16)
    for step in range(1, 1001):
        ops.adam_step(torch.zeros(n), g, st["exp_avg"], st["exp_avg_sq"], step=step, **hp)
        v_rne = (v_rne.float() * 0.999 + 0.001).to(torch.bfloat16)
    want = 1 - 0.999**1000
    mean = st["exp_avg_sq"].double().mean().item()
    assert abs(mean / want - 1) < 2e-3, (mean, want)
    assert abs(v_rne.item() / want - 1) > 0.05  # the rounding this replaces would fail the check above


def test_compact_math_flag():
    """compact_math gives fp32 moments the compact denominator (the reference's), and is refused
    for kinds that always use it."""
    n = 4097
    gen = torch.Generator().manual_seed(8)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    st = _state(n, "fp32", seed=3)
    p_ref, st_ref = p.clone(), _clone(st)
    ops.adam_step(p, g, st["exp_avg"], st["exp_avg_sq"], step=3, compact_math=True, **HP)
    ref.adam_step(p_ref, g, st_ref, step=3, adamw=True, compact_math=True, **HP)
    assert torch.equal(p, p_ref) and torch.equal(st["exp_avg_sq"], st_ref["exp_avg_sq"])
    args = _args(kind="bf16")
    with pytest.raises(ValueError, match="compact_math is for fp32 moments"):
        ops.adam_step(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], step=1, lr=1e-3,
                      compact_math=True)


def _follow(moment: str, hi: float, lo: float, switch: int, steps: int, beta: float, tol: float, every: int):
    """Eight blocks, each with its element 0 the constant max 1.0, the others' gradient ``hi`` until step
    ``switch``, then ``lo``: every ``every`` steps the mean of the kernel's stored moment over those 2040
    elements is within ``tol`` of the exact recursion's; returns the same mean for to-nearest codes (the
    reference's quantize without step) over the exact one, at the end."""
    n, sq = 8 * 256, moment == "exp_avg_sq"
    g_hi, g_lo = torch.full((n,), hi), torch.full((n,), lo)
    g_hi[::256] = g_lo[::256] = 1.0
    rest = torch.arange(n) % 256 != 0
    st, p = ops.make_state(n, "int8"), torch.zeros(n)
    exact, nearest = torch.zeros(n, dtype=torch.float64), torch.zeros(n)
    for t in range(1, steps + 1):
        g = g_hi if t <= switch else g_lo
        ops.adam_step(p, g, **st, step=t, lr=0.0, **({"beta2": beta} if sq else {"beta1": beta}))
        x = g * g if sq else g
        exact = beta * exact + (1 - beta) * x.double()
        nearest = ref.dequantize(*ref.quantize(beta * nearest + (1 - beta) * x, moment))
        if t % every == 0:
            stored = ops.dequantize_blockwise(st[moment], st[moment + "_scale"])
            assert abs(stored[rest].double().mean() / exact[rest].mean() - 1) < tol, t
    return float(nearest[rest].double().mean() / exact[rest].mean())


def test_int8_exp_avg_sq_follows_a_falling_gradient():
    """beta2 = 0.999 moves v by 0.1% of (g^2 - v) per step, far under half a code step (3-6%): to
    nearest, the codes of a block whose absmax holds froze, and v stopped following its own
    gradient. Stochastic rounding keeps the stored v unbiased. The gradient falls from 0.3 to 0.1 at
    step 200; each element's stored v is noisy (~30% std), so the mean of 2040 of them: ~0.7%."""
    assert _follow("exp_avg_sq", 0.3, 0.1, 200, 800, 0.999, 0.03, 100) > 3  # what the test guards against


def test_int8_exp_avg_follows_a_gradient_that_moves_little():
    """beta1 = 0.9 moves m by 10% of (g - m) per step: under half a code step (3-6%) once g is near m,
    as in full-batch training, where to-nearest codes froze m. A small MLP, full batch, 100 steps,
    ended 16-23% above fp32 AdamW's loss (3 seeds) with m to nearest, 1.1-1.5% below it with m
    stochastic (a plain-torch emulation of the codes). The gradient goes 0.3 -> 0.26 at step 60: to
    nearest m stays on 0.3's code (0.3125) for good; the kernel's stored m follows the exact recursion."""
    assert _follow("exp_avg", 0.3, 0.26, 60, 160, 0.9, 0.01, 160) > 1.15  # what the test guards against
