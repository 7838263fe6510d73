"""The "scheduler" block's LR at every step against DeepSpeed's formulas (deepspeed.runtime.lr_schedules):
lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma, gamma rising over the warm-up (log or linear) and,
for WarmupDecayLR, falling linearly to 0 at total_num_steps, so the LR ends at warmup_min_lr."""
import math

import pytest
import torch

from hf_zero_offload.config import resolve
from hf_zero_offload.schedulers import build_scheduler


def deepspeed_lr(it, lo, hi, warmup, kind, total=None):
    if it < warmup:
        gamma = (math.log(it + 1) / math.log(warmup) if warmup > 1 else 1.0) if kind == "log" else it / warmup
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    return lo + (hi - lo) * gamma


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("lo, hi, warmup, total", [
    (0.0, 1e-3, 5, None), (1e-4, 1e-3, 5, None), (0.0, 1e-3, 4, 12), (2e-4, 1e-3, 4, 12), (5e-4, 1e-3, 1, 6),
])
def test_lr_of_every_step_is_deepspeeds(kind, lo, hi, warmup, total):
    params = {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": warmup, "warmup_type": kind}
    block = {"type": "WarmupLR", "params": params}
    if total is not None:
        block = {"type": "WarmupDecayLR", "params": {**params, "total_num_steps": total}}
    cfg = resolve({"scheduler": block})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=hi)
    sched = build_scheduler(opt, cfg.scheduler)
    seen = []
    for _ in range((total or warmup) + 3):  # past the end of the decay too
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [deepspeed_lr(it, lo, hi, warmup, kind, total) for it in range(len(seen))]
    assert seen == pytest.approx(want, rel=1e-12, abs=0.0)
    if total is not None:
        assert seen[total] == pytest.approx(lo, rel=1e-12, abs=1e-15)  # decays to warmup_min_lr, not to 0
