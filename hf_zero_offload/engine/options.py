"""The engine's typed options: what the caller (Trainer, planner, tests) hands the engine.

Kept apart from the engines so the planner and the sharding plan can build options without importing
an optimizer; nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
