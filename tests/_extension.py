"""Load another build of the compiled module as ``hf_zero_offload._C`` before anything imports
hf_zero_offload (which then finds it in sys.modules): the emulated-AVX512 build of
tests/test_avx512_emulated.py, through HZO_TEST_EXTENSION in tests/conftest.py."""
from __future__ import annotations

import importlib.util
import sys


def load_extension(path: str) -> None:
    spec = importlib.util.spec_from_file_location("hf_zero_offload._C", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"HZO_TEST_EXTENSION={path!r} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["hf_zero_offload._C"] = module
