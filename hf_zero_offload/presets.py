"""The ds_configs shipped inside the package, usable by name: ``--zero_offload zero2-offload``.

The JSON files live in ``hf_zero_offload/configs/`` (package data, so they exist wherever the package is
installed, not only in a clone); the repository's ``configs/ds_config*.json`` are links to them, so there is one
source of truth. A name is the file's stem; the blog's file names are accepted as aliases so that
``--zero_offload ds_config_1gpu.json`` works outside a clone too. A path that exists always wins over a name.
"""
from __future__ import annotations

import difflib
import logging
import os

from .config.schema import ConfigError  # .schema, not the package: the package imports presets
from .usage import relative_path_hint

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

# name -> (file, one-line description); the order is the listing order of ``hf-zero-offload configs``
PRESETS = {
    "zero2-offload": ("zero2-offload.json", "ZeRO-2 + CPU offload of the optimizer (one or several GPUs; "
                                            "fp16/bf16/fp32 and every optimizer value follow the command line)"),
    "zero2-offload-int8": ("zero2-offload-int8.json", "as zero2-offload, with the Adam moments stored in 8 bits on "
                                                      "the host (blockwise int8: 8.1 instead of 14.1 bytes/param)"),
    "zero2": ("zero2.json", "ZeRO-2 without offload: optimizer state and gradients sharded across ranks"),
}
# the file names of the HF blog post (and of configs/ in the repository)
ALIASES = {"ds_config_1gpu": "zero2-offload", "ds_config": "zero2-offload", "ds_config_zero2": "zero2"}


def _preset_name(name: str) -> str:
    """A name or alias, with or without ``.json``, as the key of PRESETS (not checked)."""
    stem = name[:-5] if name.endswith(".json") else name
    return ALIASES.get(stem, stem)


def preset_path(name: str) -> str:
    """The packaged file of a config name (or alias, with or without ``.json``)."""
    stem = _preset_name(name)
    if stem not in PRESETS and name.endswith(".json"):  # a file name with a typo, not a shipped config's name
        folder = os.path.dirname(name) or "."
        files = [os.path.join(os.path.dirname(name), f) for f in os.listdir(folder) if f.endswith(".json")] \
            if os.path.isdir(folder) else []
        near = difflib.get_close_matches(name, files, n=1) or difflib.get_close_matches(
            stem, [*names(), *ALIASES], n=1)
        where = os.path.abspath(folder)
        raise ConfigError(f"{name}: no such file (in {where})" + (f"; did you mean {near[0]}?" if near else "")
                          + f"; shipped ds_configs: {', '.join(names())} (aliases: {', '.join(sorted(ALIASES))})")
    if stem not in PRESETS:
        near = difflib.get_close_matches(stem, [*names(), *ALIASES], n=1)
        raise ConfigError(f"no shipped ds_config named {name!r}" + (f"; did you mean {near[0]}?" if near else "")
                          + f"; names: {', '.join(names())} "
                          f"(aliases: {', '.join(sorted(ALIASES))}), or give a path to a JSON file")
    return os.path.join(_DIR, PRESETS[stem][0])


def names() -> list[str]:
    return list(PRESETS)


_SAID: set = set()  # (file name, directory) pairs whose stand-in was said


def resolve_config(name_or_path: str) -> str:
    """``name_or_path`` if it is an existing file or has a directory part, else the packaged file it names.

    A missing path with a directory part stays a path (the reader reports it as a missing file): the user
    meant a file, and silently picking a shipped config would hide the typo.
    """
    path = os.fspath(name_or_path)
    if os.path.exists(path) or os.path.dirname(path):
        return path
    shipped = preset_path(path)
    # a file name: a file of the user's, not found here, would be replaced without a word (said once per process)
    if path.endswith(".json") and (path, os.getcwd()) not in _SAID:
        _SAID.add((path, os.getcwd()))
        logging.getLogger("hf_zero_offload").warning(
            "hf_zero_offload: no file %s in the current directory (%s): the shipped config of that name runs (%s); "
            "give ./%s for a file of your own", path, os.getcwd(), shipped, path)
    return shipped


def is_shipped(path: str) -> bool:
    """Whether ``path`` is one of the packaged files (also through the repository's ``configs/`` links)."""
    return isinstance(path, str) and os.path.dirname(os.path.realpath(path)) == os.path.realpath(_DIR)


def missing_file_hint(path: str) -> str:
    """What to add to "cannot read" for a ds_config path that does not exist: where a relative path was looked
    up, and the shipped name when the file is one of ours (``configs/ds_config.json`` run from outside the clone)."""
    hint = relative_path_hint(path)
    name = _preset_name(os.path.basename(path))
    if name in PRESETS:
        hint += f"; the same config ships with the package: --zero_offload {name}"
    return hint


def listing() -> str:
    """``hf-zero-offload configs``: one line per shipped config with its file."""
    width = max(map(len, PRESETS))
    lines = [f"{n.ljust(width)}  {desc}\n{' ' * width}  {os.path.join(_DIR, f)}" for n, (f, desc) in PRESETS.items()]
    alias = ", ".join(f"{a}.json -> {n}" for a, n in ALIASES.items())
    return "\n".join(lines + [f"use: --zero_offload NAME (or a path to your own JSON); aliases: {alias}"])
