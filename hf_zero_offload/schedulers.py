"""DeepSpeed's WarmupLR / WarmupDecayLR as torch LR schedulers (the config's "scheduler" block).

Iteration 0 is the first optimizer step, as in DeepSpeed: with warmup_type "log" it runs at
``warmup_min_lr`` (log(1) = 0) and the LR reaches ``warmup_max_lr`` at ``warmup_num_steps`` (1: no warm-up).
WarmupDecayLR then decays linearly back to ``warmup_min_lr`` at ``total_num_steps``: DeepSpeed's
``min_lr + (max_lr - min_lr) * gamma`` in both phases.
"""
from __future__ import annotations

import math

import torch


class WarmupLR(torch.optim.lr_scheduler.LRScheduler):
    def __init__(self, optimizer, *, warmup_min_lr: float = 0.0, warmup_max_lr: float = 1e-3,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", total_num_steps: int | None = None,
                 last_epoch: int = -1):
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        self.warmup = max(1, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.total = total_num_steps
        super().__init__(optimizer, last_epoch)

    def _gamma(self, it: int) -> float:
        if it < self.warmup:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(self.warmup) if self.warmup > 1 else 1.0
            return it / self.warmup
        if self.total is None:
            return 1.0
        return max(0.0, (self.total - it) / max(1.0, self.total - self.warmup))

    def lr_at(self, it: int) -> float:
        return self.min_lr + (self.max_lr - self.min_lr) * self._gamma(it)

    def get_lr(self):
        return [self.lr_at(self.last_epoch) for _ in self.optimizer.param_groups]


def build_scheduler(optimizer, cfg) -> WarmupLR:
    """``cfg``: a resolved ``config.SchedulerConfig``."""
    total = cfg.total_num_steps if cfg.type == "WarmupDecayLR" else None
    return WarmupLR(optimizer, warmup_min_lr=cfg.warmup_min_lr, warmup_max_lr=cfg.warmup_max_lr,
                    warmup_num_steps=cfg.warmup_num_steps, warmup_type=cfg.warmup_type, total_num_steps=total)
