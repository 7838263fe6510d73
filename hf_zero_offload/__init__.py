"""ZeRO-Offload and ZeRO-1/2 sharding for the Hugging Face Trainer.

``import hf_zero_offload`` loads only torch and the compiled kernels; the Trainer classes (which
import transformers) load on first access.
"""
from __future__ import annotations

import importlib.machinery as _machinery
import importlib.util as _util
import pkgutil as _pkgutil
import os as _os
import sys as _sys


def _kernels_error(e: ImportError) -> ImportError:
    """Why ``_C`` did not import, from what lies beside this file: not built (a source tree), built for another
    Python, or built but not loadable here (a wheel built on a newer system: every case was "not built")."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    cause = f"[{type(e).__name__}: {e}]"
    built = sorted(f for f in _os.listdir(here) if f.startswith("_C.") and f.endswith((".so", ".pyd")))
    ours = [_os.path.join(here, f) for f in built if f[len("_C"):] in _machinery.EXTENSION_SUFFIXES]
    try:  # an editable install (make install) keeps _C in site-packages, found by scikit-build-core's import hook
        spec = _util.find_spec(f"{__name__}._C")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and _os.path.isfile(spec.origin):
        ours = [spec.origin]  # (the file the import tried: "not built" said the source tree lacked it)
    if ours:
        newer = any(w in str(e) for w in ("GLIBC", "CXXABI"))  # "version `GLIBCXX_3.4.30' not found"
        return ImportError(
            f"hf_zero_offload's compiled kernels ({ours[0]}) do not load on this machine"
            + (": they were built on a system with a newer C/C++ runtime (glibc, libstdc++) than this one; install "
               "hf_zero_offload here from its sdist or checkout, which compiles them for this machine" if newer else "")
            + f" {cause}")
    if built:
        return ImportError(
            f"hf_zero_offload's compiled kernels in {here} ({', '.join(built)}) were built for another Python, not "
            f"this one ({_sys.version.split()[0]}, which loads {_machinery.EXTENSION_SUFFIXES[0]}): reinstall "
            f"hf_zero_offload with this Python {cause}")
    # (said "partially initialized module ... (most likely due to a circular import)")
    return ImportError(
        f"hf_zero_offload's compiled kernels (_C) are not built in {here}: build them there (make install, or pip "
        "install -e . in that checkout); when hf_zero_offload is also installed elsewhere, this source tree hides it "
        f"(it comes first on sys.path: run from another directory) {cause}")


try:
    from . import _C  # noqa: F401 (the compiled kernels; the typed wrapper is ops)
except ImportError as _e:
    raise _kernels_error(_e) from None

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

# a loop of one's own: the engines and adapt_accelerator here too (``from hf_zero_offload import OffloadAdam`` was an
# AttributeError; their modules stay the documented paths), imported on first access like the Trainer's names
_LOOP_NAMES = {"OffloadAdam": "engine", "OffloadOptions": "engine", "ShardedAdam": "engine", "ShardOptions": "engine",
               "adapt_accelerator": "accelerator_patch"}

# ``from hf_zero_offload import *`` without transformers (no [trainer] extra) gives the engines' names alone
__all__ = ["ops", "CPUAdam", "__version__", *_LOOP_NAMES,
           *(sorted(_TRAINER_NAMES) if _util.find_spec("transformers") is not None else [])]


def _import(module: str, wanted: str):
    from .extras import import_named  # (any optional dependency missing named: safetensors for consolidate too)

    return import_named(f"{__name__}.{module}", f"hf_zero_offload.{wanted}")


def __dir__() -> list[str]:
    # the names imported on first access too (dir() and a shell's completion listed neither the engines nor the
    # Trainer's classes, which ``from hf_zero_offload import X`` gives)
    return sorted({*globals(), *__all__})


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        return getattr(_import("trainer", name), name)
    if name in _LOOP_NAMES:
        return getattr(_import(_LOOP_NAMES[name], name), name)
    # a submodule used as an attribute after ``import hf_zero_offload`` alone (the README's
    # ``hf_zero_offload.torch_state.torch_optimizer_state(DIR)`` was an AttributeError), imported on first access;
    # only the package's own modules and subpackages (not a folder of data files, a namespace package to Python)
    if name.isidentifier() and not name.startswith("_") and name in {m.name for m in _pkgutil.iter_modules(__path__)}:
        return _import(name, name)
    raise AttributeError(f"module 'hf_zero_offload' has no attribute {name!r}")
