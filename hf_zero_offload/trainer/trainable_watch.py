"""Parameters made trainable while ``train()`` runs (a callback's gradual unfreezing) have no slot in the engine: they
are refused at the next optimizer step, as ``train()`` refuses one made trainable between two runs
(``launch_checks.check_trainable``). The plain Trainer drops their update silently (they are in no optimizer group)
but its ``clip_grad_norm_`` counts their gradients, which the engine's norm cannot: with clipping the two runs
trained apart, with no word from either (an outside probe: 5.2e-5 apart after 12 steps)."""
from __future__ import annotations

import weakref

from transformers import TrainerCallback

from ..launch_checks import check_trainable


class TrainableWatch:
    """One flag test per param outside the engine per optimizer step (none when every param trains)."""

    def __init__(self):
        self._outside = None  # (the engine, the model's params it does not hold)

    def check(self, engine, model) -> None:
        if engine is None or model is None:
            return
        if self._outside is None or self._outside[0] is not engine:
            known = {id(p) for group in engine.slot_params() for p in group}
            self._outside = (engine, [p for p in model.parameters() if id(p) not in known])
        if any(p.requires_grad for p in self._outside[1]):
            check_trainable(engine.slot_params(), model.named_parameters(), during_training=True)


class RefuseNewTrainable(TrainerCallback):
    """In the Trainer's callbacks while a ``ZeroOffloadMixin.train()`` runs."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)  # the trainer holds this callback: no reference cycle
        self._watch = TrainableWatch()

    def on_step_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            self._watch.check(trainer.zero_engine, trainer.model)
