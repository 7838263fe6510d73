"""The gradient store's sum of squares, taken as the gradients land in it.

Every step needs the squared norm of its gradients (clipping, the fp16 overflow check, the norm the Trainer logs),
and a pass over the whole store at ``step()`` costs what the store weighs: 24 ms of a 1B-param step on the H100
machine of session 40 (its CPU Adam pass: 266 ms), 10 of 90 ms at 50M on a 2-core CPU. The pipeline that writes each
gradient into the store sums the squares of what it just wrote, on its scatter thread while backward goes on (where
the values are still in cache, one thread: no hand-off to the kernels' pool), so ``step()`` adds up a few numbers
instead. Without a scatter thread (the CPU default: the store is written inline, in backward) ``step()`` keeps its one
pass: a sum there would only move the same work onto backward.

What a sum covers can go stale: a later micro-batch (or a checkpointed layer's second gradient) writes a param
again, and the sum of the range that held it no longer describes the store. Each range's sum is therefore kept with
the params it covers, and a param written again voids the sum of its earlier range; ``total()`` returns the params
no valid sum covers, for the caller's own pass over just those. The result is the same set of fp64 partial sums
however the ranges fall, summed in the order they landed (deterministic for one model and configuration); it
rounds differently from one pass over the whole store only in fp64's last bits.
"""
from __future__ import annotations


class LandedNorms:
    """Sums of squares of store ranges, by the slots (params) each covers, for one accumulation window."""

    def __init__(self, nslots: int):
        self._nslots = nslots
        self.reset()

    def reset(self) -> None:
        """A new window: nothing of the store is summed yet."""
        self._range_of: list[int | None] = [None] * self._nslots  # per slot: the range whose sum covers it
        self._sums: list[float | None] = []                        # per range: its sum, None once voided

    def landed(self, slots: list[int], sumsq: float) -> None:
        """``slots`` were just written and the store range holding exactly them sums to ``sumsq``."""
        r = len(self._sums)
        self._sums.append(sumsq)
        for i in slots:
            old = self._range_of[i]
            if old is not None:
                self._sums[old] = None  # a param of that range changed since: its sum no longer holds
            self._range_of[i] = r

    def total(self, wanted: list[bool]) -> tuple[float, list[int]]:
        """(the sum over the valid ranges covering ``wanted`` slots, the wanted slots none covers)."""
        ranges, missing = set(), []
        for i, w in enumerate(wanted):
            if not w:
                continue
            r = self._range_of[i]
            if r is None or self._sums[r] is None:
                missing.append(i)
            else:
                ranges.add(r)
        return sum(self._sums[r] for r in sorted(ranges)), missing
