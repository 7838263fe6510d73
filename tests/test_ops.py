"""The fused CPU Adam kernels (hf_zero_offload.ops) against torch, across instruction sets and threads.

Element-wise checks everywhere (never only norms). Our fp32 update is the canonical per-element math
of csrc/adam.h: exp_avg is bit-identical to torch's lerp; exp_avg_sq uses one fused multiply-add
where torch's addcmul rounds twice, so params and exp_avg_sq agree with torch to a few ulp and are
compared with tight tolerances, while every instruction set and every thread count must agree with
the scalar path bit for bit (torch.equal).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hf_zero_offload import ops

LEVELS = ops.available_simd_levels()
SIZES = [1, 7, 15, 16, 17, 4097, 2**20 + 3]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]
# fp32 state after 10 steps: a few ulp from torch (one fma vs addcmul's two roundings).
TOL = dict(rtol=2e-6, atol=1e-6)


@pytest.fixture(autouse=True)
def restore_simd():
    before = ops.simd_level()
    yield
    ops.set_simd_level(before)


@pytest.fixture(params=LEVELS)
def simd(request):
    ops.set_simd_level(request.param)
    assert ops.simd_level() == request.param
    return request.param


def _dtname(d):
    return "none" if d is None else str(d).replace("torch.", "")


def _grads(n, steps, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(steps)]


# ---------------------------------------------------------------------------------------------
# against torch.optim.AdamW / Adam
# ---------------------------------------------------------------------------------------------


_REF_CACHE: dict = {}


def _torch_trajectory(n, adamw, grad_dtype, steps, lr, wd, scale):
    """(grads, initial param, [(param, exp_avg, exp_avg_sq) after each step]) from torch; the last
    one is cached so the instruction sets (the fastest-varying parameter) share it."""
    key = (n, adamw, grad_dtype, steps, lr, wd, scale)
    if key not in _REF_CACHE:
        _REF_CACHE.clear()
        gen = torch.Generator().manual_seed(n)
        p0 = torch.randn(n, generator=gen)
        grads = _grads(n, steps, grad_dtype, seed=n + 1)
        ref = p0.clone().requires_grad_(True)
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        opt = cls([ref], lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd, foreach=False)
        traj = []
        for g in grads:
            ref.grad = g.float() * scale  # the reference gets the upcast, scaled gradient
            opt.step()
            st = opt.state[ref]
            traj.append((ref.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()))
        _REF_CACHE[key] = (grads, p0, traj)
    return _REF_CACHE[key]


@pytest.mark.parametrize("simd", LEVELS, indirect=True)  # top: varies fastest, reuses the cached reference
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_dtname)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("n", SIZES)
def test_adam_matches_torch(simd, n, adamw, grad_dtype):
    steps, lr, wd, scale = 10, 1e-2, 0.05, 0.25
    grads, p0, traj = _torch_trajectory(n, adamw, grad_dtype, steps, lr, wd, scale)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, (g, (ref_p, ref_m, ref_v)) in enumerate(zip(grads, traj), start=1):
        out_dtype = OUT_DTYPES[step % len(OUT_DTYPES)]  # every output dtype, in turn
        out = None if out_dtype is None else torch.full((n,), float("nan"), dtype=out_dtype)
        ops.adam_step(p, g, m, v, step=step, lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=wd,
                      adamw=adamw, grad_scale=scale, param_out=out)
        torch.testing.assert_close(m, ref_m, rtol=0, atol=0 if adamw else 1e-7)
        torch.testing.assert_close(v, ref_v, **TOL)
        torch.testing.assert_close(p, ref_p, **TOL)
        if out is not None:
            # the same pass wrote param rounded to nearest even: exactly torch's own conversion
            assert torch.equal(out, p.to(out_dtype))
            torch.testing.assert_close(out, ref_p.to(out_dtype), **TOL if out_dtype == torch.float32 else {})


@pytest.mark.parametrize("n", [17, 4097, 2**20 + 3])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_dtname)
def test_all_isas_bit_identical(n, grad_dtype):
    """Every instruction set gives the scalar path's bits, with and without L2 / AdamW decay."""
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen) * 3
    m0 = torch.randn(n, generator=gen) * 0.1
    v0 = torch.rand(n, generator=gen) * 0.01
    g = torch.randn(n, generator=gen)
    g[::97] = 0.0
    g[1::101] *= 1e-30  # fp32 subnormals after the grad scale
    g = g.to(grad_dtype)
    for adamw, wd in ((True, 0.1), (False, 0.1), (True, 0.0)):
        for out_dtype in OUT_DTYPES:
            results = {}
            for level in LEVELS:
                ops.set_simd_level(level)
                p, m, v = p0.clone(), m0.clone(), v0.clone()
                out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
                for step in (1, 2, 3):
                    ops.adam_step(p, g, m, v, step=step, lr=3e-3, weight_decay=wd, adamw=adamw, grad_scale=1.5,
                                  param_out=out)
                results[level] = (p, m, v, out)
            for level in LEVELS:
                for a, b in zip(results["scalar"], results[level]):
                    assert a is None or torch.equal(a, b), (level, adamw, wd, out_dtype)


