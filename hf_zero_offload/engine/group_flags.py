"""What a param group may carry: torch.optim's Adam/AdamW flags, which the engines refuse by name; and the groups'
params, which are fixed when an engine is built.

The step reads only lr, betas, eps, weight_decay and adamw_mode, so a flag that changes the math (or a
per-group state_dtype) copied from another optimizer's groups, or set by hand, used to be dropped without a
word. The engines check every group at each step (``AdamCore``); a user's ``create_optimizer`` whose torch
optimizer the Trainer integration takes over is checked against the same tables (``engine_setup``).
"""
from __future__ import annotations

import torch

from ..adam.flags import check_decoupled, refused_flag, torch_style


def check_group_flags(g: dict, state_dtype: str) -> None:
    """A ValueError naming the first flag of group ``g`` the engine (moments stored as ``state_dtype``) cannot
    honour (``adam.flags``' tables, shared with CPUAdam; the engines refuse ``maximize`` too)."""
    if not isinstance(g["adamw_mode"], bool):  # "false" would be true
        raise ValueError(f"adamw_mode must be a bool, got {g['adamw_mode']!r}")
    refused = refused_flag(g)
    if refused:
        raise ValueError(refused)
    check_decoupled(g)
    sd = g.get("state_dtype")
    if sd is not None and sd != state_dtype:
        raise ValueError(f"state_dtype={sd!r} differs from OffloadOptions.state_dtype={state_dtype!r}: the engine "
                         "stores every group's moments one way")


def value(x) -> float:
    """A hyper-parameter as a number (a one-element tensor's value: a copy a scheduler writing the tensor in place
    cannot change later)."""
    return float(x.item()) if torch.is_tensor(x) else float(x)


def layout_change(built: list[tuple[int, ...]], groups: list[dict]) -> str | None:
    """How ``groups``' param lists differ from ``built`` (each group's ``id``s when the engine was built), in words;
    None when they do not. The engine lays its state out by group when built and a step applies group i's
    settings to the params it was built with: torch.optim reads the lists at each step, so a param moved to
    another group (another lr), removed, or groups reordered trained on with the wrong settings, silently."""
    now = [tuple(map(id, g["params"])) for g in groups]
    if now == built:
        return None
    if len(now) != len(built):
        change = f"param_groups has {len(now)} groups; the engine was built with {len(built)}"
    else:
        before, after = {i for g in built for i in g}, {i for g in now for i in g}
        i = next(k for k, (a, b) in enumerate(zip(built, now)) if a != b)
        what = ("params added" if after - before else "params removed" if before - after else
                "params moved between groups or reordered")
        change = f"param group {i}'s params differ from those the engine was built with ({what})"
    return (f"{change}: an engine's flat layout (which params, in which group and order) is fixed when it is built, so "
            "a step would apply each group's settings to the params it was built with; restore the lists, or build an "
            "engine over the new groups")


def torch_style_groups(params):
    """``params`` with each group given the torch way read as CPUAdam reads it (``adam.flags.torch_style``). A lone
    tensor is left to torch's own TypeError."""
    return params if isinstance(params, torch.Tensor) else [torch_style(g) for g in params]
