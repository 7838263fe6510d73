"""The engines against torch.optim's contract where a plain training loop leans on it: a
zero-element parameter, ``grad_norm()`` asked between two backward passes, an infinite gradient with
clipping, parameters written between steps, torch's state-dict hooks, and copies of an engine.
Reference: ``torch.optim.AdamW(foreach=False)`` (with ``clip_grad_norm_`` where the engine clips)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

LR = 1e-2
SMALL = dict(bucket_numel=1200, tile_numel=300, num_threads=1)


def engine(kind, params, **opts):
    o = OffloadOptions(**{**SMALL, **opts})
    if kind == "offload":
        return OffloadAdam(params, lr=LR, options=o)
    return ShardedAdam(params, lr=LR, options=o, stage=int(kind[-1]), offload=kind.startswith("sharded-off"))


KINDS = ["offload", "sharded1", "sharded2", "sharded-off2"]


class WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Parameter(torch.empty(0))  # an empty adapter factor, a placeholder
        self.w = nn.Parameter(torch.linspace(-1, 1, 6))

    def forward(self, x):
        return (self.w * x).sum() + self.e.sum()


@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("empty_first", [True, False])
def test_a_zero_element_param_with_a_gradient_leaves_its_neighbours_exact(kind, dpu, empty_first):
    """The empty param shares its flat offset with the next one; the one-process engine counted
    gradients by offset, so the next param's gradient was added to the previous window's."""
    if dpu and not kind.startswith(("offload", "sharded-off")):
        pytest.skip("DPU needs offload")
    ref_model = WithEmpty()
    model = copy.deepcopy(ref_model)
    order = (lambda m: [m.e, m.w]) if empty_first else (lambda m: [m.w, m.e])
    opt = engine(kind, order(model), dpu=dpu, dpu_warmup_steps=1)
    ref = torch.optim.AdamW(order(ref_model), lr=LR, weight_decay=0.0, foreach=False)
    for k in range(4):
        x = torch.linspace(1, 2, 6) * (-1) ** k
        for m, o in ((model, opt), (ref_model, ref)):
            m(x).backward()
            o.step()
            o.zero_grad()
    opt.flush()
    torch.testing.assert_close(model.w, ref_model.w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_norm_asked_between_two_backward_passes_sees_both(kind):
    """grad_norm() is computed once per step and reused by step(); a backward after it (accumulation by
    hand) used to be left out of both, and its gradients went to the next step."""
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    model = copy.deepcopy(ref_model)
    opt = engine(kind, list(model.parameters()))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        xs = [torch.randn(3, 5, generator=g) for _ in range(2)]
        for x in xs:
            ref_model(x).pow(2).mean().backward()
        want = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()]).item()
        model(xs[0]).pow(2).mean().backward()
        opt.grad_norm()  # mid-window
        model(xs[1]).pow(2).mean().backward()
        assert opt.grad_norm() == pytest.approx(want, rel=1e-6)
        opt.step()
        opt.zero_grad()
        ref.step()
        ref.zero_grad()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
