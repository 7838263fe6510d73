"""Helpers for ``finetune_trainer.py``: task prefixes, legacy flags, freezing, sizes and timing (its data:
``seq2seq_data.py``)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from transformers import TrainerCallback, TrainingArguments

logger = logging.getLogger(__name__)

# T5's task prefixes (the public t5 configs carry the same strings in ``task_specific_params``).
T5_TASK_PREFIXES = {
    "summarization": "summarize: ",
    "translation_en_to_de": "translate English to German: ",
    "translation_en_to_fr": "translate English to French: ",
    "translation_en_to_ro": "translate English to Romanian: ",
}
# Generation settings the legacy script copied from ``task_specific_params`` into the model config.
_GENERATION_KEYS = ("num_beams", "early_stopping", "length_penalty", "no_repeat_ngram_size", "min_length")

# Flags of the v4.2 command lines (the blog's) that transformers 5.x renamed or removed.
LEGACY_FLAG_RENAMES = {
    "--evaluation_strategy": "--eval_strategy",
    "--adam_eps": "--adam_epsilon",
    "--lr_scheduler": "--lr_scheduler_type",
    "--no_cuda": "--use_cpu",
    "--per_gpu_train_batch_size": "--per_device_train_batch_size",
    "--per_gpu_eval_batch_size": "--per_device_eval_batch_size",
}
# v4.x flags that transformers 5.x removed with nothing to map them onto: named with what to do instead (an unknown
# flag was answered with the nearest name, "--fp16_opt_level (did you mean --fp16_full_eval?)")
_DROP = "gone in transformers 5.x; drop it"
REMOVED_FLAGS = {
    "--fp16_opt_level": "apex's optimization level: --fp16/--bf16 run through torch.amp since transformers 5.x "
                        "removed apex; drop it",
    "--fp16_backend": f"one backend (torch.amp) is left: {_DROP}",
    "--half_precision_backend": f"one backend (torch.amp) is left: {_DROP}",
    "--evaluate_during_training": "use --eval_strategy steps and --eval_steps",
    "--group_by_length": "use --train_sampling_strategy group_by_length (or the legacy --sortish_sampler)",
    "--tpu_num_cores": _DROP, "--tpu_metrics_debug": _DROP, "--past_index": _DROP, "--mp_parameters": _DROP,
    "--use_mps_device": f"the MPS device is used where present: {_DROP}",
    "--save_safetensors": f"checkpoints are always safetensors: {_DROP}",
    "--use_legacy_prediction_loop": _DROP, "--jit_mode_eval": _DROP, "--use_ipex": _DROP, "--xpu_backend": _DROP,
    "--torchdynamo": "use --torch_compile_backend", "--ray_scope": _DROP, "--push_to_hub_token": "use --hub_token",
    "--logging_dir": f"TensorBoard's folder is set by its own TENSORBOARD_LOGGING_DIR: {_DROP}",
    "--overwrite_cache": f"nothing is cached (the data are read from --data_dir at each run): {_DROP}",
}
# Still documented names that transformers 5.23+ deprecates with a FutureWarning on every run: renamed quietly, where
# the new name exists (before 5.23 the rename made "unknown arguments: --activation_checkpointing")
QUIET_FLAG_RENAMES = {k: v for k, v in {
    "--gradient_checkpointing": "--activation_checkpointing",
    "--gradient_checkpointing_kwargs": "--activation_checkpointing_kwargs",
}.items() if v[2:] in {f.name for f in dataclasses.fields(TrainingArguments)}}


# v4.2's --lr_scheduler values that transformers renamed
LEGACY_SCHEDULER_NAMES = {"constant_w_warmup": "constant_with_warmup", "cosine_w_restarts": "cosine_with_restarts"}


_TRUE, _FALSE = ("true", "1", "yes", "y", "t"), ("false", "0", "no", "n", "f")  # transformers' string_to_bool


def _adafactor(value, given_optim: bool) -> List[str]:
    """v4.2's ``--adafactor`` (a bool field: bare, ``true`` or ``false``) as transformers 5's ``--optim adafactor``;
    false asks for nothing (it was taken for true, as any mention of the flag was)."""
    if value is None:  # (an arguments file's null: v4's default, false)
        return []
    word = str(value).strip().lower()
    if value is not True and word not in _TRUE + _FALSE:
        raise ValueError(f"--adafactor {json.dumps(value) if not isinstance(value, str) else value}: true or false "
                         "(the legacy flag for --optim adafactor)")
    if value is True or word in _TRUE:
        if given_optim:
            raise ValueError("--adafactor and --optim: the first is the legacy spelling of --optim adafactor; give one")
        return ["--optim", "adafactor"]
    return []


def rewrite_legacy_argv(argv: Sequence[str]) -> List[str]:
    """Map the v4.2 flag spellings onto today's names (``--flag value`` and ``--flag=value`` forms), and the legacy
    --lr_scheduler's value names."""
    out: List[str] = []
    given = {a.partition("=")[0] for a in argv}
    for old, new in LEGACY_FLAG_RENAMES.items():  # (the later of the two won, without a word)
        if old in given and new in given:
            raise ValueError(f"{old} and {new}: the first is the legacy spelling of the second; give one")
    argv = list(argv)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if i and argv[i - 1] == "--adafactor" and arg.lower() in _TRUE + _FALSE:
            continue  # (its value, taken with it)
        if out and out[-1] == "--lr_scheduler_type" and arg in LEGACY_SCHEDULER_NAMES:
            out.append(LEGACY_SCHEDULER_NAMES[arg])
        elif name in ("--lr_scheduler", "--lr_scheduler_type") and value in LEGACY_SCHEDULER_NAMES:
            out.append(f"--lr_scheduler_type={LEGACY_SCHEDULER_NAMES[value]}")
        elif name in LEGACY_FLAG_RENAMES:
            new = LEGACY_FLAG_RENAMES[name]
            logger.warning("legacy flag %s is spelled %s in transformers 5.x; mapped", name, new)
            out.append(new + eq + value)
        elif name in QUIET_FLAG_RENAMES and QUIET_FLAG_RENAMES[name] not in given:  # both given: transformers' rule
            out.append(QUIET_FLAG_RENAMES[name] + eq + value)                        # (the new name wins) decides
        elif name == "--adafactor":
            following = argv[i + 1] if i + 1 < len(argv) and argv[i + 1].lower() in _TRUE + _FALSE else None
            out += _adafactor(value if eq else (following or True), "--optim" in given)
        else:
            out.append(arg)
    return out


