"""Every rank must build the same ShardedAdam: the same params in the same groups, the same hyperparameters and
the options that decide the collectives and the math.

Ranks started differently (another ds_config or command line on one node, a model with one param more or one
frozen, a tokenizer of another size) used to train on without a word where the collectives happened to line up
(replicas that matched neither rank's configuration: fp32 moments on one rank and int8 on the other, each rank's
own learning rate or clipping on its own shard), or failed deep in gloo ("Received data size doesn't match
expected size", "Connection reset by peer"), or hung (a rank with more backward passes per step). One small
all-gather at construction compares what each rank built, and every rank raises the same error naming what
differs and on which ranks.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from ..options import OffloadOptions, as_options
from .peers import said

_SHOWN = 6  # differences named in the message
_FAILED = "\0failed"  # a rank's payload key in place of its setup: the error its own build raised before the gather


def check_ranks_agree(setup: dict, process_group, world_size: int, built: str = "built different ShardedAdam engines",
                      advice: str = "Every rank must build the same one (the same ds_config, command line and model on "
                                    "every node)", failure: BaseException | None = None) -> None:
    """``setup``: this rank's description (key -> a value that compares with ``==`` and prints). Raises ValueError
    on every rank when any rank's differs from rank 0's (``built``, ``advice``: what the message says of that).
    ``failure``: this rank's own build raised it before the gather (``setup``: what it has, {} if none): it joins
    the gather anyway and raises it after, and every other rank raises naming it (a bad argument or a host-RAM check on one rank
    only raised there alone, its peers left in this gather with gloo's words or until the collective timeout)."""
    if world_size == 1:
        if failure is not None:
            raise failure
        return
    mine = {**setup, _FAILED: f"{socket.gethostname()}\n{said(failure)}"} if failure is not None else setup
    every: list = [None] * world_size
    dist.all_gather_object(every, mine, group=process_group)
    failed = [(r, *s.pop(_FAILED).split("\n", 1)) for r, s in enumerate(every) if _FAILED in s]
    diffs = []
    for key, first in (every[0].items() if all(every) else ()):  # (a rank that failed before its setup: none)
        others: dict = {}
        for rank, theirs in enumerate(every[1:], start=1):
            value = theirs.get(key)
            if value != first:
                others.setdefault(repr(value), (value, []))[1].append(rank)
        for value, ranks in others.values():
            diffs.append(_describe(key, first, value, ranks))
    extra = sorted({k for s in every[1:] for k in s} - set(every[0])) if all(every) else []
    diffs += [f"{k}: absent on rank 0" for k in extra]
    if diffs:  # (first: a rank's own refusal may follow from what differs)
        shown = "; ".join(diffs[:_SHOWN]) + (f"; and {len(diffs) - _SHOWN} more" if len(diffs) > _SHOWN else "")
        raise ValueError(f"the {world_size} ranks {built}: {shown}. {advice}") from failure
    if failure is not None:
        failure.add_note("hf_zero_offload: said to the other ranks, which raised naming this rank")
        raise failure
    if failed:
        named = "; ".join(f"rank {r} (host {host}) raised {why}" for r, host, why in failed)
        raise RuntimeError(f"{named}, where this rank (rank {dist.get_rank(process_group)}) passed its own checks: "
                           "the ranks did not all get as far as comparing what they built (see that rank's error); "
                           "none goes on")


def check_arguments(stage: int, offload: bool, options, device_adam: str, world_size: int) -> OffloadOptions:
    """ShardedAdam's own arguments, each rank's verdict said to the others at ``check_ranks_agree``; the options as
    an ``OffloadOptions`` (``options.as_options``)."""
    options = as_options(options, "ShardedAdam")
    if stage not in (0, 1, 2):
        raise ValueError(f"stage must be 0 (one process), 1 or 2, got {stage!r}")
    if options.dpu and not offload:
        raise ValueError("the delayed parameter update hides the CPU step: it needs offload=True")
    if device_adam not in ("auto", "torch", "kernel"):
        raise ValueError(f"device_adam must be 'auto', 'torch' or 'kernel', got {device_adam!r}")
    if stage == 0 and world_size > 1:
        raise ValueError(f"stage 0 (no partitioning) runs on one process, not {world_size}; use stage 1 or 2")
    return options


def _describe(key: str, first, value, ranks: list) -> str:
    where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if isinstance(first, tuple) and isinstance(value, tuple) and key.endswith(" param shapes"):
        group = key[:-len(" param shapes")]
        j = next((j for j, (a, b) in enumerate(zip(first, value)) if a != b), min(len(first), len(value)))
        mine, theirs = (first[j] if j < len(first) else "none"), (value[j] if j < len(value) else "none")
        if len(first) == len(value):
            return f"{group} param {j}: {mine} on rank 0, {theirs} on {where}"
        return (f"{group}: {len(first)} params on rank 0, {len(value)} on {where} (the first that differs: param {j}, "
                f"{mine} against {theirs})")
    return f"{key}: {first!r} on rank 0, {value!r} on {where}"


_HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")


def hyper_disagreement(param_groups, n_groups: int, process_group, device, step: int,
                       problem: str | None) -> str | None:
    """Each group's lr, betas, eps and weight decay as this step reads them, compared across ranks by one small MAX
    all-reduce of them and their negatives, with each rank's own verdict on them (``problem``: this rank's groups are
    invalid), so every rank gets the same answer. The build compares them once; a schedule that differed on one node
    (--warmup_steps, --lr_scheduler_type, --max_steps) then stepped each shard with its own rank's lr, a model of
    neither rank's run, without a word (an outside probe); a lr gone bad on one rank raised there alone, before a
    collective its peers then waited in. ``n_groups``: the groups the engine was built with (a ``problem`` when they
    changed), so that every rank's vector has one size. Compared as the kernels take them (fp32): a float32 tensor
    lr against the same Python float is the same lr."""
    # every rank's vector one size: the built groups' values, or zeros beside a problem
    vals = [0.0] * (len(_HYPER) * n_groups) if problem else torch.tensor(
        [float(x) for g in param_groups for x in (g["lr"], *g["betas"], g["eps"], g["weight_decay"])],
        dtype=torch.float32).double().tolist()
    both = torch.tensor([float(problem is not None)] + vals + [-x for x in vals], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=process_group)
    top = both.tolist()
    if top[0] > 0:
        return problem or "another rank's param group hyperparameters are invalid (see its error)"
    for i, x in enumerate(vals):
        hi, lo = top[1 + i], -top[1 + len(vals) + i]
        if hi != lo:
            group, key = divmod(i, len(_HYPER))
            digits = next(d for d in (7, 9) if d == 9 or f"{lo:.{d}g}" != f"{hi:.{d}g}")  # (fp32: 9 tell any two apart)
            return (f"param group {group} {_HYPER[key]} differs across ranks at step {step}: from {lo:.{digits}g} to "
                    f"{hi:.{digits}g} (this rank {x:.{digits}g}). Each rank steps its own shard with its own value, so "
                    "the model would be neither rank's run: give every rank the same schedule (--learning_rate, "
                    "--warmup_steps, --lr_scheduler_type, --max_steps, the ds_config's \"scheduler\" block) and edit "
                    "param_groups alike on every rank")
    return None
