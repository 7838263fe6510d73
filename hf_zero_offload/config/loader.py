"""Reading a ds_config (a path, a shipped config's name, or a dict) and validating it against :mod:`.schema`;
a problem is a :class:`~.schema.ConfigError` naming the file and the key path.
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any, NamedTuple

# the module, not its names: presets raises ConfigError from .schema, so presets and this package import
# each other, and binding the module lets either be imported first (resolve_config is looked up at call time)
from .. import presets
from ..usage import first_bad_utf8
from .rules import validate
from .schema import ConfigError


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _parse_int(text: str) -> int:
    """json's integer parsing, except past Python's limit on integer strings (4300 digits by default), where
    int() raises a ValueError with no key in it that suggests sys.set_int_max_str_digits() to a config's author.
    Such a number stands in as 10**(digits-1), same sign and number of digits: every numeric key refuses an int
    beyond a float's range (naming the key and the digit count), and free-form objects (checkpoint, timers) are
    never read."""
    try:
        return int(text)
    except ValueError:
        digits = len(text.lstrip("-"))
        return (-1 if text.startswith("-") else 1) * 10 ** (digits - 1)


def _json_hint(text: str, e: json.JSONDecodeError) -> str:
    """What JSON's own message leaves unsaid about the mistakes people make in hand-written configs."""
    if not text.strip():
        return "the file is empty (a ds_config is a JSON object: {...})"
    rest = text[e.pos:]
    if rest.startswith(("//", "/*", "#")):
        return "JSON has no comments; remove them"
    before = text[:e.pos].rstrip()
    if before.endswith(",") and rest[:1] in ("}", "]"):
        return f"a trailing comma before {rest[0]!r}; JSON allows none, remove it"
    if e.msg == "Extra data" and before.lstrip("\ufeff").startswith('"') and rest.lstrip().startswith(":"):
        # the README's extension block, pasted as the whole file, said only "Extra data"
        return ('a "key": value outside any object (a fragment pasted as the whole file?): a ds_config is one JSON '
                "object, so wrap the file's content in { }")
    return e.msg


INLINE = "<inline JSON>"


def is_inline(value: Any) -> bool:
    """A ds_config given as JSON text (``--zero_offload '{"zero_optimization": ...}'``), as transformers takes a
    ``--deepspeed`` string that starts with ``{``; a file of that name (``{run}.json``) is a file."""
    return isinstance(value, str) and value.lstrip("\ufeff \t\r\n").startswith(("{", "[")) and \
        not os.path.exists(value)  # (an array: JSON too, refused as not an object)


def parse_inline(text: str) -> dict:
    """JSON text -> the dict it holds, refused as a file's JSON is (duplicate keys, comments, trailing commas)."""
    value = _parse(text.lstrip("\ufeff"), INLINE)
    if not isinstance(value, dict):
        raise ConfigError(f"{INLINE}: a ds_config is a JSON object ({{...}}), got a JSON {type(value).__name__}")
    return value


def _parse(text: str, source: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {_json_hint(text, e)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid JSON: nested too deeply for a ds_config") from None
    except ValueError as e:  # duplicate key
        raise ConfigError(f"{source}: invalid JSON: {e}") from None


MAX_BYTES = 16 << 20  # a ds_config is a few KB: /dev/zero or a dataset given by mistake was read whole (memory, time)
# What a pipe held (--zero_offload <(jq ... ds_config.json), /dev/stdin), by its path and (st_dev, st_ino): the
# example script's early check read it and the Trainer then read an empty pipe ("the file is empty"), or blocked on a
# named FIFO whose writer had gone. A regular file is read each time.
_STREAMS: dict[tuple[str, int, int], bytes] = {}


def _read_bytes(source: str) -> bytes:
    try:
        st = os.stat(source)
        key = (source, st.st_dev, st.st_ino) if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)) else None
    except (OSError, ValueError):  # (open() says why)
        key = None
    if key in _STREAMS:  # (before open(): a second open of a FIFO waits for a writer)
        return _STREAMS[key]
    with open(source, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{source}: over {MAX_BYTES >> 20} MiB, not a ds_config (a JSON object of a few KB); read "
                          f"no further")
    if key is not None:
        _STREAMS[key] = data
    return data


def _read(path_or_dict: Any) -> tuple[Any, str]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, "<dict>"
    if is_inline(path_or_dict):
        return parse_inline(path_or_dict), INLINE
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigError(f"expected a ds_config path, a shipped config's name, JSON text or a dict, got "
                          f"{type(path_or_dict).__name__}")
    if "\0" in os.fspath(path_or_dict):  # (from code or an arguments file) open() raised a bare "embedded null byte"
        raise ConfigError(f"{os.fspath(path_or_dict)!r}: not a ds_config path: it holds a NUL character")
    source = presets.resolve_config(os.fspath(path_or_dict))  # a shipped config's name -> its packaged file
    try:
        data = _read_bytes(source)
    except OSError as e:
        hint = presets.missing_file_hint(source) if isinstance(e, FileNotFoundError) else ""
        raise ConfigError(f"{source}: cannot read the ds_config file: {e.strerror or e}{hint}") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) changes no value
    except UnicodeDecodeError:
        bad = first_bad_utf8(data)[1]  # in the file (the decoder's offset left out a byte-order mark)
        raise ConfigError(f"{source}: not a UTF-8 text file (byte {bad} is 0x{data[bad]:02x}); "
                          "a ds_config is JSON saved as UTF-8") from None
    return _parse(text, source), source


class Checked(NamedTuple):
    """A ds_config read and validated once (normalised; ``resolve`` takes it without a second pass);
    ``no_effect``: the keys given that change nothing here (the start log names them)."""
    cfg: dict
    source: str
    no_effect: list


def check(path_or_dict: Any) -> Checked:
    raw, source = _read(path_or_dict)
    ignored: list = []
    return Checked(validate(raw, source, ignored), source, ignored)


def load_config(path_or_dict: Any) -> dict:
    """Read (when given a path) and validate a ds_config; return the raw dict, unchanged."""
    raw, source = _read(path_or_dict)
    validate(raw, source)
    return raw

