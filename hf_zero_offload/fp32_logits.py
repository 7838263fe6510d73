"""A 16-bit model's logits widened to fp32, so that the loss it computes from them is fp32 (torch only: used by the
Trainer integration, ``trainer/loss_precision.py``, which says why, and by the planner, which traces the same step).

The logits are the output embeddings' result (``model.get_output_embeddings()``). An embedding table used as the
output projection through ``F.linear`` is an ``nn.Embedding``, whose forward is the input lookup: left alone."""
from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)


def logits_in_fp32(module, args, output):
    """Forward hook of the output embeddings: 16-bit logits widened to fp32 (the backward casts the gradient back)."""
    if isinstance(output, torch.Tensor) and output.dtype in HALF:
        return output.float()
    return None


def output_head(model) -> torch.nn.Module | None:
    """The module whose output is the model's logits, or None (no output embeddings, or an ``nn.Embedding``)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Module) or isinstance(head, torch.nn.Embedding):
        return None
    return head


def widen_logits(model):
    """``logits_in_fp32`` on the model's output head, once per module: the new hook's handle, or None (no head, or
    the hook is there already)."""
    head = output_head(model)
    if head is None or logits_in_fp32 in head._forward_hooks.values():
        return None
    return head.register_forward_hook(logits_in_fp32)


def narrow_logits(model) -> bool:
    """Take ``logits_in_fp32`` off the model's output head (a reused model, now trained with the 16-bit loss):
    whether it was there."""
    head = output_head(model)
    hooks = head._forward_hooks if head is not None else {}
    found = [k for k, fn in hooks.items() if fn is logits_in_fp32]
    for k in found:
        del hooks[k]
    return bool(found)


def logits_width(head: torch.nn.Module) -> int | None:
    """The head's output size (the last dimension of the logits), when it says."""
    weight = getattr(head, "weight", None)
    return getattr(head, "out_features", None) or (
        weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None)
