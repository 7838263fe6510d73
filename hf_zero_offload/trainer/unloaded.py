"""Trainable params that a checkpoint's weight files do not hold under this model's names.

transformers 5.x saves some architectures' weights under their older names (ViT's ``encoder.layer.N.attention.
attention.key``, Mixtral's and Qwen2-MoE's per-expert ``w1``/``w2``/``w3``) and converts them in ``from_pretrained``,
but the Trainer's resume loads the file by name (``load_state_dict(strict=False)``): those params keep the values they
had, their initialisation, with transformers' "missing keys" warning alone (the plain Trainer then trains on from
them). The engine's state restores them from its masters, except a delayed (DPU) state's lagging weights, which only
the model file holds (``CheckpointLoading`` says what it does then).
"""
from __future__ import annotations

import glob
import json
import os

from safetensors import safe_open

INDEX = "model.safetensors.index.json"


def weight_file_keys(checkpoint: str) -> set[str] | None:
    """The tensor names of ``checkpoint``'s model weights (``model*.safetensors`` and their index: headers only);
    None when it has none (a ``pytorch_model.bin`` checkpoint is not read here)."""
    keys: set[str] = set()
    index = os.path.join(checkpoint, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            keys.update(json.load(f).get("weight_map", {}))
    for path in sorted(glob.glob(os.path.join(glob.escape(checkpoint), "model*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            keys.update(f.keys())
    return keys or None


def unloaded_params(model, checkpoint: str) -> list[str]:
    """The trainable params of ``model`` (one name each) that no name of theirs (tied aliases included) holds in the
    checkpoint's weight files; [] when nothing can be compared (a PEFT model: its adapters are saved under peft's
    names, which peft maps)."""
    if hasattr(model, "peft_config"):
        return []
    keys = weight_file_keys(checkpoint)
    if keys is None:
        return []
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            aliases.setdefault(id(p), []).append(name)
    return [names[0] for names in aliases.values() if not any(n in keys for n in names)]
