"""``BroadcastBuffers``: what DDP does to the module's states, for ``--sharded_ddp``, which trains without a DDP
wrapper: rank 0's frozen params and buffers on every rank when it wraps the model (the engine sets the trainable
params itself), and rank 0's buffers before each synced training forward (``broadcast_buffers``). A mixin of
``ZeroOffloadMixin``'s Trainer; its methods read the Trainer's fields as their own."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .same_model import check_same_model

_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast bucket


class BroadcastBuffers:
    # DDP sets rank 0's buffers (a BatchNorm's running statistics) on every rank before a training forward that
    # follows a synced backward (the first one, and each accumulation window's first): without it rank 1 kept its
    # own statistics, and a 2-rank evaluate() of equal weights gave another loss than DDP's
    _zo_buffers_stale = True

    def training_step(self, model, inputs, *args, **kwargs):
        if self._zo_buffers_stale:
            self._zo_broadcast_buffers()
        out = super().training_step(model, inputs, *args, **kwargs)
        # as DDP: a micro-batch under no_sync (not the window's last) leaves the next forward unsynced
        self._zo_buffers_stale = self.accelerator.sync_gradients
        return out

    def _zo_broadcast_buffers(self, model=None, frozen: bool = False) -> None:
        """Rank 0's buffers (unless ``ddp_broadcast_buffers`` is False) and, with ``frozen``, its frozen params, on
        every rank. ``frozen`` once, when the engine is built, as DDP's wrap does: the engine sets the trainable
        params from rank 0, and ranks that built the model with other seeds kept their own frozen layers (0.9 apart
        for a whole run, another eval loss per rank) and, until the first training step, their own buffers (an
        ``eval_on_start`` 9.9% off DDP's)."""
        engine, model = self.zero_engine, self.model if model is None else model
        if engine is None or getattr(engine, "world_size", 1) < 2:
            return
        if frozen:  # once, before the first broadcast: every later one sends the same tensors
            check_same_model(model, self.args.ddp_broadcast_buffers is not False, engine.process_group,
                             engine.world_size)
        states = [p for p in model.parameters() if not p.requires_grad] if frozen else []
        if self.args.ddp_broadcast_buffers is not False:
            states += [b for b in model.buffers()]
        states = list({id(t): t for t in states}.values())  # a tied tensor once
        if states:
            with torch.no_grad():
                dist._broadcast_coalesced(engine.process_group or dist.group.WORLD, states, _BUCKET_BYTES, 0)
