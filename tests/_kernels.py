"""Shared by the ``test_ops*`` files: the instruction sets and dtypes they sweep (the fixtures that
select a SIMD level, ``simd`` and ``restore_simd``, are in ``conftest.py``)."""
from __future__ import annotations

import torch

from hf_zero_offload import ops

LEVELS = ops.available_simd_levels()
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def dtname(d):
    return "none" if d is None else str(d).replace("torch.", "")
