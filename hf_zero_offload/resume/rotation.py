"""``save_total_limit`` over whole checkpoints only: which old ``checkpoint-N`` folders a save removes, and which it
leaves alone (incomplete or damaged: a crash mid-save). transformers' ``rotate_checkpoints`` counted every
``checkpoint-*`` folder: an incomplete one written after two complete ones kept its place and both complete ones went
(left with one complete checkpoint), and a user's renamed copy (``checkpoint-500-old``) was a candidate too. The
order is transformers' (folder mtime, by step where the times are within a second: a file system that fakes them);
the folder just saved and the best one are kept. Nothing here deletes or imports transformers."""
from __future__ import annotations

import os

from . import _not_whole, _step, checkpoints, status


def plan(run_dir: str, limit: int | None, keep: tuple = ()) -> tuple[list[str], list[tuple[str, str]]]:
    """(the complete checkpoints to remove, oldest first; (folder, why) of each incomplete one, not counted)."""
    if limit is None or limit <= 0:
        return [], []
    whole, left = [], []
    for c in checkpoints(run_dir):
        if status(c) == "incomplete":
            left.append((c, _not_whole(c)))
        else:
            whole.append(c)
    if len(whole) <= limit:
        return [], left
    by_time = sorted(whole, key=lambda c: (os.path.getmtime(c), _step(c)))
    spread = os.path.getmtime(by_time[-1]) - os.path.getmtime(by_time[0])
    order = by_time if spread >= 1.0 else sorted(whole, key=_step)
    protected = {os.path.normpath(k) for k in keep if k} | {os.path.normpath(order[-1])}
    to_keep = max(limit, len([c for c in whole if os.path.normpath(c) in protected]))
    remove, remaining = [], len(order)
    for c in order:
        if remaining <= to_keep:
            break
        if os.path.normpath(c) not in protected:
            remove.append(c)
            remaining -= 1
    return remove, left