@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_misaligned_views_bit_identical(offset):
    """Contiguous views at any element offset (unaligned vector loads, param_out stored without streaming)."""
    n = 20_011
    gen = torch.Generator().manual_seed(offset)
    base_p = torch.randn(n + offset, generator=gen)
    base_g = torch.randn(n + offset, generator=gen).to(torch.bfloat16)
    results = {}
    for level in LEVELS:
        ops.set_simd_level(level)
        p = base_p.clone()[offset:]
        m, v = torch.zeros(n + offset)[offset:], torch.zeros(n + offset)[offset:]
        outs = [torch.empty(n + offset, dtype=dt)[offset:] for dt in (torch.bfloat16, torch.float16, torch.float32)]
        for step, out in enumerate(outs, start=1):
            ops.adam_step(p, base_g[offset:], m, v, step=step, lr=1e-2, weight_decay=0.1, param_out=out)
            assert torch.equal(out, p.to(out.dtype))
        results[level] = (p, m, v, *outs)
    for level in LEVELS:
        for a, b in zip(results["scalar"], results[level]):
            assert torch.equal(a, b), level


@pytest.mark.parametrize("level", LEVELS)
def test_threads_bit_identical(level):
    ops.set_simd_level(level)
    n = 2**20 + 3
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    results = []
    for threads in (1, 2, 3):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2):
            ops.adam_step(p, g, m, v, step=step, lr=1e-3, weight_decay=0.01, param_out=out, num_threads=threads)
        acc = torch.ones(n)
        ops.accumulate_grad(acc, g, scale=0.5, num_threads=threads)
        norm = ops.grad_norm_sq_and_finite(g, num_threads=threads)
        results.append((p, m, v, out, acc, norm))
    for r in results[1:]:
        for a, b in zip(results[0][:5], r[:5]):
            assert torch.equal(a, b)
        assert r[5] == results[0][5]


def test_flush_denormal_mode_reaches_every_thread():
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-denormal mode on this CPU")
    try:
        n = 2**18
        g = torch.full((n,), 1e-39)  # fp32 subnormal: read as zero under denormals-are-zero
        for threads in (1, 2, 3):
            acc = torch.ones(n)
            ops.accumulate_grad(acc, g, overwrite=True, num_threads=threads)
            assert torch.equal(acc, torch.zeros(n)), threads
    finally:
        torch.set_flush_denormal(False)
    acc = torch.ones(n)
    ops.accumulate_grad(acc, g, overwrite=True, num_threads=2)
    assert torch.equal(acc, g)


def test_default_thread_count_is_torch_threads():
    n = 4097
    p0, g = torch.randn(n), torch.randn(n)
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
            ops.adam_step(p, g, m, v, step=1, lr=1e-3)
            outs.append(p)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------
# conversions: param_out rounding and gradient widening, against torch's own .to()
# ---------------------------------------------------------------------------------------------


