"""The names of the params a saved optimizer state holds (``zero_offload/param_names.json``): written with the state,
and compared with the model's params before a resume writes the saved masters into them (the engine matches its state
to the params by position: the same shapes in another order would take another param's weights)."""
from __future__ import annotations

import json
import os

from .engine import checkpoint
from .engine.param_names import unwrapped

NAMES_FILE = "param_names.json"


def write_param_names(state_dir: str, slot_names: list[list[str]]) -> None:
    """``slot_names``: for each engine slot in flat order, every name the parameter has (tied aliases)."""
    with checkpoint.atomic_open(os.path.join(state_dir, NAMES_FILE), "w") as f:
        json.dump(slot_names, f)


def _saved_names(state_dir: str) -> list[list[str]] | None:
    """The saved ``param_names.json`` (a list of alias lists), or None when absent, unreadable or malformed."""
    try:
        saved = read_json(os.path.join(state_dir, NAMES_FILE))
    except (OSError, ValueError):
        return None
    ok = isinstance(saved, list) and all(isinstance(a, list) and a and all(isinstance(n, str) for n in a)
                                         for a in saved)
    return saved if ok else None


def names_mismatch(state_dir: str, slot_names: list[list[str]]) -> str | None:
    """The saved ``param_names.json`` against this model's slots (``slot_names``, every alias of each): "" when it
    names them in the same order (any alias of each slot, wrappers' segments ignored); the difference, as
    :func:`names_difference` words it, when not; None when it cannot say: absent or unreadable (a checkpoint from
    before the file), or naming another number of slots (the engine's own layout check refuses that). The engine
    matches its state to the params by position and writes the saved masters into them: the same shapes in another
    order would take another param's weights."""
    saved = _saved_names(state_dir)
    if saved is None or len(saved) != len(slot_names):
        return None
    if all(a & b for a, b in zip(_plain_slots(saved), _plain_slots(slot_names))):
        return ""
    return _difference(state_dir, saved, slot_names)


def trainable_set_mismatch(state_dir: str, slot_names: list[list[str]]) -> str | None:
    """Order aside, as :func:`names_mismatch`: for a check before the engine (and so its slot order) exists. The
    difference when the saved file names other trainable params than ``slot_names``; None when the same ones (any
    alias of each) or when it cannot say."""
    saved = _saved_names(state_dir)
    if saved is None:
        return None
    before, now = _plain_slots(saved), _plain_slots(slot_names)
    every_before, every_now = set().union(*before), set().union(*now)
    if len(before) == len(now) and all(s & every_now for s in before) and all(s & every_before for s in now):
        return None
    return _difference(state_dir, saved, slot_names)


def names_difference(state_dir: str, slot_names: list[list[str]]) -> str:
    """For a refused resume: the first params that differ between the saved ``param_names.json`` and this
    model's slots (``slot_names``), as text to append to the refusal ("" without a readable file)."""
    saved = _saved_names(state_dir)
    return "" if saved is None else _difference(state_dir, saved, slot_names)


def _plain_slots(slots: list[list[str]]) -> list[set[str]]:
    """Each slot's aliases without the segments wrappers add (torch.compile's). Never DDP's ``module.``: the Trainer
    holds its model unwrapped, and this file names only the trainable params, which cannot tell DDP's prefix from a
    submodule called ``module`` (one of them trainable in place of a same-shaped layer ``a`` beside it swapped them)."""
    return [{unwrapped(n) for n in aliases} for aliases in slots]


def _difference(state_dir: str, saved_slots: list[list[str]], slot_names: list[list[str]]) -> str:
    saved = [unwrapped(a[0]) for a in saved_slots]
    now = [unwrapped(a[0]) for a in slot_names]

    def first(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    def tied_to(slots: list[list[str]]) -> dict[str, str]:  # each alias -> the slot's first name
        return {unwrapped(n): unwrapped(a[0]) for a in slots for n in a[1:]}

    # a tie made or undone since the save (tie_word_embeddings changed): the name is a param's second name on one
    # side and a param of its own on the other, which "trainable now / not now" misnamed as a change of what trains
    was_tied, now_tied = tied_to(saved_slots), tied_to(slot_names)
    saved_set, now_set = set(saved), set(now)
    added = [n for n in now if n not in saved_set and n not in was_tied]
    gone = [n for n in saved if n not in now_set and n not in now_tied]
    untied = [f"{n} (to {was_tied[n]})" for n in now if n not in saved_set and n in was_tied]
    tied = [f"{n} (to {now_tied[n]})" for n in saved if n not in now_set and n in now_tied]
    parts = ([f"trainable now, not in the checkpoint: {first(added)}"] if added else []) + \
        ([f"trainable in the checkpoint, not now: {first(gone)}"] if gone else []) + \
        ([f"tied in the checkpoint, not now: {first(untied)}"] if untied else []) + \
        ([f"tied now, not in the checkpoint: {first(tied)}"] if tied else [])
    if not parts:  # the same names: another order, or other shapes
        i = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), None)
        parts = [f"the same params in another order (slot {i}: {saved[i]} saved, {now[i]} now)" if i is not None
                 else "the same params, with other shapes"]
    return f" ({'; '.join(parts)}; from {os.path.join(state_dir, NAMES_FILE)})"


def read_json(path: str):
    """The JSON in ``path``; a damaged file is a ValueError that names it (json's own message does not)."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from e
