"""The checks every wrapper runs before a raw address crosses into C++ (dtype, device, contiguity,
size), and the codes the kernels take for dtypes and thread counts."""
from __future__ import annotations

import torch

from .simd import check_env_level

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_HALF_OR_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def check_num_threads(num_threads: int | None) -> None:
    """A kernel call's ``num_threads``: None (torch's thread count) or an int in [1, 2**31). Public for
    optimizers that take it at construction (CPUAdam), so a bad one is refused before the first step."""
    check_env_level()
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or not 1 <= num_threads < 2**31):
        raise ValueError(f"num_threads must be a positive int (< 2**31), got {num_threads!r}")


def _threads(num_threads: int | None) -> int:
    """The thread count of a kernel call; every kernel call passes here, so it also refuses to run one
    under a bad HF_ZERO_OFFLOAD_SIMD."""
    check_num_threads(num_threads)
    return max(1, torch.get_num_threads()) if num_threads is None else num_threads


def _check(name: str, t, dtypes: tuple[torch.dtype, ...], numel: int | None = None,
           what: str = "the size of param", written: bool = True) -> None:
    """``written``: the kernel writes ``t`` in place (so a contiguous copy of it would lose the
    update); else it only reads it, as one flat array."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got a tensor on {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).replace('torch.', '')}")
    if not t.is_contiguous():
        why = "a copy would lose the in-place update" if written else "read as one flat array: pass .contiguous()"
        raise ValueError(f"{name} must be contiguous ({why})")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} ({what})")


def _read_only(t):
    """An input a one-off conversion only reads: an odd layout is copied rather than refused."""
    return t.contiguous() if isinstance(t, torch.Tensor) else t
