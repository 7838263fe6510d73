"""``CPUAdam``: a ``torch.optim.Optimizer`` for CPU parameters backed by the fused C++ kernel.

Per-param state has ``torch.optim.AdamW``'s layout (``step`` as a float tensor, ``exp_avg``,
``exp_avg_sq``), so state dicts load both ways. Hyper-parameters are read from ``param_groups`` at
every step, so LR schedulers work.
"""
from __future__ import annotations

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
    ):
        if lr < 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if eps < 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        super().__init__(params, defaults)
        self.num_threads = num_threads
        for group in self.param_groups:
            for p in group["params"]:
                if p.device.type != "cpu":
                    raise ValueError(f"CPUAdam needs CPU parameters; got one on {p.device}")
                if p.dtype != torch.float32:
                    raise TypeError(f"CPUAdam needs float32 parameters; got {p.dtype}")

    def __setstate__(self, state):
        # Also the path of load_state_dict, whose saved groups replace ours: a group saved by
        # torch.optim.Adam/AdamW has no "adamw_mode" but says "decoupled_weight_decay".
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", bool(group.get("decoupled_weight_decay", True)))
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
        for group in self.param_groups:
            for flag in ("amsgrad", "maximize"):  # may come in with a torch.optim.Adam(W) state dict
                if group.get(flag):
                    raise ValueError(f"CPUAdam does not support {flag}=True (param group loaded from another optimizer?)")
            beta1, beta2 = (float(b) for b in group["betas"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("CPUAdam does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                ops.adam_step(
                    p,  # ops raises if not contiguous: an update to a copy would be lost
                    p.grad.contiguous(),  # a read-only input: a copy here loses nothing
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=int(state["step"].item()),
                    lr=float(group["lr"]),  # a tensor lr (some schedulers) becomes a float here
                    beta1=beta1,
                    beta2=beta2,
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    adamw=bool(group["adamw_mode"]),
                    num_threads=self.num_threads,
                )
        return loss

