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
        # only before our engine exists (a model_init or a second Trainer builds a new one, which places it); not
        # for a model dispatched over devices (the Trainer leaves it where it is, with a warning); not with several
        # GPUs in one process (an evaluate() before training wraps the model in DataParallel, which Accelerate then
        # does not place: its forward refused the CPU params)
        if getattr(self, "_zo_raw", None) is not None and getattr(self, "optimizer", None) is None and \
                self._zo_engine_may_place(model):
            self._zo_place_on = torch.device(device)
            return
        super()._move_model_to_device(model, device)

    def _zo_placement(self, model) -> torch.device | None:
        """Where the engine puts the model: where the Trainer would have, or, where the Trainer did not place it at
        all (``model_init`` with ``--fp16_full_eval``, ``place_model_on_device=False``), the Trainer's device:
        Accelerate's prepare moved it there after the engine was built, under it (CPU streams, an unpinned arena).
        None for a model dispatched or quantized by its loader: it stays where that put it."""
        place, self._zo_place_on = self._zo_place_on, None
        if place is None and getattr(model, "quantization_method", None) is None and self._zo_engine_may_place(model):
            place = self.args.device
        return place

    def _zo_engine_may_place(self, model) -> bool:
        return getattr(model, "hf_device_map", None) is None and self.args.n_gpu <= 1
