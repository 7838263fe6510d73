"""Which instruction set the kernels run: chosen at import by the CPU's features, overridden by the
HF_ZERO_OFFLOAD_SIMD environment variable or ``set_simd_level`` (tests, benchmarks)."""
from __future__ import annotations

import os

from .. import _C

_ENV_SIMD = "HF_ZERO_OFFLOAD_SIMD"


def _apply_env_override() -> None:
    level = os.environ.get(_ENV_SIMD)
    if not level:
        return
    try:
        _C.set_level(level.strip().lower())
    except ValueError as exc:
        raise RuntimeError(f"{_ENV_SIMD}={level!r}: {exc}") from None


_apply_env_override()


def simd_level() -> str:
    """The instruction set the kernels use now: "avx512", "avx2" or "scalar"."""
    return _C.current_level()


def available_simd_levels() -> list[str]:
    """Every instruction set this CPU (and OS) supports, "scalar" first."""
    return list(_C.available_levels())


def set_simd_level(level: str) -> None:
    """Force an instruction set (tests and benchmarks). Raises ValueError if the CPU lacks it."""
    if not isinstance(level, str):
        raise TypeError(f"level must be a str (one of {', '.join(available_simd_levels())}), got {level!r}")
    _C.set_level(level.strip().lower())  # as HF_ZERO_OFFLOAD_SIMD is read
