"""The optional dependencies (pyproject's extras) and the command that adds a missing one to this installation.

``pip install hf_zero_offload`` (a wheel, an sdist or a checkout) brings torch, numpy and psutil: the engines and
``CPUAdam``. The Trainer classes, ``hf-zero-offload estimate`` and ``consolidate`` need the ``[trainer]`` extra. An
import of them without it said "No module named 'transformers'" (``import hf_zero_offload.trainer``,
``hf_zero_offload.consolidate``), or named ``'<the checkout>[trainer]'`` and the checkout's ``.venv``, which a user
of a wheel does not have. Every such message is written here, once.
"""
from __future__ import annotations

import importlib
import os
from importlib import metadata

DIST = "hf_zero_offload"
# top-level module -> the extra of pyproject.toml that installs it
EXTRA_OF = {"transformers": "trainer", "accelerate": "trainer", "safetensors": "trainer", "sentencepiece": "examples",
            "sacrebleu": "examples", "matplotlib": "examples", "google": "examples"}


def extra_of(exc: BaseException) -> str | None:
    """The extra that installs the module a ``ModuleNotFoundError`` names (None: not an optional dependency)."""
    if not isinstance(exc, ModuleNotFoundError):
        return None
    return EXTRA_OF.get((exc.name or "").split(".")[0])


def install_command(extra: str) -> str:
    """pip's command adding ``extra``'s packages to the hf_zero_offload this Python has."""
    try:
        metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        # a source tree on sys.path that pip never installed: its name is on no index, so name the tree
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return f"pip install '{root}[{extra}]'"
    # installed (wheel, sdist, checkout, editable): pip keeps that hf_zero_offload and adds what the extra lists
    return f"pip install '{DIST}[{extra}]'"


def hint(extra: str) -> str:
    """What to add after "No module named 'X'"."""
    return f"an optional dependency of hf_zero_offload; install it with the [{extra}] extra ({install_command(extra)})"


def missing(exc: ModuleNotFoundError, what: str) -> ModuleNotFoundError:
    """``exc`` (an optional dependency missing) as one line naming ``what`` needs it and the command installing it;
    ``exc`` itself where the missing module is none of the extras' (a broken install: its own message)."""
    extra = extra_of(exc)
    if extra is None:
        return exc
    module = (exc.name or "").split(".")[0]
    return ModuleNotFoundError(f"{what} needs {module}, {hint(extra)}", name=exc.name)


def import_named(module: str, what: str):
    """``module`` imported; where an extra's package is missing, itself or one it imports, :func:`missing`'s error
    naming ``what`` needs it (another extra's package missing under this one's import is named too: accelerate
    importing an absent safetensors said only "No module named 'safetensors'"); any other module missing: its own."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        error = missing(e, what)
        if error is e:
            raise
        raise error from None


def require(what: str, *modules: str) -> None:
    """Import ``modules`` (top-level names of the extras' packages), or raise :func:`missing`'s error for the first
    extra's package absent: a module needing them calls this before its own imports."""
    for module in modules:
        import_named(module, what)
