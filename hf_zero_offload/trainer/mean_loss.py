"""Models that compute their loss as their own mean while their ``forward`` takes ``**kwargs`` (T5, BART).

transformers reads ``**kwargs`` as "this model sums its loss over ``num_items_in_batch``": it then neither divides
the loss by ``gradient_accumulation_steps`` nor leaves it per rank (with ``average_tokens_across_devices`` it
multiplies it by the rank count). A model that takes its own mean gets loss, gradients and logged ``grad_norm``
``accumulation x ranks`` times the averaged ones, under the plain Trainer as under ours. Adam's step nearly cancels
the scale, but ``max_grad_norm`` clips the larger norm, ``eps`` weighs less, and a resume at another world size or
accumulation starts from moments of another scale. We say so once, with the fix, and change nothing: the numerics
stay the plain Trainer's (``model.accepts_loss_kwargs = False`` averages, as ``examples/seq2seq`` sets it)."""
from __future__ import annotations

import inspect


def mean_loss_only(model) -> bool:
    """Whether the model's forward computes its loss as a plain mean of its own (``CrossEntropyLoss()``) while
    taking ``**kwargs``: transformers' models that honour ``num_items_in_batch`` pass it to ``self.loss_function``."""
    forward = type(model).forward
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return False
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        return False
    # the class that defines forward, whole: its forward may hand the loss to a helper method that calls it
    owner = next((k for k in type(model).__mro__ if "forward" in vars(k)), type(model))
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):  # (unreadable: taken for a mean, the wrong guess that costs least, see below)
        return True
    # (EncoderDecoderModel passes num_items_in_batch on to its decoder and still takes a mean of its own; a model
    # judged so wrongly loses only the token-count weighting, as the Trainer then passes it no num_items_in_batch)
    return "loss_function" not in source


def loss_scale_note(model, accepts_loss_kwargs: bool, custom_loss: bool, scaled_for_ga, accumulation: int,
                    world_size: int, average_tokens: bool) -> str | None:
    """One line when the Trainer will scale this model's mean loss up (the module's docstring), else None.
    ``model``: the unwrapped model (its PEFT base); the rest: the Trainer's own attributes and arguments."""
    if not accepts_loss_kwargs or custom_loss or not mean_loss_only(model):
        return None
    ga = accumulation if accumulation > 1 and scaled_for_ga is not False else 1
    ranks = world_size if average_tokens and world_size > 1 else 1
    if ga * ranks == 1:
        return None
    how = " and ".join(f for f in (f"gradient_accumulation_steps={ga}" if ga > 1 else "",
                                   f"{ranks} ranks with average_tokens_across_devices" if ranks > 1 else "") if f)
    return (f"hf_zero_offload: {type(model).__name__} computes its own mean loss while its forward takes **kwargs, "
            f"which transformers reads as a sum over num_items_in_batch: with {how} its loss, gradients and logged "
            f"grad_norm are {ga * ranks}x the averaged ones (as under the plain Trainer; max_grad_norm clips that "
            "norm). Set model.accepts_loss_kwargs = False before building the Trainer to average them "
            "(examples/seq2seq/finetune_trainer.py does)")


class LossScaleNote:
    """A mixin of our Trainers: the note above, once per Trainer, at the start of each training loop (the model is
    final there: ``model_init`` has run)."""

    def _zo_say_loss_scale(self, logger) -> None:
        if getattr(self, "_zo_loss_scale_said", False) or not self.args.should_log:
            return
        model = self.accelerator.unwrap_model(self.model)
        base = getattr(model, "get_base_model", None)  # a PEFT model: the Trainer inspects its base model too
        note = loss_scale_note(base() if callable(base) else model, bool(self.model_accepts_loss_kwargs),
                               self.compute_loss_func is not None, getattr(self, "loss_is_scaled_for_ga", None),
                               self.args.gradient_accumulation_steps, self.args.world_size,
                               bool(getattr(self.args, "average_tokens_across_devices", False)))
        if note:
            logger.warning(note)
            self._zo_loss_scale_said = True
