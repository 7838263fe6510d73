"""Compact moments in the fused kernel: bf16 and blockwise 8-bit exp_avg/exp_avg_sq.

The kernel against the plain-torch reference of tests/_quant_ref.py (built from the spec, not the
kernel): codes, scales and bf16 moments exactly, the fp32 master exactly (the reference evaluates
the kernel's fused multiply-adds exactly); every instruction set and thread count bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import _quant_ref as ref
from _kernels import GRAD_DTYPES, LEVELS
from _kernels import dtname as _dtname

from hf_zero_offload import ops

SIZES = [1, 17, 256, 257, 4097, 3 * 2**16 + 5]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


def _wide(n, seed):
    """Values over many orders of magnitude (moments of real models span ~1e-10..1e-2)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 4)


def test_block_constant():
    assert ops.QUANT_BLOCK == ref.BLOCK == 256


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_code_table(moment):
    if moment == "exp_avg":
        codes = torch.arange(-120, 121, dtype=torch.int32).to(torch.int8)
    else:
        codes = torch.arange(0, 249, dtype=torch.int32).to(torch.uint8)
    got = ops.dequantize_blockwise(codes, torch.ones(-(-codes.numel() // 256)))
    assert torch.equal(got, ref.code_values(codes))
    # sorted, distinct; the top is 1 - c (exact) for exp_avg, 1.0 for exp_avg_sq (c is under its ulp)
    assert got.max() == (1.0 - ref.shift(moment) if moment == "exp_avg" else 1.0)
    smallest = got[codes.numel() // 2 + 1] if moment == "exp_avg" else got[1]
    assert torch.all(got[1:] > got[:-1]) and smallest == ref.shift(moment) / 8


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("n", [1, 255, 256, 1000, 70_000])
def test_quantize_is_nearest_code(moment, n):
    x = _wide(n, seed=n)
    if moment == "exp_avg_sq":
        x = x.abs()
    x[: min(n, 256)] *= 0  # an all-zero block
    if n > 600:
        x[300] = 1e30  # an outlier flattens only its own block
    codes, scales = ops.quantize_blockwise(x, moment)
    want_codes, want_scales = ref.quantize(x, moment)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, want_codes)
    back = ops.dequantize_blockwise(codes, scales)
    assert torch.equal(back, ref.dequantize(codes, scales))
    assert torch.equal(back[: min(n, 256)], torch.zeros(min(n, 256)))


def test_quantize_ties_go_up():
    # s = fp32(n + c) halfway between two code floats takes the larger: 0.53125 is halfway between
    # 0.5 (mag 112) and 0.5625 (113), 0.59375 between 113 and 0.625 (114); c = 2^-15 for exp_avg.
    c = ref.shift("exp_avg")
    x = torch.tensor([1.0, 0.53125 - c, 0.59375 - c, 0.53125 - c - 2**-20, -(0.53125 - c)])
    codes, _ = ops.quantize_blockwise(x, "exp_avg")
    assert codes.tolist() == [120, 113, 114, 112, -113]


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


@pytest.mark.parametrize("src", ops.STATE_DTYPES)
@pytest.mark.parametrize("dst", ops.STATE_DTYPES)
def test_state_conversions(src, dst):
    n = 1000
    m, v = _wide(n, 1) * 1e-3, _wide(n, 2).abs() * 1e-6
    st = ops.state_from_fp32(m, v, src)
    assert ops.state_dtype_of(st) == src
    m1, v1 = ops.state_to_fp32(st)
    conv = ops.state_from_fp32(m1, v1, dst)
    assert ops.state_dtype_of(conv) == dst
    m2, v2 = ops.state_to_fp32(conv)
    if src == dst:  # a round trip through fp32 keeps every code and value
        for k in st:
            if k == "exp_avg_scale":  # exp_avg's top code decodes to 1 - 2^-15 of the block's absmax
                torch.testing.assert_close(conv[k], st[k] * (1 - ref.shift("exp_avg")), rtol=2**-23, atol=0)
            else:
                assert torch.equal(st[k], conv[k]), k
    if "int8" not in (src, dst) and "bf16" not in (src, dst):
        assert torch.equal(m2, m) and torch.equal(v2, v)
    rtol = {"fp32": 0, "bf16": 2**-8, "int8": 2**-4}
    tol = max(rtol[src], rtol[dst]) * 2.01
    big = m.abs() > m.abs().max() * 1e-4  # the 8-bit code flushes values far below the block's max
    torch.testing.assert_close(m2[big], m[big], rtol=tol, atol=0)
    big = v > v.max() * 1e-8
    torch.testing.assert_close(v2[big], v[big], rtol=tol, atol=0)


def _args(n=512, kind="int8"):
    return dict(param=torch.zeros(n), grad=torch.zeros(n), **ops.make_state(n, kind))


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(exp_avg_scale=None), ValueError, "exp_avg_scale is required"),
    (dict(exp_avg_sq_scale=torch.zeros(3)), ValueError, "exp_avg_sq_scale has 3 elements, expected 2"),
    (dict(exp_avg_scale=torch.zeros(2, dtype=torch.float64)), TypeError, "exp_avg_scale must have dtype float32"),
    (dict(exp_avg_sq=torch.zeros(512, dtype=torch.int8)), TypeError, "exp_avg_sq must have dtype"),
    (dict(exp_avg_sq=torch.zeros(512)), TypeError, "exp_avg is int8 .int8 state., so exp_avg_sq must be uint8"),
])
def test_int8_argument_errors(change, exc, pattern):
    args = _args()
    args.update(change)
    before = args["param"].clone()
    with pytest.raises(exc, match=pattern):
        ops.adam_step(args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), step=1,
                      lr=1e-3, **args)
    assert torch.equal(args.get("param", before), before)


