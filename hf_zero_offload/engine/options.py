"""The engine's typed options: what the caller (Trainer, planner, tests) hands the engine.

Kept apart from the engines so the planner and the sharding plan can build options without importing
an optimizer; nothing here imports torch.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any


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

    def __post_init__(self):
        _check_fields(self, {"gradient_accumulation_steps": (1, False), "max_grad_norm": (0.0, False),
                             "bucket_numel": (1, False), "tile_numel": (1, False), "dpu_warmup_steps": (0, False),
                             "num_threads": (1, True)})
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
    def fp16_enabled(self) -> bool:
        f = self.fp16
        return bool(f is not None and (f.get("enabled") if isinstance(f, dict) else f.enabled))


@dataclass(frozen=True)
class ShardOptions:
    """ZeRO stage and partitioning (``factory.choose`` picks the engine from these)."""
    stage: int = 2                          # 0: no partitioning; 1, 2: ZeRO-1/2 across ranks
    offload: bool = True                    # optimizer state and step on the CPU
    allgather_bucket_numel: int = 200_000_000
    reduce_scatter: bool = True             # False: always reduce each owner's piece to it

    def __post_init__(self):
        _check_fields(self, {"allgather_bucket_numel": (1, False)})
