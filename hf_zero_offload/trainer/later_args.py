"""``ArgsAfterInit``: TrainingArguments changed after the Trainer's ``__init__`` (a mixin of the same Trainer as
``ZeroOffloadMixin``).

transformers' hyperparameter search sets each trial's values on ``trainer.args`` (``_hp_search_setup``: a plain
``setattr`` per key, ``--optim`` among the common ones) and then creates the Accelerator again
(``create_accelerator_and_postprocess``); a user may set ``trainer.args.optim`` by hand alike. The checks made at
``__init__`` and the Accelerator's changes (``accelerator_patch.py``, and no mixed precision: the engine owns the
16-bit model and loss scaling) were not made again, so:

- with ``--bf16``/``--fp16`` every trial failed in Accelerate ("AcceleratorState has already been initialized ...
  pass ``mixed_precision='bf16'``"): ours was created with ``"no"``;
- in fp32 the trial's Accelerator was Accelerate's own (a DDP wrapper on several ranks, the optimizer's state
  placed through ``state_dict()``);
- ``--optim sgd`` (or ``lr_scheduler_kwargs`` next to a ds_config ``scheduler`` block) set after ``__init__``
  trained as AdamW without a word, where the plain Trainer trains SGD.

Here the Accelerator is created again as at ``__init__``, and before each training loop (and each engine build)
the arguments are checked again: refused in one line, naming the flag, before any training work. The training
precision (``--bf16``/``--fp16``) is read at ``__init__`` (the engine's dtype, Accelerate's mixed precision off):
changed since, it is refused in the same way, and so are ``zero_offload`` and ``sharded_ddp`` (which decide whether
there is an engine and which: set after ``__init__``, another config, none, or one on a Trainer made without, trained
with ``__init__``'s choice without a word).
"""
from __future__ import annotations

import contextlib
import copy
import json
import weakref

from ..args_view import training_precision
from ..accelerator_patch import patch_accelerator
from ..config import ConfigError
from ..launch_checks import check_arguments, check_even_batches


@contextlib.contextmanager
def no_mixed_precision(targs):
    """``targs`` without fp16/bf16/mixed_precision while Accelerate reads them (its Accelerator must neither autocast
    nor run a GradScaler: the 16-bit model and the loss scale are the engine's); their values back after."""
    saved = (targs.fp16, targs.bf16, targs.mixed_precision)
    targs.fp16 = targs.bf16 = False
    targs.mixed_precision = "no"
    try:
        yield
    finally:
        targs.fp16, targs.bf16, targs.mixed_precision = saved


#: the arguments that decide whether the Trainer runs an engine, and which, as ``__init__`` reads them
ENGINE_FIELDS = ("zero_offload", "sharded_ddp")


def engine_args(args) -> dict:
    """``ENGINE_FIELDS``' values (copies: a config dict edited in place after ``__init__`` is a change too)."""
    return {f: copy.deepcopy(getattr(args, f, None)) for f in ENGINE_FIELDS}


def _leaves(value, path: str) -> dict:
    if isinstance(value, dict) and value:
        return {k: v for key, sub in value.items() for k, v in _leaves(sub, f"{path}.{key}").items()}
    return {path: value}


def _changes(field: str, then, now) -> str:
    """What differs, leaf by leaf where both are config dicts (the key that changed, not two whole configs)."""
    a, b = (_leaves(then, field), _leaves(now, field)) if isinstance(then, dict) and isinstance(now, dict) else \
        ({field: then}, {field: now})
    absent = object()
    return "; ".join(f"{k}: {'absent' if a.get(k, absent) is absent else _shown(a[k])} then, "
                     f"{'absent' if b.get(k, absent) is absent else _shown(b[k])} now"
                     for k in sorted(set(a) | set(b)) if a.get(k, absent) != b.get(k, absent))


def _shown(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if isinstance(value, dict) else repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _flags(precision) -> str:
    fp16, bf16 = precision
    return " and ".join(f for f, on in (("--fp16", fp16), ("--bf16", bf16)) if on) or "fp32 (no --bf16/--fp16)"


class ArgsAfterInit:
    """The Accelerator created again as ``__init__`` created it, and the arguments checked again before training."""

    def create_accelerator_and_postprocess(self):
        if getattr(self, "_zo_raw", None) is None:
            return super().create_accelerator_and_postprocess()
        with no_mixed_precision(self.args):
            out = super().create_accelerator_and_postprocess()
        self._zo_patch_accelerator()
        return out

    def _zo_patch_accelerator(self) -> None:
        # (once per Accelerator) the Trainer held weakly: the Accelerator it owns must not hold it back (a cycle kept
        # the engine's host arena alive after ``del trainer`` until the garbage collector ran)
        trainer = weakref.ref(self)
        patch_accelerator(self.accelerator, lambda: getattr(trainer(), "zero_engine", None))

    def _zo_check_args_again(self) -> None:
        """``check_arguments`` as at ``__init__``, on the arguments as they are now (a hyperparameter search trial's
        values, a field set by hand), and the training precision and engine config unchanged since ``__init__``."""
        given = getattr(self, "_zo_engine_args", None)  # (every Trainer of the mixin: one made without an engine too)
        current = engine_args(self.args) if given is not None else None
        if changed := [f for f in ENGINE_FIELDS if given is not None and current[f] != given[f]]:
            raise ConfigError(f"{' and '.join(changed)} changed after the Trainer was created ("
                              + "; ".join(_changes(f, given[f], current[f]) for f in changed)
                              + ", e.g. a hyperparameter search trial's value or a field set by hand): whether the "
                              "Trainer runs an engine, and which, is decided at __init__, and this train() would "
                              "have run that one; create the Trainer with the values to train with (leave "
                              f"{' and '.join(changed)} out of a search space)")
        if self._zo_raw is None:
            return
        now = training_precision(self.args)
        if now != self._zo_precision:
            raise ConfigError(f"Not supported with zero_offload / sharded_ddp: the training precision changed after "
                              f"the Trainer was created ({_flags(self._zo_precision)} then, {_flags(now)} now, e.g. "
                              "a hyperparameter search trial's value): the engine's dtype and Accelerate's settings "
                              "are taken at __init__; create the Trainer with the precision to train in, and leave "
                              "bf16/fp16 out of the search space")
        block = self._zo_raw.cfg.get("scheduler")
        check_arguments(self.args, block["type"] if isinstance(block, dict) else None)
        check_even_batches(self.args, getattr(self, "train_dataset", None))
