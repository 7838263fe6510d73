"""TrainingArguments -> :class:`config.ArgsView`: the few values the config resolution needs.

``args`` is any object with TrainingArguments' attributes (nothing here imports transformers).
"""
from __future__ import annotations

import dataclasses

from .config import ArgsView, ConfigError


def hidden_size_of(model) -> int | None:
    """The width "auto" bucket sizes scale with, found where transformers' DeepSpeed integration finds it: the
    config's hidden size (or its other names), else the largest of ``hidden_sizes`` (ConvNext, ResNet: no single
    width), else the text model's (Llava and other multimodal configs nest it in ``text_config``)."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        for name in ("hidden_size", "d_model", "n_embd"):
            if _is_width(getattr(c, name, None)):
                return getattr(c, name)
        widths = getattr(c, "hidden_sizes", None)
        if isinstance(widths, (list, tuple)) and widths and all(map(_is_width, widths)):
            return max(widths)
    return None


def _is_width(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def training_precision(args) -> tuple[bool, bool]:
    """(fp16, bf16): the 16-bit format the engine trains in. As transformers' DeepSpeed integration reads them,
    --fp16_full_eval / --bf16_full_eval mean the 16-bit model too (the model evaluated is the one trained); the
    Trainer and the example script's early config check read them here, so both resolve a config alike."""
    return (bool(args.fp16 or getattr(args, "fp16_full_eval", False)),
            bool(args.bf16 or getattr(args, "bf16_full_eval", False)))


def accumulation_steps(args) -> int:
    """--gradient_accumulation_steps, or ``accelerator_config``'s ``gradient_accumulation_kwargs`` ``num_steps``,
    which the Trainer copies into it when the flag is 1 (``create_accelerator_and_postprocess``, inside its
    ``__init__``): a ds_config's explicit gradient_accumulation_steps equal to num_steps was refused before it, as
    contradicting "--gradient_accumulation_steps 1"."""
    ga = args.gradient_accumulation_steps
    kwargs = getattr(getattr(args, "accelerator_config", None), "gradient_accumulation_kwargs", None)
    if ga == 1 and isinstance(kwargs, dict) and "num_steps" in kwargs:
        n = kwargs["num_steps"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:  # (was named as --gradient_accumulation_steps)
            raise ConfigError(f"accelerator_config gradient_accumulation_kwargs num_steps {n!r}: must be an int >= 1 "
                              "(the Trainer takes it for --gradient_accumulation_steps)")
        return n
    return ga


def args_view(args, *, fp16: bool, bf16: bool, max_steps: int | None, model=None) -> ArgsView:
    warmup = args.get_warmup_steps(max_steps) if max_steps else int(args.warmup_steps or 0)
    return ArgsView(
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=accumulation_steps(args), world_size=args.world_size,
        max_grad_norm=args.max_grad_norm or 0.0, learning_rate=args.learning_rate, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon, weight_decay=args.weight_decay,
        warmup_steps=int(warmup), max_steps=max_steps, fp16=fp16, bf16=bf16,
        hidden_size=hidden_size_of(model) if model is not None else None,
        lr_scheduler_type=str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        sharded_ddp=bool(getattr(args, "sharded_ddp", False)))


def early_view(args, raw: dict, fp16: bool, bf16: bool, model) -> ArgsView:
    """The view at ``__init__``: the step count may not be known yet (epochs, a dataset not measured yet) and
    with ``model_init`` there is no model. What depends on them takes the config's own explicit values (no
    contradiction possible), or a placeholder for "auto"; both are resolved for real at train start. A model without
    a width for "auto" bucket sizes is refused here, before any model work."""
    max_steps = args.max_steps if args.max_steps and args.max_steps > 0 else None
    view = args_view(args, fp16=fp16, bf16=bf16, max_steps=max_steps, model=model)
    params = (raw.get("scheduler") or {}).get("params") or {}

    def explicit(key, placeholder):
        v = params.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else placeholder

    repl = {}
    if max_steps is None:
        repl["max_steps"] = explicit("total_num_steps", 1)
        repl["max_steps_placeholder"] = True
        if 0 < args.warmup_steps < 1:  # a warm-up ratio of a step count not known yet
            repl["warmup_steps"] = explicit("warmup_num_steps", 0)
    if view.hidden_size is None and model is None:  # model_init: the model comes at train start
        repl["hidden_size"] = 1
    return dataclasses.replace(view, **repl)
