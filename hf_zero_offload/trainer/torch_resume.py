"""``TorchStateResume``: a plain Trainer's checkpoint (torch's ``optimizer.pt``, no ``zero_offload/``) resumed with
zero_offload: the AdamW moments and step counts go into the engine (``load_torch_state_dict``), the masters are the
checkpoint's weights read in their own dtype (fp32 from an fp32 run: a 16-bit model would round them otherwise), and
the LR schedule loads as for a checkpoint of ours. Its methods read the Trainer's fields as their own."""
from __future__ import annotations

import glob
import logging
import os

import torch

from ..engine.checkpoint.contents import LayoutMismatch
from ..engine.torch_import import not_adam
from ..resume.foreign import FRESH_START
from ..weight_files import open_weights

logger = logging.getLogger("hf_zero_offload")

TORCH_OPTIMIZER = "optimizer.pt"


class TorchStateResume:
    _zo_torch_sd: tuple | None = None  # (checkpoint, its optimizer.pt as loaded), read once per resume

    def _zo_torch_state(self, checkpoint: str) -> dict | None:
        """The plain Trainer's ``optimizer.pt`` of ``checkpoint`` (torch.optim's state dict), checked against this
        model's trainable params; None when the checkpoint holds none (or the engine's own state dict: a
        ZeroOffloadCallback run's)."""
        if self._zo_torch_sd is not None and self._zo_torch_sd[0] == checkpoint:
            return self._zo_torch_sd[1]
        path = os.path.join(checkpoint, TORCH_OPTIMIZER)
        if not os.path.isfile(path):
            return None
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - named: torch's own message says neither the file nor what to do
            first = (str(e).strip().splitlines() or [""])[0]  # (its first line: torch's goes on for a page)
            raise ValueError(f"{path} cannot be read ({type(e).__name__}: {first}); resume from another "
                             "checkpoint") from None
        if isinstance(sd, dict) and "format" in sd:
            return None  # the engine's own state_dict: a ZeroOffloadCallback run's (missing_state_message says so)
        if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict) and isinstance(sd.get("param_groups"), list)):
            raise ValueError(f"{path} holds a {type(sd).__name__}, not a torch optimizer's state_dict ({{'state': ..., "
                             "'param_groups': [...]}); resume from another checkpoint")
        not_adam(sd, path)  # before the weights load, as the param count below
        trainable = {id(p) for p in self.model.parameters() if p.requires_grad}
        saved = sum(len(g.get("params", ())) for g in sd["param_groups"] if isinstance(g, dict))
        if saved != len(trainable):
            raise LayoutMismatch(f"{path} is the state of an optimizer over {saved} params; this model has "
                                 f"{len(trainable)} trainable: resume with the model and trainable params of that "
                                 f"run. {FRESH_START}")
        self._zo_torch_sd = (checkpoint, sd)
        return sd

    def _zo_load_torch_state(self, checkpoint: str, sd: dict) -> None:
        try:
            self.zero_engine.load_torch_state_dict(sd, self._zo_checkpoint_weights(checkpoint))
        finally:
            self._zo_torch_sd = None
        logger.info("hf_zero_offload: %s is a plain Trainer's checkpoint: its optimizer's state (Adam moments and "
                    "step counts, the param groups' hyper-parameters) is taken over by the engine", checkpoint)

    def _zo_checkpoint_weights(self, checkpoint: str) -> list[torch.Tensor] | None:
        """The engine's params as the checkpoint's weight files hold them (in their dtype: fp32 from an fp32 run),
        in the engine's order; None when the files do not name every one (then the params, as loaded, are the
        masters)."""
        found: dict[str, torch.Tensor] = {}
        names = self._zo_slot_names()
        wanted = {n for aliases in names for n in aliases}
        for path in sorted(glob.glob(os.path.join(glob.escape(checkpoint), "*.safetensors"))):
            with open_weights(path, "resume from an earlier checkpoint") as f:
                for key in wanted.intersection(f.keys()):
                    found[key] = f.get_tensor(key)
        out = []
        for aliases, p in zip(names, (p for g in self.zero_engine.slot_params() for p in g)):
            w = next((found[n] for n in aliases if n in found and found[n].shape == p.shape), None)
            if w is None:
                logger.info("hf_zero_offload: %s's weight files do not hold %s: the masters are the params as "
                            "loaded", checkpoint, aliases[0])
                return None
            out.append(w)
        return out
