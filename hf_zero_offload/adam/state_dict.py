"""CPUAdam's state dicts: the outline checked on load, the int8 keys on save, and the conversion
to a dict ``torch.optim.AdamW``/``Adam`` can load.

int8 moments are saved as ``exp_avg_codes`` (int8) and ``exp_avg_sq_codes`` (uint8) beside their
``exp_avg_scale``/``exp_avg_sq_scale``, never as ``exp_avg``/``exp_avg_sq``: torch.optim casts
every state tensor to the param's dtype, so codes saved under torch's names were loaded by
torch.optim.AdamW as if they were moments, and it trained on them (steps of the wrong size, no
error). Under their own names torch's first step stops (KeyError 'exp_avg') and
``to_torch_state_dict`` is the documented way across. States saved the earlier way still load.
"""
from __future__ import annotations

import math
import reprlib
import weakref

import torch

from .. import ops
from .flags import adamw_mode
from ..ops.moments import check_code_range, check_second_moment

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
EXACT_KEYS = MOMENT_KEYS + ("master",)
#: in-memory name of an int8 moment -> its name in a state dict
CODE_KEYS = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}
#: what a CPUAdam group holds that torch.optim.Adam(W) does not (and torch's name for one of them)
_OUR_GROUP_KEYS = ("state_dtype", "adamw_mode")
#: step tensors that count exactly past any real run (and torch's: float32)
_STEP_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
_MAX_STEP = 2**53


def step_tensor(step) -> torch.Tensor:
    """A checked step count as torch.optim.AdamW keeps it: a 0-dim float32 tensor (float64 past
    2**24, where float32 would stop counting), whatever number or tensor kind it was saved as."""
    value = float(step.item() if torch.is_tensor(step) else step)
    return torch.tensor(value, dtype=torch.float32 if value <= 2**24 else torch.float64)


def packed(state: dict) -> dict:
    """One param's state as a state dict stores it: int8 codes under their own names (a new dict;
    the tensors are shared, as torch.optim.Optimizer.state_dict shares them)."""
    if not (torch.is_tensor(state.get("exp_avg")) and state["exp_avg"].dtype == torch.int8):
        return state
    return {CODE_KEYS.get(k, k): v for k, v in state.items()}


def readable(state_dict) -> dict:
    """``state_dict`` with torch.optim's outline checked (a clear error instead of a KeyError deep
    in torch) and, in a shallow copy, int8 codes back under the moments' names, moments saved in
    float16/float64 (torch.optim.AdamW's, of fp16/fp64 params) widened/rounded to float32, as torch
    would cast them to an fp32 param."""
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list)
            and all(isinstance(g, dict) and "params" in g for g in state_dict["param_groups"])):
        raise ValueError("CPUAdam.load_state_dict: expected an optimizer state dict, {'state': {param id: dict}, "
                         f"'param_groups': [dict with 'params']}}; got {reprlib.repr(state_dict)}")
    state = {}
    for pid, st in state_dict["state"].items():
        if not isinstance(st, dict):
            raise ValueError(f"optimizer state of param {pid}: expected a dict, got {type(st).__name__}")
        for mine, saved in CODE_KEYS.items():
            if saved in st and mine in st:
                raise ValueError(f"optimizer state of param {pid}: has both {mine} and {saved} (one moment twice)")
        st = {next((m for m, s in CODE_KEYS.items() if s == k), k): v for k, v in st.items()}
        state[pid] = {k: v.float() if k in MOMENT_KEYS[:2] and torch.is_tensor(v)
                      and v.dtype in (torch.float16, torch.float64) else v for k, v in st.items()}
    return {**state_dict, "state": state}


