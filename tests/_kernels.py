"""Shared by the ``test_ops*`` files: the instruction sets and dtypes they sweep, and the fixtures
that select a SIMD level for one test and put the previous one back afterwards.

A test module uses the fixtures by importing them (``from _kernels import restore_simd, simd``).
"""
from __future__ import annotations

import pytest
import torch

from hf_zero_offload import ops

LEVELS = ops.available_simd_levels()
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


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


def dtname(d):
    return "none" if d is None else str(d).replace("torch.", "")
