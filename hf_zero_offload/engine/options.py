"""The engine's typed options: what the caller (Trainer, planner, tests) hands the engine.

Kept apart from the engines so the planner and the sharding plan can build options without importing
an optimizer; nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LossScaling:
    """fp16 loss scaling with DeepSpeed's semantics (``loss_scaler.LossScaler``); 0 = dynamic."""
    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class OffloadOptions:
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 0.0              # 0: no clipping
    fp16: LossScaling | None = None         # None: no loss scaling (a dict of LossScaling's fields is accepted)
    bucket_numel: int = 200_000_000
    tile_numel: int = 1 << 22
    pin_memory: bool = True
    dpu: bool = False
    dpu_warmup_steps: int = 40
    num_threads: int | None = None
    scatter_thread: bool | None = None      # gradient scatter on a helper thread (default: on CUDA)

    def __post_init__(self):
        if isinstance(self.fp16, dict):
            known = {f.name for f in fields(LossScaling)}
            unknown = set(self.fp16) - known
            if unknown:
                raise ValueError(f"OffloadOptions.fp16: unknown keys {sorted(unknown)} (known: {sorted(known)})")
            object.__setattr__(self, "fp16", LossScaling(**self.fp16))

    @property
    def fp16_enabled(self) -> bool:
        return self.fp16 is not None and self.fp16.enabled


@dataclass(frozen=True)
class ShardOptions:
    """ZeRO stage and partitioning (``factory.choose`` picks the engine from these)."""
    stage: int = 2                          # 0: no partitioning; 1, 2: ZeRO-1/2 across ranks
    offload: bool = True                    # optimizer state and step on the CPU
    allgather_bucket_numel: int = 200_000_000
    reduce_scatter: bool = True             # False: always reduce each owner's piece to it
