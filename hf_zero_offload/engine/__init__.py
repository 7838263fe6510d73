"""The optimizer engine: no transformers, no argparse, no config (see docs/ARCHITECTURE.md)."""
from .buffers import HostPlan, plan_host_memory
from .loss_scaler import LossScaleAtMinimum, LossScaler, StepResult
from .offload import OffloadAdam
from .options import OffloadOptions, ShardOptions
from .sharded import ShardedAdam

__all__ = ["HostPlan", "plan_host_memory", "LossScaleAtMinimum", "LossScaler", "OffloadAdam", "OffloadOptions",
           "ShardOptions", "ShardedAdam", "StepResult"]
