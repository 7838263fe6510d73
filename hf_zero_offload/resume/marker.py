"""The completion marker of a checkpoint (``checkpoint-N/hzo_complete.json``): written last, once every piece and
every rank's optimizer state is on disk, it records the step, the world size, the engine that saved (with its save
id) and what the folder held (``manifest``); read back, checked, and compared with the folder before a resume or a
consolidate reads anything. Where to resume from, and what to say about it, is ``resume``'s.
"""
from __future__ import annotations

import json
import os
import time

from . import manifest
from ..engine.checkpoint import atomic_open

MARKER = "hzo_complete.json"


def write_marker(checkpoint: str, info: dict) -> None:
    """Declares ``checkpoint`` complete, recording what it holds (``manifest``: a resume compares it first)."""
    files = manifest.build(checkpoint, skip=(MARKER,))
    with atomic_open(os.path.join(checkpoint, MARKER), "w") as f:
        json.dump({"complete": True, "written": time.strftime("%Y-%m-%d %H:%M:%S"), "written_ns": time.time_ns(),
                   **info, "files": files}, f, indent=1)


def read_marker(checkpoint: str) -> dict | None:
    try:
        with open(os.path.join(checkpoint, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):  # missing, or unreadable: not a proof of completeness either way
        return None
    return marker if isinstance(marker, dict) and marker.get("complete") is True else None


def marker_problem(checkpoint: str) -> str | None:
    """What is wrong with a marker that is there (None: whole, or absent): said as such, not as a missing one."""
    path = os.path.join(checkpoint, MARKER)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError) as e:
        return f"its {MARKER} cannot be read ({type(e).__name__}: {e})"
    if not isinstance(marker, dict):
        return f"its {MARKER} is damaged (a JSON {type(marker).__name__}, not an object)"
    if marker.get("complete") is not True:
        return f"its {MARKER} is damaged (\"complete\" is {marker.get('complete')!r}, not true)"
    if "files" in marker and not (isinstance(marker["files"], dict) and marker["files"]):
        # a save lists every file it wrote (markers from before the manifest have no "files" at all)
        return f"its {MARKER} is damaged (\"files\" is {marker['files']!r}, not the files its save wrote)"
    if marker.get("engine") is not None and not isinstance(marker["engine"], dict):
        return f"its {MARKER} is damaged (\"engine\" is a {type(marker['engine']).__name__}, not an object)"
    # the fields the checks read, of the type a save writes: one of another type (a hand edit: the README has users
    # delete an entry of "files") was read as nothing recorded, and the check it feeds passed over in silence (a
    # save id of 5 let consolidate take any save's optimizer state; a size of "757" read "757 bytes where its save
    # wrote 757")
    save_id = (marker.get("engine") or {}).get("save_id")
    for field, value, ok, want in (
            ("step", marker.get("step"), manifest.is_count(marker.get("step")), "an int >= 0"),
            ("world_size", marker.get("world_size"), manifest.is_count(marker.get("world_size"))
             and marker.get("world_size") >= 1, "an int >= 1"),
            ("engine.save_id", save_id, isinstance(save_id, str), "a string")):
        if value is not None and not ok:
            return f"its {MARKER} is damaged (\"{field}\" is {value!r}, not {want})"
    bad = next((rel for rel, want in (marker.get("files") or {}).items() if manifest.entry_problem(want)), None)
    if bad is not None:
        return (f"its {MARKER} is damaged (the \"files\" entry of {bad} is {marker['files'][bad]!r}, not "
                f"{manifest.ENTRY})")
    return None


def changed_files(checkpoint: str, read=None, required=None) -> list[str]:
    """How a marked checkpoint differs from what its save wrote (``manifest``; ``read``/``required``: the files the
    operation reads / cannot do without, default a resume's); [] when it does not, or unmarked."""
    marker = read_marker(checkpoint)
    return manifest.problems(checkpoint, marker.get("files"), read, required) if marker is not None else []


def recorded_save_id(checkpoint: str) -> str | None:
    """The save id of the optimizer state the checkpoint's marker records (None: no marker, or one written before
    save ids): the state under ``zero_offload/`` must be that save's, not one copied or linked from elsewhere."""
    engine = (read_marker(checkpoint) or {}).get("engine")
    save_id = engine.get("save_id") if isinstance(engine, dict) else None
    return save_id if isinstance(save_id, str) else None
