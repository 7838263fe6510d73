"""An optimizer state of ours (a checkpoint's ``zero_offload/``) as ``torch.optim.AdamW``'s state dict.

For leaving the plugin mid-run without losing Adam's moments: ``hf-zero-offload consolidate --with-optimizer``
writes this as ``optimizer.pt`` beside the fp32 weights and the Trainer's own files, which the plain Trainer (or a
loop of one's own: ``AdamW(params).load_state_dict(torch.load(...))``) resumes. Params are numbered as torch numbers
them, group after group in the order the engine held them, which is the order of the optimizer it was built from
(the Trainer's decay / no-decay groups, or the groups a user passed). Moments are fp32 in each param's shape (bf16
widened, int8 decoded with its code map), one tensor each (a slice of one flat array would drag the whole array
along into every param's state); a param that never took a step has no state, as in torch.

Frozen params own no state and are not in the groups (the Trainer's AdamW leaves them out too). An AdamW built over
``model.parameters()`` lists them in its groups, and torch refuses that state ("doesn't match the size of optimizer's
group"); the checkpoint does not record where they sat, so give the params it goes into: ``params=`` here, or
``for_params(state_dict, params)`` on an exported one (``optimizer.pt``), numbers it for them.
"""
from __future__ import annotations

import torch

from . import ops
from .adam.flags import adamw_mode
from .adam.state_dict import step_tensor
from .engine.moments import Q, moment_regions
from .engine.checkpoint.contents import check_meta
from .engine.checkpoint.folder import check_save_id, check_sources, read_range, sources

#: what a torch.optim.AdamW group holds beside lr, betas, eps and weight_decay (torch's defaults; the saved values
#: replace a group's on load, so a group without them would lose the keys torch's step reads)
_TORCH_GROUP_DEFAULTS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                         "differentiable": False, "fused": None}
#: ours, not torch's (adamw_mode is torch's decoupled_weight_decay; param_names are the Trainer's own record)
_OUR_GROUP_KEYS = ("adamw_mode", "param_names", "params")


def torch_optimizer_state(state_dir: str, expected_save_id: str | None = None, params=None) -> dict:
    """The state under ``state_dir`` (every rank's file, any world size) as torch.optim.AdamW's ``state_dict()``,
    after every header, the partition map and the save id (``expected_save_id``: the marker's) are checked.
    ``params``: what the AdamW that loads it was built over, frozen params included (``for_params``); without it,
    numbered for the trainable params alone, group after group."""
    srcs, meta = sources(state_dir)
    check_save_id(meta, expected_save_id, state_dir)
    slots = meta["slots"]
    flat_slots = [s for g in slots for s in g]
    if "param_steps" not in meta or "param_groups" not in meta:
        raise ValueError(f"{state_dir}: written by an early version of hf_zero_offload (no param_groups or "
                         "param_steps in its header); resume it with hf_zero_offload and save it again first")
    check_meta(meta, state_dir, numel=meta["numel"], slots=slots, groups=len(slots), steps=len(flat_slots))
    state_dtype = meta.get("state_dtype", "fp32")
    codes = meta.get("int8_codes", 1) if state_dtype == "int8" else ops.INT8_CODES
    if state_dtype == "int8":
        ops.check_int8_codes(codes)
    check_sources(srcs, state_dtype, 0, meta["numel"])
    held = {k: torch.empty(n, dtype=dt) for k, (n, dt) in moment_regions(meta["numel"], state_dtype).items()}
    read_range(srcs, 0, held)
    steps = meta["param_steps"]
    state, groups, pid = {}, [], 0
    for saved, group_slots in zip(meta["param_groups"], slots):
        group = {**_TORCH_GROUP_DEFAULTS, **{k: v for k, v in saved.items() if k not in _OUR_GROUP_KEYS}}
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        group["decoupled_weight_decay"] = bool(adamw_mode(saved))
        group["params"] = list(range(pid, pid + len(group_slots)))
        for offset, numel, shape in group_slots:
            if steps[pid]:
                exp_avg, exp_avg_sq = _moments(held, offset, numel, state_dtype, codes)
                state[pid] = {"step": step_tensor(steps[pid]), "exp_avg": exp_avg.view(shape),
                              "exp_avg_sq": exp_avg_sq.view(shape)}
            pid += 1
        groups.append(group)
    sd = {"state": state, "param_groups": groups}
    return sd if params is None else for_params(sd, params)


