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
    "QUANT_BLOCK",
    "INT8_CODES",
    "STATE_DTYPES",
    "check_int8_codes",
    "check_state_dtype",
    "adam_step",
    "make_state",
    "state_slice",
    "state_to_fp32",
    "state_from_fp32",
    "quantize_blockwise",
    "dequantize_blockwise",
    "state_dtype_of",
    "check_hyperparameters",
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
    if not isinstance(level, str):
        raise TypeError(f"level must be a str (one of {', '.join(available_simd_levels())}), got {level!r}")
    _C.set_level(level.strip().lower())  # as HF_ZERO_OFFLOAD_SIMD is read


def _threads(num_threads: int | None) -> int:
    if num_threads is None:
        return max(1, torch.get_num_threads())
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or not 1 <= num_threads < 2**31:
        raise ValueError(f"num_threads must be a positive int (< 2**31), got {num_threads!r}")
    return num_threads


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


_HALF_OR_FLOAT = (torch.float32, torch.bfloat16, torch.float16)

#: Elements per scale of the 8-bit moments (csrc/quant.h explains the choice). A range handed to
#: ``adam_step`` with 8-bit moments must start at a multiple of it (``state_slice`` checks that).
QUANT_BLOCK: int = _C.quant_block()
#: How the moments are stored: fp32 (exact torch AdamW), bf16 (stochastic rounding), or int8
#: (blockwise 8-bit codes: int8 exp_avg, uint8 exp_avg_sq, one fp32 absmax per QUANT_BLOCK).
STATE_DTYPES = ("fp32", "bf16", "int8")
#: Version of the int8 code map (csrc/quant.h), saved with int8 states: 2, the codes read off the
#: bits of fp32(n + c); 1, the map before it (a subnormal branch, ties to even), which states saved
#: without a version use and which ``state_to_fp32`` still decodes, so they convert on load.
INT8_CODES = 2
_STATE_CODE = {"fp32": 0, "bf16": 1, "int8": 2}


def _read_only(t):
    """An input a one-off conversion only reads: an odd layout is copied rather than refused."""
    return t.contiguous() if isinstance(t, torch.Tensor) else t


