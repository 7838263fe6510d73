"""``CPUAdam``: a ``torch.optim.Optimizer`` for CPU parameters backed by the fused C++ kernel.

Per-param state has ``torch.optim.AdamW``'s layout (``step`` as a float tensor, ``exp_avg``,
``exp_avg_sq``), so fp32 state dicts load both ways. Hyper-parameters are read from
``param_groups`` at every step, so LR schedulers work.

``state_dtype`` ("fp32", "bf16", "int8"; see ``ops.STATE_DTYPES``) stores the moments compactly;
int8 adds ``exp_avg_scale``/``exp_avg_sq_scale``. bf16/fp16 parameters get an fp32 ``master`` in
the state (DeepSpeed's CPU Adam keeps fp32 states for half params the same way): the update runs
on the master and the 16-bit param is written from it in the same pass. A state saved with another
``state_dtype`` (or by torch.optim.AdamW) is converted at the next step.

torch.optim's flags: ``maximize`` is implemented (the step descends the negated gradient, as
torch's); ``amsgrad``, ``capturable``, ``differentiable`` and ``foreach``/``fused`` = True are
refused by name (at construction, ``add_param_group``, ``load_state_dict`` and every step). A
state dict saved by torch.optim.AdamW(foreach=True / fused=True / capturable=True) loads: those
say how that optimizer ran, not what it computes, so this optimizer keeps its own (as it keeps
its ``state_dtype``). int8 state dicts keep their codes under their own names and do not load into
torch.optim: convert with ``CPUAdam.to_torch_state_dict`` (state_dict.py says why).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Iterable

import torch

from .. import ops
from . import state_dict as sdict
from .checks import check_group, check_param
from .flags import adamw_mode, listed_once, torch_style
from .state_dict import MOMENT_KEYS as _MOMENT_KEYS

logger = logging.getLogger("hf_zero_offload")

# torch.optim's flags that choose how its step runs, not what it computes: a loaded group's are
# replaced by this optimizer's (None/False: anything else is refused by checks.check_group)
_IMPL_FLAGS = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}


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
        *,
        maximize: bool = False,
        amsgrad: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ):
        try:  # before torch sees them: None, a string or nan would otherwise pass or fail obscurely
            ops.check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=bool(adamw_mode))
        except ValueError as e:
            raise ValueError(f"CPUAdam: {e}") from None
        ops.check_state_dtype(state_dtype)
        self.num_threads = num_threads
        self._versions = {}  # 16-bit param -> (version counter, storage) after our last write (_prepare_state)
        self._checked = {}  # param -> its state as last checked and stepped (sdict.snapshot; _check_state)
        self._converted = set()  # (saved moments, state_dtype) conversions logged (_prepare_state)
        ops.check_num_threads(num_threads)  # the kernels' check, now rather than at the first step
        self._state_dtype = state_dtype
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                        state_dtype=state_dtype, maximize=maximize, amsgrad=amsgrad, foreach=foreach, fused=fused,
                        capturable=capturable, differentiable=differentiable)
        try:  # a refused flag, by name, before torch's checks
            check_group(defaults)
        except (TypeError, ValueError) as e:
            raise type(e)(f"CPUAdam: {e}") from None
        super().__init__(params, defaults)  # each group through add_param_group, checked there

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then this group's trainable params (CPU, float32/bfloat16/float16), ``state_dtype`` and
        hyper-parameters are checked: a group added after construction is refused whole, here,
        rather than at a later step. A param listed twice is refused (torch only warns: each step
        would update it twice)."""
        index = len(self.param_groups)
        # (torch's decoupled_weight_decay honoured)
        super().add_param_group(torch_style(listed_once(self.param_groups, param_group, "CPUAdam")))
        group = self.param_groups[-1]
        try:
            for p in group["params"]:
                if p.requires_grad:  # a frozen one (an int8 weight, a float64 table) is never stepped, as in torch:
                    check_param(p, index)  # refused at a step if it gets a gradient after all
            check_group(group, index)
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
        self._checked = {}  # (also load_state_dict's path: states replaced)
        self.__dict__.setdefault("_converted", set())
        for group in self.param_groups:
            group["adamw_mode"] = adamw_mode(group)
            group.setdefault("state_dtype", getattr(self, "_state_dtype", "fp32"))
            group.setdefault("maximize", False)
            group.setdefault("amsgrad", False)
            for k, v in _IMPL_FLAGS.items():
                group.setdefault(k, v)
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    # Never traced: torch.compile of a step (or of a train step that calls it) took the kernel's raw pointers for
    # constants, and from the second call updated one param twice and another never (two params of one shape)
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every check and state conversion first, then the updates: a refused step updates no param.
        todo, index = [], 0  # index: a param's first element among the optimizer's params (rounding counter)
        pids = itertools.count()  # a param's number in state_dict(), which errors name
        for gi, group in enumerate(self.param_groups):
            check_group(group, gi, ops.next_step(int(self.state[p]["step"]) if "step" in self.state.get(p, {}) else 0
                                                 for p in group["params"] if p.grad is not None))
            for p in group["params"]:
                index, pid = index + p.numel(), next(pids)
                if p.grad is None:
                    continue
                check_param(p, gi)  # again: p.data may have been replaced since the group was added
                if p.grad.layout != torch.strided:
                    raise TypeError(f"CPUAdam does not support sparse gradients: the grad of a {tuple(p.shape)} param "
                                    f"in group {gi} is {p.grad.layout} (nn.Embedding(sparse=True)? use "
                                    "sparse=False)")
                if (p.grad.dtype not in (torch.float32, torch.bfloat16, torch.float16) or p.grad.shape != p.shape
                        or p.grad.device != p.device):
                    raise TypeError(f"the grad of a {tuple(p.shape)} param is {str(p.grad.dtype)[6:]} "
                                    f"{tuple(p.grad.shape)} on {p.grad.device}: expected its shape in float32, "
                                    "bfloat16 or float16 on the CPU")
                self._check_state(p, pid)
                try:  # here, not only in adam_step: a grad sharing its param's memory was refused after the
                    arrays = {k: v for k, v in self.state.get(p, {}).items() if k != "step" and torch.is_tensor(v)}
                    ops.check_separate(param=p, grad=p.grad, **arrays)
                except ValueError as e:  # params before it in the step were updated
                    raise ValueError(f"CPUAdam: a {tuple(p.shape)} param in group {gi}: {e}") from None
                todo.append((group, p, index - p.numel()))
        # Only now are states created or converted: a step refused by a later param or group left the earlier
        # params' states made (step 0) or converted to an edited state_dtype (int8 rounds them for good)
        todo = [(group, p, self._prepare_state(p, group["state_dtype"]), first) for group, p, first in todo]
        for group, p, state, first in todo:
            beta1, beta2 = (float(b) for b in group["betas"])
            half = p.dtype != torch.float32
            moments = {k: state[k] for k in _MOMENT_KEYS if k in state}
            # A non-contiguous param (transposed, channels_last, a slice of a larger tensor) is updated
            # in a contiguous copy, in its logical element order like the grad and the moments, then
            # copied back: the kernel reads and writes flat arrays.
            work = p.contiguous()
            # torch's maximize: the step descends -grad (negation is exact, so the math is torch's)
            grad = p.grad.neg() if group["maximize"] else p.grad
            ops.adam_step(
                state["master"] if half else work,
                grad.contiguous(),  # a read-only input: a copy here loses nothing
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
                self._versions[p] = (p._version, p.data_ptr())
            state["step"] += 1  # after the update: a refused call leaves the count as it was
            self._checked[p] = sdict.snapshot(state)
        return loss

    def _check_state(self, p: torch.Tensor, pid: int) -> None:
        """What ``_prepare_state`` would refuse in ``p``'s state, found without changing it: all that a load
        refuses in a state edited since its last check (a hand edit: codes outside the map, a scale of another
        length; one pass), else its sizes against ``p`` (``p.data`` may have been replaced)."""
        state = self.state.get(p)
        if not state:
            return
        if sdict.edited(state, self._checked.get(p)):
            return sdict.check_saved_state(state, p, pid, live=True)
        try:
            ops.state_dtype_of(_flat(state), p.numel())
            master = state.get("master")
            if p.dtype != torch.float32 and torch.is_tensor(master) and master.numel() != p.numel():
                raise ValueError(f"master has {master.numel()} elements, expected {p.numel()}")
        except (TypeError, ValueError) as e:
            raise type(e)(f"CPUAdam state of param {pid} (shape {tuple(p.shape)}): {e}") from None

    def _prepare_state(self, p: torch.Tensor, state_dtype: str) -> dict:
        """The state of ``p``, created (zeros, fp32 master of a 16-bit param) or converted to
        ``state_dtype`` when it was saved with another one (or by torch.optim)."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state.update(_shaped(ops.make_state(p.numel(), state_dtype), p))
        elif (saved := _dtype_of(state, p.numel())) != state_dtype or _codes_of(state) != ops.INT8_CODES:
            what = f"{saved} (code map {_codes_of(state)})" if saved == "int8" else saved
            if (what, state_dtype) not in self._converted:  # one line per conversion, not per param (as the engines)
                self._converted.add((what, state_dtype))
                logger.info("hf_zero_offload: optimizer moments saved as %s converted to state_dtype=%s", what,
                            state_dtype)
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
        elif (self._versions.get(p) != (p._version, p.data_ptr())
              and not torch.equal(state["master"].view(p.shape).to(p.dtype), p.detach())):
            # Written since our last step (model.load_state_dict, an in-place edit, p.data = t: the version
            # counter or the storage moved) to a value that is not the master's rounding: the param is what
            # the user set, the master follows it (else this step would put back the old weights). A write
            # through p.data.<op>_() moves neither (p.data has its own counter): it is not seen.
            state["master"].view(p.shape).copy_(p.detach())
        return state

    def state_dict(self) -> dict:
        """torch's, with int8 codes under their own names (state_dict.py says why); the
        state_dict post hooks see (and may replace) that dict, as in torch."""
        with _hooks_set_aside(self, "_optimizer_state_dict_post_hooks") as (post_hooks,):
            state_dict = super().state_dict()
        state_dict["state"] = {pid: sdict.packed(st) for pid, st in state_dict["state"].items()}
        # torch.optim.Adam(decoupled_weight_decay=True) loading this dict takes the saved groups and defaults a
        # missing key to False: it became L2 Adam, without a word (torch's AdamW forces it; Adam does not)
        for g in state_dict["param_groups"]:
            g["decoupled_weight_decay"] = bool(g["adamw_mode"])
        for hook in post_hooks:
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    to_torch_state_dict = staticmethod(sdict.to_torch_state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, in torch's order (the load_state_dict pre hooks see the dict first, the post
        hooks the loaded state), with every saved state and group checked before anything loads,
        and the fp32 master and compact moments kept exactly as saved (torch.optim casts every
        floating state tensor to its param's dtype, and would turn int8 codes into floats). Each step
        count loads as torch's float32 tensor, whatever number or tensor kind it was saved as."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # (torch's shallow copy, which its pre hooks get)
        with _hooks_set_aside(self, "_optimizer_load_state_dict_pre_hooks",
                              "_optimizer_load_state_dict_post_hooks") as (pre_hooks, post_hooks):
            for hook in pre_hooks:
                result = hook(self, state_dict)
                state_dict = state_dict if result is None else result
            state_dict = sdict.readable(state_dict)
            exact = {pid: {k: v for k, v in st.items() if k in sdict.EXACT_KEYS and torch.is_tensor(v)}
                     for pid, st in state_dict["state"].items()}
            saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
            params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
            by_id = dict(zip(saved_ids, params))
            # (groups that do not match: torch's load_state_dict below says so, before loading anything)
            loaded = [_loaded_group(saved, mine) for saved, mine in zip(state_dict["param_groups"], self.param_groups)]
            if [len(g["params"]) for g in state_dict["param_groups"]] == [len(g["params"]) for g in self.param_groups]:
                for pid, st in state_dict["state"].items():  # refused before anything is loaded
                    if pid in by_id:
                        sdict.check_saved_state(st, by_id[pid], pid)
                for i, (group, saved) in enumerate(zip(loaded, state_dict["param_groups"])):
                    try:  # at its stepped params' next step, as step() checks (step 1's refused a run's own state)
                        check_group(group, i, ops.next_step(int(state_dict["state"][pid]["step"]) for pid in
                                                            saved["params"] if pid in state_dict["state"]))
                    except (TypeError, ValueError) as e:
                        raise type(e)(f"{e} (in the state dict being loaded)") from None
            super().load_state_dict(state_dict)
            for group, values in zip(self.param_groups, loaded):
                group.update(values)
            for pid, values in exact.items():
                if pid in by_id:
                    self.state[by_id[pid]].update({k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format)
                                                   for k, v in values.items()})
            for pid, st in state_dict["state"].items():  # torch keeps a step's kind; an int64 one stayed int64
                if pid in by_id and "step" in st:
                    self.state[by_id[pid]]["step"] = sdict.step_tensor(st["step"])
            self._checked = {p: sdict.snapshot(self.state[p]) for p in by_id.values() if self.state.get(p)}  # above
        for hook in post_hooks:
            hook(self)


@contextlib.contextmanager
def _hooks_set_aside(opt, *names):
    """The hooks in ``opt``'s dicts ``names``, taken out while torch's method runs (CPUAdam runs
    them itself, before or after its own part, where torch would) and put back after."""
    saved = [getattr(opt, name) for name in names]
    for name, hooks in zip(names, saved):
        setattr(opt, name, type(hooks)())
    try:
        yield [list(hooks.values()) for hooks in saved]
    finally:
        for name, hooks in zip(names, saved):
            setattr(opt, name, hooks)


def _loaded_group(saved: dict, mine: dict) -> dict:
    """The keys of a saved group that CPUAdam sets as they will be after the load: the math of the
    saved one (adamw_mode, or torch's decoupled_weight_decay; maximize; amsgrad), this optimizer's
    storage (state_dtype) and implementation flags. The other keys are the saved ones. A group that says
    neither (torch before 2.7 wrote no decoupled_weight_decay: its Adam and AdamW dicts look alike) keeps this
    optimizer's mode, as the engines do and as torch's own classes do; AdamW's was taken, so a torch 2.6
    Adam state loaded into CPUAdam(adamw_mode=False) stepped as AdamW (an outside probe at the floors)."""
    out = {k: saved[k] for k in ("lr", "betas", "eps", "weight_decay") if k in saved}
    mode = adamw_mode(saved, default=mine.get("adamw_mode", True))
    if "adamw_mode" not in saved and "decoupled_weight_decay" not in saved and saved.get("weight_decay"):
        logger.info("hf_zero_offload: a loaded param group does not say whether its weight decay was decoupled "
                    "(saved by torch < 2.7): CPUAdam keeps its own mode (adamw_mode=%s)", mode)
    out.update(adamw_mode=mode,
               maximize=saved.get("maximize", False), amsgrad=saved.get("amsgrad", False),
               state_dtype=mine["state_dtype"], **{k: mine.get(k, v) for k, v in _IMPL_FLAGS.items()})
    return out


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


def _codes_of(state: dict) -> int:
    """The code map of int8 moments (``ops.INT8_CODES``; 1 when saved without one); others: current."""
    return state.get("int8_codes", 1) if _dtype_of(state) == "int8" else ops.INT8_CODES