def check_saved_state(st, p: torch.Tensor, pid, live: bool = False) -> None:
    """One param's saved state (after ``readable``) against its param: a step count (an int >= 0,
    as a number or a one-element tensor), moments that pair up and have its size, an fp32 master of
    its size. Anything else was not written by an Adam (or is damaged): refused, naming the param
    and the entry. ``live``: a CPUAdam's own state before a step (``edited``), its codes under the
    moments' names."""
    where = f"{'CPUAdam state' if live else 'optimizer state'} of param {pid} (shape {tuple(p.shape)})"
    if not st:
        return
    for k, v in st.items():  # torch's load would fail on it, or ours after torch's had loaded the rest
        if torch.is_tensor(v) and v.device.type == "meta":
            raise ValueError(f"{where}: {k} is on the meta device (a tensor without data)")
    step = st.get("step")
    if step is None:
        raise ValueError(f"{where}: step is missing (Adam's per-param step count)")
    if torch.is_tensor(step) and step.dtype not in _STEP_DTYPES:
        # uint8 255 + 1 wraps to 0, bfloat16 256 + 1 stays 256: the bias correction would restart or stall
        raise TypeError(f"{where}: step must be a float32, float64, int32 or int64 tensor (a count that "
                        f"does not wrap or stall), got {str(step.dtype)[6:]}")
    value = step.item() if torch.is_tensor(step) and step.numel() == 1 else step
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"{where}: step must be a whole number >= 0, got {step!r}")
    if value >= _MAX_STEP:  # else the kernel refuses it at a step, after updating the params before it
        raise ValueError(f"{where}: step must be a whole number < 2**53 (counted exactly), got {step!r}")
    try:
        # (a strided view holds valid moments: flat copies, as the load copies them anyway)
        flat = {k: v.reshape(-1).contiguous() if torch.is_tensor(v) else v for k, v in st.items() if k in MOMENT_KEYS}
        kind = ops.state_dtype_of(flat, numel=p.numel())
        for k in ("exp_avg", "exp_avg_sq"):  # torch.optim's layout, which the step and to_torch_state_dict keep
            if st[k].shape != p.shape:
                raise ValueError(f"{k} has shape {tuple(st[k].shape)}, expected the param's {tuple(p.shape)}")
        if kind == "int8":
            ops.check_scales(flat["exp_avg_scale"], flat["exp_avg_sq_scale"])
            ops.check_int8_codes(st.get("int8_codes", 1))
            for k in ("exp_avg", "exp_avg_sq"):
                check_code_range(k if live else CODE_KEYS[k], flat[k])
        else:  # a negative one (torch's AdamW takes it) turns its param NaN at the next step
            check_second_moment("exp_avg_sq", flat["exp_avg_sq"])
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    master = st.get("master")
    if master is not None and not (torch.is_tensor(master) and master.dtype == torch.float32
                                   and master.numel() == p.numel()):
        got = f"{str(master.dtype)[6:]} of {master.numel()} elements" if torch.is_tensor(master) else repr(master)
        raise TypeError(f"{where}: master must be float32 of {p.numel()} elements, got {got}")


def snapshot(state: dict) -> dict:
    """A param's state as a step (or a load) checked and left it, for ``edited``: each tensor by a weak
    reference (a replaced one cannot pass for it at a reused address) and its version counter, which
    a write through it or a view moves (the kernel's writes through its pointer do not); each other
    value as it is."""
    return {k: (weakref.ref(v), v._version) if torch.is_tensor(v) else (None, v) for k, v in state.items()}


def edited(state: dict, seen: dict | None) -> bool:
    """Whether ``state`` changed since its ``snapshot`` ``seen`` (None: never taken): an entry added,
    dropped or replaced, or a tensor written in place (``state["exp_avg"][0] = -128``). A write
    through ``t.data`` moves no counter and is not seen (as for the params, cpu_adam.py)."""
    if seen is None or seen.keys() != state.keys():
        return True
    for k, v in state.items():
        ref, mark = seen[k]
        if torch.is_tensor(v):
            if ref is None or ref() is not v or v._version != mark:
                return True
        elif ref is not None or not (v is mark or _equal_scalars(v, mark)):
            return True
    return False


def _equal_scalars(a, b) -> bool:
    """Two plain values that are equal (an int code map set again to itself); anything else compares by identity
    (an object's ``==`` may raise or answer an array)."""
    return type(a) is type(b) and isinstance(a, (int, float, str)) and a == b


def to_torch_state_dict(state_dict: dict) -> dict:
    """A CPUAdam state dict (``CPUAdam.state_dict()``, or one loaded from a checkpoint) as
    torch.optim.AdamW/Adam's: fp32 ``exp_avg``/``exp_avg_sq`` in each param's shape (bf16 widened,
    int8 decoded with its code map), the scales, code map and fp32 masters dropped (torch keeps no
    master: its 16-bit params step themselves), and each group's ``adamw_mode`` as torch's
    ``decoupled_weight_decay``. A new dict; the argument is left as it was."""
    sd = readable(state_dict)
    state = {}
    for pid, st in sd["state"].items():
        out = {k: v for k, v in st.items() if k not in EXACT_KEYS and k != "int8_codes"}
        if "exp_avg" in st:
            shape = st["exp_avg"].shape
            m, v = ops.state_to_fp32({k: st[k].reshape(-1) for k in MOMENT_KEYS if k in st},
                                     st.get("int8_codes", 1) if "exp_avg_scale" in st else ops.INT8_CODES)
            out.update(exp_avg=m.view(shape), exp_avg_sq=v.view(shape))
        if torch.is_tensor(out.get("step")):
            out["step"] = out["step"].clone()  # torch steps it in place; the CPUAdam dict keeps its own
        state[pid] = out
    groups = []
    for g in sd["param_groups"]:
        group = {k: v for k, v in g.items() if k not in _OUR_GROUP_KEYS}
        group["decoupled_weight_decay"] = bool(adamw_mode(g))
        groups.append(group)
    return {"state": state, "param_groups": groups}
