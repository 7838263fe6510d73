"""``AgreedControl``: the ranks of a sharded run act on one ``TrainerControl``.

Each rank runs its own callbacks, and each rank's ``control`` decides whether it logs (a gather of the loss),
evaluates (the evaluation's gathers), saves (the engine's shards) and stops. A callback that set a flag on one rank
only (a stop file looked at on rank 0, a rank-local metric, ``if not state.is_world_process_zero:
control.should_save = False``) sent the ranks into different collectives: ``should_log`` on rank 0 alone aborted
its process in gloo ("Received data size doesn't match expected size", exit -6), ``should_evaluate`` on one rank
waited until the collective timeout (30 minutes by default); plain DDP does the same (an outside probe, 2 gloo ranks).

Here the ranks agree at each of the Trainer's log/evaluate/save points, before its first collective: a flag set on
any rank is taken by every rank (as accelerate's ``set_trigger``/``check_trigger``), and one warning per flag and
``train()``, on rank 0, names the ranks that differed. Agreed again after the point's log (its ``on_log`` callbacks
may ask for an evaluation or a save), after its evaluation (``on_evaluate``) and at its end (``on_save``: a stop).
One all-reduce of ``world_size x 5`` ints per step (about 0.9 ms with gloo on 2 ranks of a 2-core VM; up to three
more at a step that logs, evaluates or saves); nothing with one process, or without the engine (the plain
Trainer's behaviour is kept). A save still one-sided past this (no engine; ``--save_strategy best`` sets should_save
after the last agreement) is stopped, naming the ranks, by the save's own agreement (``saving._zo_agree_to_save``).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .shared_dir import distributed, ranks_named

logger = logging.getLogger("hf_zero_offload")

FLAGS = ("should_log", "should_evaluate", "should_save", "should_epoch_stop", "should_training_stop")


def agree(control, rank: int, world_size: int, device) -> list[tuple[str, list[int], list[int]]]:
    """Every rank's ``control`` takes each of FLAGS that any rank has set (one all-reduce); returns, for each flag
    the ranks differed on, (flag, the ranks that had it set, the ranks that had not)."""
    every = torch.zeros(world_size, len(FLAGS), dtype=torch.int32, device=device)
    every[rank] = torch.tensor([bool(getattr(control, f)) for f in FLAGS], dtype=torch.int32, device=device)
    dist.all_reduce(every)  # (a sum: each rank's row, as it is)
    every = every.cpu().tolist()
    differed = []
    for i, flag in enumerate(FLAGS):
        on = [r for r in range(world_size) if every[r][i]]
        if on:
            setattr(control, flag, True)
        if on and len(on) < world_size:
            differed.append((flag, on, [r for r in range(world_size) if not every[r][i]]))
    return differed


class AgreedControl:
    """Mixed into ``ZeroOffloadMixin``: reads the Trainer's ``args``, ``state``, ``control`` and ``_zo_raw``."""
    _zo_agree_after: set | frozenset = frozenset()  # the phases of the point in progress still to agree after
    _zo_acted = False  # whether a phase agreed since the point began logs, evaluates or saves
    _zo_control_said: tuple | None = None  # (the train()'s state, the flags said in it)

    def _zo_agreeing(self) -> bool:
        return getattr(self, "_zo_raw", None) is not None and distributed(self.args.world_size)

    def _zo_agree_control(self, where: str) -> bool:
        """The ranks' flags agreed; whether the point logs, evaluates or saves (the same on every rank)."""
        differed = agree(self.control, self.args.process_index, self.args.world_size, self.args.device)
        if differed and self.args.process_index == 0:
            said = self._zo_control_said
            if said is None or said[0] is not self.state:  # once per flag and train() (each builds its state)
                said = self._zo_control_said = (self.state, set())
            for flag, on, off in differed:
                if flag not in said[1]:
                    said[1].add(flag)
                    logger.warning(
                        "hf_zero_offload: control.%s was set on %s and not on %s (%s, step %d): every rank takes it, "
                        "as the ranks of a sharded run must log, evaluate, save and stop together (each takes part "
                        "in the collectives; one rank alone aborted or hung in them). A flag set on any rank is "
                        "taken by all; said once per flag and train()", flag, ranks_named(on), ranks_named(off), where,
                        self.state.global_step)
        c = self.control
        return bool(c.should_log or c.should_evaluate or c.should_save)

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        if not self._zo_agreeing() or getattr(self, "_zo_own_end", False):  # (own_end: same_run.SameBatches)
            return super()._maybe_log_save_evaluate(*args, **kwargs)
        acted = self._zo_agree_control("after on_step_end/on_epoch_end")
        # the point's own log and evaluation (the same on every rank, the flags agreed): their callbacks may set flags
        logs = self.control.should_log and self.state.global_step > self._globalstep_last_logged
        self._zo_agree_after = {"log", "evaluate"} if logs else {"evaluate"}
        try:
            out = super()._maybe_log_save_evaluate(*args, **kwargs)
        finally:
            acted = acted or self._zo_acted
            self._zo_agree_after, self._zo_acted = frozenset(), False
        if acted:  # a stop asked by on_log, on_evaluate or on_save on some ranks: taken before the loop reads it
            self._zo_agree_control("after on_log/on_evaluate/on_save")
        return out

    def _zo_agree_after_phase(self, phase: str, where: str) -> None:
        if phase in self._zo_agree_after:
            self._zo_agree_after.discard(phase)
            self._zo_acted = self._zo_agree_control(where) or self._zo_acted

    def log(self, logs: dict, *args, **kwargs):
        out = super().log(logs, *args, **kwargs)
        self._zo_agree_after_phase("log", "after on_log")
        return out

    def _evaluate(self, *args, **kwargs):
        if self._zo_agree_after:  # (evaluate's own log: agreed after the evaluation, not at its log)
            self._zo_agree_after.discard("log")
        out = super()._evaluate(*args, **kwargs)
        self._zo_agree_after_phase("evaluate", "after on_evaluate")
        return out
