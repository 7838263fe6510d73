"""ZeRO-Offload and ZeRO-1/2 sharding for the Hugging Face Trainer.

``import hf_zero_offload`` loads only torch and the compiled kernels; the Trainer classes (which
import transformers) load on first access.
"""
from __future__ import annotations

import importlib as _importlib
import importlib.util as _util
import pkgutil as _pkgutil
import os as _os

try:
    from . import _C  # noqa: F401 (the compiled kernels; the typed wrapper is ops)
except ImportError as _e:  # said "partially initialized module ... (most likely due to a circular import)"
    _here = _os.path.dirname(_os.path.abspath(__file__))
    raise ImportError(
        f"hf_zero_offload's compiled kernels (_C) are not built in {_here}: build them there (make install, or pip "
        "install -e . in that checkout); when hf_zero_offload is also installed elsewhere, this source tree hides it "
        f"(it comes first on sys.path: run from another directory) [{type(_e).__name__}: {_e}]") from None

from . import ops  # noqa: E402
from .adam.cpu_adam import CPUAdam  # noqa: E402

__version__ = "0.1.0"

_TRAINER_NAMES = {
    "ZeroOffloadTrainingArguments",
    "ZeroOffloadSeq2SeqTrainingArguments",
    "ZeroOffloadTrainer",
    "ZeroOffloadSeq2SeqTrainer",
    "ZeroOffloadCallback",
    "ZeroOffloadMixin",
}

# ``from hf_zero_offload import *`` without transformers (no [trainer] extra) gives the engines' names alone
__all__ = ["ops", "CPUAdam", "__version__",
           *(sorted(_TRAINER_NAMES) if _util.find_spec("transformers") is not None else [])]


def _import(module: str, wanted: str):
    try:
        return _importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as e:
        from .extras import missing  # (any optional dependency: safetensors for consolidate too)

        error = missing(e, f"hf_zero_offload.{wanted}")
        if error is e:
            raise
        raise error from None


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        return getattr(_import("trainer", name), name)
    # a submodule used as an attribute after ``import hf_zero_offload`` alone (the README's
    # ``hf_zero_offload.torch_state.torch_optimizer_state(DIR)`` was an AttributeError), imported on first access;
    # only the package's own modules and subpackages (not a folder of data files, a namespace package to Python)
    if name.isidentifier() and not name.startswith("_") and name in {m.name for m in _pkgutil.iter_modules(__path__)}:
        return _import(name, name)
    raise AttributeError(f"module 'hf_zero_offload' has no attribute {name!r}")