def _bits_to_f32(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _edge_values():
    vals = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, -65520.0, 1e5, -1e5, 6.1e-5, 6.0e-5, 1e-6, -1e-6,
            5.960464477539063e-08, 2.9802322387695312e-08, 2.98023259e-08, 8.940696716308594e-08, 1e-8, 1e-40,
            -1e-40, 3.4028234663852886e38, -3.4028234663852886e38, float("inf"), float("-inf"), float("nan"),
            1.0009765625, 1.00048828125, 1.00146484375, 2049.0, 2051.0, 4097.0]
    t = torch.tensor(vals, dtype=torch.float32)
    bits = [
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000,  # bf16 ties and near-ties
        0x00008000, 0x00018000, 0x00000001, 0x807FFFFF, 0x007FFFFF,  # fp32 subnormals
        0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000,  # round up to inf in bf16
        0x7F800001, 0xFF800001, 0x7FC00000, 0xFFFFFFFF, 0x7FBFFFFF,  # NaNs: signalling, quiet, negative
    ]
    t = torch.cat([t, _bits_to_f32(bits)])
    gen = torch.Generator().manual_seed(11)
    rand = torch.randn(4096, generator=gen) * torch.logspace(-30, 30, 4096)
    return torch.cat([t, rand, -rand[:2048] * 1e-3])


def _same_with_nans(a, b):
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_dtname)
def test_param_out_conversion_edge_cases(simd, out_dtype):
    # lr = 0 and a zero gradient leave param unchanged, so param_out is just param.to(out_dtype)
    x = _edge_values()
    n = x.numel()
    p, m, v = x.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    ops.adam_step(p, torch.zeros(n), m, v, step=1, lr=0.0, param_out=out)
    assert _same_with_nans(p, x)
    assert _same_with_nans(out, x.to(out_dtype))
    # signs survive, including on zeros, infinities and overflow
    nn = ~torch.isnan(x)
    assert torch.equal(torch.signbit(out[nn]), torch.signbit(x[nn]))


def test_param_out_nan_bits_identical_across_isas():
    x = _edge_values()
    n = x.numel()
    per_level = {}
    for level in LEVELS:
        ops.set_simd_level(level)
        outs = []
        for dt in (torch.bfloat16, torch.float16):
            out = torch.empty(n, dtype=dt)
            ops.adam_step(x.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, param_out=out)
            outs.append(out.view(torch.int16))
        per_level[level] = outs
    for level in LEVELS:
        for a, b in zip(per_level["scalar"], per_level[level]):
            assert torch.equal(a, b), level


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=_dtname)
def test_grad_widening_edge_cases(simd, grad_dtype):
    g = _edge_values().to(grad_dtype)
    h = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(grad_dtype)  # every 16-bit pattern
    g = torch.cat([g, h])
    acc = torch.empty(g.numel())
    ops.accumulate_grad(acc, g, overwrite=True)
    assert _same_with_nans(acc, g.float())


# ---------------------------------------------------------------------------------------------
# norm and accumulate
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 15, 16, 17, 4097, 2**20 + 3])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_dtname)
def test_grad_norm_sq(simd, n, grad_dtype):
    g = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 10).to(grad_dtype)
    total, finite = ops.grad_norm_sq_and_finite(g)
    ref = (g.double() ** 2).sum().item()
    assert finite
    assert total == pytest.approx(ref, rel=1e-12, abs=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_dtname)
def test_grad_norm_detects_non_finite(simd, bad, grad_dtype):
    n = 100_003
    for pos in (0, 17, n - 1):
        g = torch.randn(n).to(grad_dtype)
        g[pos] = bad
        total, finite = ops.grad_norm_sq_and_finite(g)
        assert not finite and not (total == total and abs(total) != float("inf"))


def test_grad_norm_large_finite_values_stay_finite():
    g = torch.full((1000,), 3.0e38)  # the sum would overflow fp32, not fp64
    total, finite = ops.grad_norm_sq_and_finite(g)
    assert finite and total == pytest.approx((g.double() ** 2).sum().item(), rel=1e-12)
    assert ops.grad_norm_sq_and_finite(torch.empty(0)) == (0.0, True)


