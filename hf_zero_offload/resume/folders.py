"""The ``checkpoint-N`` folders of an output_dir: which names are checkpoints, their listing by step, and what keeps
an output_dir from holding them (a file in the way, paths over the file system's limits). Imported into ``resume``,
whose names they stay (``resume.checkpoints``, ``resume.output_dir_problem``, ...); nothing here reads a checkpoint."""
from __future__ import annotations

import os
import re

from . import path_limits

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(path: str) -> int | None:
    """N of a folder named exactly ``checkpoint-N`` (None otherwise: checkpoint-500-old, ckpt500)."""
    m = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def checkpoints(folder: str) -> list[str]:
    """``checkpoint-N`` directories of ``folder``, oldest step first."""
    if not os.path.isdir(folder):
        return []
    found = [(checkpoint_step(n), os.path.join(folder, n)) for n in os.listdir(folder)]
    return [p for s, p in sorted((s, p) for s, p in found if s is not None and os.path.isdir(p))]


def _in_the_way(path: str) -> str:
    return (f"{path} is a file, not a directory: the Trainer saves (and rotates) its checkpoint-N folders there; "
            "move or rename it")


def output_dir_problem(output_dir: str, training: bool = True, max_steps: int | None = None,
                       world_size: int = 1) -> str | None:
    """What keeps a run from writing ``output_dir`` (None: nothing), before any model work: a file where the
    directory belongs (os.makedirs said only "[Errno 17] File exists"), or, for training, checkpoint paths over the
    file system's limits (``path_limits``) or a file named like a checkpoint (both found only at that save, after the
    steps since the last one were lost)."""
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        return f"--output_dir {output_dir} is a file, not a directory"
    if not training:
        return None
    if too_long := path_limits.problem(output_dir, max_steps, world_size):
        return too_long
    if not os.path.isdir(output_dir):
        return None
    in_the_way = sorted((p for p in (os.path.join(output_dir, n) for n in os.listdir(output_dir))
                         if checkpoint_step(p) is not None and not os.path.isdir(p)), key=checkpoint_step)
    return _in_the_way(in_the_way[0]) if in_the_way else None
