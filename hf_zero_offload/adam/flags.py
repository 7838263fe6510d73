"""The torch.optim Adam/AdamW group keys that ``CPUAdam`` and the engines (``engine/core.py``) read alike: the flags
whose math or implementation their kernels do not run, refused by name, torch's ``decoupled_weight_decay`` as the
kernels' ``adamw_mode``, and a param listed twice in the groups (a tied weight under two names), refused naming both.

One home for both, so the two optimizers cannot drift apart (they did: each had its own table and its own
translation of ``decoupled_weight_decay``, worded differently). Torch only; importing it loads no engine.
"""
from __future__ import annotations

import torch

# flags that change the math, which the kernels do not run (CPUAdam runs ``maximize``: the engines do not)
MATH_FLAGS = {
    "amsgrad": "the kernel keeps no max(exp_avg_sq) state",
    "maximize": "the engine descends the gradient",
    "differentiable": "autograd does not record the kernel's step",
}
# flags that choose an implementation: the kernels always run their own
IMPLEMENTATION_FLAGS = {
    "capturable": "it is for CUDA graphs, which the host step cannot be captured in",
    "foreach": "the step always runs its own fused C++ kernel; leave foreach None or False",
    "fused": "the step always runs its own fused C++ kernel; leave fused None or False",
}
_ADVICE = {"amsgrad": "; use torch.optim.AdamW(amsgrad=True)", "maximize": "; negate the loss instead"}


def refused_flag(group: dict, allowed: tuple[str, ...] = ()) -> str | None:
    """The message for the first flag of ``group`` (outside ``allowed``) the kernels cannot honour; None if none."""
    for key, why in {**MATH_FLAGS, **IMPLEMENTATION_FLAGS}.items():
        if key not in allowed and group.get(key) not in (None, False):
            return f"{key}={group[key]!r} is not supported: {why}{_ADVICE.get(key, '')}"
    return None


def adamw_mode(group: dict, default: bool = True) -> bool:
    """Whether ``group``'s weight decay is decoupled: its ``adamw_mode``, else torch's ``decoupled_weight_decay``
    (torch.optim.Adam(decoupled_weight_decay=True) is AdamW), else ``default``."""
    if "adamw_mode" in group:
        return group["adamw_mode"]
    dwd = group.get("decoupled_weight_decay")
    return default if dwd is None else bool(dwd)


def torch_style(group):
    """A group given the torch way (``{"decoupled_weight_decay": False}``, no ``adamw_mode``) with ``adamw_mode``
    set from it: the default adamw_mode=True overrode it silently (AdamW's decay where the group asked for Adam's L2).
    In the caller's dict, which torch's ``add_param_group`` fills with the defaults and keeps as the optimizer's group
    (a copy broke ``opt.param_groups[0] is group``). Anything else (a tensor, a group already saying adamw_mode) is
    returned as it is."""
    if isinstance(group, dict) and group.get("decoupled_weight_decay") is not None and "adamw_mode" not in group:
        group["adamw_mode"] = bool(group["decoupled_weight_decay"])
    return group


def check_decoupled(group: dict, where: str = "") -> None:
    """A ValueError when ``group`` says both names and they disagree (an edit of one of the two)."""
    dwd, mode = group.get("decoupled_weight_decay"), group.get("adamw_mode", True)
    if dwd is not None and bool(dwd) != mode:
        raise ValueError(f"{where}decoupled_weight_decay={dwd!r} contradicts adamw_mode={mode!r}: the weight decay "
                         "is decoupled (AdamW) exactly when adamw_mode is True; set both alike")


def listed_once(groups: list[dict], group, who: str):
    """``group``, its params a list (a generator is read once here), once ``refuse_listed_twice`` has checked it
    against ``groups`` (those added so far). The caller's own dict, as torch's ``add_param_group`` keeps it (it lists
    the params in it, and the optimizer's group is that dict: a copy here broke ``opt.param_groups[0] is group`` and
    left a refused generator's params read and gone). A tensor or a set of params: as given (torch's own message names
    those)."""
    given = group.get("params") if isinstance(group, dict) else None
    if given is None or isinstance(given, (torch.Tensor, set)):
        return group
    group["params"] = list(given)
    refuse_listed_twice([*groups, group], who)
    return group


def refuse_listed_twice(groups: list[dict], who: str) -> None:
    """A tensor listed twice in ``groups`` (the groups added so far, then the one being added, its entries a tensor or
    torch's ``(name, tensor)``) refused naming both places: a tied weight, which ``named_parameters(remove_duplicate=
    False)`` or a walk over ``model.modules()`` lists under each of its names. torch's AdamW steps such a param twice
    per step within a group (with a warning), and across groups refuses it without saying which; the engine's own
    refusal named nothing either."""
    seen: dict[int, tuple[str, str | None]] = {}
    for i, g in enumerate(groups):
        given = g.get("param_names") if isinstance(g.get("param_names"), (list, tuple)) else ()
        for j, entry in enumerate(g["params"]):
            name, p = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, entry)
            name = name if name is not None else (given[j] if j < len(given) else None)
            name = name if isinstance(name, str) else None
            where = f"{name!r} (param {j} of group {i})" if name else f"param {j} of group {i}"
            if id(p) not in seen:
                seen[id(p)] = (where, name)
                continue
            first, first_name = seen[id(p)]
            tied = ", one weight tied under two names" if name and first_name and name != first_name else ""
            raise ValueError(
                f"{who}: {first} and {where} are the same tensor (shape {tuple(getattr(p, 'shape', ()))}{tied}), "
                "listed twice in the param groups: each step would update it twice. List each param once: "
                "model.named_parameters() and model.parameters() give a tied param once, under its first name")
