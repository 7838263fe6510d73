"""The engine's model of asynchrony: ``Streams`` (CUDA streams and events, or synchronous copies on a
CPU device, ``device.py``) and ``SimStreams``, the same interface with deferred copies that checks the
GPU orderings on a CPU (``sim.py``)."""
from __future__ import annotations

import torch

from ...switches import env_switch
from .device import Streams
from .sim import SimStreams

#: Testing aid: on a CPU-only device, run the GPU pipeline on simulated streams (deferred copies).
SIMULATE_ENV = "HF_ZERO_OFFLOAD_SIMULATE_STREAMS"
#: Tuning experiment (GPU): host waits sleep instead of spinning (``Streams(blocking_waits=True)``).
BLOCKING_ENV = "HF_ZERO_OFFLOAD_BLOCKING_WAITS"

__all__ = ["BLOCKING_ENV", "SIMULATE_ENV", "SimStreams", "Streams", "make_streams"]


def make_streams(device: torch.device) -> Streams:
    """Streams for ``device``; on a CPU device the simulator when ``HF_ZERO_OFFLOAD_SIMULATE_STREAMS=1``; host waits
    that sleep when ``HF_ZERO_OFFLOAD_BLOCKING_WAITS=1``."""
    if device.type == "cpu" and env_switch(SIMULATE_ENV):
        return SimStreams()
    return Streams(device, blocking_waits=env_switch(BLOCKING_ENV))
