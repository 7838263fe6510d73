"""Parameters made trainable while ``train()`` runs (a callback's gradual unfreezing, a submodule swapped in) have no
slot in the engine: they are refused at the optimizer step they would join, as ``train()`` refuses one made trainable
between two runs (``launch_checks.check_trainable``). The plain Trainer drops their update silently (they are in no
optimizer group) but its ``clip_grad_norm_`` counts their gradients, which the engine's norm cannot: with clipping the
two runs trained apart, with no word from either (an outside probe: 5.2e-5 apart after 12 steps).

The check runs at ``on_pre_optimizer_step``, after the step's backward passes and before the engine's step, over the
model's params as they are then: an unfreeze in any callback's ``on_step_begin`` or a module swapped in mid-run is
seen by the step it changes (a first form checked at ``on_step_begin``, before a user's callbacks, over the params
listed once, and missed both)."""
from __future__ import annotations

import weakref

from transformers import TrainerCallback

from ..config import ConfigError
from ..launch_checks import check_trainable, first_names


class TrainableWatch:
    """``left_out``: ids of params trainable but deliberately outside the engine when the run began (a plain Trainer's
    ``ZeroOffloadCallback`` over an engine the user built on some of them); the mixin's engine holds every one."""

    def __init__(self, left_out: frozenset = frozenset()):
        self.left_out = left_out
        self._known = (None, frozenset())  # (the engine, the ids of the params it holds): fixed for an engine

    def outside(self, engine, model) -> list:
        """The model's trainable params, as they are now, that ``engine`` does not hold."""
        if self._known[0] is not engine:
            self._known = (engine, frozenset(id(p) for group in engine.slot_params() for p in group))
        known = self._known[1]
        return [p for p in model.parameters() if p.requires_grad and id(p) not in known]

    def check(self, engine, model, clipping: bool) -> None:
        """One pass over the model's params per optimizer step (0.25 us each: 5 ms for 20000 frozen tensors)."""
        if engine is None or model is None:
            return
        outside = self.outside(engine, model)
        if any(id(p) not in self.left_out for p in outside):  # raises, naming them
            kept = [p for p in outside if id(p) in self.left_out]
            check_trainable(engine.slot_params() + [kept], model.named_parameters(), during_training=True)
        with_grad = {id(p) for p in outside if p.grad is not None} if clipping else ()
        if with_grad:
            names = [n for n, p in model.named_parameters() if id(p) in with_grad]
            raise ConfigError(
                f"{len(names)} trainable parameter(s) the engine does not hold got gradients ({first_names(names)}): "
                "with --max_grad_norm the engine clips by its own params' norm, while a plain Trainer's clipping "
                "counts theirs too, so the two would train apart. Build the engine over every trainable parameter, "
                "freeze the others, or train without clipping")


class RefuseNewTrainable(TrainerCallback):
    """In the Trainer's callbacks while a ``ZeroOffloadMixin.train()`` runs."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)  # the trainer holds this callback: no reference cycle
        self._watch = TrainableWatch()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            self._watch.check(trainer.zero_engine, trainer.model, args.max_grad_norm > 0)
