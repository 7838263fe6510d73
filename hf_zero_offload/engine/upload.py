"""Updated parameters back to the device: staging buffers, their events, and the copies.

Two modes. Synchronous steps write each Adam tile into one of two pinned staging tiles and upload it
at once, so the next tile's compute overlaps this tile's copy. The delayed parameter update keeps a
full-size staging (its step finishes while the device still runs on the previous parameters) and
publishes it later, tile by tile, each tile with its own event. The targets are any flat tensors
given as ``(tensor, offset, numel)`` slots: the model's parameters (``OffloadAdam``) or one rank's
updated shard on the device (``ShardedAdam``, which all-gathers it next).
"""
from __future__ import annotations

import torch

from .runs import FlatIndex
from .streams import Streams


class ParamUploader:
    def __init__(self, streams: Streams, slots: list[tuple[torch.nn.Parameter, int, int]], staging: torch.Tensor,
                 *, full: bool, tile_numel: int):
        self.streams = streams
        self.slots = slots                       # flat order: (param, offset, numel)
        self._index = FlatIndex(slots)
        self.staging = staging
        self.full = full
        self.tile_numel = tile_numel if full else staging.numel() // 2
        self._tiles = None if full else staging[:2 * self.tile_numel].view(2, self.tile_numel)
        self._tile_events = [None, None]         # sync mode: last upload from each staging tile
        self._staging_events: dict[int, object] = {}  # full mode: staging tile index -> its last upload

    def begin(self) -> None:
        """Before a pass of uploads: the targets may still be read by kernels queued before it
        (the forward, or the all-gather of the previous shard), so the copies are queued after
        those. One wait covers the pass: what the copies must follow was queued before it."""
        s = self.streams
        if s.async_copies:
            s.wait(s.h2d, s.event())

    def out_buffer(self, k: int, a: int, b: int) -> torch.Tensor:
        """Where the k-th Adam tile (flat range [a, b)) writes its updated params."""
        if self.full:
            # This range may still feed the previous publish: wait for the upload of just the staging
            # tiles it overlaps, not the whole model.
            t = self.tile_numel
            for i in range(a // t, (b - 1) // t + 1):
                self.streams.host_wait(self._staging_events.pop(i, None))
            return self.staging[a:b]
        # A staging tile is rewritten only after its previous upload finished.
        self.streams.host_wait(self._tile_events[k % 2])
        return self._tiles[k % 2, :b - a]

    def upload(self, k: int, out: torch.Tensor, a: int, b: int) -> None:
        ev = self._copy(out, a, b)
        if self.full:
            t = self.tile_numel
            for i in range(a // t, (b - 1) // t + 1):
                self._staging_events[i] = ev
        else:
            self._tile_events[k % 2] = ev

    def finish(self) -> None:
        # The next forward reads the parameters: the compute stream waits for the last upload.
        s = self.streams
        if s.async_copies:
            s.wait(s.compute(), s.event(s.h2d))

    def publish_all(self, numel: int) -> None:
        """Full mode: upload the whole staging, tile by tile, so the next step's worker may rewrite a
        tile as soon as that tile landed while later tiles are still in flight."""
        self.begin()
        for k, a in enumerate(range(0, numel, self.tile_numel)):
            b = min(numel, a + self.tile_numel)
            self.upload(k, self.staging[a:b], a, b)
        self.finish()

    def wait_all(self) -> None:
        for ev in [*self._staging_events.values(), *self._tile_events]:
            self.streams.host_wait(ev)
        self._staging_events.clear()
        self._tile_events = [None, None]

    def _copy(self, src: torch.Tensor, a: int, b: int):
        """Copy ``src`` holding flat range [a, b) into the device parameters it covers."""
        s = self.streams
        for p, off, lo, hi in self._index.pieces(a, b):
            s.copy(p.data.view(-1)[lo - off:hi - off], src[lo - a:hi - a], s.h2d)
        return s.event(s.h2d) if s.async_copies else None
