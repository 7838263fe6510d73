"""What a resume says: the one line describing what was restored (saved against now), and the warnings for a state
this run drops, a schedule that restarts and a checkpoint with no steps left. ``resume`` decides which checkpoint to
take and whether it is whole."""
from __future__ import annotations

import json
import os

import torch

from ..engine.checkpoint import read_header
from .foreign import missing_state_message, plain_checkpoint
from .marker import marker_problem, read_marker
from . import TRAINER_STATE, checkpoint_step, held_step, newest_whole, recorded_step


def saved_engine(checkpoint: str, state_dir: str) -> dict | None:
    """What the checkpoint's optimizer state is: the marker's record, else read from the state files (legacy);
    None when the checkpoint holds no hf_zero_offload state."""
    d = os.path.join(checkpoint, state_dir)
    if not os.path.isdir(d):
        return None  # e.g. --save_only_model: the marker records the engine that ran, but no state was written
    marker = read_marker(checkpoint)
    if marker is not None and isinstance(marker.get("engine"), dict) and marker["engine"]:
        return marker["engine"]  # (any other "engine" is damage, which describe() names: read the files)
    files = sorted(n for n in os.listdir(d) if n.endswith(".hzo"))
    if not files:
        return None
    info = {"world_size": len(files)}
    try:
        meta = read_header(os.path.join(d, files[0]))[0]
    except (OSError, ValueError, KeyError):
        return info  # the engine's load says what is wrong with the file
    return {**info, "format": meta.get("format"), "stage": meta.get("stage"), "offload": meta.get("offload", True),
            "dtype": meta.get("param_dtype")}


def describe(checkpoint: str, state: str, engine: dict | None, now: dict) -> str:
    """The one line a resume logs: what was restored, saved vs now."""
    step = recorded_step(checkpoint)
    problem = marker_problem(checkpoint)
    how = ("complete" if state == "complete" else f"{problem}, accepted as is" if problem else
           "a plain Trainer's, its optimizer.pt taken over" if plain_checkpoint(checkpoint) else
           "written before completion markers, accepted as is")
    parts = [f"hf_zero_offload: resumed {checkpoint} (step {step if step is not None else '?'}, {how})"]
    if state == "complete" and problem:
        parts.append(f"{problem}: the state files say what was saved")
    if engine is not None:
        ws = engine.get("world_size", "?")
        parts.append(f"optimizer state {engine.get('format', '?')} saved by {ws} rank(s), loaded on "
                     f"{now['world_size']}")
        parts.append(f"stage {engine.get('stage', '-')} -> {now.get('stage', '-')}, offload "
                     f"{engine.get('offload', '?')} -> {now.get('offload', '?')}, dpu {engine.get('dpu', '?')} -> "
                     f"{now.get('dpu', '?')}, dtype {engine.get('dtype', '?')} -> {now.get('dtype', '?')}")
    return "; ".join(parts)


def dpu_change_message(engine: dict | None, dpu: bool, warmup_steps: int) -> str | None:
    """The warning for a state saved with the delayed parameter update (DPU) on and resumed with it off, or the
    other way round (None when unchanged or unknown: a state written before the marker recorded it)."""
    was = (engine or {}).get("dpu")
    if not isinstance(was, bool) or was == dpu:
        return None
    if was:
        return ("hf_zero_offload: delayed_param_update was on in the saved run and is off in this one: a step in "
                "flight at the save reaches the model now and every step after the resume is synchronous (each "
                "forward sees the last step's weights, not those of the step before it), so the run differs from the "
                "saved one's DPU schedule")
    return ("hf_zero_offload: delayed_param_update was off in the saved run and is on in this one: each step after "
            f"warmup_steps={warmup_steps} (counted from the run's first step) runs its forward on the weights of the "
            "step before the last, so the run differs from the saved one's synchronous schedule")


def dropped_state_message(checkpoint: str, state_dir: str, why: str) -> str | None:
    """The warning for a checkpoint whose hf_zero_offload optimizer state this run will not load (None when it
    holds none)."""
    engine = saved_engine(checkpoint, state_dir)
    if engine is None:
        return None
    return (f"hf_zero_offload: {checkpoint} holds hf_zero_offload optimizer state ({state_dir}/: fp32 master "
            f"weights, Adam moments, step counts and loss scale, saved by {engine.get('world_size', '?')} rank(s)) "
            f"that this run drops ({why}): Adam restarts from zero moments and, without optimizer.pt, "
            "transformers does not load scheduler.pt either, so the LR schedule restarts from its first step. "
            "Pass the same --zero_offload config to continue the run as it was")