def test_scales_rejected_for_float_states():
    args = _args(kind="bf16")
    with pytest.raises(ValueError, match="exp_avg_scale is only for int8 moments"):
        ops.adam_step(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], step=1, lr=1e-3,
                      exp_avg_scale=torch.zeros(2))


def test_state_slice_alignment_and_dtype_errors():
    st = ops.make_state(1000, "int8")
    assert ops.state_slice(st, 256, 1000)["exp_avg_scale"].numel() == 3
    with pytest.raises(ValueError, match="multiples of QUANT_BLOCK=256"):
        ops.state_slice(st, 100, 512)
    with pytest.raises(ValueError, match="multiples of QUANT_BLOCK=256"):
        ops.state_slice(st, 0, 300)
    assert ops.state_slice(ops.make_state(1000, "bf16"), 100, 300)["exp_avg"].numel() == 200
    with pytest.raises(ValueError, match="state_dtype must be one of fp32, bf16, int8; got 'fp8'"):
        ops.make_state(10, "fp8")
    with pytest.raises(ValueError, match="moment must be"):
        ops.quantize_blockwise(torch.zeros(4), "m")


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


@pytest.mark.parametrize("bad", [-1.0, float("nan")], ids=["negative", "nan"])
def test_negative_scales_are_refused_before_any_write(bad):
    """A scale is its block's absmax; the vector kernels rely on it being >= 0, and the kernel never writes a NaN
    one (the block max skips a NaN; inf it may), so either is refused by ops, and nothing is written."""
    args = _args()
    args["exp_avg_sq_scale"][1] = bad
    p, g = args.pop("param"), args.pop("grad")
    p0 = p.clone()
    with pytest.raises(ValueError, match="exp_avg_sq_scale has negative or NaN entries"):
        ops.adam_step(p, g + 1, args.pop("exp_avg"), args.pop("exp_avg_sq"), step=1, lr=1e-3, **args)
    assert torch.equal(p, p0)
    st = ops.make_state(512, "int8")
    st["exp_avg_scale"][0] = float("inf")  # allowed: a block that met an inf
    ops.adam_step(torch.zeros(512), torch.ones(512), **st, step=1, lr=1e-3)


@pytest.mark.parametrize("bad", [-0.5, float("nan")], ids=["negative", "nan"])
def test_cpu_adam_refuses_a_state_dict_with_negative_scales(bad):
    from hf_zero_offload.adam.cpu_adam import CPUAdam

    p = torch.nn.Parameter(torch.randn(600))
    opt = CPUAdam([p], lr=1e-3, state_dtype="int8")
    p.grad = torch.randn(600)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_scale"] = sd["state"][0]["exp_avg_scale"].clone()
    sd["state"][0]["exp_avg_scale"][2] = bad
    fresh = CPUAdam([torch.nn.Parameter(p.detach().clone())], lr=1e-3, state_dtype="int8")
    with pytest.raises(ValueError, match="exp_avg_scale has negative or NaN entries"):
        fresh.load_state_dict(sd)
    assert len(fresh.state) == 0  # nothing loaded


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


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("step,round_index", [(1, 0), (7, 12345), (2**31 + 5, 2**32 - 100)])
def test_quantize_stochastic_matches_reference(step, round_index, moment):
    """A moment as a step stores it (ops.quantize_blockwise(step=...), the scalar helpers the
    kernels equal) against the reference's table search: magnitudes over the whole code range,
    exact code values, both sides of mag 8 (the end of the evenly spaced first binade), zeros, 1.0
    and an outlier; exp_avg with both signs."""
    sq = moment == "exp_avg_sq"
    x = _wide(3 * 256 + 41, seed=step).abs()
    x[:256] = x[:256].clamp(max=0.5)
    x[0], x[600] = 1.0, 1e30  # block 0's max (its values are their own codes' scale); an outlier
    c = 2.0 ** (1 - ref.BIAS[moment])
    x[1:40] = torch.tensor([c * (1 + k / 64) for k in range(-20, 19)])  # around c: s = 2c is mag 8
    x[40:60] = ref.magnitudes(moment)[torch.arange(0, 240 if sq else 120, 12 if sq else 6)].float()
    x[300:310] = 0.0
    if not sq:
        x[1::3] = -x[1::3]
    codes, scales = ops.quantize_blockwise(x, moment, step=step, round_index=round_index)
    want_codes, want_scales = ref.quantize(x, moment, step, round_index)
    assert torch.equal(scales, want_scales) and torch.equal(codes, want_codes)
    nearest, _ = ops.quantize_blockwise(x, moment)
    assert (codes.int() - nearest.int()).abs().max() <= 1 and not torch.equal(codes, nearest)
    assert torch.equal(codes[40:60], nearest[40:60])  # exact code values never move


