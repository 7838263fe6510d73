"""Where the engine tests run: plain CPU, the stream simulator (two adversaries), or a real GPU.

The same equivalence tests run in every mode. ``sim-lazy`` defers copies and helper work until
someone waits for them; ``sim-eager`` runs helper work at once while copies stay deferred. In both the
host runs ahead of the device: the compute stream's waits complete only when compute next runs (a
module's forward, or a copy the engine queues on it). ``sim-late`` is the reverse for the side streams'
waits on compute: the engine's copies on the compute stream land only when waited for, side-stream copies
as soon as their waits allow. ``cuda`` is the real thing (marked, skipped
without a GPU). The ``mode`` fixture that runs a test in each is in ``conftest.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hf_zero_offload.engine.streams import SimStreams


@dataclass
class Mode:
    name: str
    device: torch.device
    sim: dict | None = None

    def __post_init__(self):
        self.sims: list[SimStreams] = []

    def streams(self):
        """The ``streams=`` argument for OffloadAdam (None: the device's own)."""
        if self.sim is None:
            return None
        s = SimStreams(**self.sim)
        self.sims.append(s)
        return s

    def data(self, batches):
        return [(ids.to(self.device), labels.to(self.device), use_branch) for ids, labels, use_branch in batches]

    def model(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(self.device)

    def sync(self) -> None:
        """Like torch.cuda.synchronize(): everything queued has completed (before the host reads params)."""
        for s in self.sims:
            s.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _compute_runs(self, module, args) -> None:
        for s in self.sims:
            s.run_compute_waits()

    def host_write(self) -> None:
        """Before a write of the params outside a forward: on a GPU it is queued on the compute stream, after
        what that stream waits for (the simulator runs those waits at each forward)."""
        self._compute_runs(None, None)


_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ALL = [
    pytest.param(("cpu", None), id="cpu"),
    pytest.param(("sim-lazy", dict(executor="lazy", defer_compute_waits=True)), id="sim-lazy"),
    pytest.param(("sim-eager", dict(executor="eager", defer_compute_waits=True)), id="sim-eager"),
    pytest.param(("sim-late", dict(executor="lazy", late_compute=True)), id="sim-late"),
    pytest.param(("cuda", None), id="cuda", marks=_CUDA),
]


def make_mode(param) -> Mode:
    name, sim = param
    return Mode(name, torch.device("cuda" if name == "cuda" else "cpu"), sim)
