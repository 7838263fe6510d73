"""The Adam moments of an engine's slice, stored as ``state_dtype`` "fp32", "bf16" or "int8".

int8 moments are blockwise-quantized (``ops.QUANT_BLOCK`` = 256 elements per scale, csrc/quant.h):
block i covers elements [256 i, 256 i + 256) of the slice. Engines start every slice (shard) at a
multiple of 256 of the flat layout, so a block is a block of the flat layout whatever the world
size, and checkpoints re-cut across world sizes without touching a block twice.

A run of parameters (one kernel call) starts and ends wherever its parameters do, so its first and
last block may be shared with the neighbouring run. Such a block is updated by decoding it to fp32,
applying the fp32 kernel with the compact kinds' math (``compact_math``) to this run's elements only,
and re-encoding the whole block: this run's elements as a step stores them, the others to nearest on the block's
old scale times a power of two, so a param without a gradient keeps its moments (``_shared_block``). Runs are visited in the same order at every
world size, so the result does not depend on it.

bf16 and int8 moments (both of them) are stored with stochastic rounding keyed by the element's index in the flat layout
(``origin`` + offset in the slice), so the same element rounds the same way at any world size.
"""
from __future__ import annotations

import math

import torch

from .. import ops

Q = ops.QUANT_BLOCK
SCALES = ("exp_avg_scale", "exp_avg_sq_scale")


def moment_regions(numel: int, state_dtype: str) -> dict:
    """name -> (numel, dtype) of the moments of ``numel`` params (the memory plan's regions)."""
    ops.check_state_dtype(state_dtype)
    if state_dtype == "int8":
        nb = -(-numel // Q)
        return {"exp_avg": (numel, torch.int8), "exp_avg_sq": (numel, torch.uint8),
                "exp_avg_scale": (nb, torch.float32), "exp_avg_sq_scale": (nb, torch.float32)}
    dt = torch.float32 if state_dtype == "fp32" else torch.bfloat16
    return {"exp_avg": (numel, dt), "exp_avg_sq": (numel, dt)}


def cut(state: dict, a: int, b: int) -> dict:
    """Views of elements [a, b) of a state (int8: ``a`` a multiple of Q; the scales of the blocks
    that [a, b) touches). Unlike ``ops.state_slice``, ``b`` may end inside a padded region."""
    out = {k: state[k][a:b] for k in ("exp_avg", "exp_avg_sq")}
    if "exp_avg_scale" in state:
        assert a % Q == 0, a
        out.update({k: state[k][a // Q:-(-b // Q)] for k in SCALES})
    return out


class Moments:
    """exp_avg / exp_avg_sq (and int8 scales) of one slice, as regions of the engine's arena."""

    def __init__(self, regions: dict, state_dtype: str, origin: int = 0):
        self.state_dtype = state_dtype
        self.origin = origin  # the slice's first element in the flat layout (stochastic rounding counter)
        self.state = {k: regions[k] for k in moment_regions(1, state_dtype)}
        self.length = self.state["exp_avg"].numel()  # the region (a sharded slice may be padded)

    def zero_(self) -> None:
        for t in self.state.values():
            t.zero_()

    def tensors(self, n: int) -> dict:
        """The moments of the slice's first ``n`` elements, for checkpoints (views, no copy)."""
        return cut(self.state, 0, n)

    def adam(self, a: int, b: int, master: torch.Tensor, grad: torch.Tensor, out, **kw) -> None:
        """Adam on [a, b) of the slice; ``master``, ``grad``, ``out`` cover [a, b)."""
        if self.state_dtype != "int8":
            ops.adam_step(master, grad, self.state["exp_avg"][a:b], self.state["exp_avg_sq"][a:b],
                          param_out=out, round_index=self.origin + a, **kw)
            return
        # [a, head): the end of a block shared with the previous run; [head, mid): whole blocks (the
        # last one may be the region's short tail), one fused call; [mid, b): the start of a block
        # shared with the next run
        head = a if a % Q == 0 else min(b, -(-a // Q) * Q)
        mid = b if b == self.length else max(head, b // Q * Q)

        def part(x, y):
            return master[x - a:y - a], grad[x - a:y - a], None if out is None else out[x - a:y - a]

        if head > a:
            self._shared_block(a, head, *part(a, head), kw)
        if mid > head:
            m, g, o = part(head, mid)
            ops.adam_step(m, g, param_out=o, round_index=self.origin + head, **cut(self.state, head, mid), **kw)
        if b > mid:
            self._shared_block(mid, b, *part(mid, b), kw)

    def _shared_block(self, x0: int, x1: int, master, grad, out, kw: dict) -> None:
        """[x0, x1) within one block: decode the block, fp32 Adam on the part, encode the block."""
        s = x0 // Q * Q
        block = cut(self.state, s, min(s + Q, self.length))
        m, v = ops.state_to_fp32(block)
        ops.adam_step(master, grad, m[x0 - s:x1 - s], v[x0 - s:x1 - s], param_out=out, compact_math=True, **kw)
        # [x0, x1) encoded as a step stores it (its random bits), the block's other elements (no gradient
        # this step, or another run's) to nearest, on the block's old scale times the power of two that
        # takes it into [absmax, 2 absmax): a code times 2^k is a code, so those elements keep their values
        # exactly (but where a growing scale pushes them under the code range's floor). Re-encoded on the
        # new absmax, a param that got no gradient random-walked with each rescale (exp_avg 5x off after
        # 200 steps). The scale follows the values down as well as up: a stale large one would flush them.
        # Where the other elements are all zero (a shard's padding after the last param, moments not yet
        # stepped) the block takes its absmax, as the kernel would step it whole: 1 and N ranks agree.
        others = torch.ones(len(m), dtype=torch.bool)
        others[x0 - s:x1 - s] = False
        for name, x in (("exp_avg", m), ("exp_avg_sq", v)):
            scale = None
            if x[others].any():
                scale = self._kept_scale(float(block[name + "_scale"][0]), float(x.abs().max()))
            codes, scales = ops.quantize_blockwise(x, name, scales=scale)  # others to nearest
            codes[x0 - s:x1 - s] = ops.quantize_blockwise(x, name, step=kw["step"], round_index=self.origin + s,
                                                          scales=scale)[0][x0 - s:x1 - s]
            block[name].copy_(codes)
            block[name + "_scale"].copy_(scales)

    @staticmethod
    def _kept_scale(old: float, absmax: float) -> torch.Tensor | None:
        """``old`` * 2^k (fp32) for the least integer k with ``absmax`` <= it, or None (the block takes its
        absmax) where that does not exist: no old scale, a zero absmax, or a non-finite or denormal one."""
        tiny = torch.finfo(torch.float32).tiny
        if not (tiny <= old < math.inf and tiny <= absmax < math.inf):
            return None
        k = math.floor(math.log2(absmax / old))  # then fix the last step exactly: log2 rounds
        while math.ldexp(old, k) < absmax:
            k += 1
        while math.ldexp(old, k - 1) >= absmax:
            k -= 1
        scale = torch.tensor([math.ldexp(old, k)])  # exact in fp32 while it stays normal and finite
        return scale if tiny <= float(scale[0]) < math.inf and float(scale[0]) == math.ldexp(old, k) else None
