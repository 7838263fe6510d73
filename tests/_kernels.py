"""Shared by the ``test_ops*`` files: the instruction sets and dtypes they sweep (the fixtures that
select a SIMD level, ``simd`` and ``restore_simd``, are in ``conftest.py``)."""
from __future__ import annotations

import torch

from hf_zero_offload import ops

LEVELS = ops.available_simd_levels()
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def dtname(d):
    return "none" if d is None else str(d).replace("torch.", "")


def torch_fuses() -> bool:
    """Whether this torch's CPU kernels round Adam's moments as adam_math does: addcmul_ as
    fma(value * t1, t2, self), lerp_ with a small weight as fma(w, end - self, self) (x86 wheels:
    ATen's vector loops, whose a + b * c the compiler fuses). Other builds get a tolerance."""
    gen = torch.Generator().manual_seed(7)
    v, g = torch.rand(4099, generator=gen) * 1e-3, torch.randn(4099, generator=gen) * 1e-2
    w = torch.tensor(1 - 0.999, dtype=torch.float32)
    fused = (v.double() + (w * g).double() * g.double()).float()  # exact in fp64, one rounding
    m_ref = (v.double() + torch.tensor(0.1).double() * (g - v).double()).float()
    return torch.equal(v.clone().addcmul_(g, g, value=1 - 0.999), fused) and torch.equal(
        v.clone().lerp_(g, 0.1), m_ref)


TORCH_FUSES = torch_fuses()
