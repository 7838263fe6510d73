"""The engine beside torch.optim.AdamW on TinyNet: the pair the engine equivalence tests train side by side."""
from __future__ import annotations

import copy

import torch

from _models import TinyNet, loss_fn, param_groups
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

LR, WD = 1e-2, 0.1
SMALL = dict(bucket_numel=1000, tile_numel=300)  # several buckets and tiles even on a tiny model


def make_pair(mode=None, seed=0, **opts):
    torch.manual_seed(seed)
    ref_model = TinyNet() if mode is None else mode.model(TinyNet())
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    opt = engine(mode, model, **opts)
    return ref_model, ref, model, opt


def engine(mode, model, *, param_dtype=None, params=None, **opts):
    return OffloadAdam(params if params is not None else param_groups(model, WD), lr=LR, param_dtype=param_dtype,
                       options=OffloadOptions(**{**SMALL, **opts}), streams=None if mode is None else mode.streams())


def train_both(ref_model, ref, model, opt, data):
    """The same batches through torch AdamW and the engine, one optimizer step per batch."""
    for ids, labels, use_branch in data:
        for m, o in ((ref_model, ref), (model, opt)):
            loss_fn(m, ids, labels, use_branch).backward()
            o.step()
            o.zero_grad()


def assert_models_close(a, b, **tol):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.detach().float(), pa.detach().float(), msg=name, **tol)
