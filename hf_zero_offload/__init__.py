"""ZeRO-Offload and ZeRO-1/2 sharding for the Hugging Face Trainer.

``import hf_zero_offload`` loads only torch and the compiled kernels; the Trainer classes (which
import transformers) load on first access.
"""
from __future__ import annotations

from . import ops
from .cpu_adam import CPUAdam

__version__ = "0.1.0"

_TRAINER_NAMES = {
    "ZeroOffloadTrainingArguments",
    "ZeroOffloadSeq2SeqTrainingArguments",
    "ZeroOffloadTrainer",
    "ZeroOffloadSeq2SeqTrainer",
    "ZeroOffloadCallback",
    "ZeroOffloadMixin",
}

__all__ = ["ops", "CPUAdam", "__version__", *sorted(_TRAINER_NAMES)]


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hf_zero_offload' has no attribute {name!r}")
