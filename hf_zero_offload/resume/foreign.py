"""Optimizer state of other tools in a checkpoint (DeepSpeed's ZeRO folders, a torch optimizer's ``optimizer.pt``)
and what a resume with zero_offload says about a checkpoint that holds no state of ours. Nothing here imports
transformers; ``resume`` re-exports these names."""
from __future__ import annotations

import os
import re

TORCH_OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")  # what transformers saves a torch optimizer's state in
_DEEPSPEED_STEP = re.compile(r"^global_step\d+$")


def deepspeed_state(checkpoint: str) -> tuple[list[str], list[str]]:
    """DeepSpeed's ZeRO state in ``checkpoint``: its ``global_stepN`` folders (sorted) and, beside them (or together,
    without them), its ``latest`` and ``zero_to_fp32.py`` files; both lists empty when there is none."""
    held = set(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else set()
    steps = sorted(n for n in held if _DEEPSPEED_STEP.match(n) and os.path.isdir(os.path.join(checkpoint, n)))
    files = [n for n in ("latest", "zero_to_fp32.py") if n in held and os.path.isfile(os.path.join(checkpoint, n))]
    return (steps, files) if steps or len(files) == 2 else ([], [])


def foreign_state(checkpoint: str) -> str | None:
    """What optimizer state of another tool ``checkpoint`` holds, in words ("DeepSpeed's global_step3/",
    "optimizer.pt"), or None: DeepSpeed's ZeRO state (``deepspeed_state``) or a torch optimizer's (optimizer.pt/.bin:
    a plain Trainer's, or a ZeroOffloadCallback run's engine state_dict)."""
    steps, files = deepspeed_state(checkpoint)
    if steps or files:
        return f"DeepSpeed's {steps[-1] + '/' if steps else 'latest'}"
    found = [n for n in TORCH_OPTIMIZER_FILES if os.path.isfile(os.path.join(checkpoint, n))]
    return found[0] if found else None


def plain_checkpoint(checkpoint: str) -> bool:
    """A plain Trainer's checkpoint: torch's optimizer.pt and trainer_state.json, no zero_offload/ and no marker of
    ours (the Trainer's resume takes its optimizer's state over: ``TorchStateResume``)."""
    held = set(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else set()
    return {"optimizer.pt", "trainer_state.json"} <= held and not held & {"zero_offload", "hzo_complete.json"}


FRESH_START = ("To start a new run from these weights, load the model from the checkpoint (from_pretrained, or "
                "--model_name_or_path) and train without resume_from_checkpoint: Adam's moments and the LR schedule "
                "then start afresh")


def missing_state_message(checkpoint: str, state_dir: str) -> str:
    """Why a checkpoint without ``state_dir/`` cannot be resumed with zero_offload, and what to do instead."""
    foreign = foreign_state(checkpoint)
    if foreign is not None and foreign.startswith("DeepSpeed"):
        return (f"{checkpoint} was saved by DeepSpeed ({foreign} holds its ZeRO optimizer state, in DeepSpeed's own "
                f"format, which hf_zero_offload does not read; no {state_dir}/). {FRESH_START}")
    if foreign is not None:
        return (f"{checkpoint} has no {state_dir}/ optimizer state, and its {foreign} is not a torch optimizer's "
                "state_dict (which this Trainer takes over): the engine's own state_dict of a run with "
                f"ZeroOffloadCallback, which that callback's Trainer resumes. {FRESH_START}")
    if not os.path.isfile(os.path.join(checkpoint, "scheduler.pt")):
        return (f"{checkpoint} holds the model only (no {state_dir}/, optimizer or scheduler state: saved with "
                "--save_only_model?): resuming with zero_offload needs the optimizer state (fp32 master weights, Adam "
                f"moments). {FRESH_START}")
    return f"{checkpoint} has no {state_dir}/ optimizer state (was it saved without --zero_offload?). {FRESH_START}"
