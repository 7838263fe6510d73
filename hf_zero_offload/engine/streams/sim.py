"""Simulated streams: the GPU pipeline's orderings, checked on a CPU.

``SimStreams`` implements ``device.Streams`` for CPU tensors with the adversarial timing a GPU is
allowed to have. Copies queued on a side stream (``d2h``, ``h2d``) are *deferred*: a copy runs only
when something must see it complete (a host wait on a later event, a stream waiting on such an
event, ``synchronize``). Executor work (the gradient scatter, the DPU step) is deferred likewise
until its future is waited on. So:

- a copy whose source is rewritten before anyone waited for it copies the new data;
- a reader that forgot to wait for a copy sees the old data;
- a helper that nobody waited for has not run yet.

Each of these turns a missing wait into a wrong number, deterministically, without a GPU. Two knobs
pick the adversary for the other class of races, host work racing a queued copy:
``executor="eager"`` runs helper work at submission (before queued copies it should wait for), and
``defer_compute_waits=True`` keeps the compute stream's waits pending until the next compute work
that the test announces with ``run_compute_waits()`` (e.g. from a forward pre-hook), so the host runs
ahead of the device as it does on a GPU.

A third adversary, ``late_compute=True``, is for the side streams' waits on the compute stream: the copies
the engine queues on the compute stream (a gradient into a device bucket) land only when something waits for
a later compute event (or at ``synchronize``), reading their source as it was when queued (the compute
stream's later kernels come after them), while side-stream copies run as soon as their stream's queued waits
let them. A copy down that forgot to wait for the bucket's filling reads the bucket before it was written.

What it cannot show: the model's own kernels run eagerly (they finish as they are queued), so a side stream
writing what a forward or backward still reads without waiting for it goes unnoticed; and it says nothing
about speed.
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque
from concurrent.futures import Executor, Future

import torch

from .device import Streams


class SimStream:
    def __init__(self, name: str):
        self.name = name
        self.queue: deque = deque()
        self.issued = 0     # operations ever queued
        self.done = 0       # operations completed

    def __repr__(self) -> str:
        return f"SimStream({self.name}, issued={self.issued}, done={self.done})"


class SimEvent:
    """Completes when its stream has completed ``position`` operations."""
    __slots__ = ("stream", "position")

    def __init__(self, stream: SimStream, position: int):
        self.stream, self.position = stream, position


class EagerExecutor(Executor):
    """Runs a submitted call at once, on the calling thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, like a thread pool does
            fut.set_exception(exc)
        return fut


class LazyExecutor(Executor):
    """Runs a submitted call only when its result is asked for (or at shutdown), in submission order."""

    def __init__(self):
        self._lock = threading.RLock()
        self._queue: deque = deque()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut = _LazyFuture(self)
        with self._lock:
            self._queue.append((fut, fn, args, kwargs))
        return fut

    def _run_until(self, target: Future) -> None:
        with self._lock:
            while not target.done():
                fut, fn, args, kwargs = self._queue.popleft()
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter, like a thread pool does
                    fut.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            while self._queue:
                self._run_until(self._queue[-1][0])


class _LazyFuture(Future):
    def __init__(self, executor: LazyExecutor):
        super().__init__()
        self._executor = executor

    def result(self, timeout=None):
        self._executor._run_until(self)
        return super().result(timeout)


class SimStreams(Streams):
    def __init__(self, *, executor: str = "lazy", defer_compute_waits: bool = False, late_compute: bool = False):
        if executor not in ("lazy", "eager"):
            raise ValueError(f"executor must be 'lazy' or 'eager', got {executor!r}")
        super().__init__(torch.device("cpu"))  # the CPU's fields (counters included), then ours:
        self.async_copies, self.kind = True, "sim"
        self.executor_mode = executor
        self.defer_compute_waits, self.late_compute = defer_compute_waits, late_compute
        self._compute_waits: list[SimEvent] = []
        self.d2h, self.h2d = SimStream("d2h"), SimStream("h2d")
        self._compute = SimStream("compute")  # holds queued copies with late_compute only
        self._lock = threading.RLock()        # the autograd, scatter and DPU threads all queue and wait
        self.copies = 0                       # copies queued on side streams (tests check they happened)

    def compute(self):
        return self._compute

    def event(self, stream=None):
        stream = stream if stream is not None else self._compute
        if stream is self._compute:
            self.run_compute_waits()  # work after this event on any stream sees what compute waited for
        with self._lock:
            return SimEvent(stream, stream.issued)

    def use(self, stream):
        if stream is None:  # code written for "no stream on CPU" (the sharded reducer's comm stream)
            return contextlib.nullcontext()
        raise NotImplementedError("SimStreams: queue copies with copy(); kernels run on the compute stream")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        if stream is self._compute:
            self.run_compute_waits()  # queued after the compute stream's waits
            if not self.late_compute:
                dst.copy_(src)
                return
            snap = src.clone()  # what the compute stream reads, in order with its later kernels (which may free src)
            with self._lock:
                self._enqueue(self._compute, lambda: dst.copy_(snap))
            return
        with self._lock:
            self._count(src, stream)
            self.copies += 1
            self._enqueue(stream, lambda: dst.copy_(src))
            self._run_early(stream)

    def wait(self, stream, event) -> None:
        if event is None or event.stream is stream or (event.stream is self._compute and not self.late_compute):
            return  # a stream is FIFO; the compute stream is complete but for late_compute's queued copies
        if stream is self._compute:
            if self.defer_compute_waits:
                with self._lock:
                    self._compute_waits.append(event)
            else:
                self._run(event.stream, event.position)  # eager compute: what it waits for completes now
        else:
            with self._lock:
                self._enqueue(stream, lambda: self._run(event.stream, event.position))
                self._run_early(stream)

    def host_wait(self, event) -> None:
        if event is not None:
            self._run(event.stream, event.position)

    def run_compute_waits(self) -> None:
        """Compute is about to run: the copies it waits for complete now."""
        with self._lock:
            waits, self._compute_waits = self._compute_waits, []
            for ev in waits:
                self._run(ev.stream, ev.position)

    def synchronize(self) -> None:
        self.run_compute_waits()
        while self.pending():  # a queued wait may run work of another stream
            for s in (self._compute, self.d2h, self.h2d):
                self._run(s, s.issued)

    def executor(self, name: str) -> Executor:
        return LazyExecutor() if self.executor_mode == "lazy" else EagerExecutor()

    def pending(self) -> int:
        """Queued side-stream operations not yet run."""
        return sum(s.issued - s.done for s in (self.d2h, self.h2d, self._compute))

    def _enqueue(self, stream: SimStream, op) -> None:
        stream.queue.append(op)
        stream.issued += 1

    def _run_early(self, stream: SimStream) -> None:
        """late_compute: a side stream runs what it queued at once (its queued waits run what they wait for)."""
        if self.late_compute:
            self._run(stream, stream.issued)

    def _run(self, stream: SimStream, position: int) -> None:
        with self._lock:
            while stream.done < position:
                op = stream.queue.popleft()
                stream.done += 1
                op()
