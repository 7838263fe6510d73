"""Gradients leave the device during backward.

Each parameter's gradient, once fully accumulated for this backward, is copied into the current
device bucket and the device gradient is freed. A full bucket goes down to pinned host staging by
an async copy on a side stream, in the gradient's own dtype; the two buckets alternate, so one fills
while the other drains. A helper thread waits for each copy and scatters the staging into the flat
host gradient store (16-bit copy, or fp32 accumulation across micro-batches), so neither the device
nor the autograd thread waits for the CPU, and the device never sees the accumulator. On CPU the same
path runs with plain tensors (the buckets are host memory, scattered directly), inline by default.
"""
from __future__ import annotations

import torch

from .buffers import write_grad
from .grad_hooks import GradHooks
from .runs import grad_dtype_error
from .streams import Streams
from .streams.device import outcome

_SMALL = 1 << 16  # below this many elements a kernel call is cheaper on one thread


class GradPipeline:
    def __init__(self, slots: list[tuple[torch.nn.Parameter, int, int]], *, streams: Streams,
                 buckets: torch.Tensor, staging: torch.Tensor | None, scatter_thread: bool | None = None,
                 num_threads: int | None = None, label=lambda p: f"of shape {tuple(p.shape)}", who: str = "the engine"):
        self.streams = streams
        self._label = label               # how an error names a param (the engine's param_label)
        self.num_threads = num_threads    # the engine's step threads (None: torch's)
        self.buckets = buckets            # [2, bucket_numel] on the device
        self.staging = staging            # [2, bucket_numel] pinned host (async copies) or None (CPU)
        self.bucket_numel = buckets.shape[1]
        self.store: torch.Tensor | None = None   # flat host gradient store, set by the engine
        # grads received in this window, per slot: by slot, not by flat offset, which an empty param shares
        # with the next one (its gradient then counted as the next param's, added to a stale store)
        self.received = [0] * len(slots)
        self.arrivals = 0                 # gradients taken from backward, ever (the engine's cache key)
        self._index = {}
        self._slot, self._cursor = 0, 0
        self._pending = [[], []]
        self._done = [None, None]
        self._futures = [None, None]
        # Default: a scatter thread on CUDA (backward must not stall), inline on CPU (nothing to overlap).
        use_thread = streams.async_copies if scatter_thread is None else scatter_thread
        self._pool = streams.executor("hzo-scatter") if use_thread else None
        for i, (p, offset, numel) in enumerate(slots):
            if numel > self.bucket_numel:
                raise ValueError(f"bucket of {self.bucket_numel} elements cannot hold a {numel}-element parameter")
            self._index[p] = (i, offset, numel)
        self.hooks = GradHooks(self._index, self._on_grad, label=label, who=who)

    def close(self) -> None:
        self.hooks.detach()
        if self._pool is not None:
            self._pool.shutdown()

    # -- backward side -------------------------------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        g = p.grad
        if g is None:
            return
        if g.dtype != self.buckets.dtype:
            raise grad_dtype_error(self._label(p), g.dtype, self.buckets.dtype, p)
        i, offset, numel = self._index[p]
        self.arrivals += 1
        if self._cursor + numel > self.bucket_numel:
            self._flush()
        s = self.streams
        s.copy(self.buckets[self._slot, self._cursor:self._cursor + numel], g.reshape(-1), s.compute())
        self._pending[self._slot].append((i, offset, self._cursor, numel))
        self._cursor += numel
        # Freed on the compute stream right after the copy kernel that reads it was queued there:
        # the caching allocator reuses memory in stream order, so the copy still reads valid data.
        p.grad = None

    def _flush(self) -> None:
        if self._cursor == 0:
            return
        slot, used = self._slot, self._cursor
        s = self.streams
        if s.async_copies:
            # The staging half is rewritten only after its previous scatter finished reading it.
            self._wait(slot)
            filled = s.event()          # every copy into this bucket is queued before it
            s.wait(s.d2h, filled)
            s.copy(self.staging[slot, :used], self.buckets[slot, :used], s.d2h)
            self._done[slot] = s.event(s.d2h)
        self._submit(slot)
        self._slot, self._cursor = slot ^ 1, 0
        if s.async_copies:
            # Device-side wait: kernels refilling the other bucket start after its copy down landed,
            # without blocking this (autograd) thread.
            s.wait(s.compute(), self._done[self._slot])
        else:
            self._wait(self._slot)  # on CPU the bucket itself is what the scatter reads

    def _submit(self, slot: int) -> None:
        pending, self._pending[slot] = self._pending[slot], []
        if self._pool is None:
            self._retire(slot, pending)
        else:
            # The scatter runs on a helper thread so backward keeps queueing device work meanwhile.
            self._futures[slot] = self._pool.submit(self._retire, slot, pending)

    def _wait(self, slot: int) -> None:
        fut, self._futures[slot] = self._futures[slot], None
        if fut is not None:
            outcome(fut)  # re-raises a failed scatter here (and one cut by a fork: streams.device.outcome)

    def _retire(self, slot: int, pending: list) -> None:
        if not pending:
            return
        self.streams.host_wait(self._done[slot])  # the copy down must have landed in staging
        src = self.staging[slot] if self.streams.async_copies else self.buckets[slot]
        for i, offset, boff, numel in pending:
            seen = self.received[i]
            dst = self.store[offset:offset + numel]
            piece = src[boff:boff + numel]
            write_grad(dst, piece, first=seen == 0, num_threads=1 if numel < _SMALL else self.num_threads)
            self.received[i] = seen + 1

    def taken(self) -> list[bool]:
        """Per slot: a gradient taken in this window, scattered into the store or still in a bucket (with the
        default 200M-element buckets a step's gradients mostly wait in the partly filled one until the step)."""
        waiting = {i for slot in self._pending for i, *_ in slot}
        return [c > 0 or i in waiting for i, c in enumerate(self.received)]

    # -- step side -----------------------------------------------------------------------------
    def drain(self) -> None:
        """Send the partly filled bucket and wait until every gradient is in the store."""
        self._flush()
        for slot in (self._slot ^ 1, self._slot):  # the older copy first
            self._wait(slot)

    def new_window(self, store: torch.Tensor) -> None:
        """Start accumulating the next step's gradients into ``store``."""
        self.store = store
        self.received = [0] * len(self.received)
