"""Trainer integration: the only module that imports ``transformers``.

(Skeleton: argument classes and the mixin entry points; the offload path is wired in as the engine lands.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainerCallback, TrainingArguments

__all__ = [
    "ZeroOffloadTrainingArguments",
    "ZeroOffloadSeq2SeqTrainingArguments",
    "ZeroOffloadMixin",
    "ZeroOffloadTrainer",
    "ZeroOffloadSeq2SeqTrainer",
    "ZeroOffloadCallback",
]


@dataclass
class _ZeroOffloadFields:
    # Typed str for HfArgumentParser; code may pass a dict (the dataclass does not enforce the annotation).
    zero_offload: Optional[str] = field(
        default=None,
        metadata={"help": "Path to a DeepSpeed-style ds_config.json (a dict is accepted in code): enables "
                          "hf_zero_offload's ZeRO-Offload / ZeRO-2 engine."},
    )
    sharded_ddp: bool = field(
        default=False,
        metadata={"help": "Partition optimizer states and gradients across data-parallel ranks (ZeRO stage 1/2)."},
    )


@dataclass
class ZeroOffloadTrainingArguments(TrainingArguments, _ZeroOffloadFields):
    pass


@dataclass
class ZeroOffloadSeq2SeqTrainingArguments(Seq2SeqTrainingArguments, _ZeroOffloadFields):
    pass


class ZeroOffloadMixin:
    """Mix into any ``transformers.Trainer`` subclass (before it in the bases) to gain the feature."""


class ZeroOffloadTrainer(ZeroOffloadMixin, Trainer):
    pass


class ZeroOffloadSeq2SeqTrainer(ZeroOffloadMixin, Seq2SeqTrainer):
    pass


class ZeroOffloadCallback(TrainerCallback):
    """For users who keep their own Trainer."""
