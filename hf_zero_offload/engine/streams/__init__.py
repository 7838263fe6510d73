"""The engine's model of asynchrony: ``Streams`` (CUDA streams and events, or synchronous copies on a
CPU device, ``device.py``) and ``SimStreams``, the same interface with deferred copies that checks the
GPU orderings on a CPU (``sim.py``)."""
from __future__ import annotations

import os

import torch

from .device import Streams
from .sim import SimStreams

#: Testing aid: on a CPU-only device, run the GPU pipeline on simulated streams (deferred copies).
SIMULATE_ENV = "HF_ZERO_OFFLOAD_SIMULATE_STREAMS"
#: Tuning experiment (GPU): host waits sleep instead of spinning (``Streams(blocking_waits=True)``).
BLOCKING_ENV = "HF_ZERO_OFFLOAD_BLOCKING_WAITS"

__all__ = ["BLOCKING_ENV", "SIMULATE_ENV", "SimStreams", "Streams", "make_streams"]


def _on(name: str) -> bool:
    # the words HF_ZERO_OFFLOAD_DEBUG takes for off ("false" turned the simulator on)
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def make_streams(device: torch.device) -> Streams:
    """Streams for ``device``; on a CPU device the simulator when ``HF_ZERO_OFFLOAD_SIMULATE_STREAMS=1``; host waits
    that sleep when ``HF_ZERO_OFFLOAD_BLOCKING_WAITS=1``."""
    if device.type == "cpu" and _on(SIMULATE_ENV):
        return SimStreams()
    return Streams(device, blocking_waits=_on(BLOCKING_ENV))
