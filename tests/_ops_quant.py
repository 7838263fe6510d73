"""Shared by the ``test_ops_quant*`` files: wide-ranged test values, and the arguments of one compact step."""
from __future__ import annotations

import torch

from hf_zero_offload import ops


def _wide(n, seed):
    """Values over many orders of magnitude (moments of real models span ~1e-10..1e-2)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 4)


def _args(n=512, kind="int8"):
    return dict(param=torch.zeros(n), grad=torch.zeros(n), **ops.make_state(n, kind))
