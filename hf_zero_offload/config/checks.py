"""The vocabulary of the ``ds_config.json`` tables in :mod:`hf_zero_offload.config.schema`: a key's
:class:`Spec` (its kind: ``use``, ``ignore``, ``unsupported`` or a ``section``) and the value checks that
normalise a value or say what was expected.

A check takes the raw JSON value and returns the normalised one, or raises :class:`BadValue` (with a
description of the accepted values) or :class:`UnsupportedValue` (the value names a DeepSpeed feature
hf_zero_offload does not implement); the walker in ``config.schema`` turns both into a ``ConfigError``
naming the file and key path.

Stdlib only: no torch, no transformers.
"""
from __future__ import annotations

import json
import math
import numbers
import sys
from typing import Any, Callable, NamedTuple


class BadValue(Exception):
    """Raised by a value check: ``expected`` describes the accepted values."""

    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


class UnsupportedValue(Exception):
    """Raised by a value check for a value naming a DeepSpeed feature we do not implement."""


class Spec(NamedTuple):
    kind: str  # "use" | "ignore" | "unsupported"
    check: Callable[[Any], Any] | None = None  # value -> normalised value, raises BadValue/UnsupportedValue
    auto: bool = False  # "auto" accepted (resolved from TrainingArguments)
    children: dict[str, "Spec"] | None = None  # nested object
    harmless: Callable[[Any], bool] | None = None  # for "unsupported": values accepted and ignored
    why: str = ""  # for "unsupported": the reason and what to use instead


# ---------------------------------------------------------------- value checks


def _is_num(v: Any) -> bool:
    # numbers.Real, not (int, float): a dict built in Python may hold numpy scalars (np.float32 is no float)
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond a float's range (JSON allows 10**400): no key takes one, and every
        return False       # check that calls this then names the key instead of a traceback from float()


def huge_int(v: Any) -> bool:
    """An int no float holds (what a JSON integer literal of 309+ digits parses to)."""
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) > sys.float_info.max


def _digits(n: int) -> int:
    # str(n) fails beyond sys.get_int_max_str_digits() (4300 by default): count from the logarithm, then correct it
    n = abs(n)
    d = int(math.log10(n)) + 1
    return d + 1 if n >= 10 ** d else d - 1 if n < 10 ** (d - 1) else d


def show(value: Any) -> str:
    """A value as the user wrote it in JSON ("true" as a string shows its quotes, None shows as null); an
    integer too large for a float as its number of digits (printing 400 or 5000 of them helps nobody, and
    beyond 4300 Python refuses to)."""
    if huge_int(value):
        return ("a negative" if value < 0 else "an") + f" integer of {_digits(value)} digits"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # numpy scalars from a dict built in Python; a huge int inside a list
        try:
            text = repr(value)
        except ValueError:
            return json_type(value)
    return text if len(text) <= 200 else text[:200] + "..."


def non_json(v: Any, where: str = "") -> tuple[str, str] | None:
    """Where in ``v`` something sits that json.load could not have produced (``".key"``, ``"[1]"``, ``""`` for
    ``v`` itself) and what is wrong; None when there is none. numpy scalars count as numbers; arrays, tensors
    and sets do not (comparing them with ``==`` gives no single truth value)."""
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, (list, tuple)) else None
    if items is None:
        if v is None or isinstance(v, (str, bool, numbers.Real)):
            return None
        return where, ("expected a JSON value (object, array, string, number, true/false/null), got "
                       + type(v).__name__)
    for k, x in items:
        if isinstance(v, dict) and not isinstance(k, str):
            return f"{where}.{k!r}", f"keys must be strings, got {type(k).__name__}"
        found = non_json(x, f"{where}.{k}" if isinstance(v, dict) else f"{where}[{k}]")
        if found is not None:
            return found
    return None


def plain_numbers(v: Any) -> Any:
    """``v`` with numpy scalars (any number not an int, float or bool) as Python's int or float, in a copy, so that
    json.dumps takes it (TrainingArguments.to_json_string, the report_to integrations); anything else as it is."""
    if isinstance(v, dict):
        return {k: plain_numbers(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(plain_numbers(x) for x in v)
    if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)):
        return int(v) if isinstance(v, numbers.Integral) else float(v)
    return v


