"""What to add to "does not exist" for a ``resume_from_checkpoint`` path: where a relative path was looked up, and
what ``output_dir`` holds. ``--resume_from_checkpoint checkpoint-4`` is read from the current directory, not from
``output_dir`` as a user who sees ``output_dir/checkpoint-4`` expects: the error said only "checkpoint-4 does not
exist", without where it looked or which checkpoint was meant."""
from __future__ import annotations

import os

from ..usage import relative_path_hint


def where_to_look(path: str, output_dir: str | None) -> str:
    from . import checkpoints, newest_whole  # (the package imports this module)

    relative, hint = not os.path.isabs(path), relative_path_hint(path)
    if not output_dir:
        return hint
    inside = os.path.join(output_dir, path)
    if relative and os.path.isdir(inside):
        return f"{hint}; did you mean {inside}, in output_dir?"
    held = checkpoints(output_dir)
    if not held:
        return hint
    whole = newest_whole(output_dir)  # (not every name: a run without save_total_limit holds hundreds)
    return (f"{hint}; output_dir {output_dir} holds {len(held)} checkpoint(s), "
            + (f"the newest complete one {whole} (what --resume_from_checkpoint true takes)" if whole else
               "none of them complete"))
