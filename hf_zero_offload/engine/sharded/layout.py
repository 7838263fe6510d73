"""Index arithmetic for ``ShardedAdam``: the partition map and the gradient buckets.

Everything here is pure bookkeeping over the flat layout (trainable params in param-group order,
``offset`` = sum of the sizes before): no tensors are allocated and no collective is issued, so
every rank computes the same answers from the same model.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """Equal flat slices: rank r owns [r * S, (r + 1) * S) of the flat layout padded to W * S.

    Every rank allocates exactly S = ceil(N / W) elements of each optimizer-state tensor (the last
    ranks' tails are padding that no parameter maps to), so collectives move equal pieces and the
    memory per rank is N / W to within one element.
    """
    numel: int
    world_size: int
    align: int = 1  # S is a multiple of this (int8 moments: a quantization block never straddles shards)

    @property
    def shard_numel(self) -> int:
        s = max(1, -(-self.numel // self.world_size))
        return -(-s // self.align) * self.align

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def start(self, rank: int) -> int:
        return min(rank * self.shard_numel, self.numel)

    def end(self, rank: int) -> int:
        return min((rank + 1) * self.shard_numel, self.numel)

    def ranges(self) -> list[list[int]]:
        return [[self.start(r), self.end(r)] for r in range(self.world_size)]

    def segments(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """(owner, lo, hi) for each rank's part of the padded flat range [a, b), in rank order."""
        s = self.shard_numel
        out = []
        for r in range(a // s, min(self.world_size, -(-b // s))):
            lo, hi = max(a, r * s), min(b, (r + 1) * s)
            if hi > lo:
                out.append((r, lo, hi))
        return out


@dataclass
class Bucket:
    """A contiguous flat range [start, end) holding whole parameters (``slots``: indices into the
    flat slot list); the bucket holding the last parameter also covers the padding up to W * S."""
    start: int
    end: int
    slots: list

    @property
    def numel(self) -> int:
        return self.end - self.start


def make_buckets(slots: list[tuple], cap: int, padded_numel: int) -> list[Bucket]:
    """Stage-2 buckets in launch order. Backward produces gradients roughly from the last
    registered parameter to the first, so buckets are cut walking the flat layout backwards:
    bucket 0 holds the last parameters and is usually the first to fill."""
    buckets: list[Bucket] = []
    cur: Bucket | None = None
    for i in range(len(slots) - 1, -1, -1):
        _, off, n = slots[i]
        if cur is not None and cur.end - off <= cap:
            cur.start = off
            cur.slots.append(i)
            continue
        cur = Bucket(off, off + n, [i])
        buckets.append(cur)
    buckets[0].end = padded_numel  # bucket 0 holds the last parameter: the padding rides along, as zeros
    return buckets