def no_state_message(checkpoint: str, state_dir: str) -> str:
    """``missing_state_message``, and the newest earlier checkpoint beside it that a resume can take: a run switched
    to --save_only_model part way (a requeued job's --resume_from_checkpoint true found the model-only one) was told
    to start afresh, its earlier full checkpoints not named."""
    message = missing_state_message(checkpoint, state_dir)
    step = held_step(checkpoint)
    if step is None:
        return message
    c = newest_whole(os.path.dirname(os.path.normpath(checkpoint)), step[0],
                     lambda c: os.path.isdir(os.path.join(c, state_dir)) or plain_checkpoint(c))
    if c is None:
        return message
    return (f"{message}. Or go on from the newest earlier checkpoint beside it that holds optimizer state, {c} "
            f"(step {checkpoint_step(c)}: the steps after it train again)")


def unloaded_reason(checkpoint: str, state_dir: str) -> str | None:
    """Why a plain Trainer's resume from ``checkpoint`` loads no optimizer state into an engine, or None when it
    would load one (optimizer.pt and scheduler.pt both there, no hf_zero_offload state)."""
    held = saved_engine(checkpoint, state_dir)
    if held is not None:
        return (f"it holds hf_zero_offload optimizer state ({state_dir}/, saved by {held.get('world_size', '?')} "
                "rank(s)): a plain Trainer does not load it; resume it with ZeroOffloadTrainer / ZeroOffloadMixin")
    missing = [n for n in ("optimizer.pt", "scheduler.pt") if not os.path.isfile(os.path.join(checkpoint, n))]
    if missing:
        return (f"it has no {' and no '.join(missing)} (a --save_only_model checkpoint, or one a file was lost "
                "from), and transformers loads the two together or neither")
    return None


def saved_optimizer_steps(checkpoint: str) -> int | None:
    """The engine step count its optimizer.pt holds (what a plain Trainer's resume loads), None when there is none
    or it is no engine's state_dict. Memory-mapped: the tensors are not read."""
    try:
        state = torch.load(os.path.join(checkpoint, "optimizer.pt"), map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        return None
    steps = state.get("global_steps") if isinstance(state, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def unloaded_engine_message(checkpoint: str | None, step: int, engine: str, engine_steps: int,
                            state_dir: str) -> str:
    """The warning for a plain Trainer's resume (ZeroOffloadCallback) that left the engine as it was. ``checkpoint``:
    the one resumed, None when no callback can tell which (train()'s argument reaches none)."""
    why = unloaded_reason(checkpoint, state_dir) if checkpoint else None
    if why is None:
        why = ("transformers loads a checkpoint's optimizer.pt and scheduler.pt together or neither (a "
               f"--save_only_model checkpoint has neither), and never an hf_zero_offload {state_dir}/")
    moments = ("Adam restarts from zero moments" if engine_steps == 0 else "Adam goes on from the engine's own "
               f"moments (its step count is {engine_steps}), not the checkpoint's")
    return (f"hf_zero_offload: this run resumed {checkpoint or 'a checkpoint'} (step {step}), but its optimizer state "
            f"was not loaded into the {engine}: {why}. {moments}, and the LR schedule restarts from its first step")


def saved_learning_rate(checkpoint: str) -> float | None:
    """The last logged learning rate in the checkpoint's trainer_state.json."""
    try:
        with open(os.path.join(checkpoint, TRAINER_STATE), encoding="utf-8") as f:
            history = json.load(f).get("log_history", [])
    except (OSError, ValueError, AttributeError):
        return None
    rates = [h["learning_rate"] for h in history if isinstance(h, dict) and "learning_rate" in h]
    return rates[-1] if rates else None


def missing_scheduler_message(checkpoint: str, restart_lr: float, scheduler_name: str) -> str:
    saved = saved_learning_rate(checkpoint)
    was = f"the saved run was at lr={saved:.6g}" if saved is not None else "the saved LR is unknown"
    return (f"hf_zero_offload: {checkpoint} has no {scheduler_name}: the learning-rate schedule restarts from its "
            f"first step (lr={restart_lr:.6g}) instead of continuing ({was} at step {recorded_step(checkpoint)})")


def nothing_left_message(checkpoint: str, max_steps: int, chosen: bool = True) -> str | None:
    """The warning for a resume whose checkpoint already reached ``max_steps``: often a checkpoint an earlier run
    left in output_dir (``--overwrite_output_dir`` removes none), which ``true`` takes as the highest-numbered
    complete one (``chosen``: the checkpoint was picked that way, not named). transformers' loop compares the step
    with max_steps only after a step, so where the epoch has batches left it trains one step past max_steps and
    saves it (checkpoint-4 of a 4-step run resumed: step 5, checkpoint-5). None when steps are left."""
    step = recorded_step(checkpoint)
    if max_steps is None or max_steps <= 0 or step is None or step < max_steps:
        return None
    earlier = (" A checkpoint of an earlier run in this output_dir? (--resume_from_checkpoint true takes the "
               "highest-numbered complete one; --overwrite_output_dir removes none)") if chosen else ""
    return (f"hf_zero_offload: {checkpoint} is at step {step} and max_steps is {max_steps}: nothing left to train, "
            f"but transformers' Trainer checks max_steps after each step, so it may still train one step past it "
            f"(step {step + 1}) and save it.{earlier} Raise --max_steps to train on")
