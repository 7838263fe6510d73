"""Whether the files a run writes under ``output_dir`` fit the file system's limits on a name (``PC_NAME_MAX``) and a
path (``PC_PATH_MAX``), checked before any training: an output_dir too long for ``checkpoint-N/zero_offload/...``
failed only at the first save, with the steps since the start lost. The longest names are ours and the Trainer's
(weights' shards, the RNG state per rank, tokenizer files), each as its temporary (``<name>.hzo-tmp.<host>.<pid>``)."""
from __future__ import annotations

import os
import socket

from ..engine.checkpoint import TMP_TAG
from .marker import MARKER

_STEP_DIGITS = 9  # a run given epochs, not max_steps: checkpoint-999999999
_PID = "9" * 7  # pid_max is at most 4194304 on Linux


def _names(world_size: int) -> list[str]:
    """What a save writes under checkpoint-N (relative paths), the longest of each kind."""
    w = max(1, int(world_size))
    ours = [f"zero_offload/rank{w - 1}_of_{w}.hzo", "zero_offload/param_names.json", "zero_offload/meta.json",
            MARKER, "scheduler.pt"]
    trainers = ["model-00001-of-00001.safetensors", "model.safetensors.index.json", "pytorch_model.bin.index.json",
                "adapter_model.safetensors", "generation_config.json", "special_tokens_map.json",
                "tokenizer_config.json", "training_args.bin", "trainer_state.json", f"rng_state_{w - 1}.pth"]
    tmp = f"{TMP_TAG}{socket.gethostname()}.{_PID}"
    return [n + tmp for n in ours] + trainers


def existing_folder(path: str) -> str:
    """The nearest folder that exists on ``path`` (itself, or the first parent that does): what the file system's
    limits and free space are read from before the rest is created."""
    at = os.path.abspath(path)
    while not os.path.isdir(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    return at


def _limit(at: str, name: str) -> int | None:
    try:
        value = os.pathconf(at, name)
    except (OSError, ValueError):  # not said by this platform or file system: nothing to check against
        return None
    return value if isinstance(value, int) and value > 0 else None


def problem(output_dir: str, max_steps: int | None, world_size: int = 1) -> str | None:
    """One line naming the path (or name) that would not fit, and the limit; None when all fit."""
    root = os.path.abspath(output_dir)
    at = existing_folder(root)
    steps = max_steps if isinstance(max_steps, int) and max_steps > 0 else int("9" * _STEP_DIGITS)
    step_dir = f"checkpoint-{steps}"
    name_max, path_max = _limit(at, "PC_NAME_MAX"), _limit(at, "PC_PATH_MAX")
    fix = "use a shorter --output_dir"
    if name_max is not None:
        new = os.path.relpath(root, at).split(os.sep) if root != at else []
        for name in [c for c in new if c not in (".", "")] + [step_dir] + [p for n in _names(world_size)
                                                                            for p in n.split("/")]:
            if len(os.fsencode(name)) > name_max:
                return (f"--output_dir {output_dir}: the name {name} ({len(os.fsencode(name))} bytes) is over the "
                        f"file system's PC_NAME_MAX of {name_max} bytes (os.pathconf of {at}); the first checkpoint "
                        f"save would fail after training: {fix}")
    if path_max is not None:
        longest = max((os.path.join(step_dir, n) for n in _names(world_size)), key=lambda p: len(os.fsencode(p)))
        size = len(os.fsencode(os.path.join(root, longest))) + 1  # (the terminating NUL counts)
        if size > path_max:
            room = path_max - (size - len(os.fsencode(root)))
            return (f"--output_dir {output_dir}: the path of {longest} under it would be {size} bytes (absolute, "
                    f"with its NUL), over the file system's PC_PATH_MAX of {path_max} bytes; the first checkpoint "
                    f"save would fail after training: {fix} (at most {max(room, 0)} bytes as an absolute path)")
    return None
