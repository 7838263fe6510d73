"""Small models shared by the engine tests."""
from __future__ import annotations

import copy
import os

import torch
from torch import nn

from hf_zero_offload.engine.checkpoint import folder
from hf_zero_offload.ops import QUANT_BLOCK as Q


class TinyNet(nn.Module):
    """A frozen layer, a tied weight (embedding == output projection) and a branch that is used
    only on some steps (so some params get no gradient in some steps)."""

    def __init__(self, vocab: int = 50, dim: int = 24):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.branch = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.frozen(h)
        h = h + self.body(h)
        if use_branch:
            h = h + self.branch(h)
        return self.head(self.norm(h))


def batches(n: int, *, vocab: int = 50, seed: int = 0, batch: int = 4, seq: int = 6):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((ids, torch.randint(0, vocab, (batch, seq), generator=g), i % 3 != 2))
    return out


def loss_fn(model: nn.Module, ids, labels, use_branch) -> torch.Tensor:
    logits = model(ids, use_branch)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def run_steps(model: nn.Module, opt, data) -> None:
    """One optimizer step per batch of ``data`` (``batches``), no accumulation, no loss scaling."""
    for ids, labels, use_branch in data:
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()


def write_some_params(model: TinyNet) -> list[nn.Parameter]:
    """A user's writes between two steps (in place under no_grad, and load_state_dict); returns the params written."""
    with torch.no_grad():
        model.body[0].weight.fill_(0.5)
    model.norm.load_state_dict({"weight": torch.full_like(model.norm.weight, 2.0), "bias": model.norm.bias * 0 + 0.1})
    return [model.body[0].weight, model.norm.weight, model.norm.bias]


def param_groups(model: nn.Module, weight_decay: float):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def delayed_update_reference(device_model: nn.Module, data, warmup: int, *, lr: float, weight_decay: float,
                             forward=None, gas: int = 1, make_opt=None, edit=None):
    """Hand-written delayed parameter update: AdamW (foreach=False) on fp32 masters, the device model's
    params one step behind after ``warmup`` steps. ``forward``: what the loss runs (e.g. a DDP
    wrapper of ``device_model``); micro-batch i of ``gas`` is rows ``i::gas``; ``make_opt``: another
    optimizer over the param groups instead of AdamW; ``edit``: (k, fn), fn(device_model) writes some
    params after step k and returns them: they keep the written values, which their masters take before
    step k + 1 or the end (a flush; the in-flight step's update of them is dropped). Returns (device model, master model)."""
    master_model = copy.deepcopy(device_model)
    forward = forward if forward is not None else device_model
    groups = param_groups(master_model, weight_decay)
    ref = make_opt(groups) if make_opt else torch.optim.AdamW(groups, lr=lr, foreach=False)
    pairs = [(d, m) for d, m in zip(device_model.parameters(), master_model.parameters()) if d.requires_grad]
    written = []
    for k, (ids, labels, use_branch) in enumerate(data, start=1):
        for i in range(gas):
            (loss_fn(forward, ids[i::gas], labels[i::gas], use_branch) / gas).backward()
        for d, m in pairs:
            m.grad, d.grad = d.grad, None
        with torch.no_grad():
            for d, m in pairs:
                if any(d is w for w in written):
                    m.copy_(d)
            if k > warmup:  # publish the masters of step k-1, then step k on the side
                for d, m in pairs:
                    d.copy_(m)
            ref.step()
            ref.zero_grad()
            if k <= warmup:
                for d, m in pairs:
                    d.copy_(m)
            written = edit[1](device_model) if edit is not None and edit[0] == k else []
    with torch.no_grad():  # after the last step: what the engine's flush() publishes
        for d, m in pairs:
            if any(d is w for w in written):
                m.copy_(d)
    return device_model, master_model


def save_as_two_ranks(opt, directory) -> None:
    """``opt``'s state as the 2-rank checkpoint a sharded run with the same flat layout writes (its shards start on
    an int8 block; int8 scales are cut by block)."""
    meta, tensors = {**opt.state_meta(), "save_id": os.urandom(8).hex()}, opt.state_tensors()  # as save_checkpoint
    cut = opt.numel // 2 // Q * Q
    ranges = [[0, cut], [cut, opt.numel]]
    for r in (1, 0):  # rank 0 writes meta.json after its file: last
        a, b = ranges[r]
        folder.save(str(directory), r, 2, {**meta, "rank": r, "world_size": 2, "shard_start": a, "shard_end": b},
                       {k: v[a // Q:-(-b // Q)] if k.endswith("_scale") else v[a:b] for k, v in tensors.items()},
                       barrier=lambda: None, partition=ranges)
