"""A checkpoint's ``scheduler.pt`` into this run's LR schedule: as saved, or, when another kind of schedule (or one
of another number of param groups) saved it, this run's own schedule at the saved step, as transformers goes from
one ``--lr_scheduler_type`` to another. A file that does not load is an error naming it."""
from __future__ import annotations

import torch


class DamagedFile(ValueError):
    """A file of a checkpoint that is there but cannot be loaded; the message names it."""


class OtherSchedule(ValueError):
    """A scheduler.pt of another kind of LR schedule, which this run's cannot take its step from."""


def load_scheduler(scheduler, path: str, step: int | None = None) -> str | None:
    """``path`` (scheduler.pt) into the LR schedule; the Trainer calls it before the engine's state is loaded (it was
    read after: a damaged file failed with torch's error naming no file, the engine already overwritten), and
    restores the schedule it had should either load fail. A file that does not load is an error naming it.
    Returns a warning to log when a schedule of another kind, or of another number of param groups, saved it (its
    step is carried over; ``step``: the checkpoint's global step, which a plateau scheduler's own count of
    evaluations is not)."""
    try:
        saved = torch.load(path, weights_only=True)
        groups = len(scheduler.optimizer.param_groups)
        rates = saved.get("base_lrs") if isinstance(saved, dict) else None
        if isinstance(rates, list) and len(rates) != groups:
            # the Trainer's empty param group was dropped until session 19: torch's schedulers loaded the old list
            # of rates and failed at the first step (a strict zip); this run's own rates go on from the saved step
            why = f"for {len(rates)} param group(s), and this run has {groups}"
            return _carry_position(scheduler, saved, step, path, why, None)
        try:
            scheduler.load_state_dict(saved)
        except Exception as e:
            # A schedule of another kind saved it (a ds_config "scheduler" block, then none, or the reverse; the
            # plateau schedulers): as transformers goes from one --lr_scheduler_type to another, this run's
            # schedule goes on from the saved step (it was refused as a damaged file)
            return _carry_position(scheduler, saved, step, path, "by another kind of LR schedule", e)
    except OtherSchedule:
        raise
    except Exception as e:
        raise DamagedFile(f"{path} cannot be loaded ({type(e).__name__}: {e}); resume from an earlier checkpoint, or "
                          "remove the file to restart the learning-rate schedule from its first step") from e
    return None


def _carry_position(scheduler, saved, step: int | None, path: str, why: str, error: Exception | None) -> str:
    position = _position_of(saved, scheduler, step)
    if position is None and isinstance(saved, dict) and type(saved.get("last_epoch")) is int:
        raise OtherSchedule(f"{path} was saved {why}, and this run's {type(scheduler).__name__} cannot take its step"
                            f"{f' ({type(error).__name__}: {error})' if error is not None else ''}; resume with the "
                            "schedule that saved it")
    if position is None:
        raise error if error is not None else ValueError("no step recorded")
    scheduler.load_state_dict(position)
    return (f"hf_zero_offload: {path} was saved {why}: this run's {type(scheduler).__name__} goes on from step "
            f"{position['last_epoch']} (the first step resumed runs at the saved rate)")


def _position_of(saved, scheduler, global_step: int | None) -> dict | None:
    """``scheduler``'s own state at the step ``saved`` (a torch LR scheduler's state) records, or None when
    ``saved`` records no step or ``scheduler`` is made of others (SequentialLR, ChainedScheduler: the step of each
    inner one is not the saved state's to say)."""
    if not isinstance(saved, dict) or "_schedulers" in scheduler.state_dict():
        return None
    # ReduceLROnPlateau (and transformers' GreedyLR) step once per evaluation: their count is not the step's
    per_evaluation = "num_bad_epochs" in saved or "cooldown_counter" in saved
    step = global_step if per_evaluation else saved.get("last_epoch")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    count = step + 1 if per_evaluation else saved.get("_step_count", step + 1)
    groups = len(scheduler.optimizer.param_groups)
    last = saved.get("_last_lr")
    position = {**scheduler.state_dict(), "last_epoch": step,
                "_step_count": count if isinstance(count, int) and not isinstance(count, bool) else step + 1}
    if isinstance(last, list) and last and len(last) != groups and all(x == last[0] for x in last):
        last = [last[0]] * groups  # another number of groups (an empty one kept), all at one rate: that rate
    if isinstance(last, list) and len(last) == groups:
        position["_last_lr"] = last  # the rate the optimizer's state holds, which the first resumed step runs at
    return position
