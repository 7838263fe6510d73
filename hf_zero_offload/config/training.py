"""The frozen dataclasses a ds_config resolves to (:class:`TrainingConfig` and its parts), and :class:`ArgsView`,
the TrainingArguments values the resolution reads. Stdlib only: no torch, no transformers.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

DEFAULT_BUCKET_SIZE = 500_000_000


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0  # 0 = dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "AdamW"  # "Adam" | "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True  # decoupled weight decay; always True for "AdamW"


@dataclass(frozen=True)
class SchedulerConfig:
    type: str = "WarmupLR"  # "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR"
    warmup_min_lr: float = 0.0  # the two LRs: WarmupLR / WarmupDecayLR (WarmupCosineLR peaks at the optimizer's lr)
    warmup_max_lr: float = 1e-3
    warmup_num_steps: int = 1000
    warmup_type: str = "log"  # "log" | "linear"
    total_num_steps: int | None = None  # WarmupDecayLR and WarmupCosineLR
    warmup_min_ratio: float = 0.0  # the two ratios (of each param group's lr): WarmupCosineLR only
    cos_min_ratio: float = 1e-4


@dataclass(frozen=True)
class DPUConfig:
    enabled: bool = False
    warmup_steps: int = 40


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0
    offload: bool = False
    pin_memory: bool = True
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = DEFAULT_BUCKET_SIZE
    allgather_partitions: bool = True
    allgather_bucket_size: int = DEFAULT_BUCKET_SIZE
    round_robin_gradients: bool = False
    delayed_param_update: DPUConfig = field(default_factory=DPUConfig)
    state_dtype: str = "fp32"  # offload_optimizer.state_dtype: the Adam moments on the host
    cpu_threads: int | None = None  # offload_optimizer.cpu_threads; None ("auto"): engine_setup.step_threads


@dataclass(frozen=True)
class TrainingConfig:
    train_batch_size: int = 1
    train_micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0  # 0 = off (DeepSpeed's default)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: bool = False
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    source: str = "<dict>"
    grad_accum_fp32: bool = False  # data_types.grad_accum_dtype "fp32" asked for (the engines sum in fp32, ZeRO-1 not)
    check_grad_overflow: bool = False  # bf16 training with bf16.check_grad_overflow: a non-finite step is skipped

    def to_dict(self) -> dict:
        """Field names as in the dataclasses; JSON-serialisable (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict) -> "TrainingConfig":
        """Inverse of :meth:`to_dict` (e.g. for checkpoint metadata)."""
        d = dict(d)
        d["fp16"] = FP16Config(**d["fp16"])
        if d.get("optimizer") is not None:
            d["optimizer"] = OptimizerConfig(**{**d["optimizer"], "betas": tuple(d["optimizer"]["betas"])})
        if d.get("scheduler") is not None:
            d["scheduler"] = SchedulerConfig(**d["scheduler"])
        zero = dict(d["zero"])
        zero["delayed_param_update"] = DPUConfig(**zero["delayed_param_update"])
        d["zero"] = ZeroConfig(**zero)
        return cls(**d)


@dataclass(frozen=True)
class ArgsView:
    """Plain values from TrainingArguments (built by the Trainer integration); defaults are transformers'."""

    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    max_grad_norm: float = 1.0
    learning_rate: float = 5e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0  # already computed (e.g. from warmup_ratio)
    max_steps: int | None = None  # total optimizer steps, when known
    max_steps_placeholder: bool = False  # max_steps stands in for a count not known yet (at __init__): no rule reads it
    fp16: bool = False
    bf16: bool = False
    hidden_size: int | None = None  # model.config.hidden_size / d_model
    lr_scheduler_type: str = "linear"  # the Trainer's schedule, which a "scheduler" block replaces
    sharded_ddp: bool = False  # --sharded_ddp: partitioning asked for (a stage 0 in the file contradicts it)

