"""Shared by the ``test_engine_inputs*`` files: the engine kinds they build on a TinyNet, and one backward."""
from __future__ import annotations

import torch

from _models import TinyNet, batches, loss_fn, param_groups
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

KINDS = {"offload": (OffloadAdam, {}), "zero2": (ShardedAdam, {"stage": 2, "offload": False}),
         "zero0": (ShardedAdam, {"stage": 0, "offload": False})}


def _engine(kind="offload", groups=param_groups):
    torch.manual_seed(0)
    model = TinyNet()
    cls, extra = KINDS[kind]
    return model, cls(groups(model, 0.01), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)


def _backward(model, k=0):
    ids, labels, use_branch = batches(k + 1)[k]
    loss_fn(model, ids, labels, use_branch).backward()
