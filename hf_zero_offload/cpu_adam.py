"""``CPUAdam``: a ``torch.optim.Optimizer`` for CPU parameters backed by the fused C++ kernel.

Per-param state has ``torch.optim.AdamW``'s layout (``step`` as a float tensor, ``exp_avg``,
``exp_avg_sq``), so fp32 state dicts load both ways. Hyper-parameters are read from
``param_groups`` at every step, so LR schedulers work.

``state_dtype`` ("fp32", "bf16", "int8"; see ``ops.STATE_DTYPES``) stores the moments compactly;
int8 adds ``exp_avg_scale``/``exp_avg_sq_scale``. bf16/fp16 parameters get an fp32 ``master`` in
the state (DeepSpeed's CPU Adam keeps fp32 states for half params the same way): the update runs
on the master and the 16-bit param is written from it in the same pass. A state saved with another
``state_dtype`` (or by torch.optim.AdamW) is converted at the next step.
"""
from __future__ import annotations

import itertools
import math
import reprlib
from typing import Iterable

import torch

from . import ops


class CPUAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        num_threads: int | None = None,
        state_dtype: str = "fp32",
    ):
        try:  # before torch sees them: None, a string or nan would otherwise pass or fail obscurely
            ops.check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        except ValueError as e:
            raise ValueError(f"CPUAdam: {e}") from None
        ops.check_state_dtype(state_dtype)
        self.num_threads = num_threads
        self._versions = {}  # 16-bit param -> its version counter after our last write (see _prepare_state)
        ops.check_num_threads(num_threads)  # the kernels' check, now rather than at the first step
        self._state_dtype = state_dtype
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                        state_dtype=state_dtype)
        super().__init__(params, defaults)  # each group through add_param_group, checked there

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then this group's params (CPU, float32/bfloat16/float16), ``state_dtype`` and
        hyper-parameters are checked: a group added after construction is refused whole, here,
        rather than at a later step."""
        super().add_param_group(param_group)
        group, index = self.param_groups[-1], len(self.param_groups) - 1
        try:
            for p in group["params"]:
                _check_param(p, index)
            if not isinstance(group["adamw_mode"], bool):  # "false" would be true
                raise TypeError(f"CPUAdam param group {index}: adamw_mode must be a bool, got {group['adamw_mode']!r}")
            try:
                ops.check_state_dtype(group["state_dtype"])
                ops.check_hyperparameters(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                          weight_decay=group["weight_decay"])
            except ValueError as e:
                raise ValueError(f"CPUAdam param group {index}: {e}") from None
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def __getstate__(self):
        # torch.optim pickles defaults, state and groups only: a torch.load-ed CPUAdam lacked these
        return {**super().__getstate__(), "num_threads": self.num_threads, "_state_dtype": self._state_dtype}

    def __setstate__(self, state):
        # Also the path of load_state_dict, whose saved groups replace ours: a group saved by
        # torch.optim.Adam/AdamW has no "adamw_mode" but says "decoupled_weight_decay".
        super().__setstate__(state)
        self.__dict__.setdefault("num_threads", None)  # unpickled from a version that did not save it
        self.__dict__.setdefault("_versions", {})
        for group in self.param_groups:
            group.setdefault("adamw_mode", bool(group.get("decoupled_weight_decay", True)))
            group.setdefault("state_dtype", getattr(self, "_state_dtype", "fp32"))
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every check and state conversion first, then the updates: a refused step updates no param.
        todo, index = [], 0  # index: a param's first element among the optimizer's params (rounding counter)
        for gi, group in enumerate(self.param_groups):
            for flag in ("amsgrad", "maximize"):  # may come in with a torch.optim.Adam(W) state dict
                if group.get(flag):
                    raise ValueError(f"CPUAdam does not support {flag}=True (param group loaded from another optimizer?)")
            try:  # a scheduler may have set them since the last step
                ops.check_hyperparameters(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                          weight_decay=group["weight_decay"])
            except ValueError as e:
                raise ValueError(f"CPUAdam param group {gi}: {e}") from None
            for p in group["params"]:
                index += p.numel()
                if p.grad is None:
                    continue
                _check_param(p, gi)  # again: p.data may have been replaced since the group was added
                if p.grad.is_sparse:
                    raise TypeError("CPUAdam does not support sparse gradients")
                if (p.grad.dtype not in (torch.float32, torch.bfloat16, torch.float16) or p.grad.shape != p.shape
                        or p.grad.device != p.device):
                    raise TypeError(f"the grad of a {tuple(p.shape)} param is {str(p.grad.dtype)[6:]} "
                                    f"{tuple(p.grad.shape)} on {p.grad.device}: expected its shape in float32, "
                                    "bfloat16 or float16 on the CPU")
                try:
                    todo.append((group, p, self._prepare_state(p, group["state_dtype"]), index - p.numel()))
                except (TypeError, ValueError) as e:  # a state of another size (p.data replaced, a foreign load)
                    raise type(e)(f"CPUAdam state of a {tuple(p.shape)} param: {e}") from None
        for group, p, state, first in todo:
            beta1, beta2 = (float(b) for b in group["betas"])
            half = p.dtype != torch.float32
            moments = {k: state[k] for k in _MOMENT_KEYS if k in state}
            # A non-contiguous param (transposed, channels_last, a slice of a larger tensor) is updated
            # in a contiguous copy, in its logical element order like the grad and the moments, then
            # copied back: the kernel reads and writes flat arrays.
            work = p.contiguous()
            ops.adam_step(
                state["master"] if half else work,
                p.grad.contiguous(),  # a read-only input: a copy here loses nothing
                **moments,
                param_out=work if half else None,
                step=int(state["step"].item()) + 1,
                lr=float(group["lr"]),  # a tensor lr (some schedulers) becomes a float here
                beta1=beta1,
                beta2=beta2,
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                adamw=bool(group["adamw_mode"]),
                num_threads=self.num_threads,
                round_index=first,
            )
            if work is not p:
                p.copy_(work)
            if half:
                self._versions[p] = p._version
            state["step"] += 1  # after the update: a refused call leaves the count as it was
        return loss

    def _prepare_state(self, p: torch.Tensor, state_dtype: str) -> dict:
        """The state of ``p``, created (zeros, fp32 master of a 16-bit param) or converted to
        ``state_dtype`` when it was saved with another one (or by torch.optim)."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state.update(_shaped(ops.make_state(p.numel(), state_dtype), p))
        elif _dtype_of(state, p.numel()) != state_dtype or _codes_of(state) != ops.INT8_CODES:
            m, v = ops.state_to_fp32(_flat(state), _codes_of(state))
            for k in _MOMENT_KEYS + ("int8_codes",):
                state.pop(k, None)
            state.update(_shaped(ops.state_from_fp32(m, v, state_dtype), p))
        if state_dtype == "int8":  # saved with the codes (a state without it has map 1)
            state["int8_codes"] = ops.INT8_CODES
        if p.dtype == torch.float32:
            # the param is its own master; one kept from 16-bit training would go stale here, and a
            # later load into 16-bit params would step from it, undoing this training
            state.pop("master", None)
        elif "master" not in state:
            state["master"] = p.detach().float().contiguous()
        elif state["master"].numel() != p.numel():
            raise ValueError(f"master has {state['master'].numel()} elements, expected {p.numel()}")
        elif (self._versions.get(p) != p._version
              and not torch.equal(state["master"].view(p.shape).to(p.dtype), p.detach())):
            # Written since our last step (model.load_state_dict, an in-place edit) to a value that
            # is not the master's rounding: the param is what the user set, the master follows it
            # (else this step would put back the old weights).
            state["master"].view(p.shape).copy_(p.detach())
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = _readable(state_dict)
        # torch.optim casts every floating state tensor to its param's dtype (and would turn int8
        # codes into floats): the fp32 master and compact moments are put back exactly as saved.
        exact = {pid: {k: v for k, v in st.items() if k in _EXACT_KEYS and torch.is_tensor(v)}
                 for pid, st in state_dict["state"].items()}
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        by_id = dict(zip(saved_ids, params))
        if [len(g["params"]) for g in state_dict["param_groups"]] == [len(g["params"]) for g in self.param_groups]:
            for pid, st in state_dict["state"].items():  # refused before anything is loaded
                if pid in by_id:
                    _check_saved_state(st, by_id[pid], pid)
        # (groups that do not match: torch's load_state_dict below says so, before loading anything)
        # The storage is this optimizer's choice, not the checkpoint's: moments saved with another
        # state_dtype are converted at the next step.
        mine = [g["state_dtype"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, state_dtype in zip(self.param_groups, mine):
            group["state_dtype"] = state_dtype
        for pid, values in exact.items():
            if pid in by_id:
                self.state[by_id[pid]].update({k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format)
                                               for k, v in values.items()})


_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
_EXACT_KEYS = _MOMENT_KEYS + ("master",)


def _readable(state_dict) -> dict:
    """``state_dict`` with torch.optim's outline checked (a clear error instead of a KeyError deep
    in torch) and, in a shallow copy, moments saved in float16/float64 (torch.optim.AdamW's, of
    fp16/fp64 params) widened/rounded to float32, as torch would cast them to an fp32 param."""
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list)
            and all(isinstance(g, dict) and "params" in g for g in state_dict["param_groups"])):
        raise ValueError("CPUAdam.load_state_dict: expected an optimizer state dict, {'state': {param id: dict}, "
                         f"'param_groups': [dict with 'params']}}; got {reprlib.repr(state_dict)}")
    for pid, st in state_dict["state"].items():
        if not isinstance(st, dict):
            raise ValueError(f"optimizer state of param {pid}: expected a dict, got {type(st).__name__}")
    state = {pid: {k: v.float() if k in _MOMENT_KEYS[:2] and torch.is_tensor(v)
                   and v.dtype in (torch.float16, torch.float64) else v for k, v in st.items()}
             for pid, st in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _check_saved_state(st, p: torch.Tensor, pid) -> None:
    """One param's saved state against its param: a step count (an int >= 0, as a number or a
    one-element tensor), moments that pair up and have its size, an fp32 master of its size. Anything
    else was not written by an Adam (or is damaged): refused, naming the param and the entry."""
    where = f"optimizer state of param {pid} (shape {tuple(p.shape)})"
    if not st:  # (a dict: _readable checked)
        return
    step = st.get("step")
    if step is None:
        raise ValueError(f"{where}: step is missing (Adam's per-param step count)")
    value = step.item() if torch.is_tensor(step) and step.numel() == 1 else step
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"{where}: step must be a whole number >= 0, got {step!r}")
    try:
        kind = ops.state_dtype_of({k: v.reshape(-1) if torch.is_tensor(v) else v for k, v in st.items()
                                   if k in _MOMENT_KEYS}, numel=p.numel())
        if kind == "int8":
            ops.check_scales(st["exp_avg_scale"], st["exp_avg_sq_scale"])
            ops.check_int8_codes(st.get("int8_codes", 1))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None
    master = st.get("master")
    if master is not None and not (torch.is_tensor(master) and master.dtype == torch.float32
                                   and master.numel() == p.numel()):
        got = f"{str(master.dtype)[6:]} of {master.numel()} elements" if torch.is_tensor(master) else repr(master)
        raise TypeError(f"{where}: master must be float32 of {p.numel()} elements, got {got}")


