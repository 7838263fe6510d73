"""``PlaceWithEngine``: the model reaches the device through the engine, in the training dtype. A mixin of
``ZeroOffloadMixin``'s Trainer; its method reads the Trainer's fields as its own.

The Trainer places the model on its device in ``__init__``, before any optimizer exists, in fp32: 4 B/param on the
device (t5-3b's 10.7 GiB was the device peak of its first H200 run, above anything its training steps used at
batch 24; a model whose fp32 weights exceed the card could not start at all). With our engine the model stays where
it is until the engine is built (``ZeroOffloadMixin._zo_build``), which takes each trainable param's fp32 master
and then moves that param to the device in the training dtype, one at a time; the frozen params and buffers follow.
DeepSpeed casts the model to 16 bits before placing it, so its masters start from the rounded weights; ours start
from the fp32 ones. An evaluation before any training is placed by Accelerate's ``prepare_model`` (in fp32, as the
plain Trainer's is), as an evaluation with DeepSpeed is.
"""
from __future__ import annotations

import torch


class PlaceWithEngine:
    _zo_place_on: torch.device | None = None  # where the Trainer would have placed the model (None: nowhere yet)

    def _move_model_to_device(self, model, device) -> None:
        # only before our engine exists (a model_init or a second Trainer builds a new one, which places it), and
        # not for a model dispatched over devices (the Trainer leaves it where it is, with a warning)
        if getattr(self, "_zo_raw", None) is not None and getattr(self, "optimizer", None) is None and \
                getattr(model, "hf_device_map", None) is None:
            self._zo_place_on = torch.device(device)
            return
        super()._move_model_to_device(model, device)
