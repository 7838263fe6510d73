"""Fixtures shared by the test files (their helpers stay in the ``_*.py`` modules)."""
from __future__ import annotations

import os
import signal

import pytest

# torch's OpenMP workers (libgomp) spin ~300000 iterations after each parallel op by default, on the cores that the
# engine's step threads and DPU worker need next: on 2 cores tests/test_trainer.py took 160 s of CPU with libgomp's
# default and 40 s with the value the example script sets for users (docs/LIMITATIONS.md). libgomp reads it once, when
# torch loads it, so before the import; children inherit it. It changes how long idle threads wait, not results.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import torch  # noqa: E402

from _extension import load_extension

# tests/test_avx512_emulated.py runs the kernel tests against a build whose AVX512 unit runs on AVX2,
# loaded here before anything imports hf_zero_offload. Unset in every normal run.
if os.environ.get("HZO_TEST_EXTENSION"):
    load_extension(os.environ["HZO_TEST_EXTENSION"])

from _kernels import LEVELS
from _modes import ALL, make_mode
from hf_zero_offload import ops
from hf_zero_offload.config import resolver


@pytest.fixture(autouse=True, scope="session")
def sigint_delivered():
    """The Ctrl-C tests need SIGINT to reach Python: a suite started in the background (``make test &``, nohup) has
    it ignored, which Python then leaves ignored, and so do the example scripts the tests run as children (an
    ignored signal stays ignored across exec). Python's own handler for the session; children get the default."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(autouse=True)
def config_warnings_anew():
    """The config's warnings are said once per process (a Trainer resolves it several times): anew for each test."""
    resolver.reset_warnings()


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
