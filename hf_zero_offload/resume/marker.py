"""The completion marker of a checkpoint (``checkpoint-N/hzo_complete.json``): written last, once every piece and
every rank's optimizer state is on disk, it records the step, the world size, the engine that saved (with its save
id) and what the folder held (``manifest``); read back, checked, and compared with the folder before a resume or a
consolidate reads anything. Where to resume from, and what to say about it, is ``resume``'s.
"""
from __future__ import annotations

import json
import os
import time
from typing import NamedTuple

from . import manifest
from ..engine.checkpoint import atomic_open

MARKER = "hzo_complete.json"


def write_marker(checkpoint: str, info: dict) -> None:
    """Declares ``checkpoint`` complete, recording what it holds (``manifest``: a resume compares it first)."""
    files = manifest.build(checkpoint, skip=(MARKER,))
    with atomic_open(os.path.join(checkpoint, MARKER), "w") as f:
        json.dump({"complete": True, "written": time.strftime("%Y-%m-%d %H:%M:%S"), "written_ns": time.time_ns(),
                   **info, "files": files}, f, indent=1)


class MarkerRead(NamedTuple):
    """One read of a checkpoint's marker, which ``read_marker``, ``marker_problem`` and ``changed_files`` each judge
    when given it: read once, their answers cannot disagree (a marker replaced or damaged between three reads was
    complete to one and damaged to the next). ``present``: something is at its path (a link to nothing too)."""
    present: bool
    value: object = None  # its JSON
    error: Exception | None = None  # why it could not be read


def load_marker(checkpoint: str) -> MarkerRead:
    path = os.path.join(checkpoint, MARKER)
    try:
        with open(path, encoding="utf-8") as f:
            return MarkerRead(True, json.load(f))
    except FileNotFoundError as e:  # (absent, or a link to nothing: there, and unreadable)
        return MarkerRead(os.path.lexists(path), error=e)
    except (OSError, ValueError) as e:
        return MarkerRead(True, error=e)


def read_marker(checkpoint: str, marker_read: MarkerRead | None = None) -> dict | None:
    """The marker's record when it is whole (None: missing, or unreadable: not a proof of completeness either way);
    ``marker_read``: ``load_marker``'s, else the file is read here (as in the two below)."""
    marker = (load_marker(checkpoint) if marker_read is None else marker_read).value
    return marker if isinstance(marker, dict) and marker.get("complete") is True else None


def marker_problem(checkpoint: str, marker_read: MarkerRead | None = None) -> str | None:
    """What is wrong with a marker that is there (None: whole, or absent): said as such, not as a missing one."""
    read = load_marker(checkpoint) if marker_read is None else marker_read
    if not read.present:
        return None
    if read.error is not None:
        return f"its {MARKER} cannot be read ({type(read.error).__name__}: {read.error})"
    marker = read.value
    if not isinstance(marker, dict):
        return f"its {MARKER} is damaged (a JSON {type(marker).__name__}, not an object)"
    if marker.get("complete") is not True:
        return f"its {MARKER} is damaged (\"complete\" is {marker.get('complete')!r}, not true)"
    if "files" in marker and not (isinstance(marker["files"], dict) and marker["files"]):
        # a save lists every file it wrote (markers from before the manifest have no "files" at all)
        return f"its {MARKER} is damaged (\"files\" is {marker['files']!r}, not the files its save wrote)"
    if marker.get("engine") is not None and not isinstance(marker["engine"], dict):
        return f"its {MARKER} is damaged (\"engine\" is a {type(marker['engine']).__name__}, not an object)"
    # the fields the checks read, of the type a save writes: one of another type (a hand edit: docs/CHECKPOINTS.md has users
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


def changed_files(checkpoint: str, read=None, required=None, marker_read: MarkerRead | None = None) -> list[str]:
    """How a marked checkpoint differs from what its save wrote (``manifest``; ``read``/``required``: the files the
    operation reads / cannot do without, default a resume's); [] when it does not, or unmarked."""
    marker = read_marker(checkpoint, marker_read)
    return manifest.problems(checkpoint, marker.get("files"), read, required) if marker is not None else []


def recorded_save_id(checkpoint: str) -> str | None:
    """The save id of the optimizer state the checkpoint's marker records (None: no marker, or one written before
    save ids): the state under ``zero_offload/`` must be that save's, not one copied or linked from elsewhere."""
    engine = (read_marker(checkpoint) or {}).get("engine")
    save_id = engine.get("save_id") if isinstance(engine, dict) else None
    return save_id if isinstance(save_id, str) else None
