"""Moment storage: fp32, bf16 or blockwise int8 (csrc/quant.h). Creation, block-aligned slices and
the conversions checkpoints and state dicts use, each checked before the compiled module runs."""
from __future__ import annotations

import numbers

import torch

from .. import _C
from ._args import _check, _read_only, _threads

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
_MOMENTS = ("exp_avg", "exp_avg_sq")


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


def check_blocks(**pairs) -> None:
    """int8 codes and their scales (``name=(codes, scales)``) that start on the same block, when that can be
    told: when each tensor's storage holds exactly one state array (``make_state``, ``state_from_fp32``, a
    ``torch.load``: ``n`` codes, ``ceil(n / QUANT_BLOCK)`` scales), a view of it (``state_slice``) sits at its
    offset in that storage, so the codes must start at ``QUANT_BLOCK`` times the scales' offset. Otherwise
    (the engine carves every region out of one host arena, whose offsets say nothing about a region's start)
    nothing is checked: the caller must slice on blocks, as ``state_slice`` does. Two integer compares per
    array, no pass over the data."""
    for name, (codes, scales) in pairs.items():
        # (one storage shared by codes and scales, as in the arena, fails this too: n == 4 * ceil(n / 256) only at 0)
        if scales.untyped_storage().nbytes() != 4 * _num_scales(codes.untyped_storage().nbytes()):
            continue  # not one storage per array: the offsets do not locate the range
        if codes.storage_offset() != QUANT_BLOCK * scales.storage_offset():
            raise ValueError(
                f"{name} starts at element {codes.storage_offset()} of its state array but {name}_scale at block "
                f"{scales.storage_offset()}, whose codes start at {QUANT_BLOCK * scales.storage_offset()}: int8 "
                f"moments are stepped from a multiple of QUANT_BLOCK={QUANT_BLOCK} with that block's scales "
                "(take both with ops.state_slice)")


def check_scales(exp_avg_scale: torch.Tensor, exp_avg_sq_scale: torch.Tensor) -> None:
    """int8 scales are their blocks' absmax: >= 0 (inf after a non-finite step; never NaN: the block max
    skips a NaN). A negative or NaN one was not written by this kernel (a NaN scale turned its whole block
    of params NaN at the next step); the vector kernels rely on it (they skip |v| for exp_avg_sq, which the
    kernel only ever computes >= 0), so it is refused before any write. For loads;
    ``adam_step`` has the same check in C++ (a torch reduction there would leave torch's OpenMP workers
    spinning on the cores the step's threads need)."""
    for name, t in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
        if bool(((t < 0) | t.isnan()).any()):
            raise ValueError(f"{name} has negative or NaN entries: a scale is its block's absmax (>= 0, never NaN), "
                             "so this int8 state was not written by hf_zero_offload (or is damaged)")


#: The largest code magnitude the kernel writes (csrc/quant.h, QFormat::kMaxMag: 1.0's code, where
#: every value clamps, inf and NaN included; 120 and 248): a larger one decodes above its block's absmax
#: (up to 2x), which no step wrote. Read from the kernel, as QUANT_BLOCK is.
MAX_CODE = {"exp_avg": _C.quant_max_code(False), "exp_avg_sq": _C.quant_max_code(True)}


def check_code_range(name: str, codes: torch.Tensor) -> None:
    """int8 codes of ``exp_avg`` (int8: |code| <= 120) or ``exp_avg_sq`` (uint8: <= 248), named
    ``name`` in the error; for loads, before they write anything."""
    top = MAX_CODE["exp_avg" if codes.dtype == torch.int8 else "exp_avg_sq"]
    bottom = -top if codes.dtype == torch.int8 else 0
    if codes.numel() == 0:
        return
    lo, hi = int(codes.min()), int(codes.max())  # one pass each, at load time only
    if lo < bottom or hi > top:
        raise ValueError(f"{name} has code {lo if lo < bottom else hi}, outside [{bottom}, {top}], the codes the "
                         "kernel writes: this int8 state was not written by hf_zero_offload (or is damaged)")


