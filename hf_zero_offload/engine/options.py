"""The engine's typed options: what the caller (Trainer, planner, tests) hands the engine.

Kept apart from the engines so the planner and the sharding plan can build options without importing
an optimizer; nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .loss_scaler import LossScaler


def _check_fields(options, rules: dict) -> None:
    """Each field named in ``rules`` (name -> (smallest value, whether None is allowed)) an int (a
    number for max_grad_norm) >= its bound: a nonsense value (0 micro-batches, a nan clipping norm)
    would otherwise pass, clamped or read as "off", and train differently than asked."""
    for name, (lo, none_ok) in rules.items():
        v = getattr(options, name)
        if v is None and none_ok:
            continue
        kind = numbers.Real if isinstance(lo, float) else numbers.Integral
        if isinstance(v, bool) or not isinstance(v, kind) or not (math.isfinite(v) and v >= lo):
            what = "a finite number" if kind is numbers.Real else "an int"
            raise ValueError(f"{type(options).__name__}.{name} must be {what} >= {lo:g}"
                             f"{' or None' if none_ok else ''}, got {v!r}")


def _is_flag(v) -> bool:
    # a bool, or numpy's (np.bool_ is not an int subclass); not "false", 0 or 1, which bool() reads its own way
    return isinstance(v, bool) or (type(v).__module__ == "numpy" and type(v).__name__ in ("bool_", "bool"))


def _check_flags(options, names, none_ok=()) -> None:
    """Each on/off field a bool (stored as one): "false" and {"enabled": "no"} are truthy, so a string switched
    the delayed update or fp16 on without a word, where the ds_config path says "expected true or false"."""
    for name in names:
        v = getattr(options, name)
        if v is None and name in none_ok:
            continue
        if not _is_flag(v):
            raise TypeError(f"{type(options).__name__}.{name} must be True or False"
                            f"{' (or None)' if name in none_ok else ''}, got {v!r}")
        object.__setattr__(options, name, bool(v))


#: ``OffloadOptions.fp16``'s fields: a DeepSpeed "fp16" section's keys (``LossScaler.from_fp16``'s keywords)
FP16_FIELDS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


def _fp16_fields(fp16) -> dict:
    """The fields of ``OffloadOptions.fp16`` (a dict, or an object such as ``config.FP16Config``), checked by name."""
    if isinstance(fp16, Mapping):
        fields = dict(fp16)
    elif dataclasses.is_dataclass(fp16) and not isinstance(fp16, type):  # (slots or not)
        fields = {f.name: getattr(fp16, f.name) for f in dataclasses.fields(fp16)}
    elif hasattr(fp16, "__dict__") and not isinstance(fp16, type):
        fields = dict(vars(fp16))
    else:
        raise TypeError(f"OffloadOptions.fp16 must be None, a dict of fp16 fields ({', '.join(FP16_FIELDS)}) or a "
                        f"config.FP16Config, got {fp16!r}")
    unknown = sorted(str(k) for k in fields if k not in FP16_FIELDS)
    if unknown:
        raise ValueError(f"OffloadOptions.fp16 has unknown field(s) {', '.join(unknown)}; the fields are "
                         f"{', '.join(FP16_FIELDS)}")
    if "enabled" not in fields or not _is_flag(fields["enabled"]):
        raise TypeError(f"OffloadOptions.fp16.enabled must be True or False, got {fields.get('enabled', 'nothing')!r}")
    fields["enabled"] = bool(fields["enabled"])
    LossScaler.from_fp16(**fields)  # its values checked now too, not at the engine's build
    return fields


@dataclass(frozen=True)
class OffloadOptions:
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 0.0              # 0: no clipping
    # fp16 loss scaling: the fields of a DeepSpeed "fp16" section (``config.FP16Config``, or a dict of
    # them; ``LossScaler.from_fp16`` lists them); None: no loss scaling
    fp16: Any = None
    bucket_numel: int = 200_000_000
    tile_numel: int = 1 << 22
    pin_memory: bool = True
    dpu: bool = False
    dpu_warmup_steps: int = 40
    num_threads: int | None = None
    scatter_thread: bool | None = None      # gradient scatter on a helper thread (default: on CUDA)
    state_dtype: str = "fp32"               # Adam moments: "fp32" (exact AdamW), "bf16" or "int8" (blockwise)
    # without fp16 loss scaling: skip a step whose gradients are not finite (DeepSpeed's bf16 check_grad_overflow);
    # off, such a step is applied as torch's clip_grad_norm_ + AdamW apply it (fp16 always skips)
    skip_nonfinite: bool = False

    def __post_init__(self):
        _check_fields(self, {"gradient_accumulation_steps": (1, False), "max_grad_norm": (0.0, False),
                             "bucket_numel": (1, False), "tile_numel": (1, False), "dpu_warmup_steps": (0, False),
                             "num_threads": (1, True)})
        _check_flags(self, ("pin_memory", "dpu", "scatter_thread", "skip_nonfinite"), none_ok=("scatter_thread",))
        # checked once, kept as a dict (not a field: equality and repr stay the dataclass's)
        object.__setattr__(self, "_fp16", None if self.fp16 is None else _fp16_fields(self.fp16))
        # the kernels take fewer than 2**31 threads (ops.check_num_threads): refused here, at construction,
        # not at the first step after the model has loaded
        if self.num_threads is not None and self.num_threads >= 2**31:
            raise ValueError(f"OffloadOptions.num_threads must be an int in [1, 2**31) or None, got {self.num_threads!r}")
        # int8 moments: a tile of updated params ends on a quantization block's end, so each block is encoded once
        # per step; a smaller tile re-encoded a block per part, and the result depended on the tile size
        if self.state_dtype == "int8" and self.tile_numel % self.shard_align:
            object.__setattr__(self, "tile_numel", -(-self.tile_numel // self.shard_align) * self.shard_align)

    @property
    def shard_align(self) -> int:
        """Shards start at multiples of this (int8 moments: one quantization block, 256)."""
        return 256 if self.state_dtype == "int8" else 1

    @property
    def fp16_fields(self) -> dict | None:
        """``fp16``'s fields as a dict (None: no loss scaling)."""
        return None if self._fp16 is None else dict(self._fp16)

    @property
    def fp16_enabled(self) -> bool:
        return self._fp16 is not None and self._fp16["enabled"]


