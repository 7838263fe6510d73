"""``torch.nn.utils.clip_grad_norm_`` over an engine's params: the engine's clipping, not a silent no-op.

The engines take each gradient during backward and free ``.grad`` (OffloadAdam, ZeRO-2), or hold this rank's
gradient in ``.grad`` until their step averages it (ZeRO-0/1). torch's ``clip_grad_norm_(model.parameters(), 1.0)``
between ``backward()`` and ``step()``, the most common PyTorch loop, then found no gradient, returned 0.0 and clipped
nothing (ZeRO-0/1: clipped this rank's ``.grad`` by this rank's norm, before the average), without a word.

The only hook point is the function itself, so once an engine is built (``install``, from ``lifetime``) torch's
functions are replaced on their modules (``torch.nn.utils`` and ``torch.nn.utils.clip_grad``) by wrappers that look
up which live engine (built, not closed or replaced, its hooks attached) owns the params given (``grad_hooks``'
claim):

- ``clip_grad_norm_``: params of one engine go to ``engine.clip_grad_norm_`` (clipping.py: the global norm, returned
  as a tensor; the engine clips at its step; what it cannot honour is refused by name); params of no live engine go to
  torch's function as given; params of two engines are refused (torch would clip them by their joint norm);
- ``clip_grad_value_`` over an engine's params is refused by name (the gradients are in the engine's store), and so
  is ``clip_grads_with_norm_`` (torch >= 2.6), whose norm ``get_total_norm`` computed from ``.grad``;
- torch's ``clip_grad_norm_`` calls ``clip_grad._clip_grads_with_norm_`` through its module, so the original
  function, bound by ``from torch.nn.utils import clip_grad_norm_`` before the first engine existed (which keeps
  torch's), is refused there by name when it gets an engine's params, rather than returning 0.0. Where ``.grad``
  holds the step's whole gradient (ZeRO-0/1 on one rank) torch's clipping of it is right, and goes ahead.

``get_total_norm`` takes gradient tensors, never the params: it cannot tell that the engine took them.

Over other params the wrappers must be torch's function exactly, under ``torch.compile(fullgraph=True)`` too, where
the owner lookup (a ``WeakIdKeyDictionary``) cannot be traced: a set of the ``id`` of every param an engine took
(``_owned``, a global dynamo guards on) answers "none of them" first, traceably and in well under a microsecond a
param; only an id in it (an engine's param, or a freed one's id reused) goes on to the exact lookup. Items that are
not tensors (``opt.param_groups``, ``named_parameters()`` pairs) are torch's to refuse, with torch's own error.
"""
from __future__ import annotations

import functools
import inspect
import threading
import types
import warnings
import weakref

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as clip_grad_module

from .grad_hooks import holders

# Kept across importlib.reload (a notebook's autoreload): the installed wrappers read these globals, and a reload
# that emptied them forgot the live engines, whose params then got torch's clipping again, 0.0 without a word
_lock = globals().get("_lock") or threading.Lock()
_engines: tuple = globals().get("_engines", ())  # weakrefs to the engines built (of _held): replaced whole
_owned: frozenset = globals().get("_owned", frozenset())  # id() of each of their params (a superset: see above)
_held: tuple = globals().get("_held", ())  # (weakref, its params' ids) per engine: what _owned is rebuilt from
_TORCH = "torch.nn.utils."
# torch's own warning for an empty generator: its stacklevel counts torch's frames, so behind a wrapper it would name
# this file, not the caller's line (and the "once per location" filter would show it once per process)
_EMPTY_GENERATOR = "`parameters` is an empty generator, no gradient clipping will occur."


def install(engine, params) -> None:
    """``engine`` counts from now on, over ``params``; the wrappers are on torch's modules (once: idempotent,
    thread-safe)."""
    global _engines, _owned, _held
    with _lock:
        _held = tuple((r, ids) for r, ids in _held if r() is not None) + ((weakref.ref(engine),
                                                                         frozenset(id(p) for p in params)),)
        _engines = tuple(r for r, _ in _held)
        _owned = frozenset().union(*(ids for _, ids in _held))
        made = {}  # one wrapper per function: torch.nn.utils.clip_grad_norm_ stays clip_grad.clip_grad_norm_
        for name, wrapper in (("clip_grad_norm_", _norm_wrapper), ("clip_grad_value_", _value_wrapper),
                              ("clip_grads_with_norm_", _with_norm_wrapper)):
            for module in (torch.nn.utils, clip_grad_module):
                current = getattr(module, name, None)
                if current is not None and not hasattr(current, "_hzo_engine_aware"):
                    if id(current) not in made:
                        made[id(current)] = wrapper(current)
                    setattr(module, name, made[id(current)])
        inner = getattr(clip_grad_module, "_clip_grads_with_norm_", None)  # (torch's clip_grad_norm_ calls it)
        if inner is not None and not hasattr(inner, "_hzo_engine_aware"):
            clip_grad_module._clip_grads_with_norm_ = _early_bound_wrapper(inner)


def _live(ref) -> bool:
    e = ref()
    return e is not None and e.is_open


