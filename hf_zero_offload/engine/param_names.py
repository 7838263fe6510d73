"""Parameter names in an engine's param groups, and the check a load makes with them.

An engine built from ``model.named_parameters()`` (or groups of ``(name, param)`` pairs, or a ``"param_names"`` list
per group: torch.optim's convention since torch 2.6) keeps each group's names in ``param_groups[i]["param_names"]``,
and its states (``state_dict``, ``save_checkpoint``) carry the names of the params that own state (``slot_names``:
the trainable ones, in the flat order; a group's ``param_names`` also names its frozen params). The engines match a
state to the params by position and also write its fp32 masters into the params, so a state loaded into params of
the same shapes in another order (a refactor that registers two layers the other way round, the other of two
same-shaped layers made trainable) handed each param another one's trained weights, silently. With names on both
sides, a load compares them before anything is written and refuses by name; a state or an engine without names
(plain ``parameters()``, a state saved before the names were kept) is loaded by position, as torch's optimizers load.
A frozen param added, removed or renamed owns no state and is no difference; nor are the prefixes wrappers add.
"""
from __future__ import annotations

from .checkpoint import StateFileError
from .checkpoint.contents import LayoutMismatch

KEY = "param_names"  # torch.optim's key, in a param group
META_KEY = "slot_names"  # in a saved state: per param that owns state, its name
# wrappers' segments (torch.compile, activation checkpointing, FSDP): a state saved by the wrapped model loads into
# the bare one and the reverse
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class NameMismatch(LayoutMismatch):
    """A state saved for params of other names (in order) than this engine's, the shapes alike."""


def unwrapped(name: str) -> str:
    """``name`` without the segments wrappers add (torch.compile, activation checkpointing, FSDP)."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def plain_names(names: list[str], all_names: list[str] | None = None) -> list[str]:
    """``names`` without the segments wrappers add, and without DDP's leading ``module.`` where every one of
    ``all_names`` (default ``names``: give all the model's names where known, frozen ones too) has it: a model's own
    submodule called ``module`` keeps its name."""
    out = [unwrapped(n) for n in names]
    whole = out if all_names is None else [unwrapped(n) for n in all_names]
    while whole and all(n.startswith("module.") for n in whole):
        out, whole = [n[len("module."):] for n in out], [n[len("module."):] for n in whole]
    return out


def check_given(groups: list[dict], who: str) -> None:
    """The names a user gave, refused by name at construction where a load could not compare them: each group's
    a list of strings, one per param (torch checks neither), no name twice."""
    seen = set()
    for i, g in enumerate(groups):
        names = g.get(KEY)
        if names is None:
            continue
        if not (isinstance(names, (list, tuple)) and len(names) == len(g["params"])
                and all(isinstance(n, str) for n in names)):
            raise ValueError(f"{who}: param group {i}'s {KEY} must be one name (a str) per param "
                             f"({len(g['params'])}), got {str(names)[:200]}")
        twice = [n for n in names if n in seen or seen.add(n)]
        if twice:
            raise ValueError(f"{who}: the param name {twice[0]!r} is given twice ({KEY}): a load could not tell "
                             "its params apart; give each param its own name (model.named_parameters())")


def slot_names(groups: list[dict], slots: list) -> list[str] | None:
    """The names of the params that own state, in the flat order, without wrappers' prefixes (DDP's judged over every
    name the groups give, frozen params' too); None when the groups carry no names. ``slots``: per group, the
    engine's ``(param, offset, numel)`` or a saved state's ``[offset, numel, shape]`` (``groups``' names then map
    to them one for one, or None: a group that named a frozen param cannot say which names own state)."""
    if not groups or any(not isinstance(g.get(KEY), list) for g in groups):
        return None
    out = []
    for g, group_slots in zip(groups, slots):
        if "params" in g:  # this engine's own groups
            by_id = {id(p): n for p, n in zip(g["params"], g[KEY])}
            out += [by_id[id(s[0])] for s in group_slots]
        elif len(g[KEY]) == len(group_slots):
            out += g[KEY]
        else:
            return None
    return plain_names(out, [n for g in groups for n in g[KEY]])


def check_names(meta: dict, groups: list[dict], slots: list, where: str) -> None:
    """Refuse a saved state whose params that own state are named otherwise than this engine's, in order (wrappers'
    prefixes ignored). Called after the layout check (the same params by count and shape). A state saved before
    ``slot_names`` was kept is compared by its groups' ``param_names`` where they name only params with state."""
    ours = slot_names(groups, slots)
    theirs = meta.get(META_KEY)
    if theirs is None and isinstance(meta.get("param_groups"), list) and isinstance(meta.get("slots"), list):
        theirs = slot_names(meta["param_groups"], meta["slots"])
    if theirs is None or ours is None:
        return
    if not (isinstance(theirs, list) and len(theirs) == len(ours) and all(isinstance(n, str) for n in theirs)):
        raise StateFileError(f"{where}: {META_KEY} must be a list of {len(ours)} names, got {str(theirs)[:200]}; "
                             "this state was not written by hf_zero_offload (or is damaged)")
    theirs = [unwrapped(n) for n in theirs]
    differ = [k for k, (x, y) in enumerate(zip(theirs, ours)) if x != y]
    if differ:
        k = differ[0]
        more = f" (and {len(differ) - 1} more differ)" if len(differ) > 1 else ""
        raise NameMismatch(
            f"{where}: the state was saved for other params than this engine's, of the same shapes: trainable param "
            f"{k} is {theirs[k]!r} in the state and {ours[k]!r} here{more}; loaded by position, each param would "
            "take another one's saved weights and moments. Load it into an engine built on the model that saved it, "
            "with the same trainable params in the same order")


def smallest_names(named) -> dict[int, str]:
    """Per param (by ``id``), a name that does not depend on the order the model registers tied modules in: the
    smallest of its names in ``named`` (``model.named_parameters(remove_duplicate=False)``: every alias)."""
    names: dict[int, str] = {}
    for name, p in named:
        names[id(p)] = min(names.get(id(p), name), name)
    return names
