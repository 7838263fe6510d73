"""CUDA streams and events that become no-ops on a CPU-only machine.

The engine is written once against this tiny interface; on CPU every copy is synchronous, so the
orderings that streams and events enforce on a GPU hold trivially there, and CI covers the logic.
"""
from __future__ import annotations

import contextlib

import torch


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.d2h = self.h2d = None
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
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else self.compute())
        return ev

    def use(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    @staticmethod
    def wait(stream, event) -> None:
        """Device-side wait: work queued on ``stream`` after this starts once ``event`` completed."""
        if event is not None:
            stream.wait_event(event)

    @staticmethod
    def host_wait(event) -> None:
        """Block the calling host thread until ``event`` completed."""
        if event is not None:
            event.synchronize()
