"""The fused CPU Adam kernels (hf_zero_offload.ops) against torch, across instruction sets and threads.

Element-wise checks everywhere (never only norms). Our fp32 update performs the operations of torch's
CPU kernels (csrc/adam.h): lerp, and addcmul as ATen's vector loop fuses it, so exp_avg and exp_avg_sq
equal torch.optim.AdamW's bit for bit where torch's own kernels round that way (``TORCH_FUSES``
checks it on this build). The param agrees to a few ulp: torch's CPU sqrt is not correctly rounded
(this wheel's: 1 ulp off for 20% of inputs), ours is (every instruction set). Every instruction set and every thread
count must agree with the scalar path bit for bit (torch.equal).

This file: the Adam step against torch, across instruction sets and threads, and the conversions
(param_out rounding, gradient widening). ``test_ops_norms.py``: the gradient norm and accumulation;
``test_ops_dispatch.py``: argument checks and the choice of instruction set.
"""
from __future__ import annotations

import pytest
import torch
from _forked import run_forked
from _kernels import GRAD_DTYPES, LEVELS, TORCH_FUSES
from _kernels import dtname as _dtname

from hf_zero_offload import ops

# 2 to 4 threads' parts (csrc/thread_pool.h: >= 64K elements each), 2**20 + 3's tail, a quarter of its time
MULTI = 2**18 + 3
SIZES = [1, 7, 15, 16, 17, 4097, MULTI]
OUT_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]
# params after 10 steps: a few ulp from torch (its sqrt is not correctly rounded; see above)
TOL = dict(rtol=2e-6, atol=1e-6)
MOMENT_TOL = dict(rtol=0, atol=0) if TORCH_FUSES else TOL


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
        # AdamW's moments depend on the gradients alone: torch's bits; Adam's see the param (L2)
        torch.testing.assert_close(m, ref_m, **(MOMENT_TOL if adamw else dict(rtol=0, atol=1e-7)))
        torch.testing.assert_close(v, ref_v, **(MOMENT_TOL if adamw else TOL))
        torch.testing.assert_close(p, ref_p, **TOL)
        if out is not None:
            # the same pass wrote param rounded to nearest even: exactly torch's own conversion
            assert torch.equal(out, p.to(out_dtype))
            torch.testing.assert_close(out, ref_p.to(out_dtype), **TOL if out_dtype == torch.float32 else {})


@pytest.mark.skipif(not TORCH_FUSES, reason="this torch's CPU kernels round Adam's moments another way")
@pytest.mark.parametrize("simd", LEVELS, indirect=True)
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.0, 0.99), (0.3, 0.9), (0.5, 0.95)])
@pytest.mark.parametrize("n", [7, 4097, 2**18 + 5])
def test_moments_bit_identical_to_torch_adamw(simd, n, betas):
    """AdamW's moments are torch's bits, step after step, for every beta1: lerp's two forms (a weight
    1 - beta1 >= 0.5 interpolates from the gradient), addcmul's fused form; the vector loops and
    the scalar tails alike. The param is torch's to a few ulp (its sqrt is not correctly rounded)."""
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    ref = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-3, betas=betas, eps=1e-8, weight_decay=0.01, foreach=False)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 13):
        g = torch.randn(n, generator=gen) * 10.0 ** (step % 5 - 3)  # magnitudes from 1e-3 to 10
        g[::31] = 0.0
        ref.grad = g.clone()
        opt.step()
        ops.adam_step(p, g, m, v, step=step, lr=1e-3, beta1=betas[0], beta2=betas[1], eps=1e-8,
                      weight_decay=0.01, adamw=True)
        st = opt.state[ref]
        assert torch.equal(m, st["exp_avg"]), (step, (m != st["exp_avg"]).sum())
        assert torch.equal(v, st["exp_avg_sq"]), (step, (v != st["exp_avg_sq"]).sum())
        torch.testing.assert_close(p, ref.detach(), **TOL)


@pytest.mark.parametrize("n", [17, 4097, MULTI])
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


@pytest.mark.parametrize("flush_denormal", [False, True], ids=["ieee", "flush_denormal"])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_bf16_param_out_bits_identical_across_isas(kind, flush_denormal, restore_simd):
    """A bf16 param out from every moment kind (the int8 loop writes it two vectors at a time) equals the scalar
    kernel's bit for bit at every level, subnormal params included: avx512_bf16 converts a vector with
    vcvtneps2bf16, which flushes subnormal inputs whatever MXCSR says, and only where no lane is one (tested on
    the bits, since vfpclassps sees a subnormal as zero under denormals-are-zero). A zero step (lr = 0, zero
    gradient) keeps the params as they were, so each vector of 16 carries at most one subnormal among values."""
    x = _edge_values()
    x = torch.cat([x, x.flip(0) * 0.5, torch.full((64,), 2.0 ** -140), torch.full((64,), 1.0)])
    n = x.numel()
    if flush_denormal and not torch.set_flush_denormal(True):
        pytest.skip("no flush-denormal mode on this CPU")
    try:
        per_level = {}
        for level in LEVELS:
            ops.set_simd_level(level)
            st = ops.state_from_fp32(torch.zeros(n), torch.zeros(n), kind)
            out = torch.empty(n, dtype=torch.bfloat16)
            ops.adam_step(x.clone(), torch.zeros(n), st["exp_avg"], st["exp_avg_sq"], step=1, lr=0.0, param_out=out,
                          exp_avg_scale=st.get("exp_avg_scale"), exp_avg_sq_scale=st.get("exp_avg_sq_scale"))
            per_level[level] = out.view(torch.int16)
    finally:
        torch.set_flush_denormal(False)
    for level in LEVELS:
        assert torch.equal(per_level["scalar"], per_level[level]), level
    if not flush_denormal:
        assert _same_with_nans(per_level["scalar"].view(torch.bfloat16), x.to(torch.bfloat16))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=_dtname)
