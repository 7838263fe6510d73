"""Typed wrapper over the compiled kernels (``hf_zero_offload._C``).

Every argument is checked here before a raw address crosses into C++: dtype, device, contiguity,
sizes. A bad tensor raises ``TypeError``/``ValueError`` naming the argument; nothing is ever copied
silently (a hidden copy would make an in-place update disappear).
"""
from __future__ import annotations

import math
import numbers
import os

import torch

from . import _C

__all__ = [
    "adam_step",
    "grad_norm_sq_and_finite",
    "accumulate_grad",
    "simd_level",
    "available_simd_levels",
    "set_simd_level",
]

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
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
    _C.set_level(level)


def _threads(num_threads: int | None) -> int:
    if num_threads is None:
        return max(1, torch.get_num_threads())
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
    return num_threads


def _check(name: str, t, dtypes: tuple[torch.dtype, ...], numel: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got a tensor on {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a copy would lose the in-place update)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} (the size of param)")


_HALF_OR_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = True,
    grad_scale: float = 1.0,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """One fused Adam/AdamW update, in place, with the math of ``torch.optim.AdamW``/``Adam``.

    ``param``, ``exp_avg``, ``exp_avg_sq``: fp32. ``grad``: fp32, bf16 or fp16, multiplied by
    ``grad_scale`` in-register. ``param_out`` (optional, fp32/bf16/fp16): receives the updated param,
    rounded to nearest even, in the same pass. ``step`` is the 1-based count after this update.
    """
    _check("param", param, (torch.float32,))
    n = param.numel()
    _check("grad", grad, _HALF_OR_FLOAT, n)
    _check("exp_avg", exp_avg, (torch.float32,), n)
    _check("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    if param_out is not None:
        _check("param_out", param_out, _HALF_OR_FLOAT, n)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int (1-based count after this update), got {type(step).__name__}")
    step = int(step)
    if step < 1:
        raise ValueError(f"step must be >= 1 (the 1-based count after this update), got {step}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    if n == 0:
        return
    _C.adam_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODE[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if param_out is None else param_out.data_ptr(), 0 if param_out is None else _DTYPE_CODE[param_out.dtype],
        n, step, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw),
        float(grad_scale), _threads(num_threads),
    )


def grad_norm_sq(grad: torch.Tensor, *, num_threads: int | None = None) -> float:
    """Sum of squares of ``grad`` (fp32/bf16/fp16), accumulated in fp64; inf/nan if any element is."""
    _check("grad", grad, _HALF_OR_FLOAT)
    if grad.numel() == 0:
        return 0.0
    return _C.norm_sq(grad.data_ptr(), _DTYPE_CODE[grad.dtype], grad.numel(), _threads(num_threads))


def grad_norm_sq_and_finite(grad: torch.Tensor, *, num_threads: int | None = None) -> tuple[float, bool]:
    """One pass over ``grad``: (sum of squares in fp64, whether every element is finite).

    A finite fp32 value squared is at most ~1.2e77, so an fp64 sum over any real array stays finite
    unless an element is inf or nan: the sum's finiteness is the overflow flag.
    """
    total = grad_norm_sq(grad, num_threads=num_threads)
    return total, math.isfinite(total)


def accumulate_grad(
    acc: torch.Tensor, grad: torch.Tensor, *, scale: float = 1.0, overwrite: bool = False,
    num_threads: int | None = None,
) -> None:
    """``acc = (0 if overwrite else acc) + grad * scale`` with ``acc`` fp32 and ``grad`` fp32/bf16/fp16."""
    _check("acc", acc, (torch.float32,))
    _check("grad", grad, _HALF_OR_FLOAT, acc.numel())
    if acc.numel() == 0:
        return
    _C.accumulate(acc.data_ptr(), grad.data_ptr(), _DTYPE_CODE[grad.dtype], float(scale), bool(overwrite),
                  acc.numel(), _threads(num_threads))
