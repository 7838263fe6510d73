"""``LossInFp32``: a 16-bit model's language-model loss in fp32 (a mixin of the same Trainer as ``ZeroOffloadMixin``).

The engine casts the whole model to the training dtype and runs it without autocast, as DeepSpeed does. A model that
computes its cross-entropy straight on its logits (T5, BART, BERT's MLM head: ``CrossEntropyLoss()(logits, labels)``)
then computes and returns its loss in bf16/fp16: a loss near 6 moves in steps of 1/32 (an outside probe, t5, bf16: the
eval loss 6.0 at 9 evaluations in a row, where the plain Trainer's fell from 6.0225 to 6.0159, so
``load_best_model_at_end`` kept the second checkpoint), and the log-softmax and its gradient round in 16 bits. The
plain Trainer's autocast runs ``cross_entropy`` in fp32. Here the output embeddings' result (the logits) is widened
to fp32, so whatever the model computes from them, its loss included, is fp32, as in the models whose
``loss_function`` widens the logits itself (GPT-2, Llama: for those only the dtype of the returned logits changes;
a step between the head and the loss, such as Gemma2's logit softcapping, now runs in fp32 too). ``prediction_step``
returns the logits (fp32 tensors whose last dimension is the head's output size) in the training dtype again, as
the plain Trainer's autocast and DeepSpeed return them: what ``compute_metrics`` gathers costs what it did. Other
heads (sequence classification: ``classifier``, ``score``) are not an output embedding, and their loss stays in the
training dtype, as with DeepSpeed. ``--zero_offload_fp32_logits false`` keeps the 16-bit loss (and takes off a hook
an earlier Trainer put on the same model).
"""
from __future__ import annotations

import logging

import torch

from ..fp32_logits import HALF, logits_width, narrow_logits, output_head, widen_logits

logger = logging.getLogger("hf_zero_offload")


def _narrowed(x, dtype: torch.dtype, dim: int):
    """``x`` (a tensor, or nested tuples/lists/dicts of them) with its fp32 tensors of last dimension ``dim`` (the
    logits; not what a model computes in fp32 on purpose, such as router logits) in ``dtype``."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.dtype == torch.float32 and x.dim() and x.shape[-1] == dim else x
    if isinstance(x, (tuple, list)):
        return type(x)(_narrowed(v, dtype, dim) for v in x)
    if isinstance(x, dict):
        return type(x)({k: _narrowed(v, dtype, dim) for k, v in x.items()})
    return x


class LossInFp32:
    def _zo_widen_logits(self, model, dtype: torch.dtype) -> None:
        """Once the model is in ``dtype``: its logits (the output embeddings' output) in fp32, once per module."""
        self._zo_logits_dim = None
        if not getattr(self.args, "zero_offload_fp32_logits", True) or dtype not in HALF:
            if narrow_logits(model):  # another Trainer's hook on this model: the switch holds for this run
                logger.info("hf_zero_offload: the logits' widening to fp32 that an earlier run added is removed")
            return
        head = output_head(model)
        if head is None:
            return
        self._zo_logits_dim = logits_width(head)
        if widen_logits(model) is not None:
            logger.info("hf_zero_offload: the %s model's logits (%s) are widened to fp32, so its loss is computed in "
                        "fp32 (the plain Trainer's autocast does so); evaluation returns them in %s",
                        str(dtype).replace("torch.", ""), type(head).__name__, str(dtype).replace("torch.", ""))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **kwargs):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys,
                                                       **kwargs)
        dtype, dim = getattr(self, "_zo_dtype", None), getattr(self, "_zo_logits_dim", None)
        if dtype is not None and dim is not None and logits is not None:
            logits = _narrowed(logits, dtype, dim)
        return loss, logits, labels
