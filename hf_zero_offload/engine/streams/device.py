"""The engine's model of asynchrony: copy streams, events and helper executors.

The engine is written once against this small interface. On a GPU it is CUDA streams and events; on
a CPU-only machine every copy is synchronous, so the orderings that streams and events enforce on a
GPU hold trivially there. ``sim.SimStreams`` implements the same interface on the CPU with
*deferred* copies, so the GPU code paths (staging buffers, events, waits) run in CI and a missing
wait shows up as wrong numbers.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import Executor, ThreadPoolExecutor

import torch


class Streams:
    #: copies on the side streams complete later than they are issued: staging buffers and events
    #: are in play (True on CUDA and in the simulator)
    async_copies: bool

    def __init__(self, device: torch.device, blocking_waits: bool = False):
        """``blocking_waits``: a host thread waiting for an event sleeps instead of spinning (CUDA's default, kept
        unless set: the per-tile waits are short). A spinning wait holds a core the CPU Adam's threads also run
        on (the scatter thread during backward, the DPU worker); which costs more is for a GPU run to measure."""
        self.device = device
        self.blocking_waits = blocking_waits
        self.cuda = device.type == "cuda"
        self.async_copies = self.cuda
        self.kind = "cuda" if self.cuda else "cpu"   # what the start log line reports
        self.d2h = self.h2d = None
        self.bytes_down = self.bytes_up = 0   # host<->device bytes queued so far (PCIe traffic)
        if self.cuda:
            # Dedicated copy streams: gradient copies down and parameter copies up each get their own
            # queue, so neither waits behind compute kernels nor behind each other.
            self.d2h = torch.cuda.Stream(device=device)
            self.h2d = torch.cuda.Stream(device=device)

    def compute(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def event(self, stream=None):
        """Record an event on ``stream`` (default: the compute stream); None on CPU."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(blocking=self.blocking_waits)
        ev.record(stream if stream is not None else self.compute())
        return ev

    def use(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """Queue ``dst.copy_(src)`` on ``stream``; it completes once an event recorded after it has."""
        self._count(src, stream)
        if self.cuda:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def _count(self, src: torch.Tensor, stream) -> None:
        if not self.async_copies:
            return  # no device: nothing crosses a bus
        n = src.numel() * src.element_size()
        if stream is self.d2h:
            self.bytes_down += n
        elif stream is self.h2d:
            self.bytes_up += n

    def wait(self, stream, event) -> None:
        """Device-side wait: work queued on ``stream`` after this starts once ``event`` completed."""
        if event is not None:
            stream.wait_event(event)

    def host_wait(self, event) -> None:
        """Block the calling host thread until ``event`` completed."""
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        """Every queued copy and kernel has completed."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def executor(self, name: str) -> Executor:
        """A one-worker executor for host-side work that overlaps the device (scatter, DPU step)."""
        # A new thread's current CUDA device is 0: the helper of rank r (torchrun, cuda:r) records its
        # events and queues its copies on this engine's device.
        init = (lambda: torch.cuda.set_device(self.device)) if self.cuda else None
        return ForkSafeExecutor(lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=init))


class ForkedMidTask(RuntimeError):
    """A helper thread's task was running when this process was forked from its parent: the child has no such
    thread, and what the task wrote is part way."""


class ForkSafeExecutor(Executor):
    """An executor whose worker thread a fork()ed child gets anew: after a fork the child has no threads but the
    parent's, and a ThreadPoolExecutor built before it still counts its worker, so a child's submit (a trial runner
    training on in a forked process) waited forever. The child makes its own executor at its first submit; a
    future submitted before the fork is read with :func:`outcome`."""

    def __init__(self, make):
        self._make, self._pid, self._inner = make, os.getpid(), make()

    def submit(self, fn, /, *args, **kwargs):
        if os.getpid() != self._pid:  # forked: the parent's executor has no thread here (abandoned, never joined)
            self._pid, self._inner = os.getpid(), self._make()
        future = self._inner.submit(fn, *args, **kwargs)
        future.hzo_pid = self._pid
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if os.getpid() == self._pid:  # a child does not wait for a worker it does not have
            self._inner.shutdown(wait=wait, cancel_futures=cancel_futures)


def outcome(future):
    """``future.result()``; in a process forked after the submit, the outcome the parent's thread had reached at
    the fork, read without the future's lock (that thread may have held it then, and the child's copy of the lock
    would stay taken): its result, its exception, or :class:`ForkedMidTask` when it was still running."""
    if getattr(future, "hzo_pid", None) in (None, os.getpid()):
        return future.result()
    if future._state != "FINISHED":  # noqa: SLF001 - a plain read: no lock in a forked child
        raise ForkedMidTask("this process was forked while the task ran on its parent's helper thread, which the "
                            "child does not have")
    if future._exception is not None:  # noqa: SLF001
        raise future._exception  # noqa: SLF001
    return future._result  # noqa: SLF001
