"""Which instruction set the kernels run: chosen at import by the CPU's features, overridden by the
HF_ZERO_OFFLOAD_SIMD environment variable or ``set_simd_level`` (tests, benchmarks)."""
from __future__ import annotations

import os

from .. import _C

_ENV_SIMD = "HF_ZERO_OFFLOAD_SIMD"
# A bad HF_ZERO_OFFLOAD_SIMD, raised by simd_level() and by every kernel call rather than at import: a
# command that runs no kernel (hf-zero-offload configs, a config check) still works, and one that does
# reports one line through its usual error reporting instead of a traceback from an import; no kernel
# ever runs at a level other than the one asked for.
_env_error: ValueError | None = None


def _set(level: str) -> None:
    if "\0" in level:  # the C++ message would end at it
        raise ValueError(f"unknown SIMD level {level!r} (expected one of {', '.join(available_simd_levels())})")
    _C.set_level(level)


def _apply_env_override() -> None:
    global _env_error
    level = os.environ.get(_ENV_SIMD)
    if not level:
        return
    try:
        _set(level.strip().lower())
    except ValueError as exc:
        _env_error = ValueError(f"{_ENV_SIMD}={level!r}: {exc}")


_apply_env_override()


def check_env_level() -> None:
    """Raise the error of a bad HF_ZERO_OFFLOAD_SIMD (until ``set_simd_level`` chooses a level)."""
    if _env_error is not None:
        raise _env_error


def simd_level() -> str:
    """The instruction set the kernels use now: "avx512_bf16", "avx512", "avx2" or "scalar"."""
    check_env_level()
    return _C.current_level()


def available_simd_levels() -> list[str]:
    """Every instruction set this CPU (and OS) supports, "scalar" first."""
    return list(_C.available_levels())


def set_simd_level(level: str) -> None:
    """Force an instruction set (tests and benchmarks). Raises ValueError if the CPU lacks it."""
    if not isinstance(level, str):
        raise TypeError(f"level must be a str (one of {', '.join(available_simd_levels())}), got {level!r}")
    global _env_error
    _set(level.strip().lower())  # as HF_ZERO_OFFLOAD_SIMD is read
    _env_error = None  # a level chosen in code replaces a bad one from the environment
