"""Rules across keys of a ``ds_config.json``, after each key's own check in :mod:`.schema`: contradicting legacy
spellings, features that need another one, keys of another scheduler type, fp16 loss-scaler limits. Split from
:mod:`.schema` (its tables and walker) by concept: this module holds what no single key's check can see.

Stdlib only: no torch, no transformers.
"""
from __future__ import annotations

from typing import Any

from .checks import json_type
from .schema import SCHEDULER_PARAMS, TOP, ConfigError
from .walker import _err, _walk

# Our extensions of offload_optimizer, placed under DeepSpeed's offload_param: with its "device" "none" (or none
# given) offload_param is switched off and used to be ignored whole, so the moments silently stayed fp32.
OUR_OFFLOAD_KEYS = ("state_dtype", "cpu_threads")


def validate(raw: Any, source: str, ignored: list | None = None) -> dict:
    """Check ``raw`` against the tables; return a normalised copy (ignored keys dropped, "auto" kept).
    ``ignored``: receives the paths of the keys given that have no effect (for the start log)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object ({{...}}), got {json_type(raw)}")
    cfg = _walk(raw, TOP, "", source, ignored)
    param = (raw.get("zero_optimization") or {}).get("offload_param")
    for key in OUR_OFFLOAD_KEYS if isinstance(param, dict) else ():
        if key in param:
            raise _err(source, f"zero_optimization.offload_param.{key}", "belongs under zero_optimization."
                       "offload_optimizer (offload_param is DeepSpeed's stage-3 parameter offload)")
    if "bf16" in cfg and "bfloat16" in cfg:
        raise _err(source, "bfloat16", 'legacy spelling of "bf16"; give only one of them')
    if "bfloat16" in cfg:
        cfg["bf16"] = cfg.pop("bfloat16")
    if cfg.get("fp16", {}).get("enabled") is True and cfg.get("bf16", {}).get("enabled") is True:
        raise _err(source, "bf16.enabled", "fp16 and bf16 cannot both be enabled")
    fp16 = cfg.get("fp16", {})
    power, floor = fp16.get("initial_scale_power", 16), fp16.get("min_loss_scale", 1.0)
    if fp16.get("loss_scale", 0.0) == 0 and floor > 2.0 ** power:
        # the first overflow "halves" the scale to max(scale / 2, minimum): the minimum, above the scale, raised it
        # and every later step overflowed and was skipped, silently
        raise _err(source, "fp16.min_loss_scale", f"{floor:g} is above the initial dynamic scale {2.0 ** power:g} = "
                   f"2**fp16.initial_scale_power (2**{power}); lower min_loss_scale or raise initial_scale_power")
    for name in ("optimizer", "scheduler"):
        if name in cfg and "type" not in cfg[name]:
            raise _err(source, f"{name}.type", "required when the '" + name + "' block is given")
    sched = cfg.get("scheduler", {})
    for key in sched.get("params", {}):
        if key not in SCHEDULER_PARAMS[sched["type"]]:
            users = " and ".join(t for t, keys in SCHEDULER_PARAMS.items() if key in keys)
            raise _err(source, f"scheduler.params.{key}", f"not a parameter of {sched['type']} (only used by "
                       f"{users}); remove it")
    zero = cfg.get("zero_optimization", {})
    off = zero.get("offload_optimizer", {})
    if "cpu_offload" in zero and "device" in off and zero["cpu_offload"] != (off["device"] == "cpu"):
        raise _err(source, "zero_optimization.cpu_offload",
                   f"contradicts offload_optimizer.device={off['device']!r}; drop the legacy key")
    if ("cpu_offload_use_pin_memory" in zero and "pin_memory" in off
            and zero["cpu_offload_use_pin_memory"] != off["pin_memory"]):
        raise _err(source, "zero_optimization.cpu_offload_use_pin_memory",
                   "contradicts offload_optimizer.pin_memory; drop the legacy key")
    offload = zero.get("cpu_offload", False) or off.get("device") == "cpu"
    if offload and zero.get("stage", 0) == 0:
        given = "got 0" if "stage" in zero else "and the key is missing (DeepSpeed's default is 0)"
        raise _err(source, "zero_optimization.stage", f'optimizer offload needs ZeRO stage 1 or 2, {given}: add "stage": 2')
    if off.get("state_dtype", "fp32") != "fp32" and not offload:
        raise _err(source, "zero_optimization.offload_optimizer.state_dtype",
                   'compact moments are for the CPU step: they need "device": "cpu" (on the device use "fp32")')
    if zero.get("delayed_param_update", {}).get("enabled") and not offload:
        raise _err(source, "zero_optimization.delayed_param_update.enabled",
                   'the delayed parameter update needs "offload_optimizer": {"device": "cpu"}')
    return cfg
