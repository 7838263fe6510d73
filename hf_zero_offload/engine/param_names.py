"""Parameter names in an engine's param groups, and the check a load makes with them.

An engine built from ``model.named_parameters()`` (or groups of ``(name, param)`` pairs, or a ``"param_names"`` list
per group: torch.optim's convention since torch 2.6) keeps each group's names in ``param_groups[i]["param_names"]``;
``state_dict``, ``save_checkpoint`` and the Trainer mixin's checkpoints carry them. The engines match a state to the
params by position and also write its fp32 masters into the params, so a state loaded into params of the same
shapes in another order (a refactor that registers two layers the other way round, another layer made trainable)
handed each param another one's trained weights, silently. With names on both sides, a load compares them before
anything is written and refuses by name; a state or an engine without names (plain ``parameters()``, a state saved
before the names were kept) is loaded by position, as torch's optimizers load.
"""
from __future__ import annotations

from .checkpoint import StateFileError
from .state_dir import LayoutMismatch

KEY = "param_names"  # torch.optim's key


class NameMismatch(LayoutMismatch):
    """A state saved for params of other names (in order) than this engine's, the shapes alike."""


def plain_name(name: str) -> str:
    """A param name without the prefixes wrappers add (torch.compile's ``_orig_mod.``, DDP's ``module.``), so that
    a state saved by a wrapped model loads into the bare one and the reverse."""
    return name.replace("_orig_mod.", "").removeprefix("module.")


def check_names(saved_groups: list[dict], groups: list[dict], where: str) -> None:
    """Refuse a saved state whose groups name their params otherwise than this engine's ``groups`` do (in order,
    wrappers' prefixes ignored). Called after the layout check (the same number of params per group)."""
    for i, (saved, mine) in enumerate(zip(saved_groups, groups)):
        theirs, ours = saved.get(KEY), mine.get(KEY)
        if theirs is None or ours is None:
            continue
        if not (isinstance(theirs, list) and len(theirs) == len(ours) and all(isinstance(n, str) for n in theirs)):
            raise StateFileError(f"{where}: param_groups[{i}].{KEY} must be a list of {len(ours)} names, got "
                                 f"{str(theirs)[:200]}; this state was not written by hf_zero_offload (or is damaged)")
        differ = [(a, b) for a, b in zip(theirs, ours) if plain_name(a) != plain_name(b)]
        if differ:
            (a, b), more = differ[0], len(differ) - 1
            raise NameMismatch(
                f"{where}: the state was saved for other params than this engine's, of the same shapes: param "
                f"group {i} holds {a!r} where this engine has {b!r}{f' (and {more} more differ)' if more else ''}; "
                "loaded by position, each param would take another one's saved weights and moments. Load it into "
                "an engine built on the model that saved it, with the same trainable params in the same order")


def names_of(params: list, named) -> list[str]:
    """The model's name (its first, as ``named_parameters()`` gives it) of each param in ``params``; ``named``:
    the model's ``named_parameters()``."""
    by_id = {}
    for name, p in named:
        by_id.setdefault(id(p), name)
    return [by_id[id(p)] for p in params]