def test_stochastic_codes_round_up_in_proportion():
    """Over many steps (each its own random bits) a value 30% of the way from its code to the next
    one rounds up 30% of the time; 70% for one in the evenly spaced range below the normal codes."""
    x = torch.zeros(256)
    x[0] = 1.0
    x[1] = 0.5 + 0.3 * 0.0625  # codes 0.5 (mag 240) and 0.5625 (241)
    x[2] = (2 + 0.7) * 2.0**-34  # mags 2 and 3 (step 2^-34)
    ups = torch.zeros(3)
    for step in range(1, 4001):
        codes, _ = ops.quantize_blockwise(x, "exp_avg_sq", step=step)
        ups += (codes[:3].long() == torch.tensor([248, 241, 3])).float()
    assert ups[0] == 4000
    assert abs(ups[1] / 4000 - 0.3) < 0.03 and abs(ups[2] / 4000 - 0.7) < 0.03, ups


def test_states_of_code_map_1_decode_with_it():
    """int8 states saved before ops.INT8_CODES = 2 (no version: map 1, exponent biases 15 and 31, a
    subnormal range below mag 8) still decode, so they convert on load; an unknown map is refused."""
    st = {"exp_avg": torch.tensor([0, 1, 7, 8, 9, 120, -120, -9], dtype=torch.int8),
          "exp_avg_sq": torch.tensor([0, 1, 8, 17, 248, 0, 0, 0], dtype=torch.uint8),
          "exp_avg_scale": torch.tensor([2.0]), "exp_avg_sq_scale": torch.tensor([4.0])}
    m, v = ops.state_to_fp32(st, 1)
    assert m.tolist() == [0, 2 * 2**-17, 2 * 7 * 2**-17, 2 * 2**-14, 2 * 1.125 * 2**-14, 2, -2, -2 * 1.125 * 2**-14]
    assert v.tolist() == [0, 4 * 2**-33, 4 * 2**-30, 4 * 1.125 * 2**-29, 4, 0, 0, 0]
    m2, _ = ops.state_to_fp32(st)  # the current map reads the same codes otherwise
    assert not torch.equal(m, m2)
    with pytest.raises(ValueError, match="int8 moments with code map 3"):
        ops.state_to_fp32(st, 3)


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_quantize_on_given_scales(moment):
    """The engine encodes a block shared with params it did not step on a scale it keeps (the old one times a
    power of two): the codes are the reference's on that scale, a code's value times 2^k codes exactly, and a
    scale under the block's largest |x| (values would clamp) or a non-finite one is refused. On 4x the scale a
    code's value moves by the shift c alone (decode subtracts it once per scale, csrc/quant.h): at most 2c times
    the new scale, the floor of the code range, not a code step (1/16 of the value) above it."""
    x = _wide(300, seed=3).abs()
    if moment == "exp_avg":
        x[::2] = -x[::2]
    big = torch.tensor([x[:256].abs().max() * 1.5, x[256:].abs().max() * 3])
    codes, scales = ops.quantize_blockwise(x, moment, scales=big)
    assert torch.equal(scales, big) and torch.equal(codes, torch.cat(
        [ref.quantize(x[:256], moment, scale=float(big[0]))[0], ref.quantize(x[256:], moment, scale=float(big[1]))[0]]))
    values = ops.dequantize_blockwise(*ops.quantize_blockwise(x, moment))
    _, s0 = ops.quantize_blockwise(values, moment)
    twice, _ = ops.quantize_blockwise(values, moment, scales=s0 * 4)
    c, per = 2.0 ** (1 - ref.BIAS[moment]), s0.repeat_interleave(256)[:300]
    moved = (ops.dequantize_blockwise(twice, s0 * 4) - values).abs()
    assert (moved <= 2 * c * 4 * per).all()
    above = values.abs() > 0.1 * per
    assert (moved[above] / values[above].abs() < 2e-3).all()
    for bad in (torch.tensor([x[:256].abs().max() * 0.5, 1e30]), torch.tensor([float("inf"), 1e30])):
        with pytest.raises(ValueError, match="scales: each must be finite and >= its block's largest"):
            ops.quantize_blockwise(x, moment, scales=bad)