def test_grad_norm_bit_identical_across_isas():
    g = torch.randn(3 * 65536 + 1234, generator=torch.Generator().manual_seed(5))
    results = set()
    for level in LEVELS:
        ops.set_simd_level(level)
        for t in (1, 2, 3):
            results.add(ops.grad_norm_sq_and_finite(g, num_threads=t)[0])
    assert len(results) == 1


@pytest.mark.parametrize("n", [1, 17, 4097, 2**20 + 3])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=_dtname)
def test_accumulate_grad(simd, n, grad_dtype):
    gen = torch.Generator().manual_seed(n)
    acc0 = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    acc = acc0.clone()
    ops.accumulate_grad(acc, g, scale=0.375)
    assert torch.equal(acc, acc0 + g.float() * 0.375)  # multiply, then a separate add (like add_)
    ops.accumulate_grad(acc, g, scale=3.0, overwrite=True)
    assert torch.equal(acc, g.float() * 3.0)
    acc2 = acc0.clone()
    for _ in range(3):
        ops.accumulate_grad(acc2, g)
    assert torch.equal(acc2, acc0 + g.float() + g.float() + g.float())


def test_empty_tensors_are_noops():
    e = torch.empty(0)
    ops.adam_step(e, e, e.clone(), e.clone(), step=1, lr=1e-3)
    ops.accumulate_grad(e, torch.empty(0, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# bad input: ValueError / TypeError naming the argument
# ---------------------------------------------------------------------------------------------


def _adam_args(n=8):
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


def _noncontig(dtype=torch.float32, n=8):
    return torch.zeros(n, 2, dtype=dtype)[:, 0]


def _meta(dtype=torch.float32, n=8):
    return torch.empty(n, dtype=dtype, device="meta")


ADAM_BAD = [
    ("param", torch.zeros(8, dtype=torch.bfloat16), TypeError),
    ("param", torch.zeros(8, dtype=torch.float64), TypeError),
    ("param", _noncontig(), ValueError),
    ("param", _meta(), ValueError),
    ("param", [0.0] * 8, TypeError),
    ("grad", torch.zeros(9), ValueError),
    ("grad", torch.zeros(8, dtype=torch.float64), TypeError),
    ("grad", torch.zeros(8, dtype=torch.int32), TypeError),
    ("grad", _noncontig(torch.bfloat16), ValueError),
    ("grad", _meta(torch.bfloat16), ValueError),
    ("exp_avg", torch.zeros(7), ValueError),
    ("exp_avg", torch.zeros(8, dtype=torch.bfloat16), TypeError),
    ("exp_avg", _noncontig(), ValueError),
    ("exp_avg", _meta(), ValueError),
    ("exp_avg_sq", torch.zeros(16), ValueError),
    ("exp_avg_sq", torch.zeros(8, dtype=torch.float16), TypeError),
    ("exp_avg_sq", _noncontig(), ValueError),
    ("exp_avg_sq", _meta(), ValueError),
    ("param_out", torch.zeros(9, dtype=torch.bfloat16), ValueError),
    ("param_out", torch.zeros(8, dtype=torch.float64), TypeError),
    ("param_out", _noncontig(torch.float16), ValueError),
    ("param_out", _meta(torch.bfloat16), ValueError),
]


@pytest.mark.parametrize("name,value,exc", ADAM_BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(ADAM_BAD)])
def test_adam_step_bad_tensor(name, value, exc):
    args = _adam_args()
    args[name] = value
    before = args["param"].clone() if name != "param" else None
    with pytest.raises(exc, match=rf"^{name}\b"):
        ops.adam_step(args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), step=1,
                      lr=1e-3, **args)
    if before is not None:
        assert before.eq(0).all()


