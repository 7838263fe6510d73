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


@pytest.mark.parametrize("total", [None, 9], ids=["WarmupLR", "WarmupDecayLR"])
def test_schedule_resumes_from_its_state_dict(total):
    """scheduler.pt: a new scheduler loaded from the saved state goes on where the first one was."""
    params = {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"}
    block = {"type": "WarmupLR" if total is None else "WarmupDecayLR",
             "params": params if total is None else {**params, "total_num_steps": total}}
    cfg = resolve({"scheduler": block})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = build_scheduler(opt, cfg.scheduler)
    for _ in range(6):
        opt.step()
        sched.step()
    again = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), cfg.scheduler)
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == sched.get_last_lr()
    sched.step()
    again.step()
    assert again.get_last_lr() == sched.get_last_lr()


# ---------------------------------------------------------------- WarmupCosineLR


def cosine_ratio(it, min_ratio, warmup, cos_min, kind, total):
    """DeepSpeed's WarmupCosineLR ratio, written out: warmup_num_steps 1 is no warm-up (log) here."""
    if it < warmup:
        if kind == "linear":
            up = it / warmup
        else:
            up = 1.0 if warmup == 1 else math.log(it + 1) / math.log(warmup)
        return min_ratio + up * (1.0 - min_ratio)
    span = max(1, total - warmup)
    done = min(span, it - warmup + 1) / span  # the cosine counts from the last warm-up iteration
    return cos_min + (1.0 - cos_min) * 0.5 * (1.0 + math.cos(math.pi * done))


COSINE_CASES = [  # warmup_min_ratio, warmup_num_steps, cos_min_ratio, total_num_steps
    (0.0, 5, 1e-4, 15), (0.1, 4, 0.0, 12), (0.5, 1, 0.3, 8), (0.25, 3, 1.0, 9), (0.2, 6, 0.05, 6), (0.0, 8, 0.1, 5),
]
GROUP_LRS = (1e-3, 3e-4)


def _two_groups(lrs=GROUP_LRS):
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs], lr=lrs[0])


def _cosine_block(min_ratio, warmup, cos_min, total, kind):
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": total, "warmup_min_ratio": min_ratio,
                                                 "warmup_num_steps": warmup, "cos_min_ratio": cos_min,
                                                 "warmup_type": kind}}


def _lrs_of_every_step(opt, sched, n):
    seen = []
    for _ in range(n):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return seen


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("min_ratio, warmup, cos_min, total", COSINE_CASES)
def test_cosine_lr_of_every_step_is_the_formula(kind, min_ratio, warmup, cos_min, total):
    """Each param group's own lr times the ratio, at every step and past total_num_steps (held at the floor)."""
    cfg = resolve({"scheduler": _cosine_block(min_ratio, warmup, cos_min, total, kind)})
    opt = _two_groups()
    seen = _lrs_of_every_step(opt, build_scheduler(opt, cfg.scheduler), max(total, warmup) + 4)
    want = [[lr * cosine_ratio(it, min_ratio, warmup, cos_min, kind, total) for lr in GROUP_LRS]
            for it in range(len(seen))]
    assert seen == [pytest.approx(w, rel=1e-12, abs=0.0) for w in want]
    assert seen[-1] == pytest.approx([lr * cos_min for lr in GROUP_LRS], rel=1e-12, abs=0.0)
    assert seen[0] == pytest.approx([lr * (1.0 if warmup == 1 and kind == "log" else min_ratio)
                                     for lr in GROUP_LRS], rel=1e-12, abs=0.0)


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("min_ratio, warmup, cos_min, total", [c for c in COSINE_CASES if c[1] >= 2])
def test_cosine_matches_deepspeeds_own_class(kind, min_ratio, warmup, cos_min, total):
    """Iteration by iteration against deepspeed.runtime.lr_schedules.WarmupCosineLR (warmup_num_steps >= 2: below,
    DeepSpeed makes it 2; the module docstring says why this one does not)."""
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules")
    cfg = resolve({"scheduler": _cosine_block(min_ratio, warmup, cos_min, total, kind)})
    opt, ds_opt = _two_groups(), _two_groups()
    ours = _lrs_of_every_step(opt, build_scheduler(opt, cfg.scheduler), max(total, warmup) + 4)
    theirs = ds.WarmupCosineLR(ds_opt, total_num_steps=total, warmup_min_ratio=min_ratio, warmup_num_steps=warmup,
                               cos_min_ratio=cos_min, warmup_type=kind)
    for it, lrs in enumerate(ours):
        theirs.step()  # its iteration `it` (DeepSpeed's constructor leaves iteration -1, LR 0, in place)
        assert lrs == pytest.approx([g["lr"] for g in ds_opt.param_groups], rel=1e-12, abs=0.0), it


