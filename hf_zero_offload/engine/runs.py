"""Runs: the unit of one optimizer kernel call, shared by the offload and the sharded engines."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Run:
    """Consecutive params of one group that all received a gradient and share a step count:
    one optimizer call covers the run."""
    group: int
    start: int
    end: int
    step: int
    slots: list


def make_runs(groups: list[list[int]], slots: list[tuple], received: list[bool], param_steps: list[int]) -> list[Run]:
    """``groups``: per param group, the flat slot indices in order."""
    runs: list[Run] = []
    for gi, idxs in enumerate(groups):
        cur = None
        for i in idxs:
            _, off, n = slots[i]
            if not received[i]:
                cur = None
                continue
            step = param_steps[i] + 1
            if cur is not None and cur.step == step and cur.end == off:
                cur.end = off + n
                cur.slots.append(i)
            else:
                cur = Run(gi, off, off + n, step, [i])
                runs.append(cur)
    return runs