def as_options(options, who: str) -> OffloadOptions:
    """An engine's ``options``: an ``OffloadOptions``, or a dict of its fields (a loop of one's own wrote
    ``options={"dpu": True}`` and met "'dict' object has no attribute 'state_dtype'" from inside the build)."""
    if isinstance(options, OffloadOptions):
        return options
    if isinstance(options, Mapping):
        fields = [f.name for f in dataclasses.fields(OffloadOptions)]
        unknown = sorted(str(k) for k in options if k not in fields)
        # ShardOptions' fields (stage=2 among the options) are ShardedAdam's own keywords: said so, not "unknown" alone
        sharding = [k for k in unknown if k in {f.name for f in dataclasses.fields(ShardOptions)}]
        if unknown:
            raise TypeError(f"{who}: options has unknown field(s) {', '.join(unknown)}; OffloadOptions' fields are "
                            f"{', '.join(fields)}"
                            + (f" ({', '.join(sharding)}: ShardOptions' field(s), ShardedAdam's own keyword(s): "
                               f"ShardedAdam(params, {sharding[0]}=..., options=...))" if sharding else ""))
        return OffloadOptions(**options)
    raise TypeError(f"{who}: options must be an OffloadOptions (hf_zero_offload.engine.OffloadOptions) or a dict of "
                    f"its fields, got {type(options).__name__}")


@dataclass(frozen=True)
class ShardOptions:
    """ZeRO stage and partitioning (``factory.choose`` picks the engine from these)."""
    stage: int = 2                          # 0: no partitioning; 1, 2: ZeRO-1/2 across ranks
    offload: bool = True                    # optimizer state and step on the CPU
    allgather_bucket_numel: int = 200_000_000
    reduce_scatter: bool = True             # False: always reduce each owner's piece to it

    def __post_init__(self):
        _check_fields(self, {"allgather_bucket_numel": (1, False)})
        _check_flags(self, ("offload", "reduce_scatter"))
        if isinstance(self.stage, bool) or not isinstance(self.stage, numbers.Integral) or self.stage not in (0, 1, 2):
            raise ValueError(f"ShardOptions.stage must be 0, 1 or 2 (ZeRO stage 3 is not supported), got {self.stage!r}")
        object.__setattr__(self, "stage", int(self.stage))
