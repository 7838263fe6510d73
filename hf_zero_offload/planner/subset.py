"""The trainable subset of a planned model (``estimate --trainable``, ``--peft-config``): which params train and
which stay frozen, on the meta model the trace runs and on the real one ``measure`` steps."""
from __future__ import annotations

import os
import re

import torch


def freeze_except(model, trainable: str, name: str) -> int:
    """Only the params ``trainable`` matches keep requires_grad (a tied one when any of its names matches): it
    narrows what trains already (with ``--peft-config``, the adapter's params: a LoRA on the decoder only), never
    unfreezes; returns the frozen params' element count (tied ones once)."""
    try:
        rx = re.compile(trainable)
    except (re.error, OverflowError, RecursionError) as e:  # a{99999999999}: OverflowError; deep nesting: recursion
        raise ValueError(f"--trainable {trainable!r} is not a regular expression Python can compile ({e})") from None
    aliases: dict[int, tuple[torch.nn.Parameter, list[str]]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), (p, []))[1].append(n)
    before = [(p, names) for p, names in aliases.values() if p.requires_grad]
    for p, names in before:
        p.requires_grad_(any(rx.search(n) for n in names))
    if not any(p.requires_grad for p, _ in before):
        first = ", ".join(names[0] for _, names in before[:3])
        raise ValueError(f"--trainable {trainable!r} matches no trainable parameter of {name} (their names look like "
                         f"{first}, ...): nothing would train")
    return sum(p.numel() for p, _ in aliases.values() if not p.requires_grad)


def adapter_folder(peft_config: str) -> str:
    """The folder holding ``peft_config``'s adapter_config.json (``peft_config``: the file or its folder), checked
    before the model is built and before peft is asked for: a wrong path was reported as peft missing."""
    folder = os.path.dirname(peft_config) if os.path.isfile(peft_config) else peft_config
    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        raise ValueError(f"--peft-config {peft_config}: no adapter_config.json there (give the file, or the folder "
                         "peft's save_pretrained wrote)")
    return folder


def with_adapter(model, peft_config: str):
    """``model`` with the PEFT adapter that ``peft_config`` (an ``adapter_config.json`` or its folder) describes, on
    the model's device (meta: no weights); its trainable params are the adapter's (and its ``modules_to_save``)."""
    folder = adapter_folder(peft_config)
    try:
        from peft import PeftConfig, get_peft_model
    except ImportError:
        raise ValueError(f"--peft-config {peft_config}: planning a PEFT adapter needs peft (pip install peft)") from None
    try:
        config = PeftConfig.from_pretrained(folder)
        # peft's save_pretrained writes inference_mode true (every param frozen: nothing to plan); this plans training
        config.inference_mode = False
        return get_peft_model(model, config)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"--peft-config {peft_config}: peft cannot apply it to {type(model).__name__} "
                         f"({type(e).__name__}: {e})") from None

