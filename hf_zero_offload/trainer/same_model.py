"""Every rank of a sharded run must hold the same model: the same params and buffers, in the same order, of the same
names, shapes, dtypes and trainability.

The engine compares the trainable params' shapes in its groups (``engine/sharded/agree.py``); rank 0's weights, frozen
params and buffers then go to every rank by position, as DDP's wrap sends them. An outside probe found what that
missed: one frozen param or buffer more on one rank left every rank in the coalesced broadcast until the collective
timeout (30 minutes by default), and a rank whose model registered two same-shaped layers in another order (q and k
swapped) trained on without a word, each rank's q holding the other's k. One all-gather, when the engine is built,
compares them; every rank raises the same error naming what differs.
"""
from __future__ import annotations

from ..engine.sharded.agree import check_ranks_agree


def _entry(name: str, t, trainable: bool | None = None) -> str:
    kind = "" if trainable is None else " trainable" if trainable else " frozen"
    return f"{name} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}{kind}"


def check_same_model(model, buffers: bool, process_group, world_size: int) -> None:
    """Raises ValueError on every rank when any rank's params or (with ``buffers``: --ddp_broadcast_buffers) buffers
    differ from rank 0's (nothing with one process)."""
    if world_size < 2:
        return
    params = list(model.named_parameters())
    setup = {"ddp_broadcast_buffers": buffers, "params": len(params)}
    setup.update({f"param {i}": _entry(n, p, p.requires_grad) for i, (n, p) in enumerate(params)})
    if buffers:
        named = list(model.named_buffers())
        setup["buffers"] = len(named)
        setup.update({f"buffer {i}": _entry(n, b) for i, (n, b) in enumerate(named)})
    check_ranks_agree(setup, process_group, world_size, "hold different models",
                      "Rank 0's weights, frozen params and buffers are set on every rank by position, as DDP's wrap "
                      "sets them, which needs the same ones, in the same order, on every rank (the same model, "
                      "freezing and code on every node)")
