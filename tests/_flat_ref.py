"""A plain-torch reference of the engines' compact-moment step over the flat layout.

The numbers come from ``_quant_ref`` (written from csrc/quant.h, not from the kernel); what this adds
is the engines' storage rule, stated plainly: one fp32 master and one moment state over the flat
layout of the trainable params (param-group order), int8 blocks of 256 elements of that layout, and
per run of params (``runs.make_runs``: consecutive params with a gradient and the same step count),
every block it touches decoded, updated on the run's elements only, and encoded whole.
"""
from __future__ import annotations

import math

import torch

import _quant_ref as ref
from hf_zero_offload import ops
from hf_zero_offload.engine.runs import make_runs

Q = ref.BLOCK


class FlatReference(torch.optim.Optimizer):
    def __init__(self, groups, *, lr: float, state_dtype: str, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.flat, self.groups, off = [], [], 0
        for g in self.param_groups:
            self.groups.append(list(range(len(self.flat), len(self.flat) + len(g["params"]))))
            for p in g["params"]:
                self.flat.append((p, off, p.numel()))
                off += p.numel()
        self.numel = off
        self.master = torch.cat([p.detach().reshape(-1).float().cpu() for p, _, _ in self.flat])  # a CPU reference
        self.moments = ops.make_state(off, state_dtype)  # zeros of the right dtypes and sizes
        self.steps = [0] * len(self.flat)

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0):
        grad = torch.zeros(self.numel)
        received = [p.grad is not None for p, _, _ in self.flat]
        for (p, off, n), r in zip(self.flat, received):
            if r:
                grad[off:off + n] = p.grad.reshape(-1).float()
        for run in make_runs(self.groups, self.flat, received, self.steps):
            h = self.param_groups[run.group]
            kw = dict(step=run.step, lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1], eps=h["eps"],
                      weight_decay=h["weight_decay"], adamw=True, grad_scale=grad_scale)
            if "exp_avg_scale" not in self.moments:
                self._part(run.start, run.end, run.start, run.end, grad, kw)
            else:
                for s in range(run.start // Q * Q, run.end, Q):
                    self._part(max(s, run.start), min(s + Q, run.end), s, min(s + Q, self.numel), grad, kw)
            for i in run.slots:
                self.steps[i] += 1
        for p, off, n in self.flat:
            p.copy_(self.master[off:off + n].view_as(p))

    def _part(self, x0: int, x1: int, s: int, e: int, grad, kw) -> None:
        """Elements [x0, x1) of the state span [s, e) (one int8 block, or the run itself)."""
        st = self.moments
        if "exp_avg_scale" in st:
            m = ref.dequantize(st["exp_avg"][s:e], st["exp_avg_scale"][s // Q:s // Q + 1])
            v = ref.dequantize(st["exp_avg_sq"][s:e], st["exp_avg_sq_scale"][s // Q:s // Q + 1])
        else:
            m, v = st["exp_avg"][s:e], st["exp_avg_sq"][s:e]
        part = {"exp_avg": m[x0 - s:x1 - s], "exp_avg_sq": v[x0 - s:x1 - s]}
        # int8: every block, whole or shared by two runs, takes the compact math (as the kernel does)
        ref.adam_step(self.master[x0:x1], grad[x0:x1], part, round_index=x0, compact_math="exp_avg_scale" in st,
                      **kw)
        if "exp_avg_scale" in st:
            m, v = m.clone(), v.clone()
            m[x0 - s:x1 - s], v[x0 - s:x1 - s] = part["exp_avg"], part["exp_avg_sq"]
            for name, x in (("exp_avg", m), ("exp_avg_sq", v)):
                if x0 == s and x1 == e:  # a whole block: the kernel's, on its absmax
                    st[name][s:e], st[name + "_scale"][s // Q] = ref.quantize(x, name, kw["step"], s)
                    continue
                # a block shared with params not stepped here: its old scale times the power of two that
                # takes it into [absmax, 2 absmax) (so theirs keep their values); the stepped part
                # stochastic, the rest to nearest
                old, top = float(st[name + "_scale"][s // Q]), float(x.abs().max())
                scale, tiny = None, torch.finfo(torch.float32).tiny
                others = torch.cat([x[:x0 - s], x[x1 - s:]])
                if others.any() and tiny <= old < math.inf and tiny <= top < math.inf:
                    scale = old
                    while scale < top:
                        scale *= 2
                    while scale / 2 >= top:
                        scale /= 2
                    if not tiny <= float(torch.tensor(scale)) < math.inf:
                        scale = None
                codes, sc = ref.quantize(x, name, scale=scale)
                codes[x0 - s:x1 - s] = ref.quantize(x, name, kw["step"], s, scale=scale)[0][x0 - s:x1 - s]
                st[name][s:e], st[name + "_scale"][s // Q] = codes, sc
        else:
            st["exp_avg"][s:e], st["exp_avg_sq"][s:e] = part["exp_avg"], part["exp_avg_sq"]

    def flat_state(self) -> dict:
        return {"master": self.master, **self.moments}
