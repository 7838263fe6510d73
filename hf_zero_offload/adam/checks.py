"""What ``CPUAdam`` takes: a param its kernel can step, a param group's flags and hyper-parameters as a step uses
them. Each error names the group and the key (or the param's layout, device, dtype)."""
from __future__ import annotations

import torch

from .. import ops
from .flags import check_decoupled, refused_flag


def check_group(group: dict, index: int | None = None, step: int = 1) -> None:
    """A group's flags and hyper-parameters as a step uses them (``step``: the earliest its params take next, whose
    step size lr / (1 - beta1^t) is the largest); the error names the group and the key."""
    where = "" if index is None else f"CPUAdam param group {index}: "
    for key in ("adamw_mode", "maximize"):
        if key in group and not isinstance(group[key], bool):  # "false" would be true
            raise TypeError(f"{where}{key} must be a bool, got {group[key]!r}")
    refused = refused_flag(group, allowed=("maximize",))  # CPUAdam negates the gradient for maximize
    if refused:
        raise ValueError(f"{where}{refused}")
    check_decoupled(group, where)
    try:
        ops.check_state_dtype(group.get("state_dtype", "fp32"))
        ops.check_hyperparameters(lr=group.get("lr"), betas=group.get("betas"), eps=group.get("eps"),
                                  weight_decay=group.get("weight_decay"), adamw=group.get("adamw_mode", True),
                                  step=step)
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None


def check_param(p: torch.Tensor, group: int) -> None:
    """A param the kernel can step: dense, on the CPU, in fp32, bf16 or fp16."""
    if p.layout != torch.strided:
        raise TypeError(f"CPUAdam param group {group}: needs dense parameters; got a {p.layout} one "
                        f"(shape {tuple(p.shape)}): the kernel updates flat arrays")
    if p.device.type != "cpu":
        raise ValueError(f"CPUAdam param group {group}: needs CPU parameters; got one on {p.device}")
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"CPUAdam param group {group}: needs float32, bfloat16 or float16 parameters; got "
                        f"{p.dtype} (shape {tuple(p.shape)})")
