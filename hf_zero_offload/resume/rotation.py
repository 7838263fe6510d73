"""``save_total_limit`` over finished checkpoints only: which old ``checkpoint-N`` folders a save removes, and which it
leaves alone (cut short: a crash mid-save). transformers' ``rotate_checkpoints`` counted every ``checkpoint-*``
folder: an incomplete one written after two complete ones kept its place and both complete ones went (left with one
complete checkpoint), and a user's renamed copy (``checkpoint-500-old``) was a candidate too.

Counted (and removed, oldest first): a folder with our marker, even one whose files changed since (a callback's
``on_save`` that adds a note to config.json: its save finished); a plain Trainer's checkpoint that looks finished
(``resume.looks_plain``, or one a resume takes). Left out: a folder without a marker that is neither (cut short).
The order is transformers' (folder mtime, by step where the times are within a second: a file system that fakes
them); the folder just saved (unless told otherwise) and the best one are kept. A folder that vanishes meanwhile
(the user's rm) is skipped. Nothing here deletes or imports transformers."""
from __future__ import annotations

import os

from . import checkpoint_step, checkpoints, looks_plain, not_whole, read_marker, status


def left_out(checkpoint: str) -> str | None:
    """Why a save's rotation neither counts nor removes ``checkpoint`` (None: it does)."""
    if read_marker(checkpoint) is not None or looks_plain(checkpoint) or status(checkpoint) != "incomplete":
        return None
    return not_whole(checkpoint)


def plan(run_dir: str, limit: int | None, keep: tuple = (), keep_newest: bool = True
         ) -> tuple[list[str], list[tuple[str, str]]]:
    """(the finished checkpoints to remove, oldest first; (folder, why) of each one left out, not counted)."""
    if limit is None or limit <= 0:
        return [], []
    whole, left, when = [], [], {}
    for c in checkpoints(run_dir):
        try:
            why = left_out(c)
            when[c] = os.path.getmtime(c)
        except FileNotFoundError:  # removed meanwhile
            continue
        if why is None:
            whole.append(c)
        else:
            left.append((c, why))
    if len(whole) <= limit:
        return [], left
    by_time = sorted(whole, key=lambda c: (when[c], checkpoint_step(c)))
    spread = when[by_time[-1]] - when[by_time[0]]
    order = by_time if spread >= 1.0 else sorted(whole, key=checkpoint_step)
    # by what the paths name, not how they are spelled (a best checkpoint recorded through a symlink or a relative
    # output_dir was removed: transformers compares with os.path.samefile)
    protected = {os.path.realpath(k) for k in keep if k} | ({os.path.realpath(order[-1])} if keep_newest else set())
    to_keep = max(limit, len([c for c in whole if os.path.realpath(c) in protected]))
    remove, remaining = [], len(order)
    for c in order:
        if remaining <= to_keep:
            break
        if os.path.realpath(c) not in protected:
            remove.append(c)
            remaining -= 1
    return remove, left