def json_type(v: Any) -> str:
    """How JSON names the type of a parsed value (what the user wrote, not Python's name for it)."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    for kind, name in ((str, "a string"), (dict, "an object"), ((list, tuple), "an array"),
                       (numbers.Real, "a number")):
        if isinstance(v, kind):
            return name
    return type(v).__name__


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadValue("true or false")
    return v


def integer(lo: int | None = None, what: str = "an integer", hi: int | None = None) -> Callable[[Any], int]:
    """Integers (in [lo, hi]); integral floats such as ``2e8`` (DeepSpeed's spelling of sizes) become ints."""

    def check(v: Any) -> int:
        if (not _is_num(v) or not float(v).is_integer() or (lo is not None and v < lo)
                or (hi is not None and v > hi)):
            raise BadValue(what)
        return int(v)

    return check


def number(lo: float | None = None, hi: float | None = None, what: str = "a number",
           lo_open: bool = False, hi_open: bool = True) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if not _is_num(v):
            raise BadValue(what)
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise BadValue(what)
        if hi is not None and (v > hi or (hi_open and v == hi)):
            raise BadValue(what)
        return float(v)

    return check


def static_loss_scale(v: Any) -> float:
    """fp16.loss_scale: 0 (dynamic) or a static scale. The engine unscales by ``1/scale`` in fp32: a scale below
    2**-126 made that inf and every weight NaN after the first step (0 * inf), silently. Below 1 a static scale
    scales the gradients down, the opposite of what loss scaling is for: at 1e-10 every fp16 gradient underflowed
    to 0 and nothing trained, silently; refused as the slip it almost surely is (1 is "no scaling")."""
    if _is_num(v) and (v == 0 or 1 <= v <= 2.0 ** 126):
        return float(v)
    raise BadValue("0 (dynamic) or a static scale in [1, 2**126] (below 1 a scale only pushes fp16 gradients into "
                   "underflow; 1 is no scaling)")


def choice(*options: str, unsupported: dict[str, str] | None = None, casefold: bool = False,
           other: str | None = None) -> Callable[[Any], str]:
    """One of ``options`` (returned in its canonical spelling); ``unsupported`` maps other known names to a why;
    ``other``: the why for any other string (DeepSpeed takes any torch optimizer or scheduler by its name)."""
    table = {(o.lower() if casefold else o): o for o in options}
    others = {(k.lower() if casefold else k): w for k, w in (unsupported or {}).items()}

    def check(v: Any) -> str:
        key = v.lower() if casefold and isinstance(v, str) else v
        if isinstance(key, str) and key in table:
            return table[key]
        if isinstance(key, str) and key in others:
            raise UnsupportedValue(others[key])
        near = [o for o in options if isinstance(v, str) and o.lower() == v.lower()]
        if near:  # a slip of case, not an unsupported name
            raise BadValue("one of " + ", ".join(repr(o) for o in options) +
                           f" (did you mean {near[0]!r}? names are case-sensitive, as DeepSpeed reads them)")
        if isinstance(key, str) and other is not None:
            raise UnsupportedValue(other)
        raise BadValue("one of " + ", ".join(repr(o) for o in options))

    return check


def betas(v: Any) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2 or not all(_is_num(b) and 0 <= b < 1 for b in v):
        raise BadValue("a list of two numbers in [0, 1)")
    return (float(v[0]), float(v[1]))


def stage(v: Any) -> int:
    if v == 3 and not isinstance(v, bool):
        raise UnsupportedValue("ZeRO stage 3 (parameter partitioning) is not implemented; use stage 2 with "
                           "offload_optimizer (or DeepSpeed/FSDP when the parameters alone do not fit)")
    return choice_int(v, (0, 1, 2))


def choice_int(v: Any, options: tuple[int, ...]) -> int:
    n = integer()(v) if _is_num(v) else None
    if n not in options:
        raise BadValue("one of " + ", ".join(map(str, options)))
    return n


def anything(v: Any) -> Any:
    return v


def stage3_value(v: Any) -> Any:
    """A ZeRO stage-3 tuning value (a bucket size, a threshold, a switch): a number, a boolean or null."""
    if not (v is None or isinstance(v, bool) or _is_num(v)):
        raise BadValue("a number, a boolean or null (a ZeRO stage-3 setting)")
    return v


def an_object(v: Any) -> dict:
    if not isinstance(v, dict):
        raise BadValue("an object")
    return v


def str_or_null(v: Any) -> Any:
    if v is not None and not isinstance(v, str):
        raise BadValue("a string or null")
    return v


def is_off(v: Any) -> bool:
    """A switched-off value or section: false/null/0/""/[], {"enabled": false}, or an object of such values."""
    if isinstance(v, dict):
        if "enabled" in v:
            return v["enabled"] is False
        return all(is_off(x) for x in v.values())
    return v is None or v is False or v == 0 or v == "" or v == []


# ---------------------------------------------------------------- the kinds of a table entry


def use(check: Callable[[Any], Any], auto: bool = False) -> Spec:
    return Spec("use", check, auto)


def section(children: dict[str, Spec]) -> Spec:
    return Spec("use", None, False, children)


def ignore(check: Callable[[Any], Any] = anything) -> Spec:
    return Spec("ignore", check)


def unsupported(why: str, harmless: Callable[[Any], bool] = is_off) -> Spec:
    return Spec("unsupported", harmless=harmless, why=why)
