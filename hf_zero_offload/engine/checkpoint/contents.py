"""What a saved optimizer state holds, checked against the engine that loads it: the same trainable params in the
same groups (``check_model``: ``LayoutMismatch``, ``GroupingMismatch``), the small fields of its header or state
dict (``check_meta``), its tensors and the values the kernels rely on (``check_tensors``), before the first write;
and a param group's values as the header holds them (``json_value``). ``folder`` reads and writes the files."""
from __future__ import annotations

import logging
import numbers
import reprlib

import torch

from ... import ops
from ...ops.moments import check_code_range, check_second_moment
from . import StateFileError
from ..moments import SCALES, moment_regions
from .folder import STATE_FORMATS, is_count


def json_value(v, where: str):
    """A param group's value as the state's JSON header holds it. A step takes numbers of any kind (numpy
    scalars from a scheduler's lambda, one-element tensors), which json.dumps refused only once the save had
    begun: they are written as Python numbers; what JSON cannot hold is refused by name before any write."""
    if v is None or isinstance(v, (bool, str, int, float)):
        return int(v) if type(v) is not bool and isinstance(v, int) else v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if torch.is_tensor(v) and v.numel() == 1 and not v.is_complex():
        return v.item()
    if isinstance(v, (list, tuple)) or (torch.is_tensor(v) and v.dim() == 1):
        return [json_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    raise TypeError(f"{where} is {reprlib.repr(v)} ({type(v).__name__}): an optimizer checkpoint holds a param "
                    "group's values as numbers, strings or lists of them; remove or convert that key before saving")


class LayoutMismatch(ValueError):
    """A state of another set (or order, or shapes) of trainable params than this model's."""


class GroupingMismatch(LayoutMismatch):
    """A state of the same params in the same order, split into other param groups."""


def with_empty_groups(meta: dict, slots: list, groups: list[dict]) -> dict:
    """``meta`` as this engine's groups (``slots``, ``groups``) hold it, when the two differ only by empty param
    groups: states saved before the Trainer's empty group was kept (it was dropped until session 19: a model whose
    norms and biases are all frozen, or only they train) load into an engine that has it (and the reverse). The
    saved groups are this engine's non-empty ones, in order; an empty one keeps this engine's values."""
    saved_slots, saved_groups = meta.get("slots"), meta.get("param_groups")
    if (not isinstance(saved_slots, list) or not isinstance(saved_groups, list) or saved_slots == slots
            or len(saved_slots) != len(saved_groups) or [g for g in saved_slots if g] != [g for g in slots if g]):
        return meta
    kept = iter([g for s, g in zip(saved_slots, saved_groups) if s])
    return {**meta, "slots": slots,
            "param_groups": [next(kept) if s else {k: v for k, v in g.items() if k != "params"}
                             for s, g in zip(slots, groups)]}


def check_model(meta: dict, numel: int, slots: list) -> None:
    if meta.get("format") not in STATE_FORMATS:
        raise ValueError(f"not an hf_zero_offload optimizer state (format={meta.get('format')!r})")
    if meta.get("numel") != numel or meta.get("slots") != slots:
        saved = meta.get("slots")
        grouped = isinstance(saved, list) and all(isinstance(g, list) for g in saved)
        params = sum(map(len, saved)) if grouped else "?"
        if grouped and [s for g in saved for s in g] == [s for g in slots for s in g]:
            raise GroupingMismatch(f"optimizer state does not match this model's param groups: the same params, in "
                                 f"{len(saved)} group(s) of {[len(g) for g in saved]} params when saved and "
                                 f"{len(slots)} of {[len(g) for g in slots]} here (another weight-decay split, or a "
                                 "create_optimizer of another grouping): group them as the run that saved it did")
        raise LayoutMismatch(f"optimizer state does not match this model: saved {meta.get('numel')} trainable elements "
                         f"in {params} params, this model has {numel} in {sum(map(len, slots))}")


_STEP_KEYS = ("lr", "betas", "eps", "weight_decay", "adamw_mode")  # a group's values the step checks


def check_meta(meta: dict, where: str, *, numel: int, slots: list, groups: int, steps: int,
               own_groups: list[dict] | None = None) -> None:
    """The small fields of a saved state (a file header or a state dict), checked before anything is
    loaded, so a foreign or tampered state is refused by name and the engine stays as it was. ``own_groups``: the
    loading engine's param groups, whose values a saved group's missing keys leave in place (the load checks the
    values its next step would check)."""
    check_model(meta, numel, slots)

    def bad(field: str, want: str, got) -> StateFileError:
        return StateFileError(f"{where}: {field} must be {want}, got {reprlib.repr(got)}; this state was not "
                              "written by hf_zero_offload (or is damaged)")

    if meta.get("state_dtype", "fp32") not in ops.STATE_DTYPES:
        raise bad("state_dtype", f"one of {ops.STATE_DTYPES}", meta.get("state_dtype"))
    counts = meta.get("param_steps")
    if not isinstance(counts, list) or len(counts) != steps or not all(map(is_count, counts)):
        raise bad("param_steps", f"a list of {steps} ints >= 0", counts)
    saved = meta.get("param_groups")
    if not isinstance(saved, list) or len(saved) != groups or not all(isinstance(g, dict) for g in saved):
        raise bad("param_groups", f"a list of {groups} dicts", saved)
    # each group's values at the step its params take next (AdamCore._next_steps: the earliest, whose step size
    # lr / (1 - beta1^t) is the largest): checked at step 1, a state its own run had stepped with an lr only step 1
    # could not take (5e37, beta1 0.9, at step 3) was refused at its resume
    first, next_steps = 0, []
    for group in slots:
        next_steps.append(ops.next_step(counts[first:first + len(group)]))
        first += len(group)
    for i, g in enumerate(saved):
        if not isinstance(g.get("adamw_mode", True), bool):
            raise bad(f"param_groups[{i}].adamw_mode", "a bool", g["adamw_mode"])
        # the values the next step checks (ops.check_hyperparameters), as the load leaves them: the saved ones over the
        # engine's own; adamw_mode too (an Adam state whose lr * weight_decay overflows the AdamW decay it never
        # forms was refused here while its step took it)
        v = {"lr": 0.0, "betas": (0.0, 0.0), "eps": 0.0, "weight_decay": 0.0, "adamw_mode": True,
             **({k: own_groups[i][k] for k in _STEP_KEYS if k in own_groups[i]} if own_groups else {}),
             **{k: g[k] for k in _STEP_KEYS if k in g}}
        try:
            ops.check_hyperparameters(lr=v["lr"], betas=v["betas"], eps=v["eps"], weight_decay=v["weight_decay"],
                                      adamw=v["adamw_mode"], step=next_steps[i])
        except ValueError as e:
            raise StateFileError(f"{where}: param_groups[{i}].{e}; this state was not written by hf_zero_offload "
                                 "(or is damaged)") from None
    if not is_count(meta.get("global_steps")):
        raise bad("global_steps", "an int >= 0", meta.get("global_steps"))
    if not isinstance(meta.get("needs_publish", False), bool):
        raise bad("needs_publish", "a bool", meta["needs_publish"])


def check_tensors(state: dict, n: int, where: str) -> None:
    """The tensors of a state dict of an ``n``-element slice: each one its ``state_dtype`` stores
    (``moment_regions``), of that dtype and at least that long, before any is copied."""
    saved = state.get("state_dtype", "fp32")
    want = {"master": (n, torch.float32), **moment_regions(n, saved)}
    for key, (count, dtype) in want.items():
        t = state.get(key)
        if not torch.is_tensor(t):
            raise StateFileError(f"{where}: {key} is missing or not a tensor ({saved} states hold {', '.join(want)})")
        if t.dtype != dtype:
            raise StateFileError(f"{where}: {key} is {str(t.dtype)[6:]}, expected {str(dtype)[6:]} ({saved} state)")
        if t.numel() < count:
            raise StateFileError(f"{where}: {key} has {t.numel()} elements, expected {count} ({n} in this slice)")
    # the values the kernels rely on, here before anything is written (a checkpoint's: once streamed in)
    flat = {k: state[k].reshape(-1)[:count] for k, (count, _) in want.items()}
    if saved != "int8":
        return check_second_moments(flat["exp_avg_sq"], where)
    try:
        ops.check_scales(*(flat[k] for k in SCALES))
        for k in ("exp_avg", "exp_avg_sq"):
            check_code_range(f"{k} codes", flat[k])
    except ValueError as e:
        raise StateFileError(f"{where}: {e}; use an earlier checkpoint") from None


def check_second_moments(exp_avg_sq: torch.Tensor, where: str) -> None:
    """fp32/bf16 ``exp_avg_sq`` of a load is >= 0 (``check_second_moment``), refused as ``where``'s error."""
    try:
        check_second_moment("exp_avg_sq", exp_avg_sq)
    except ValueError as e:
        raise StateFileError(f"{where}: {e}; use an earlier checkpoint") from None


# the group values a load takes from the saved state (as torch.optim's load_state_dict does), which a resumed run may
# have been asked to change: initial_lr is the schedule's base (lr itself is the schedule's position, which moves);
# likewise base_momentum/max_momentum, which torch's OneCycleLR and CyclicLR put in a group whose betas[0] they move
_TAKEN_VALUES = ("initial_lr", "base_momentum", "max_momentum", "betas", "eps", "weight_decay")


def say_taken_values(groups: list[dict], saved_groups: list[dict]) -> None:
    """A warning naming the values of ``groups`` (the loading engine's) that the saved ones replace ("group 0
    weight_decay 0.5 now, 0.01 saved"), as torch.optim's load_state_dict replaces them: a resumed run asked for
    another weight decay trained on with the old one without a word (as the plain Trainer's does)."""
    out = []
    for i, (group, saved) in enumerate(zip(groups, saved_groups)):
        for key in _TAKEN_VALUES:
            if key in group and key in saved:
                now, was = (tuple(group[key]), tuple(saved[key])) if key == "betas" else (group[key], saved[key])
                if key == "betas" and "max_momentum" in group:  # this run cycles betas[0] (a resume without the
                    key, now, was = "betas[1]", now[1:], was[1:]  # cycling keeps the saved one for good: said)
                if now != was:
                    out.append(f"group {i} {key} {now} now, {was} saved")
    if out:
        logging.getLogger("hf_zero_offload").warning(
            "hf_zero_offload: the loaded optimizer state's values are taken, as torch.optim's load_state_dict takes "
            "them: %s", "; ".join(out))
