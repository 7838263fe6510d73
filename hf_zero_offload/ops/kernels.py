"""The kernel calls: the fused Adam step (any moment storage), the gradient norm and the gradient
accumulation, each argument checked here so that a bad tensor raises naming the argument."""
from __future__ import annotations

import math
import numbers

import torch

from .. import _C
from ._args import _DTYPE_CODE, _HALF_OR_FLOAT, _check, _threads
from .hparams import FLT_MAX as _FLT_MAX, check_hyperparameters
from .moments import _STATE_CODE, _state_kind, check_blocks



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
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    round_index: int = 0,
    compact_math: bool = False,
) -> None:
    """One fused Adam/AdamW update, in place, with the math of ``torch.optim.AdamW``/``Adam``.

    ``param``: fp32 master. ``grad``: fp32, bf16 or fp16, multiplied by ``grad_scale`` in-register.
    ``param_out`` (optional, fp32/bf16/fp16): receives the updated param, rounded to nearest even,
    in the same pass. ``step`` is the 1-based count after this update.

    The moments' dtypes choose their storage (``STATE_DTYPES``): fp32/fp32; bf16/bf16; or int8
    ``exp_avg`` + uint8 ``exp_avg_sq`` codes with fp32 ``exp_avg_scale``/``exp_avg_sq_scale`` of
    ``ceil(numel / QUANT_BLOCK)`` entries, the range starting on a block boundary of the full
    arrays, with the scales of the blocks it covers (slice with ``state_slice``): codes decoded with
    another block's scale step from wrong moments. Refused when the arrays' storages tell (each holds
    one state array, as ``make_state`` makes them: ``check_blocks``); in arrays carved out of one
    buffer (the engine's arena) it is the caller's to keep. The codes' range is not checked here (a
    pass over them at every step): loads check it (``check_code_range``). In every kind the update
    runs in fp32 on the decoded moments and the param is updated from the new moments before they
    are rounded for storage.

    bf16 moments are stored with stochastic rounding; element i's random bits are a hash of
    (``step``, ``round_index + i``), so give each element of a larger state the same index at every
    call (its offset in that state) and the result does not depend on how the state is cut into
    calls or threads. Compact moments (bf16, int8) form the denominator as sqrt(v) times
    1/sqrt(1 - beta2^step) plus eps (one fma, within 1 ulp of torch's sqrt(v)/sqrt(...) + eps).
    ``compact_math=True`` gives fp32 moments that math too (an int8 block decoded to fp32 because
    two kernel calls share it is then updated like the rest of its call; the scalar kernel runs it).
    """
    _check("param", param, (torch.float32,))
    n = param.numel()
    _check("grad", grad, _HALF_OR_FLOAT, n, written=False)
    kind = _state_kind(n, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale)
    if param_out is not None:
        _check("param_out", param_out, _HALF_OR_FLOAT, n)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int (1-based count after this update), got {type(step).__name__}")
    step = int(step)
    if not 1 <= step < 2**63:
        raise ValueError(f"step must be in [1, 2**63) (the 1-based count after this update), got {step}")
    check_hyperparameters(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, adamw=adamw, step=step)
    # A negative scale would ascend the gradient. nan passes, as NaN gradients do: the engines'
    # clipping coefficient of a non-finite norm is nan, so the NaNs reach the params as with torch.
    if not (type(grad_scale) is float or (isinstance(grad_scale, numbers.Real) and not isinstance(grad_scale, bool))
            ) or grad_scale < 0.0:
        raise ValueError(f"grad_scale must be a number >= 0, got {grad_scale!r}")
    if grad_scale > _FLT_MAX:  # the kernel's float: 1e39 (1 / a static loss scale of 1e-39) became inf there, and a
        # zero gradient times inf NaN in every param, silently; inf itself is no scale the engines ever pass
        raise ValueError(f"grad_scale must be finite in fp32 (at most {_FLT_MAX:g}), got {grad_scale!r}")
    check_separate(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, param_out=param_out,
                   exp_avg_scale=exp_avg_scale, exp_avg_sq_scale=exp_avg_sq_scale)
    if kind == "int8":
        check_blocks(exp_avg=(exp_avg, exp_avg_scale), exp_avg_sq=(exp_avg_sq, exp_avg_sq_scale))
    if compact_math and kind != "fp32":
        raise ValueError(f"compact_math is for fp32 moments (bf16/int8 moments always use it); got {kind}")
    if n == 0:
        return
    _C.adam_step(
        param.data_ptr(), grad.data_ptr(), _DTYPE_CODE[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        _STATE_CODE[kind], 0 if exp_avg_scale is None else exp_avg_scale.data_ptr(),
        0 if exp_avg_sq_scale is None else exp_avg_sq_scale.data_ptr(),
        0 if param_out is None else param_out.data_ptr(), 0 if param_out is None else _DTYPE_CODE[param_out.dtype],
        n, step, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw),
        float(grad_scale), int(round_index) % 2**64, bool(compact_math),
        _threads(num_threads),
    )


def check_separate(**arrays) -> None:
    """No two of ``arrays`` (None: absent) share memory. The kernel's threads read and write its arrays in
    chunks: two that share memory (exp_avg passed as exp_avg_sq, a grad overlapping its param) would give
    thread-order-dependent values. A strided tensor counts for the bytes from its first to its last element."""
    spans = sorted((t.data_ptr(), t.data_ptr() + _extent(t), name) for name, t in arrays.items()
                   if t is not None and t.numel())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{a} and {b} share memory: each array adam_step reads or writes must be its own")


def _extent(t: torch.Tensor) -> int:
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


def stream_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                     num_threads: int | None = None) -> None:
    """Benchmark yardstick, not an optimizer: fp32 Adam's memory traffic (read 4 arrays, write 3)
    with trivial arithmetic and the kernels' thread split; its time is the streaming bound."""
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check(name, t, (torch.float32,), param.numel())
    _C.stream_ref(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), param.numel(),
                  _threads(num_threads))


def grad_norm_sq(grad: torch.Tensor, *, num_threads: int | None = None) -> float:
    """Sum of squares of ``grad`` (fp32/bf16/fp16), accumulated in fp64; inf/nan if any element is."""
    _check("grad", grad, _HALF_OR_FLOAT, written=False)
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
    _check("grad", grad, _HALF_OR_FLOAT, acc.numel(), written=False)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a number, got {scale!r}")
    if acc.numel() == 0:
        return
    _C.accumulate(acc.data_ptr(), grad.data_ptr(), _DTYPE_CODE[grad.dtype], float(scale), bool(overwrite),
                  acc.numel(), _threads(num_threads))
