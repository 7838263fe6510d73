"""Fixtures shared by the test files (their helpers stay in the ``_*.py`` modules)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

# Another build of the compiled module, loaded before anything imports hf_zero_offload (which then
# finds it in sys.modules): tests/test_avx512_emulated.py runs the kernel tests against a build whose
# AVX512 unit runs on AVX2. Unset in every normal run.
_EXTENSION = os.environ.get("HZO_TEST_EXTENSION")
if _EXTENSION:
    _spec = importlib.util.spec_from_file_location("hf_zero_offload._C", _EXTENSION)
    if _spec is None or _spec.loader is None:
        raise RuntimeError(f"HZO_TEST_EXTENSION={_EXTENSION!r} is not a loadable extension module")
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    sys.modules["hf_zero_offload._C"] = _module

from _kernels import LEVELS
from _modes import ALL, make_mode
from hf_zero_offload import ops


@pytest.fixture(autouse=True)
def restore_simd():
    """A test that selects a SIMD level gets the previous one back afterwards."""
    before = ops.simd_level()
    yield
    ops.set_simd_level(before)


@pytest.fixture(params=LEVELS)
def simd(request):
    ops.set_simd_level(request.param)
    assert ops.simd_level() == request.param
    return request.param


@pytest.fixture(params=ALL)
def mode(request):
    """Yields a Mode; in simulator modes a global forward pre-hook lets the compute stream run."""
    mode = make_mode(request.param)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(mode._compute_runs)
    before = torch.are_deterministic_algorithms_enabled()
    if mode.device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)  # bit-exact comparisons between GPU runs
    yield mode
    torch.use_deterministic_algorithms(before)
    handle.remove()