def test_cosine_resumes_from_its_state_dict():
    """scheduler.pt: the group lrs the schedule scales come back from the saved state, not the new optimizer."""
    cfg = resolve({"scheduler": _cosine_block(0.1, 3, 0.01, 10, "linear")})
    opt = _two_groups()
    sched = build_scheduler(opt, cfg.scheduler)
    _lrs_of_every_step(opt, sched, 5)
    again_opt = _two_groups((0.5, 0.5))
    again = build_scheduler(again_opt, cfg.scheduler)
    again.load_state_dict(sched.state_dict())
    rest = _lrs_of_every_step(opt, sched, 8)[1:]
    assert _lrs_of_every_step(again_opt, again, 8)[1:] == rest
    assert rest[-1] == pytest.approx([lr * 0.01 for lr in GROUP_LRS], rel=1e-12, abs=0.0)


@pytest.mark.parametrize("block", [
    {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 2}},
    _cosine_block(0.1, 2, 0.01, None, "linear")], ids=["WarmupDecayLR", "WarmupCosineLR"])
def test_the_state_dict_is_where_the_schedule_is_and_the_config_gives_its_shape(block):
    """A resume with a larger max_steps ("auto" total_num_steps): the saved total (and warm-up, LRs) used to be
    loaded over this run's, from the whole __dict__. Now the state holds base_lrs and the counters only (as
    torch's LambdaLR, DeepSpeed's last_batch_iteration); both it and a state saved the old way load, and the
    schedule goes on as one built for the longer run, every LR equal. A damaged state is refused by key."""
    def build(total):
        return build_scheduler(_two_groups(), resolve({"scheduler": {
            **block, "params": {**block["params"], "total_num_steps": total}}}).scheduler)

    short, long = build(4), build(10)
    _lrs_of_every_step(short.optimizer, short, 3)
    _lrs_of_every_step(long.optimizer, long, 3)
    assert set(short.state_dict()) == {"base_lrs", "last_epoch", "_step_count", "_last_lr"}
    whole = torch.optim.lr_scheduler.LRScheduler.state_dict(short)  # how scheduler.pt was written before
    assert whole["total"] == 4
    want = _lrs_of_every_step(long.optimizer, long, 8)[1:]
    for saved in (short.state_dict(), whole):
        again = build(10)
        again.load_state_dict(saved)
        assert again.total == 10 and again.last_epoch == 3
        assert _lrs_of_every_step(again.optimizer, again, 8)[1:] == want
    with pytest.raises(ValueError, match=r"load_state_dict: 'last_epoch' must be an int, got 'x'"):
        build(10).load_state_dict({**short.state_dict(), "last_epoch": "x"})
    with pytest.raises(ValueError, match=r"'_last_lr' must be a list of 2 learning rate\(s\), got \[0.1\]"):
        build(10).load_state_dict({**short.state_dict(), "_last_lr": [0.1]})


def test_trainer_runs_a_warmup_cosine_block(tmp_path):
    """A real Trainer run: the LR it logs at every step (the LR that step used) is the formula's, with "auto"
    total_num_steps / warmup_num_steps from max_steps / --warmup_steps, peaking at --learning_rate."""
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                                              "warmup_min_ratio": 0.2, "cos_min_ratio": 0.1}}}
    args = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=str(tmp_path / "out"), zero_offload=cfg, per_device_train_batch_size=4, max_steps=7,
        warmup_steps=3, learning_rate=1e-2, lr_scheduler_type="cosine", use_cpu=True, report_to=[], logging_steps=1,
        save_strategy="no", seed=0, disable_tqdm=True)
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset())
    trainer.train()
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    want = [1e-2 * cosine_ratio(it, 0.2, 3, 0.1, "log", 7) for it in range(7)]
    assert logged == pytest.approx(want, rel=1e-12, abs=0.0)
    # the engine's groups (decay and no-decay) hold the next iteration's LR: the schedule reached the optimizer
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx(
        [1e-2 * cosine_ratio(7, 0.2, 3, 0.1, "log", 7)] * 2, rel=1e-12, abs=0.0)
    assert trainer.zero_config.scheduler.total_num_steps == 7 and trainer.zero_config.scheduler.warmup_num_steps == 3
