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
    if trainer is None or args or kwargs or not _within(str(output_dir), str(trainer.args.output_dir)):
        # (called otherwise than that cleanup does, or for another folder: a plain Trainer run from a callback)
        return _ORIGINAL(output_dir, *args, best_model_checkpoint=best_model_checkpoint, **kwargs)
    return trainer._zo_end_listing(str(output_dir), best_model_checkpoint)


def _within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or under it (a hyperparameter search's run-N folders)."""
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


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
