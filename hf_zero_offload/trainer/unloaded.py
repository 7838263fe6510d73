"""Trainable params that the Trainer's load of a checkpoint's weights left as they were.

transformers 5.x saves some architectures' weights under their older names (ViT's ``encoder.layer.N.attention.
attention.key``, Mixtral's and Qwen2-MoE's per-expert ``w1``/``w2``/``w3``) and converts them in ``from_pretrained``,
but the Trainer's resume and best-model loads read the file by name (``load_state_dict(strict=False)``): those params
keep the values they had (at a resume, their initialisation), with transformers' "missing keys" warning alone (the
plain Trainer then trains on from them). The engine's state restores them from its masters, except a delayed (DPU)
state's lagging weights, which only the model file holds (``CheckpointLoading`` says what it does then). The load's
own ``missing_keys`` decide (``Trainer._issue_warnings_after_load`` receives them), so nothing is guessed from file
names. Frozen params are left out: nothing trains them, so they are what the run started from.
"""
from __future__ import annotations

import glob
import os

from ..weight_files import open_weights


def unloaded_params(model, missing_keys) -> list[str]:
    """The trainable params of ``model`` (one name each) that every name of theirs (tied aliases included) is among
    the load's ``missing_keys``."""
    missing = set(missing_keys or ())
    if not missing:
        return []
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            aliases.setdefault(id(p), []).append(name)
    return [names[0] for names in aliases.values() if all(n in missing for n in names)]


def other_shapes(model, checkpoint: str) -> list[str]:
    """The tensors of ``checkpoint``'s ``model*.safetensors`` (headers only) that ``model`` has under the same name in
    another shape, as "name (saved (a, b), this model (c, d))": a checkpoint of another model (another config) whose
    names match, which the Trainer's load met with a "size mismatch" line per tensor."""
    own = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    out = []
    for path in sorted(glob.glob(os.path.join(glob.escape(checkpoint), "model*.safetensors"))):
        # (a stray or damaged file: one line naming it, not safetensors' header error naming no file)
        with open_weights(path, "resume from an earlier checkpoint") as f:
            for key in f.keys():
                saved = tuple(f.get_slice(key).get_shape())
                if key in own and own[key] != saved:
                    out.append(f"{key} (saved {saved}, this model {own[key]})")
    return out