def for_params(state_dict: dict, params) -> dict:
    """``state_dict`` (``torch_optimizer_state``'s, or ``optimizer.pt`` of ``consolidate --with-optimizer``:
    the trainable params alone) numbered for a torch.optim.AdamW over ``params``: what it was built over (an
    iterable of params such as ``model.parameters()``, or a list of param groups) or the optimizer itself.
    Frozen params (``requires_grad=False``) get a number and no state, as torch keeps none for them; the trainable
    ones of each group must be the run's, in order (their count, and the shapes of their moments, are checked)."""
    groups = _given_groups(params)
    saved = state_dict["param_groups"]
    if len(groups) != len(saved):
        raise ValueError(f"the optimizer state has {len(saved)} param group(s) (trainable params per group: "
                         f"{[len(g['params']) for g in saved]}), the params given {len(groups)}: build the AdamW "
                         "over the run's groups (the Trainer's: weight decay / no weight decay), frozen params "
                         "in them or not")
    state, out, new = {}, [], 0
    for i, (given, group) in enumerate(zip(groups, saved)):
        trainable = [p for p in given if p.requires_grad]
        if len(trainable) != len(group["params"]):
            raise ValueError(f"param group {i}: {len(trainable)} trainable param(s) given (requires_grad), the "
                             f"optimizer state has {len(group['params'])}: freeze the params the run froze "
                             "(requires_grad_(False)) before building the optimizer, and give its groups in order")
        old = iter(group["params"])
        ids = []
        for p in given:
            if p.requires_grad:
                pid = next(old)
                if pid in state_dict["state"]:
                    st = state_dict["state"][pid]
                    if tuple(st["exp_avg"].shape) != tuple(p.shape):
                        raise ValueError(f"param group {i}: a trainable param of shape {tuple(p.shape)} where the "
                                         f"optimizer state has moments of shape {tuple(st['exp_avg'].shape)}: give "
                                         "the run's params, in its order")
                    state[new] = st
            ids.append(new)
            new += 1
        out.append({**group, "params": ids})
    return {"state": state, "param_groups": out}


def _given_groups(params) -> list[list[torch.Tensor]]:
    """Each group's params, as torch.optim takes them: an optimizer, an iterable of params or of param groups."""
    if isinstance(params, torch.optim.Optimizer):
        return [list(g["params"]) for g in params.param_groups]
    if isinstance(params, torch.Tensor):
        params = [params]
    given = list(params)
    if given and all(isinstance(g, dict) for g in given):
        return [[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]) for g in given]
    if not given or not all(isinstance(p, torch.Tensor) for p in given):
        raise TypeError("params: the params the AdamW was built over (model.parameters()), its param groups (a "
                        "list of dicts with 'params'), or the optimizer itself")
    return [given]


def _moments(held: dict, offset: int, numel: int, state_dtype: str, codes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's (exp_avg, exp_avg_sq) as new fp32 tensors; int8 decoded over the blocks it touches (a slot need
    not start on a block: the engines pack slots back to back and quantize the flat array)."""
    if state_dtype != "int8":
        return tuple(held[k][offset:offset + numel].float().clone() for k in ("exp_avg", "exp_avg_sq"))
    a, b = offset // Q * Q, min(-(-(offset + numel) // Q) * Q, held["exp_avg"].numel())
    part = {k: held[k][a:b] for k in ("exp_avg", "exp_avg_sq")}
    part.update({k: held[k][a // Q:-(-b // Q)] for k in ("exp_avg_scale", "exp_avg_sq_scale")})
    m, v = ops.state_to_fp32(part, codes)
    return m[offset - a:offset - a + numel].clone(), v[offset - a:offset - a + numel].clone()
