"""A second train() of the same Trainer: the engine of the first goes on, brought up to date with what changed
since (the trainable parameters checked, weights written by others adopted, --max_grad_norm and
--gradient_accumulation_steps read again, as the plain Trainer reads them at every step)."""
from __future__ import annotations

import dataclasses
import logging

from ..config import ConfigError
from ..engine_setup import accumulation_problem
from ..launch_checks import check_trainable

logger = logging.getLogger("hf_zero_offload")


class CarriedOverEngine:
    def _zo_carry_over(self, engine) -> None:
        check_trainable(engine.slot_params(), self.model.named_parameters())
        adopt_changed_params(engine)
        self._zo_update_clipping(engine)
        self._zo_update_accumulation(engine)

    def _zo_update_clipping(self, engine) -> None:
        # the plain Trainer reads --max_grad_norm at every step: a value changed since the engine was built applies
        # (resolved again: a ds_config's own "gradient_clipping" still wins over the argument)
        clip = self._zo_resolve().gradient_clipping
        if clip != engine.options.max_grad_norm:
            logger.info("hf_zero_offload: gradient clipping %g -> %g for this train()", engine.options.max_grad_norm,
                        clip)
            engine.options = dataclasses.replace(engine.options, max_grad_norm=clip)
            if self.zero_config is not None:
                self.zero_config = dataclasses.replace(self.zero_config, gradient_clipping=clip)

    def _zo_update_accumulation(self, engine) -> None:
        gas, was = self._zo_resolve().gradient_accumulation_steps, engine.options.gradient_accumulation_steps
        if gas == was:
            return
        if problem := accumulation_problem(engine, gas):
            raise ConfigError(f"{problem}, in the first train() of this Trainer. Build a new Trainer for this train() "
                              "(the model carries over; to keep the moments take this engine's state_dict() before the "
                              "new Trainer builds its engine, which releases this one, and load it into that one), "
                              f"or keep gradient_accumulation_steps={was}")
        engine.options = dataclasses.replace(engine.options, gradient_accumulation_steps=gas)


def adopt_changed_params(engine) -> None:
    changed = engine.adopt_changed_params()
    if changed:
        logger.warning("hf_zero_offload: %d parameter(s) changed since this optimizer last set them (another "
                       "optimizer trained the model, or its weights were loaded): training goes on from the model's "
                       "weights, with this optimizer's moments", changed)
