"""Accelerate keeps its state in process-wide singletons: each test of a module that imports this fixture builds its
Accelerator anew."""
from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
