"""With the delayed parameter update (DPU) the model holds the weights of one step before the optimizer's masters.
At the end of training the last step reaches the model before anything reads it there: ``on_train_end`` callbacks
(an integration's final model upload, a user's export), and, with ``--save_only_model`` (a checkpoint without the
masters), the final checkpoint. Mid-run checkpoints and evaluations keep the DPU schedule's lagging weights (a
flush there would change what the next steps compute); with ``load_best_model_at_end`` the best, evaluated weights
are the ones that stay."""
from __future__ import annotations

import weakref

from transformers import TrainerCallback


def run_ends(state, control) -> bool:
    """The Trainer takes no further step: ``max_steps`` reached, or a callback stopped the run."""
    return 0 < state.max_steps <= state.global_step or bool(control.should_training_stop)


def publish_for_final_save(args, state, control) -> bool:
    """A ``--save_only_model`` checkpoint at the end of the run holds the model alone: without the last step
    (which only the masters held) a ``from_pretrained`` of it silently lost that step."""
    return bool(args.save_only_model) and not args.load_best_model_at_end and run_ends(state, control)


class PublishBeforeTrainEnd(TrainerCallback):
    """First in the Trainer's callback list while a ``ZeroOffloadMixin.train()`` runs: the last step is published
    before any other callback's ``on_train_end`` (integrations are registered before a user's callbacks, and the
    mixin's own flush after ``train()`` came after all of them), and before a final ``--save_only_model`` save."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)  # the trainer holds this callback: no reference cycle

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and publish_for_final_save(args, state, control):
            trainer._zo_publish_last()

    def on_train_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer._zo_publish_last()