def _num_scales(n: int) -> int:
    return -(-n // QUANT_BLOCK)


def _state_kind(n: int, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale) -> str:
    """Which storage the moments use, from their dtypes; every mismatch is a clear error."""
    _check("exp_avg", exp_avg, (torch.float32, torch.bfloat16, torch.int8), n)
    _check("exp_avg_sq", exp_avg_sq, (torch.float32, torch.bfloat16, torch.uint8), n)
    kind = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}[exp_avg.dtype]
    want_sq = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[kind]
    if exp_avg_sq.dtype != want_sq:
        raise TypeError(f"exp_avg is {str(exp_avg.dtype)[6:]} ({kind} state), so exp_avg_sq must be "
                        f"{str(want_sq)[6:]}; got {str(exp_avg_sq.dtype)[6:]}")
    scales = (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale))
    if kind == "int8":
        for name, t in scales:
            if t is None:
                raise ValueError(f"{name} is required with int8 moments (one fp32 absmax per {QUANT_BLOCK} elements)")
            _check(name, t, (torch.float32,), _num_scales(n), f"one per {QUANT_BLOCK} of its {n} elements")
    else:
        for name, t in scales:
            if t is not None:
                raise ValueError(f"{name} is only for int8 moments; exp_avg is {kind}")
    return kind


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
    arrays (slice with ``state_slice``). In every kind the update runs in fp32 on the decoded
    moments and the param is updated from the new moments before they are rounded for storage.

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
    check_hyperparameters(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    # A negative scale would ascend the gradient. nan passes, as NaN gradients do: the engines'
    # clipping coefficient of a non-finite norm is nan, so the NaNs reach the params as with torch.
    if not (type(grad_scale) is float or (isinstance(grad_scale, numbers.Real) and not isinstance(grad_scale, bool))
            ) or grad_scale < 0.0:
        raise ValueError(f"grad_scale must be a number >= 0, got {grad_scale!r}")
    # The kernel's threads read and write these arrays in chunks: two that share memory (exp_avg
    # passed as exp_avg_sq, a grad overlapping its param) would give thread-order-dependent values.
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in (
        ("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("param_out", param_out),
        ("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)) if t is not None and t.numel())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{a} and {b} share memory: each array adam_step reads or writes must be its own")
    if kind == "int8":
        check_scales(exp_avg_scale, exp_avg_sq_scale)
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


def check_hyperparameters(*, lr, betas, eps, weight_decay) -> None:
    """Adam's hyper-parameters as a step uses them (a param group's values, as they are): lr, eps and
    weight_decay finite and >= 0, two betas in [0, 1); a one-element tensor counts as its value. A
    ValueError names the first bad one. Checked at every step, not only when an optimizer is built:
    an LR scheduler (or an edited param group) that yields nan, inf or a negative value would
    otherwise corrupt every master it reaches."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be two numbers, got {betas!r}") from None
    # plain floats in range (nan fails every comparison) pass at the cost of a few compares: this
    # runs at every kernel call
    if (type(lr) is float and type(eps) is float and type(weight_decay) is float and type(beta1) is float
            and type(beta2) is float and 0.0 <= lr < math.inf and 0.0 <= eps < math.inf
            and 0.0 <= weight_decay < math.inf and 0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        return
    for name, v, top in (("lr", lr, math.inf), ("eps", eps, math.inf), ("weight_decay", weight_decay, math.inf),
                         ("beta1", beta1, 1.0), ("beta2", beta2, 1.0)):
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= v < top:
            want = "a finite number >= 0" if top == math.inf else "in [0, 1)"
            raise ValueError(f"{name} must be {want}, got {v!r}")


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


# ---------------------------------------------------------------------------------------------
# Compact moments: creation, block-aligned slices, conversions (checkpoints, state_dict)
# ---------------------------------------------------------------------------------------------

_MOMENTS = ("exp_avg", "exp_avg_sq")


def check_scales(exp_avg_scale: torch.Tensor, exp_avg_sq_scale: torch.Tensor) -> None:
    """int8 scales are their blocks' absmax: >= 0 (NaN or inf after a non-finite step). A negative
    one was not written by this kernel; the vector kernels rely on it (they skip |v| for
    exp_avg_sq, which the kernel only ever computes >= 0), so it is refused before any write."""
    for name, t in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
        if bool((t < 0).any()):
            raise ValueError(f"{name} has negative entries: a scale is its block's absmax (>= 0), so this "
                             "int8 state was not written by hf_zero_offload (or is damaged)")


def check_state_dtype(state_dtype: str) -> None:
    """The one check of a moment storage name (CPUAdam, the engine, the planner)."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}; got {state_dtype!r}")


def make_state(numel: int, state_dtype: str = "fp32") -> dict[str, torch.Tensor]:
    """Zero moments for ``numel`` params: ``exp_avg``, ``exp_avg_sq`` (and, for int8, their scales),
    the keyword arguments ``adam_step`` takes."""
    check_state_dtype(state_dtype)
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    if state_dtype == "int8":
        ns = _num_scales(numel)
        return {"exp_avg": torch.zeros(numel, dtype=torch.int8), "exp_avg_sq": torch.zeros(numel, dtype=torch.uint8),
                "exp_avg_scale": torch.zeros(ns), "exp_avg_sq_scale": torch.zeros(ns)}
    dt = torch.float32 if state_dtype == "fp32" else torch.bfloat16
    return {"exp_avg": torch.zeros(numel, dtype=dt), "exp_avg_sq": torch.zeros(numel, dtype=dt)}


def state_dtype_of(state: dict[str, torch.Tensor], numel: int | None = None) -> str:
    """"fp32", "bf16" or "int8", from the tensors of a state made by ``make_state``; every mismatch
    (a missing moment, dtypes that do not pair, ``numel`` elements expected: default exp_avg's) is
    an error naming the tensor."""
    for name in _MOMENTS:
        if not isinstance(state.get(name), torch.Tensor):
            raise ValueError(f"{name} is missing (a state holds exp_avg and exp_avg_sq, int8 also their scales)")
    n = state["exp_avg"].numel() if numel is None else numel
    return _state_kind(n, state["exp_avg"], state["exp_avg_sq"], state.get("exp_avg_scale"),
                       state.get("exp_avg_sq_scale"))


def state_slice(state: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """Views of elements [start, end) of a flat state. For int8, ``start`` must be a multiple of
    QUANT_BLOCK and ``end`` one too or the end of the arrays (a block never straddles two calls)."""
    n = state["exp_avg"].numel()
    if not 0 <= start <= end <= n:
        raise ValueError(f"state_slice: [{start}, {end}) is outside [0, {n})")
    out = {k: state[k][start:end] for k in _MOMENTS}
    if "exp_avg_scale" in state:
        if start % QUANT_BLOCK or (end % QUANT_BLOCK and end != n):
            raise ValueError(f"state_slice: int8 moments are sliced at multiples of QUANT_BLOCK={QUANT_BLOCK} "
                             f"(or the end, {n}); got [{start}, {end})")
        sb, se = start // QUANT_BLOCK, _num_scales(end)
        out["exp_avg_scale"] = state["exp_avg_scale"][sb:se]
        out["exp_avg_sq_scale"] = state["exp_avg_sq_scale"][sb:se]
    return out


def quantize_blockwise(x: torch.Tensor, moment: str, *, step: int | None = None, round_index: int = 0,
                       num_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` -> (codes, scales) exactly as the int8 kernel stores them. ``moment``:
    "exp_avg" (int8 signed code, to nearest) or "exp_avg_sq" (uint8 code of |x|): to nearest without
    ``step`` (a one-off conversion), else stochastically rounded as the kernel's step ``step``
    stores it, element i keyed by ``round_index + i``."""
    if moment not in _MOMENTS:
        raise ValueError(f"moment must be 'exp_avg' or 'exp_avg_sq'; got {moment!r}")
    x = _read_only(x)
    _check("x", x, (torch.float32,))
    sq = moment == "exp_avg_sq"
    if step is not None and step < 1:
        raise ValueError(f"step must be >= 1 (the 1-based step count); got {step}")
    codes = torch.empty(x.numel(), dtype=torch.uint8 if sq else torch.int8)
    scales = torch.empty(_num_scales(x.numel()))
    if x.numel():
        _C.quantize(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), sq, x.numel(), _threads(num_threads),
                    int(step or 0), int(round_index) % 2**64)
    return codes, scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, *, num_threads: int | None = None
                         ) -> torch.Tensor:
    """(codes, scales) -> fp32, the values the int8 kernel decodes (int8: exp_avg, uint8: exp_avg_sq)."""
    codes, scales = _read_only(codes), _read_only(scales)
    _check("codes", codes, (torch.int8, torch.uint8))
    _check("scales", scales, (torch.float32,), _num_scales(codes.numel()),
           f"one per {QUANT_BLOCK} of its {codes.numel()} codes")
    out = torch.empty(codes.numel())
    if codes.numel():
        _C.dequantize(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), codes.dtype == torch.uint8,
                      codes.numel(), _threads(num_threads))
    return out


def state_to_fp32(state: dict[str, torch.Tensor], int8_codes: int = INT8_CODES) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) as new fp32 tensors, from any state dtype; int8 codes of map
    ``int8_codes`` (``INT8_CODES``, or 1 for states saved before it)."""
    if state_dtype_of(state) != "int8":
        return state["exp_avg"].float().clone(), state["exp_avg_sq"].float().clone()
    if int8_codes == INT8_CODES:
        return (dequantize_blockwise(state["exp_avg"], state["exp_avg_scale"]),
                dequantize_blockwise(state["exp_avg_sq"], state["exp_avg_sq_scale"]))
    check_int8_codes(int8_codes)
    return (_legacy_q8_values(state["exp_avg"], 15, state["exp_avg_scale"]),
            _legacy_q8_values(state["exp_avg_sq"], 31, state["exp_avg_sq_scale"]))


def check_int8_codes(int8_codes) -> None:
    """The code map of saved int8 moments must be one this version decodes (1 or ``INT8_CODES``);
    loaders call this before they write anything."""
    if not (type(int8_codes) is int and int8_codes in (1, INT8_CODES)):
        raise ValueError(f"int8 moments with code map {int8_codes!r}: this version reads maps 1 and {INT8_CODES} "
                         "(a newer hf_zero_offload wrote them?)")


def _legacy_q8_values(codes: torch.Tensor, bias: int, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of code map 1 (exponent bias 15: exp_avg, 31: exp_avg_sq): magnitude m < 8 is
    m * 2^(-2 - bias), else 2^((m >> 3) - bias) * (1 + (m & 7) / 8) (exact in fp32), times the
    block's scale in fp32, as its kernel decoded them."""
    c = codes.reshape(-1).to(torch.int32)
    mag = c.abs()
    normal = torch.ldexp(1 + (mag & 7).double() / 8, (mag >> 3) - bias)
    value = torch.where(mag < 8, torch.ldexp(mag.double(), torch.tensor(-2 - bias)), normal).float()
    return torch.where(c < 0, -value, value) * scales.repeat_interleave(QUANT_BLOCK)[:c.numel()]


def state_from_fp32(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, state_dtype: str, *, step: int | None = None,
                    round_index: int = 0) -> dict[str, torch.Tensor]:
    """A new state of ``state_dtype`` from fp32 moments. bf16: round to nearest even, a one-off
    conversion (e.g. of a checkpoint) where the kernel's per-step stochastic rounding has no drift to
    undo; int8 likewise, unless ``step`` is given: then exp_avg_sq is rounded as that step of the
    kernel rounds it (``quantize_blockwise``), for a block the engine updates outside the kernel."""
    check_state_dtype(state_dtype)
    exp_avg, exp_avg_sq = _read_only(exp_avg), _read_only(exp_avg_sq)
    _check("exp_avg", exp_avg, (torch.float32,))
    _check("exp_avg_sq", exp_avg_sq, (torch.float32,), exp_avg.numel())
    if state_dtype == "fp32":
        return {"exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    if state_dtype == "bf16":
        return {"exp_avg": exp_avg.to(torch.bfloat16), "exp_avg_sq": exp_avg_sq.to(torch.bfloat16)}
    m, ms = quantize_blockwise(exp_avg, "exp_avg")
    v, vs = quantize_blockwise(exp_avg_sq, "exp_avg_sq", step=step, round_index=round_index)
    return {"exp_avg": m, "exp_avg_sq": v, "exp_avg_scale": ms, "exp_avg_sq_scale": vs}
