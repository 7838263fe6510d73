"""The fused CPU kernels' gradient norm (sum of squares + finiteness) and gradient accumulation
(hf_zero_offload.ops) against torch's float64 / element-wise results, across instruction sets and
threads. Shared sweeps and fixtures: ``_kernels.py``; the Adam step itself: ``test_ops.py``.
"""
from __future__ import annotations

import pytest
import torch
from _kernels import GRAD_DTYPES, LEVELS
from _kernels import dtname as _dtname

from hf_zero_offload import ops


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