def test_grad_widening_edge_cases(simd, grad_dtype):
    g = _edge_values().to(grad_dtype)
    h = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(grad_dtype)  # every 16-bit pattern
    g = torch.cat([g, h])
    acc = torch.empty(g.numel())
    ops.accumulate_grad(acc, g, overwrite=True)
    assert _same_with_nans(acc, g.float())


@pytest.mark.parametrize("case,message", [
    ("exp_avg as exp_avg_sq", "exp_avg and exp_avg_sq share memory"),
    ("grad overlaps param", "param and grad share memory"),
    ("param_out is param", "param and param_out share memory"),
    ("negative grad_scale", "grad_scale must be a number >= 0, got -1.0"),
    ("grad_scale str", "grad_scale must be a number >= 0, got '1'"),
    # 1 / a static loss scale of 1e-39: inf once cast to the kernel's float, NaN params from zero gradients
    ("grad_scale 1e39", r"grad_scale must be finite in fp32 \(at most 3.40282e\+38\), got 1e\+39"),
    ("grad_scale inf", r"grad_scale must be finite in fp32 \(at most 3.40282e\+38\), got inf"),
    ("step 2**63", r"step must be in \[1, 2\*\*63\)"),
    ("num_threads 2**40", r"num_threads must be a positive int \(< 2\*\*31\), got 1099511627776"),
    ("num_threads True", r"num_threads must be a positive int \(< 2\*\*31\), got True"),
])
def test_adam_step_refuses_aliased_arrays_and_out_of_range_scalars(case, message):
    """Arrays sharing memory gave thread-order-dependent results, a negative grad_scale ascended
    the gradient, and step/num_threads past the C types were pybind's opaque TypeError: each is now
    refused, naming it, before the kernel runs (nothing written)."""
    buf = torch.ones(40)
    param, grad = buf[:16], torch.full((16,), 0.5)
    state = ops.make_state(16)
    kw = dict(step=1, lr=0.1)
    if case == "exp_avg as exp_avg_sq":
        state["exp_avg_sq"] = state["exp_avg"]
    elif case == "grad overlaps param":
        grad = buf[8:24]
    elif case == "param_out is param":
        kw["param_out"] = param
    elif case == "negative grad_scale":
        kw["grad_scale"] = -1.0
    elif case == "grad_scale str":
        kw["grad_scale"] = "1"
    elif case.startswith("grad_scale "):
        kw["grad_scale"] = float(case.split()[1])
    elif case == "step 2**63":
        kw["step"] = 2**63
    else:
        kw["num_threads"] = 2**40 if case.endswith("2**40") else True
    with pytest.raises(ValueError, match=message):
        ops.adam_step(param, grad, **state, **kw)
    assert torch.equal(buf, torch.ones(40)) and not state["exp_avg"].any()


def test_set_simd_level_takes_any_case_and_names_a_non_string():
    before = ops.simd_level()
    try:
        ops.set_simd_level(" SCALAR ")  # as HF_ZERO_OFFLOAD_SIMD is read
        assert ops.simd_level() == "scalar"
        with pytest.raises(TypeError, match="level must be a str"):
            ops.set_simd_level(None)
    finally:
        ops.set_simd_level(before)


_NO_THREADS = r"""
import resource, sys, torch
from hf_zero_offload import ops
n = 2**20
gen = torch.Generator().manual_seed(5)
p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
ref = p0.clone()
ops.adam_step(ref, g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-3, num_threads=1)
p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
with open("/proc/self/status") as f:
    vm = int(next(line.split()[1] for line in f if line.startswith("VmSize")))
# room for a dozen 8 MiB thread stacks, not 63
resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + 100 * 2**20, resource.RLIM_INFINITY))
if sys.argv[1] == "busy":  # the pool taken by another call: the short-lived threads run out
    from hf_zero_offload import _C
    _C.set_thread_pool(False)
ops.adam_step(p, g, m, v, step=1, lr=1e-3, num_threads=64)
print("equal" if torch.equal(p, ref) else "differ")
"""


@pytest.fixture(scope="module")
def no_threads_children():  # forked from one import of torch alone (tests/_forked.py): 3.5 -> 1.8 s
    return dict(zip(("pool", "busy"), run_forked([_NO_THREADS] * 2, args=[["pool"], ["busy"]], timeout=120)))


@pytest.mark.parametrize("path", ["pool", "busy"])
def test_a_step_with_fewer_threads_than_asked_still_steps_the_whole_range(path, no_threads_children):
    """More threads asked than the process can make (a thread limit, an address space cap): the pool's or the
    short-lived threads' creation failed; the short-lived ones then aborted the process (std::terminate: a
    joinable thread destroyed by the unwinding) or raised "Resource temporarily unavailable", naming nothing.
    The parts left now run on the calling thread, bit-identical (a part's result does not depend on its thread)."""
    done = no_threads_children[path]
    assert done.returncode == 0 and done.stdout.strip() == "equal", (done.returncode, done.stdout, done.stderr[-2000:])