def _flat(state: dict) -> dict:
    return {k: state[k].reshape(-1) for k in _MOMENT_KEYS if k in state}


def _shaped(moments: dict, p: torch.Tensor) -> dict:
    """Moments in the param's shape (as torch.optim keeps them); the per-block scales stay flat."""
    return {k: t if k.endswith("scale") else t.view(p.shape) for k, t in moments.items()}


def _dtype_of(state: dict, numel: int | None = None) -> str:
    """Also the check, before a step writes anything, that the moments have ``numel`` elements and
    are contiguous (the kernel updates them in place; one edited into a view is copied once here)."""
    for k in _MOMENT_KEYS:
        if torch.is_tensor(state.get(k)) and not state[k].is_contiguous():
            state[k] = state[k].contiguous()
    return ops.state_dtype_of(_flat(state), numel)


def _check_param(p: torch.Tensor, group: int) -> None:
    if p.device.type != "cpu":
        raise ValueError(f"CPUAdam param group {group}: needs CPU parameters; got one on {p.device}")
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"CPUAdam param group {group}: needs float32, bfloat16 or float16 parameters; got "
                        f"{p.dtype} (shape {tuple(p.shape)})")


def _codes_of(state: dict) -> int:
    """The code map of int8 moments (``ops.INT8_CODES``; 1 when saved without one); others: current."""
    return state.get("int8_codes", 1) if _dtype_of(state) == "int8" else ops.INT8_CODES

