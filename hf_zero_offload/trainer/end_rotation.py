"""transformers' ``_inner_training_loop`` ends with its own cleanup for ``save_total_limit=1`` with a best checkpoint
("Delete the last checkpoint when save_total_limit=1", after ``_load_best_model``): it removes every folder
``trainer.sort_checkpoints`` lists (a glob of ``checkpoint-*``) but the best, a user's ``checkpoint-1-old`` and a
folder cut short included. While one of our Trainers runs train() (:func:`running`), that listing is the Trainer's
``_zo_end_listing``: our rule removes what goes, and it lists only the finished ``checkpoint-N`` folders left. Other
Trainers (a plain one, or ours outside train()) get transformers' own listing."""
from __future__ import annotations

import contextlib
import contextvars
import os

import transformers.trainer as _trainer_module

_RUNNING: contextvars.ContextVar = contextvars.ContextVar("hf_zero_offload_training", default=None)
_ORIGINAL = _trainer_module.sort_checkpoints


def sort_checkpoints(output_dir, *args, best_model_checkpoint=None, **kwargs):
    trainer = _RUNNING.get()
    if trainer is None or args or kwargs or not _ours(str(output_dir), best_model_checkpoint, trainer):
        # (called otherwise than that cleanup does, or for another run: a plain Trainer run from a callback, into
        # a folder under ours, had its checkpoints removed by our rule)
        return _ORIGINAL(output_dir, *args, best_model_checkpoint=best_model_checkpoint, **kwargs)
    return trainer._zo_end_listing(str(output_dir), best_model_checkpoint)


def _ours(run_dir: str, best, trainer) -> bool:
    """The cleanup of ``trainer``'s own run: its best checkpoint, in ``run_dir``, which is its output_dir or a
    hyperparameter search's run folder under it (by what the paths name, not their spelling)."""
    own = None if best is None else trainer.state.best_model_checkpoint
    if own is None or os.path.realpath(str(best)) != os.path.realpath(str(own)):
        return False
    run, folder = os.path.realpath(run_dir), os.path.realpath(str(trainer.args.output_dir))
    return os.path.dirname(os.path.realpath(str(best))) == run and (
        run == folder or os.path.dirname(run) == folder)


@contextlib.contextmanager
def running(trainer):
    """``trainer``'s train() in progress: transformers' end-of-training listing is its own."""
    if _trainer_module.sort_checkpoints is _ORIGINAL:
        _trainer_module.sort_checkpoints = sort_checkpoints
    token = _RUNNING.set(trainer)
    try:
        yield
    finally:
        _RUNNING.reset(token)
