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

__all__ = ["SIMULATE_ENV", "SimStreams", "Streams", "make_streams"]


def make_streams(device: torch.device) -> Streams:
    """Streams for ``device``; on a CPU device the simulator when ``HF_ZERO_OFFLOAD_SIMULATE_STREAMS=1``."""
    # the words HF_ZERO_OFFLOAD_DEBUG takes for off ("false" turned the simulator on)
    if device.type == "cpu" and os.environ.get(SIMULATE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return SimStreams()
    return Streams(device)
