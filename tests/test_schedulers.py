"""The config's "scheduler" block (DeepSpeed's WarmupLR / WarmupDecayLR) against DeepSpeed's formulas, written out
here from its documentation: gamma rises over the warm-up (log: log(it + 1) / log(W); linear: it / W), then stays
at 1 (WarmupLR) or falls linearly, max(0, (T - it) / max(1, T - W)) (WarmupDecayLR); lr = min + (max - min) * gamma
in both phases."""
from __future__ import annotations

import math

import pytest
import torch

from hf_zero_offload.schedulers import WarmupLR

MIN, MAX = 1e-4, 1e-3


def deepspeed_lr(it: int, warmup: int, total: int | None, kind: str) -> float:
    if it < warmup:
        gamma = math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    return MIN + (MAX - MIN) * gamma


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("total", [None, 9], ids=["WarmupLR", "WarmupDecayLR"])
def test_schedule_is_deepspeeds_including_a_nonzero_min_lr(kind, total):
    """WarmupDecayLR with warmup_min_lr > 0 decayed to 0 (max_lr * gamma), not back to warmup_min_lr."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=MAX)
    sched = WarmupLR(opt, warmup_min_lr=MIN, warmup_max_lr=MAX, warmup_num_steps=4, warmup_type=kind,
                     total_num_steps=total)
    seen = []
    for _ in range(12):  # past total_num_steps: DeepSpeed holds warmup_min_lr there
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([deepspeed_lr(it, 4, total, kind) for it in range(12)], rel=1e-12, abs=0)
    # the schedule resumes from its state_dict (scheduler.pt) where it was
    again = WarmupLR(opt, warmup_min_lr=MIN, warmup_max_lr=MAX, warmup_num_steps=4, warmup_type=kind,
                     total_num_steps=total)
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == sched.get_last_lr()
