"""The optimizer engine: no transformers, no argparse."""
from .buffers import HostPlan, plan_host_memory
from .loss_scaler import LossScaler
from .offload import OffloadAdam, OffloadOptions, StepResult

__all__ = ["HostPlan", "plan_host_memory", "LossScaler", "OffloadAdam", "OffloadOptions", "StepResult"]
