"""The reference of the clipping tests on two ranks: torch's AdamW(foreach=False) with torch's ``clip_grad_norm_`` over
the whole batch, 2 micro-batches a step, and the check of each rank's norms and params against it."""
from __future__ import annotations

import pytest
import torch


def adamw_clipped(model, data, max_norm: float, *, lr: float, weight_decay: float) -> list[float]:
    """Trains ``model`` in place on ``data`` (pairs (x, y), halved MSE, a step every 2); the norms clipping returned."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    norms = []
    for i, (x, y) in enumerate(data):
        (((model(x) - y) ** 2).mean() / 2).backward()
        if i % 2:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
            opt.step()
            opt.zero_grad()
    assert min(norms) > max_norm  # clipping was active
    return norms


def assert_ranks_match(ranks, model, norms: list[float], *, rel: float) -> None:
    """Each rank's runs (its norms, its params after) as the reference's."""
    for rank in ranks:
        for got_norms, got in rank:
            assert got_norms == pytest.approx(norms, rel=rel)
            for p, q in zip(model.parameters(), got):
                torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6)