def test_cuda_tensor_is_rejected_by_device_type():
    # no GPU here: a meta tensor has a non-CPU device type just like a CUDA one; on a GPU host check both
    devices = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        args = _adam_args()
        args["grad"] = torch.zeros(8, device=dev)
        with pytest.raises(ValueError, match=rf"^grad must be a CPU tensor, got a tensor on {dev}"):
            ops.adam_step(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], step=1, lr=1e-3)


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        (dict(step=0), ValueError, "step"),
        (dict(step=-3), ValueError, "step"),
        (dict(step=1.0), TypeError, "step"),
        (dict(step=True), TypeError, "step"),
        (dict(step=1, beta1=1.0), ValueError, "beta1"),
        (dict(step=1, beta2=-0.1), ValueError, "beta2"),
        (dict(step=1, num_threads=0), ValueError, "num_threads"),
        (dict(step=1, num_threads=1.5), ValueError, "num_threads"),
    ],
)
def test_adam_step_bad_scalar(kwargs, exc, name):
    a = _adam_args()
    with pytest.raises(exc, match=rf"^{name}\b"):
        ops.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], lr=1e-3, **kwargs)


def test_adam_step_accepts_integral_step_types():
    a = _adam_args()
    ops.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], step=torch.tensor(2).item(), lr=1e-3)
    import numpy as np

    ops.adam_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], step=np.int64(3), lr=1e-3)


@pytest.mark.parametrize(
    "acc,grad,exc,name",
    [
        (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), TypeError, "acc"),
        (_noncontig(), torch.zeros(8), ValueError, "acc"),
        (_meta(), torch.zeros(8), ValueError, "acc"),
        (torch.zeros(8), torch.zeros(9), ValueError, "grad"),
        (torch.zeros(8), torch.zeros(8, dtype=torch.int64), TypeError, "grad"),
        (torch.zeros(8), _noncontig(torch.float16), ValueError, "grad"),
        (torch.zeros(8), _meta(), ValueError, "grad"),
        (torch.zeros(8), "grad", TypeError, "grad"),
    ],
)
def test_accumulate_grad_bad_input(acc, grad, exc, name):
    with pytest.raises(exc, match=rf"^{name}\b"):
        ops.accumulate_grad(acc, grad)


@pytest.mark.parametrize(
    "grad,exc",
    [
        (torch.zeros(8, dtype=torch.float64), TypeError),
        (_noncontig(), ValueError),
        (_meta(), ValueError),
        (None, TypeError),
    ],
)
def test_grad_norm_bad_input(grad, exc):
    with pytest.raises(exc, match=r"^grad\b"):
        ops.grad_norm_sq_and_finite(grad)
    with pytest.raises(ValueError, match=r"^num_threads\b"):
        ops.grad_norm_sq_and_finite(torch.zeros(4), num_threads=-1)


# ---------------------------------------------------------------------------------------------
# instruction-set choice
# ---------------------------------------------------------------------------------------------


def test_levels_reported():
    assert LEVELS[0] == "scalar"
    assert set(LEVELS) <= {"scalar", "avx2", "avx512"}
    assert ops.simd_level() in LEVELS
    with pytest.raises(ValueError, match="unknown SIMD level"):
        ops.set_simd_level("sse9")


def _import_with_env(value):
    env = dict(os.environ, HF_ZERO_OFFLOAD_SIMD=value)
    code = "from hf_zero_offload import ops; print(ops.simd_level())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_env_override_selects_level():
    r = _import_with_env("scalar")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "scalar"


def test_env_override_rejects_unknown_or_unsupported_level():
    missing = [lvl for lvl in ("avx2", "avx512") if lvl not in LEVELS]
    for value in ["sse9"] + missing:
        r = _import_with_env(value)
        assert r.returncode != 0
        assert "HF_ZERO_OFFLOAD_SIMD" in r.stderr and value in r.stderr
        if value in missing:
            assert "lacks" in r.stderr


def test_unsupported_level_message():
    missing = [lvl for lvl in ("avx2", "avx512") if lvl not in LEVELS]
    if not missing:
        pytest.skip("this CPU supports every level; the env-var subprocess test covers unknown names")
    with pytest.raises(ValueError, match="lacks"):
        ops.set_simd_level(missing[0])
