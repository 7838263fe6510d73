"""DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR as torch LR schedulers (the config's "scheduler" block).

Iteration 0 is the first optimizer step: with warmup_type "log" it runs at the start of the warm-up
(log(1) = 0) and the warm-up ends at ``warmup_num_steps``. WarmupLR / WarmupDecayLR go from ``warmup_min_lr`` to
``warmup_max_lr``, the same LR for every param group; WarmupDecayLR then decays linearly back to ``warmup_min_lr``
at ``total_num_steps`` (DeepSpeed's ``min_lr + (max_lr - min_lr) * gamma`` in both phases).
WarmupCosineLR scales each param group's own initial lr (the optimizer's lr: DeepSpeed's ``org_lrs``) by a
ratio going from ``warmup_min_ratio`` to 1 over the warm-up, then along a cosine from 1 to ``cos_min_ratio``,
which it reaches at iteration ``total_num_steps - 1`` and keeps after. As in DeepSpeed the cosine counts from the
last warm-up iteration, so its first iteration is already one step down: the ratio never quite reaches 1.

Where this differs from DeepSpeed on purpose:

* ``warmup_num_steps`` 0 or 1: DeepSpeed raises it to 2 (so the "auto" value of ``--warmup_steps 0`` would run
  its first step at the bottom of the warm-up); here it stays 1: with "log" there is no warm-up, with "linear"
  iteration 0 runs at the bottom and iteration 1 at the top.
* The first step. DeepSpeed's engine steps its schedule after each optimizer step, and its constructor sets
  the LR of the first one from iteration -1: ``warmup_min_lr`` for WarmupLR / WarmupDecayLR, 0 for
  WarmupCosineLR (whatever ``warmup_min_ratio``); under DeepSpeed, optimizer step k >= 1 runs at iteration
  k - 1. Here, as with the Trainer's own schedulers, optimizer step k runs at iteration k.
"""
from __future__ import annotations

import math

import torch


def _warm_up(it: int, warmup: int, warmup_type: str) -> float:
    """0 -> 1 over iterations ``0 .. warmup - 1`` (``warmup`` >= 1), DeepSpeed's log or linear curve."""
    if warmup_type == "log":
        return math.log(it + 1) / math.log(warmup) if warmup > 1 else 1.0
    return it / warmup


def _check_warmup_type(warmup_type: str) -> None:
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")


class _SavesPosition(torch.optim.lr_scheduler.LRScheduler):
    """The state dict is where the schedule is, not its shape: a resume with a larger max_steps kept the saved
    ``total_num_steps`` (and warm-up, LRs) over the config's values resolved for this run ("auto": this run's
    max_steps) and ran its extra steps at ``warmup_min_lr``. DeepSpeed's schedulers save only
    ``last_batch_iteration``; torch's LambdaLR saves no schedule shape either (``base_lrs`` and the counters,
    kept here as it keeps them). A state saved with the whole ``__dict__`` (before) loads: its shape is ignored."""

    _POSITION = ("base_lrs", "last_epoch", "_step_count", "_last_lr")

    def state_dict(self) -> dict:
        return {k: self.__dict__[k] for k in self._POSITION if k in self.__dict__}

    def load_state_dict(self, state_dict: dict) -> None:
        name, groups = type(self).__name__, len(self.optimizer.param_groups)
        if not isinstance(state_dict, dict):
            raise TypeError(f"{name}.load_state_dict: expected a dict, got {type(state_dict).__name__}")
        for key in ("last_epoch", "_step_count"):
            if not isinstance(state_dict.get(key), int) or isinstance(state_dict.get(key), bool):
                raise ValueError(f"{name}.load_state_dict: {key!r} must be an int, got {state_dict.get(key)!r}")
        for key in ("base_lrs", "_last_lr"):
            v = state_dict.get(key)
            if v is not None and not (isinstance(v, list) and len(v) == groups and
                                      all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
                raise ValueError(f"{name}.load_state_dict: {key!r} must be a list of {groups} learning rate(s), "
                                 f"got {v!r}")
        self.__dict__.update({k: state_dict[k] for k in self._POSITION if k in state_dict})


class WarmupLR(_SavesPosition):
    def __init__(self, optimizer, *, warmup_min_lr: float = 0.0, warmup_max_lr: float = 1e-3,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", total_num_steps: int | None = None,
                 last_epoch: int = -1):
        _check_warmup_type(warmup_type)
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        self.warmup = max(1, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.total = total_num_steps
        super().__init__(optimizer, last_epoch)

    def _gamma(self, it: int) -> float:
        if it < self.warmup:
            return _warm_up(it, self.warmup, self.warmup_type)
        if self.total is None:
            return 1.0
        return max(0.0, (self.total - it) / max(1.0, self.total - self.warmup))

    def lr_at(self, it: int) -> float:
        return self.min_lr + (self.max_lr - self.min_lr) * self._gamma(it)

    def get_lr(self):
        return [self.lr_at(self.last_epoch) for _ in self.optimizer.param_groups]


class WarmupCosineLR(_SavesPosition):
    """Each param group's initial lr (``base_lrs``, saved in the state dict) times :meth:`ratio_at`."""

    def __init__(self, optimizer, *, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4, warmup_type: str = "log",
                 last_epoch: int = -1):
        _check_warmup_type(warmup_type)
        for name, r in (("warmup_min_ratio", warmup_min_ratio), ("cos_min_ratio", cos_min_ratio)):
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"{name} must be in [0, 1] (a fraction of the optimizer's lr), got {r!r}")
        self.total = int(total_num_steps)
        self.warmup = max(1, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        super().__init__(optimizer, last_epoch)

    def ratio_at(self, it: int) -> float:
        if it < self.warmup:
            return self.min_ratio + (1.0 - self.min_ratio) * _warm_up(it, self.warmup, self.warmup_type)
        # clamped at 1: past total_num_steps (or with no room left after the warm-up) it stays at the floor
        progress = min(1.0, (it - self.warmup + 1) / max(1, self.total - self.warmup))
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ((1.0 + math.cos(math.pi * progress)) / 2)

    def get_lr(self):
        ratio = self.ratio_at(self.last_epoch)
        return [base * ratio for base in self.base_lrs]


def build_scheduler(optimizer, cfg) -> torch.optim.lr_scheduler.LRScheduler:
    """``cfg``: a resolved ``config.SchedulerConfig``."""
    if cfg.type == "WarmupCosineLR":
        return WarmupCosineLR(optimizer, total_num_steps=cfg.total_num_steps, warmup_min_ratio=cfg.warmup_min_ratio,
                              warmup_num_steps=cfg.warmup_num_steps, cos_min_ratio=cfg.cos_min_ratio,
                              warmup_type=cfg.warmup_type)
    total = cfg.total_num_steps if cfg.type == "WarmupDecayLR" else None
    return WarmupLR(optimizer, warmup_min_lr=cfg.warmup_min_lr, warmup_max_lr=cfg.warmup_max_lr,
                    warmup_num_steps=cfg.warmup_num_steps, warmup_type=cfg.warmup_type, total_num_steps=total)
