"""Trainer integration: the only package that imports ``transformers``.

``ZeroOffloadMixin`` goes before any ``transformers.Trainer`` subclass in the bases. With
``--zero_offload ds_config.json`` (or ``--sharded_ddp``) it:

- checks, at ``__init__`` and before any model work, the whole config against the TrainingArguments
  ("auto" values, one error listing mismatches), the launch (torchrun's WORLD_SIZE vs the ranks the
  Trainer sees), that no optimizer of the user's was passed, and takes the output_dir's run lock;
- builds the engine in ``create_optimizer`` from the Trainer's own parameter grouping (no weight
  decay for biases and norms) and keeps the model in the training dtype on the device;
- owns loss scaling: Accelerate runs without mixed precision (no autocast, no GradScaler), the
  loss is multiplied by the engine's scale before backward, and the engine unscales, clips and
  checks overflow on the CPU; an overflow step does not advance the LR schedule;
- logs ``grad_norm`` (the engine's, before clipping) and ``loss_scale``;
- saves the optimizer state per rank under ``checkpoint-N/zero_offload/`` atomically and loads it
  back on ``--resume_from_checkpoint``.

With or without ``zero_offload``, the classes here write a completion marker last into every checkpoint,
resume only from complete ones (``True``: the newest complete one), and log what a resume restored or drops
(see :mod:`hf_zero_offload.resume`).

``args``: the TrainingArguments with ``zero_offload``/``sharded_ddp``; ``mixin``: ``ZeroOffloadMixin`` and the two
Trainers; ``saving``: its checkpoint saves (``CheckpointSaving``, a mixin of the same Trainer); ``last_step``: with
the delayed parameter update, the last step published before the end of training is read; ``callback``:
``ZeroOffloadCallback``, for a plain Trainer given an engine.
"""
from __future__ import annotations

from ..extras import require

require("hf_zero_offload.trainer", "transformers", "accelerate", "safetensors")  # the [trainer] extra, named if missing

from .args import ZeroOffloadSeq2SeqTrainingArguments, ZeroOffloadTrainingArguments  # noqa: E402
from .callback import ZeroOffloadCallback  # noqa: E402
from .mixin import ZeroOffloadMixin, ZeroOffloadSeq2SeqTrainer, ZeroOffloadTrainer, logger  # noqa: E402
from .saving import STATE_DIR  # noqa: E402

__all__ = [
    "ZeroOffloadTrainingArguments",
    "ZeroOffloadSeq2SeqTrainingArguments",
    "ZeroOffloadMixin",
    "ZeroOffloadTrainer",
    "ZeroOffloadSeq2SeqTrainer",
    "ZeroOffloadCallback",
    "STATE_DIR",
    "logger",
]