def _engine_among(parameters, what: str):
    """(the live engine that owns ``parameters``, or None; ``parameters`` to hand on: one consumed here is handed on
    as a list, which torch takes as it takes the iterable). Two engines: refused. Traceable by dynamo up to the
    exact lookup, which only a param in ``_owned`` reaches."""
    if not any(_live(r) for r in _engines):  # no engine alive: nothing to look up, torch's call as it was made
        return None, parameters
    if isinstance(parameters, torch.Tensor):
        listed = [parameters]
    else:
        listed = parameters = list(parameters)
    if not any(id(p) in _owned for p in listed):  # (a dict or a pair too: torch's error names it)
        return None, parameters
    engines = _owners(listed)
    if len(engines) > 1:
        names = " and ".join(type(e).__name__ for e in engines)
        raise ValueError(f"{_TORCH}{what}: the given params belong to {len(engines)} engines ({names}): torch would "
                         "clip them all by their joint norm, and each engine knows its own gradients only and clips "
                         "them at its own step; clip each engine's params on their own (each by its own norm)")
    return (engines[0] if engines else None), (listed if engines else parameters)


@torch._disable_dynamo  # (a WeakIdKeyDictionary: a compiled loop over an engine's params graph-breaks here)
def _owners(listed: list) -> list:
    # (an engine whose hooks are detached, after a Trainer's train(), leaves .grad to whatever trains next: torch's)
    tensors = [p for p in listed if isinstance(p, torch.Tensor)]
    return [e for e in holders(None, tensors) if e.is_open and e.owns_grads_now]


def _norm_wrapper(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def clip_grad_norm_(parameters, *args, **kwargs):
        if isinstance(parameters, types.GeneratorType):
            parameters = list(parameters)
            if not parameters:
                warnings.warn(_EMPTY_GENERATOR, stacklevel=2)  # (torch's, at the caller's line; it will not warn)
        engine, parameters = _engine_among(parameters, "clip_grad_norm_")
        if engine is None:
            return original(parameters, *args, **kwargs)
        given = signature.bind(parameters, *args, **kwargs)
        given.apply_defaults()
        a = given.arguments  # (foreach: torch's choice of kernel, the engine has its own)
        return _engines_clipping(engine, a["max_norm"], a["norm_type"], parameters, a["error_if_nonfinite"])

    clip_grad_norm_._hzo_engine_aware = original
    return clip_grad_norm_


@torch._disable_dynamo  # never traced, as the engine's step() (a compiled loop's clip graph-breaks here instead)
def _engines_clipping(engine, max_norm, norm_type, parameters, error_if_nonfinite) -> torch.Tensor:
    return engine.clip_grad_norm_(max_norm, norm_type, parameters=parameters, error_if_nonfinite=error_if_nonfinite,
                                  caller=f"{_TORCH}clip_grad_norm_ over the params of {type(engine).__name__}")


def _refusing(what: str, why, *, whole_ok: bool):
    """A wrapper of torch's ``what`` that refuses an engine's params, saying ``why(engine's class name)``; other
    params (and, ``whole_ok``, an engine whose ``.grad`` is the step's whole gradient) get torch's function."""
    def wrap(original):
        @functools.wraps(original)
        def wrapper(parameters, *args, **kwargs):
            engine, parameters = _engine_among(parameters, what)
            if engine is None or (whole_ok and engine.holds_whole_grad):
                return original(parameters, *args, **kwargs)
            raise ValueError(why(type(engine).__name__))

        wrapper._hzo_engine_aware = original
        return wrapper
    return wrap


_value_wrapper = _refusing("clip_grad_value_", lambda name: (
    f"{_TORCH}clip_grad_value_ on the params of {name}: the engine takes each gradient during backward (its .grad "
    "freed, or under ZeRO-0/1 this rank's, not yet averaged) and clips by the global norm only, at its step; clip "
    f"with {_TORCH}clip_grad_norm_(model.parameters(), max_norm) (or engine.clip_grad_norm_(max_norm)) instead"),
    whole_ok=False)

# (Accelerate's clip_grad_norm_, unadapted, calls it: right where .grad is whole)
_with_norm_wrapper = _refusing("clip_grads_with_norm_", lambda name: (
    f"{_TORCH}clip_grads_with_norm_ on the params of {name}: the engine takes each gradient during backward (its "
    ".grad freed, or under ZeRO-0/1 this rank's, not yet averaged over the ranks), so a norm from .grad "
    "(get_total_norm) is not the step's and nothing would be clipped right; call "
    f"{_TORCH}clip_grad_norm_(model.parameters(), max_norm) (the engine's global norm, clipped at its step) or "
    "engine.clip_grad_norm_(max_norm)"), whole_ok=True)

# only torch's own clip_grad_norm_, bound before install(), gets here with an engine's params (the wrapper never does)
_early_bound_wrapper = _refusing("clip_grad_norm_", lambda name: (
    "torch's clip_grad_norm_ as bound before the first engine was built (`from torch.nn.utils import "
    f"clip_grad_norm_` ran before it) got the params of {name}: it found none of the step's gradients (the engine "
    "takes them during backward) and would return 0.0 having clipped nothing, or clip this rank's gradient by this "
    f"rank's norm (ZeRO-0/1 on several ranks); call {_TORCH}clip_grad_norm_(...) through the module (it delegates to "
    "the engine), or engine.clip_grad_norm_(max_norm)"), whole_ok=True)
