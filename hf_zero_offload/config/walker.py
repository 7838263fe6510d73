"""The walker of the ``ds_config.json`` key tables (:mod:`.schema`): each key of a config checked against its
table's :class:`~.checks.Spec`, every problem a :class:`~.schema.ConfigError` naming the file and the key path.
Split from :mod:`.schema` by concept: that module holds the tables, this one walks a config through them.

Stdlib only: no torch, no transformers.
"""
from __future__ import annotations

import difflib
from typing import Any

from .checks import BadValue, Spec, UnsupportedValue, is_off, non_json, show
from .schema import AUTO, NO_EFFECT, QUIET_WHEN_OFF, STAGE3_KEY, TOP, ZERO, ConfigError


_FIRST = ("stage", "type", "device", "enabled")  # checked first so their messages win


_show = show


def _err(source: str, path: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: {msg}")


def _unknown(source: str, prefix: str, key: str, table: dict[str, Spec]) -> ConfigError:
    # The key quoted with repr(): a trailing space, a NUL or a zero-width space printed bare made "unknown key fp16
    # (did you mean 'fp16'?)", which reads as nonsense; the path too, where such a character would print raw.
    visible = "".join(c for c in key if c.isprintable() and not c.isspace())
    close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.6)
    case = [k for k in table if k.lower() == key.lower()]  # "FP16", "LR": too short for difflib's ratio
    elsewhere = [w for w in _places(key) if w != prefix[:-1]]
    if visible != key and visible in table:
        hint = f" (it differs from {visible!r} only by spaces or invisible characters)"
    elif case:
        hint = f" (did you mean {case[0]!r}? keys are case-sensitive)"
    elif 0 < len(elsewhere) <= 2:  # "lr" beside "type", "device" in zero_optimization: a level off
        hint = " (it is a key of " + " or ".join("the top level" if not w else repr(w) for w in elsewhere) + ")"
    else:
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = "top level" if not prefix else f"'{prefix[:-1]}'"
    path = prefix + (key if key and key == visible else repr(key))
    return ConfigError(f"{source}: {path}: unknown key {key!r} at {where}{hint}; supported keys there: "
                       + ", ".join(k for k, s in table.items() if s.kind == "use"))


def _places(key: str, table: dict[str, Spec] | None = None, prefix: str = "") -> list[str]:
    """The sections (dotted paths, "" for the top level) whose table holds ``key``."""
    table = TOP if table is None else table
    found = [prefix] if key in table else []
    for name, spec in table.items():
        if spec.children is not None:
            found += _places(key, spec.children, f"{prefix}.{name}" if prefix else name)
    return found


def _expected(spec: Spec) -> str:
    """"; expected <the values the key takes>" for an error about "auto" (offload_optimizer.state_dtype: "auto" used
    to be refused without saying that fp32, bf16 and int8 are what it takes)."""
    try:
        if spec.check is not None:
            spec.check(AUTO)
    except BadValue as e:
        return f"; expected {e.expected}"
    except UnsupportedValue:
        pass
    return ""


def _walk(node: dict, table: dict[str, Spec], prefix: str, source: str, ignored: list | None = None) -> dict:
    out: dict[str, Any] = {}
    for key in sorted(node, key=lambda k: k not in _FIRST):
        value, path = node[key], f"{prefix}{key}"
        bad = non_json({key: value})  # a dict built in Python: an int key, a numpy array, a tensor...
        if bad is not None:
            raise _err(source, prefix + bad[0][1:], bad[1])
        if key.startswith("_") and key.lstrip("_"):  # "_comment": JSON has no comments; DeepSpeed ignores such keys
            continue
        spec = table.get(key)
        if spec is None and table is ZERO and key.startswith("stage3_"):
            spec = STAGE3_KEY
        if spec is None:
            raise _unknown(source, prefix, key, table)
        if spec.kind == "unsupported":
            # null is DeepSpeed's "not set" for its optional features (offload_param: null, ...)
            if value is None or (spec.harmless is not None and spec.harmless(value)):
                continue
            raise _err(source, path, f"{_show(value)} is not supported by hf_zero_offload: {spec.why}")
        if value == AUTO:
            if spec.auto:
                if spec.kind == "use":
                    out[key] = AUTO
                elif ignored is not None:
                    ignored.append(path)
                continue
            raise _err(source, path, '"auto" is not accepted for this key (only for batch sizes, gradient_'
                       'clipping, the optimizer\'s numbers, the scheduler\'s LRs and step counts, fp16/bf16.enabled '
                       'and the bucket sizes)' + _expected(spec))
        if spec.children is not None:
            if value is None:  # a section set to null is a section not given (DeepSpeed's optional blocks)
                continue
            if not isinstance(value, dict):
                legacy = (f' (DeepSpeed\'s legacy form of {{"stage": {int(value)}}}: write that)'
                          if path == "zero_optimization" and isinstance(value, bool) else "")
                raise _err(source, path, f"expected an object, got {_show(value)}{legacy}")
            sub = _walk(value, spec.children, path + ".", source, ignored)
        else:
            try:
                sub = spec.check(value)
            except BadValue as e:
                raise _err(source, path, f"expected {e.expected}, got {_show(value)}") from None
            except UnsupportedValue as e:
                raise _err(source, path, f"{_show(value)} is not supported by hf_zero_offload: {e}") from None
        if spec.kind == "use":
            out[key] = sub
        if ignored is not None and (spec.kind == "ignore" or path in NO_EFFECT) and not (path in QUIET_WHEN_OFF
                                                                                        and is_off(value)):
            ignored.append(path)
    return out
