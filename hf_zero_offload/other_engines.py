"""The arguments and launcher settings that turn on another engine beside ours (DeepSpeed, FSDP, accelerate's
ParallelismConfig mesh), transformers 4.x's ``--sharded_ddp`` values, and the launcher's mixed precision: checked
before TrainingArguments' own ``__post_init__`` (the Trainer integration calls them).

Nothing here imports transformers: ``args`` is any object with TrainingArguments' attributes.
"""
from __future__ import annotations

import logging
import os

from .config import ConfigError

logger = logging.getLogger("hf_zero_offload")

# transformers 4.x's fairscale ``--sharded_ddp`` values (ShardedDDPOption), gone with fairscale
LEGACY_SHARDED_DDP = ("simple", "zero_dp_2", "zero_dp_3", "offload", "auto_wrap")
# the words HfArgumentParser takes for a bool flag (string_to_bool), which code and JSON files may pass as strings
_TRUTHY, _FALSY = ("true", "yes", "y", "t", "1"), ("false", "no", "n", "f", "0", "")


def legacy_sharded_ddp(value) -> str | None:
    """The refusal of a transformers 4.x ``--sharded_ddp`` value ("zero_dp_2", "zero_dp_3 offload", ...), or None."""
    if isinstance(value, (list, tuple)) and all(isinstance(w, str) for w in value):  # 4.x's to_dict() wrote a list
        value = " ".join(value)
    words = value.split() if isinstance(value, str) else []
    if not words or any(w not in LEGACY_SHARDED_DDP for w in words):
        return None
    return (f"--sharded_ddp {value}: transformers 4.x's fairscale values ({', '.join(LEGACY_SHARDED_DDP)}) are gone; "
            "here --sharded_ddp is a switch (ZeRO-1/2 across the ranks), and the stage and the CPU offload come from "
            'the ds_config: --sharded_ddp --zero_offload FILE, with "zero_optimization": {"stage": 2, '
            '"offload_optimizer": {"device": "cpu"}} in FILE (stage 3 is not supported)')


def _our_flag(args) -> str | None:
    """The flag that turns our engine on (``sharded_ddp`` already a bool), to name in an error; None when off."""
    return "--zero_offload" if args.zero_offload is not None else "--sharded_ddp" if args.sharded_ddp else None


def refuse_other_engines(args) -> None:
    """``deepspeed`` or ``fsdp`` next to ``zero_offload``/``sharded_ddp`` (as arguments or from accelerate's launcher):
    two engines would each own the optimizer (and DeepSpeed would read the same ds_config). Checked before
    TrainingArguments' own ``__post_init__``, whose first complaint without the deepspeed package would be a missing
    package, not the real mistake."""
    if not isinstance(args.sharded_ddp, bool):  # the command line gives a bool; code and JSON files may not
        word = "" if args.sharded_ddp is None else str(args.sharded_ddp).strip().lower()
        if word in _TRUTHY + _FALSY and not isinstance(args.sharded_ddp, (list, tuple)):
            args.sharded_ddp = word in _TRUTHY
        else:
            raise ConfigError(legacy_sharded_ddp(args.sharded_ddp) or f"sharded_ddp must be True or False, got "
                              f"{args.sharded_ddp!r}")
    ours = _our_flag(args)
    if ours and args.deepspeed:
        raise ConfigError(f"--deepspeed and {ours} both given: they are two engines for the same job (hf_zero_offload "
                          "reads the same ds_config.json as --deepspeed); keep one of them")
    if ours and args.fsdp:
        raise ConfigError(f"--fsdp and {ours} both given: FSDP and hf_zero_offload's ZeRO-1/2 both shard the "
                          "optimizer state; keep one of them")
    mesh = _parallelism_sizes(args)
    if ours and mesh:
        raise ConfigError(f"parallelism_config ({mesh}) and {ours} both given: accelerate's ParallelismConfig builds "
                          "its own device mesh and shards or replicates the model over it, and hf_zero_offload shards "
                          "the optimizer over its own ranks; leave parallelism_config unset (and "
                          "ACCELERATE_USE_PARALLELISM_CONFIG) or drop " + ours)
    # accelerate's own engines, turned on by its launcher (both engines were built, then the run failed naming a
    # create_optimizer override nobody wrote, or on a missing deepspeed package)
    for var, what, flag in (("ACCELERATE_USE_DEEPSPEED", "accelerate's DeepSpeed", "--use_deepspeed"),
                            ("ACCELERATE_USE_FSDP", "accelerate's FSDP", "--use_fsdp")):
        value = os.environ.get(var, "")
        if ours and value.strip().lower() in _TRUTHY + ("on",):
            raise ConfigError(f"{var}={value} (accelerate launch {flag}, or an accelerate config whose "
                              f"distributed_type is {flag[6:].upper()}) and {ours} both given: {what} and "
                              f"hf_zero_offload are two engines for the same job; launch with torchrun or a plain "
                              f"`accelerate launch --multi_gpu`, or drop {ours}")


def take_launcher_precision(args) -> None:
    """``accelerate launch --mixed_precision bf16|fp16`` (ACCELERATE_MIXED_PRECISION) without --bf16/--fp16: the
    plain Trainer autocasts then; the engine, which owns the 16-bit model and runs without autocast, takes it as
    --bf16/--fp16, as transformers hands it to DeepSpeed (it was dropped: the run trained in fp32 without a word)."""
    value = os.environ.get("ACCELERATE_MIXED_PRECISION", "")
    mp = value.strip().lower()
    ours = _our_flag(args)
    if not ours or mp in ("", "no") or args.fp16 or args.bf16:
        return
    if mp not in ("bf16", "fp16"):
        raise ConfigError(f"ACCELERATE_MIXED_PRECISION={value} (accelerate launch --mixed_precision) with {ours}: "
                          "hf_zero_offload trains in fp32, bf16 or fp16; launch with --mixed_precision bf16, fp16 "
                          "or no")
    setattr(args, mp, True)
    logger.info("hf_zero_offload: ACCELERATE_MIXED_PRECISION=%s (accelerate launch --mixed_precision): training in "
                "%s, as with --%s (the model cast, no autocast)", value, mp, mp)


def _parallelism_sizes(args) -> str:
    """accelerate's ParallelismConfig sizes above 1, given as the argument or by accelerate's launcher (its
    environment), in words; "" when none."""
    pc = getattr(args, "parallelism_config", None)
    keys = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
    if pc is not None:
        sizes = {k: getattr(pc, k, None) for k in keys}
    elif os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").strip().lower() == "true":
        sizes = {k: os.environ.get(f"PARALLELISM_CONFIG_{k.upper()}", "1") for k in keys}
    else:
        return ""
    big = []
    for k, v in sizes.items():
        try:
            if v is not None and int(v) > 1:
                big.append(f"{k}={v}")
        except (TypeError, ValueError):
            big.append(f"{k}={v!r}")
    return ", ".join(big)