def rewrite_legacy_keys(args: dict) -> dict:
    """The same mapping for a JSON arguments file: keys are the flags without their dashes."""
    quiet = {k: v for k, v in QUIET_FLAG_RENAMES.items() if v[2:] not in args}  # both given: as on the command line
    renames = {k[2:]: v[2:] for k, v in {**LEGACY_FLAG_RENAMES, **quiet}.items()}
    for old, new in LEGACY_FLAG_RENAMES.items():
        if old[2:] in args and new[2:] in args:
            raise ValueError(f"{old[2:]} and {new[2:]}: the first is the legacy spelling of the second; give one")
    out = {}
    for key, value in args.items():
        new = renames.get(key, key)
        if new != key and key not in {k[2:] for k in QUIET_FLAG_RENAMES}:
            logger.warning("legacy key %s is spelled %s in transformers 5.x; mapped", key, new)
        if new == "lr_scheduler_type" and value in LEGACY_SCHEDULER_NAMES:
            value = LEGACY_SCHEDULER_NAMES[value]
        if key == "adafactor":
            if _adafactor(value, "optim" in args):
                out["optim"] = "adafactor"
            continue
        out[new] = value
    return out


def task_prefix(task: str, config) -> str:
    """The source prefix: ``config.task_specific_params[task]["prefix"]``, else T5's table for T5 models."""
    params = (getattr(config, "task_specific_params", None) or {}).get(task) or {}
    if "prefix" in params:
        return params["prefix"] or ""
    if getattr(config, "model_type", None) in ("t5", "mt5", "umt5"):
        if task in T5_TASK_PREFIXES:
            return T5_TASK_PREFIXES[task]
        if task.startswith("translation_") and task.count("_") == 3:
            return ""  # unknown pair: no prefix rather than a wrong one
    return getattr(config, "prefix", None) or ""


def task_generation_params(task: str, config) -> Dict:
    """Generation settings for ``task`` from ``config.task_specific_params`` (legacy ``use_task_specific_params``)."""
    params = (getattr(config, "task_specific_params", None) or {}).get(task) or {}
    return {k: params[k] for k in _GENERATION_KEYS if k in params}


# ----------------------------------------------------------------------------------------------------------------------
# Freezing (legacy --freeze_embeds / --freeze_encoder)


def _freeze(module: Optional[torch.nn.Module]) -> None:
    if module is not None:
        for p in module.parameters():
            p.requires_grad_(False)


def freeze_embeds(model) -> None:
    """T5: ``shared`` and the encoder/decoder ``embed_tokens`` (tied, so also the LM head when tied); others:
    the input embeddings plus any positional embeddings of the encoder/decoder."""
    if getattr(model.config, "model_type", None) in ("t5", "mt5", "umt5"):
        _freeze(getattr(model, "shared", None))
        for stack in (model.get_encoder(), model.get_decoder()):
            _freeze(getattr(stack, "embed_tokens", None))
        return
    _freeze(model.get_input_embeddings())
    for stack in (model.get_encoder(), model.get_decoder()):
        _freeze(getattr(stack, "embed_positions", None))
        _freeze(getattr(stack, "embed_tokens", None))


def freeze_encoder(model) -> None:
    _freeze(model.get_encoder())


def count_params(model) -> Tuple[int, int]:
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


# ----------------------------------------------------------------------------------------------------------------------
# Results


def peak_host_rss_bytes() -> Optional[int]:
    """Peak resident set size of this process (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    try:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    except Exception:
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)  # current, not peak: the best psutil offers portably
        except Exception:
            return None


def save_json(obj, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=4, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


class StepProgressCallback(TrainerCallback):
    """With --disable_tqdm (logs, pipes, CI) a line per logging step: step k/N, percent, elapsed and time left,
    and the logged values, so a slow run still shows it is alive and how long it will take."""

    def __init__(self):
        self._t0 = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = time.monotonic()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._t0 is None or not state.is_world_process_zero or not state.max_steps or not state.global_step:
            return
        elapsed = time.monotonic() - self._t0
        left = elapsed / state.global_step * (state.max_steps - state.global_step)
        values = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in (logs or {}).items()
                           if k in ("loss", "grad_norm", "learning_rate", "eval_loss", "eval_bleu"))
        if values:  # (the end-of-training summary and the final evaluation have their own lines)
            logger.info("step %d/%d (%.0f%%), %s elapsed, about %s left: %s", state.global_step, state.max_steps,
                        100 * state.global_step / state.max_steps, minutes(elapsed), minutes(left), values)


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"
