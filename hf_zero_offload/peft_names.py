"""A PEFT adapter checkpoint for ``consolidate``: which folder holds the trained adapter, and the engine's masters
under the names peft saves them by (no peft import: its file layout and key rule, as its ``save_pretrained`` and
``get_peft_model_state_dict`` write them).

- The adapter named ``default`` is saved in the checkpoint folder itself, any other one in a subfolder of its name,
  each with an ``adapter_config.json``.
- A saved key is the param's name without the adapter's name and without ``modules_to_save``
  (``q.lora_A.default.weight`` -> ``q.lora_A.weight``, ``head.modules_to_save.default.weight`` -> ``head.weight``);
  DoRA's magnitude loses its ``.weight`` too (``q.lora_magnitude_vector``); prompt tuning's embedding is saved as
  ``prompt_embeddings``. Other prompt-learning methods save what their encoder computes, not its params: refused.
"""
from __future__ import annotations

import glob
import os

import torch

from .weight_files import open_weights

CONFIG, DEFAULT = "adapter_config.json", "default"
#: consolidate's advice on a checkpoint it cannot use (its own refusals, and a damaged adapter weight file here)
EARLIER = "consolidate an earlier checkpoint"


def adapter_folders(checkpoint_dir: str) -> dict[str, str]:
    """Adapter name -> the folder peft saved it in: empty for a checkpoint that is not a PEFT adapter's."""
    found = glob.glob(os.path.join(glob.escape(checkpoint_dir), "*", CONFIG))
    folders = {os.path.basename(os.path.dirname(p)): os.path.dirname(p) for p in found}
    if os.path.isfile(os.path.join(checkpoint_dir, CONFIG)):
        folders[DEFAULT] = checkpoint_dir
    return folders


def adapter_source(checkpoint_dir: str, folders: dict[str, str],
                   masters: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
    """(the folder of the adapter the masters train, of ``adapter_folders``; the masters by its file's keys)."""
    segments = {s for name in masters for s in name.split(".")}
    trained = sorted(n for n in folders if n in segments)
    if len(trained) != 1:
        what = (f"adapters {', '.join(trained)}" if trained else
                f"no adapter of those saved here ({', '.join(sorted(folders))})")
        raise ValueError(f"{checkpoint_dir}: a PEFT adapter checkpoint whose optimizer state trains {what}: "
                         "consolidate writes the one adapter a run trains")
    name = trained[0]
    folder = folders[name]
    keys = set()
    for path in glob.glob(os.path.join(glob.escape(folder), "*.safetensors")):
        with open_weights(path, EARLIER) as f:
            keys.update(f.keys())
    prompts = [n for n in masters if n.split(".")[0] == "prompt_encoder"]
    out: dict[str, torch.Tensor] = {}
    for n, t in masters.items():
        key = _saved_key(n, name, keys)
        if n in prompts:
            if len(prompts) != 1 or "prompt_embeddings" not in keys:
                raise ValueError(f"{folder}: a prompt-learning adapter saves the prompts its encoder computes, not "
                                 f"the encoder's params ({', '.join(prompts[:3])}): consolidate writes prompt "
                                 "tuning's embedding only")
            key = "prompt_embeddings"
        elif key not in keys and key.endswith(".weight") and key[:-len(".weight")] in keys:
            key = key[:-len(".weight")]  # DoRA's magnitude vector
        if out.get(key, t) is not t:
            raise ValueError(f"{folder}: a PEFT adapter checkpoint, whose tensor names leave out the adapter name: "
                             f"two masters would be written as {key}")
        out[key] = t
    return folder, out


def _saved_key(master: str, adapter: str, keys: set) -> str:
    """The adapter file's key of ``master``: peft drops the adapter's name where it stands before the last segment
    (``q.lora_A.<adapter>.weight``; ``lm_head.modules_to_save.<adapter>.weight`` loses both), so an adapter named like a
    module of the path (``model``, ``encoder``) keeps that module; older peft dropped every such segment."""
    parts = master.split(".")
    candidates = []
    if len(parts) >= 2 and parts[-2] == adapter:
        near = parts[:-2] + parts[-1:]
        candidates.append(".".join(near[:-2] + near[-1:] if len(near) >= 2 and near[-2] == "modules_to_save" else near))
    candidates.append(".".join(s for s in parts if s not in (adapter, "modules_to_save")))
    return next((c for c in candidates if c in keys), candidates[0])