_CHECK_CHUNK = 1 << 24


def check_second_moment(name: str, exp_avg_sq: torch.Tensor) -> None:
    """fp32 or bf16 ``exp_avg_sq`` of a load: a running mean of squared gradients, never negative (a NaN is: a
    step with a NaN gradient writes one, beside its NaN param). A negative one makes sqrt(v) NaN: its param turns
    NaN at the next step, with no word. ``name`` is named in the error."""
    flat = exp_avg_sq.reshape(-1)
    for start in range(0, flat.numel(), _CHECK_CHUNK):  # one pass, at load time only; a mask of the whole state
        part = flat[start:start + _CHECK_CHUNK]          # would cost 1 B/param of host memory (2.9 GB for t5-3b)
        if bool((part < 0).any()):
            at = start + int(torch.nonzero(part < 0)[0])
            raise ValueError(f"{name} has a negative entry ({float(flat[at])} at element {at}); Adam's exp_avg_sq is "
                             "a mean of squares, >= 0: this state was not written by an optimizer (or is damaged)")


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
                       scales: torch.Tensor | None = None, num_threads: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` -> (codes, scales) exactly as the int8 kernel stores them. ``moment``:
    "exp_avg" (int8 signed code) or "exp_avg_sq" (uint8 code of |x|): to nearest without ``step`` (a
    one-off conversion), else stochastically rounded as the kernel's step ``step`` stores it, element i
    keyed by ``round_index + i`` (each moment with its own random bits). ``scales``: each block's scale
    instead of its absmax (finite, >= the absmax; returned as given)."""
    if moment not in _MOMENTS:
        raise ValueError(f"moment must be 'exp_avg' or 'exp_avg_sq'; got {moment!r}")
    x = _read_only(x)
    _check("x", x, (torch.float32,))
    sq = moment == "exp_avg_sq"
    if step is not None and step < 1:
        raise ValueError(f"step must be >= 1 (the 1-based step count); got {step}")
    codes = torch.empty(x.numel(), dtype=torch.uint8 if sq else torch.int8)
    given = scales is not None
    if given:
        _check("scales", scales, (torch.float32,), _num_scales(x.numel()), f"one per {QUANT_BLOCK} of {x.numel()}",
               written=False)
        pad = torch.zeros(_num_scales(x.numel()) * QUANT_BLOCK)
        pad[:x.numel()] = x.reshape(-1).abs()
        if not (torch.isfinite(scales).all() and (scales >= pad.view(-1, QUANT_BLOCK).amax(1)).all()):
            raise ValueError("scales: each must be finite and >= its block's largest |x|")
        scales = scales.clone()
    else:
        scales = torch.empty(_num_scales(x.numel()))
    if x.numel():
        _C.quantize(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), sq, x.numel(), _threads(num_threads),
                    int(step or 0), int(round_index) % 2**64, given)
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
    undo; int8 likewise, unless ``step`` is given: then both moments are rounded as that step of the
    kernel rounds them (``quantize_blockwise``), for a block the engine updates outside the kernel."""
    check_state_dtype(state_dtype)
    exp_avg, exp_avg_sq = _read_only(exp_avg), _read_only(exp_avg_sq)
    _check("exp_avg", exp_avg, (torch.float32,))
    _check("exp_avg_sq", exp_avg_sq, (torch.float32,), exp_avg.numel())
    if state_dtype == "fp32":
        return {"exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    if state_dtype == "bf16":
        return {"exp_avg": exp_avg.to(torch.bfloat16), "exp_avg_sq": exp_avg_sq.to(torch.bfloat16)}
    m, ms = quantize_blockwise(exp_avg, "exp_avg", step=step, round_index=round_index)
    v, vs = quantize_blockwise(exp_avg_sq, "exp_avg_sq", step=step, round_index=round_index)
    return {"exp_avg": m, "exp_avg_sq": v, "exp_avg_scale": ms, "exp_avg_sq_scale": vs}
