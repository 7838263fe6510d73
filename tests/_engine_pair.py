"""The engine beside torch.optim.AdamW on TinyNet: the pair the engine equivalence tests train side by side."""
from __future__ import annotations

import copy

import torch

from _models import TinyNet, loss_fn, param_groups, run_steps
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


def resume_and_train(weights, load_state, options, data, *, engine_first: bool, write=None):
    """A new process's resume: a TinyNet of other weights and a new OffloadAdam over it, the model's ``weights`` and
    the engine's state (``load_state(engine)``) loaded in either order, ``write(model)`` after both, then ``data``
    trained and the delayed step flushed. (model, engine), the engine open: the caller closes it."""
    torch.manual_seed(1)  # other weights than the saved ones, as a new process's model has
    again = TinyNet()
    resumed = OffloadAdam(param_groups(again, WD), lr=LR, options=options)
    loads = [lambda: again.load_state_dict(weights), lambda: load_state(resumed)]
    for load in loads[::-1] if engine_first else loads:
        load()
    if write is not None:
        write(again)
    run_steps(again, resumed, data)
    resumed.flush()
    return again, resumed
