"""``BroadcastBuffers``: what DDP's ``broadcast_buffers`` does, for ``--sharded_ddp``, which trains without a DDP
wrapper. A mixin of ``ZeroOffloadMixin``'s Trainer; its methods read the Trainer's fields as their own."""
from __future__ import annotations

import torch
import torch.distributed as dist

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

    def _zo_broadcast_buffers(self) -> None:
        engine = self.zero_engine
        if engine is None or getattr(engine, "world_size", 1) < 2 or self.args.ddp_broadcast_buffers is False:
            return
        buffers = [b for _, b in self.model.named_buffers()]
        if buffers:
            with torch.no_grad():
                dist._broadcast_coalesced(engine.process_group or dist.group.WORLD, buffers, _BUCKET_BYTES, 0)
