"""A checkpoint's ``*.safetensors`` weight files opened for reading, a damaged one refused by name.

safetensors' own errors name no file ("Error while deserializing header: header too small", "incomplete metadata,
file not fully covered", "No such device (os error 19)" for a folder with that name) and its ``SafetensorError`` is
neither a ValueError nor an OSError, so ``hf-zero-offload consolidate`` on a checkpoint whose weights were cut short
or damaged printed a traceback from inside the library (found by an outside probe: an unmarked checkpoint, a stray
``*.safetensors`` file added beside a marked one, or bit rot in the header of a weight file too large to be hashed by
the completion marker). Needs no transformers.
"""
from __future__ import annotations

import contextlib
import os

from .extras import require

require(__name__, "safetensors")  # the [trainer] extra, named if missing
from safetensors import SafetensorError, safe_open  # noqa: E402


class WeightFileError(ValueError):
    """A weight file that cannot be read as safetensors; the message names it and what is wrong."""


@contextlib.contextmanager
def open_weights(path: str, advice: str = "use an earlier checkpoint"):
    """``safe_open(path, framework="pt")``; a file that is not readable safetensors (cut short, damaged header, a
    folder or a link to nothing of that name) is a :class:`WeightFileError` naming ``path``, then ``advice``."""
    if os.path.isdir(path):
        raise WeightFileError(f"{path} is a folder, not a safetensors weight file; {advice}")
    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise WeightFileError(f"{path} cannot be read as safetensors model weights ({_said(e)}): the file is cut "
                              f"short, damaged or not a weight file; {advice}") from None
    with handle as f:
        yield f


def _said(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, SafetensorError) else f"{type(e).__name__}: {text}"
