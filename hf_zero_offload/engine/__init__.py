"""The optimizer engine: no transformers, no argparse."""
from .buffers import HostPlan, plan_host_memory
from .loss_scaler import LossScaler, StepResult
from .offload import OffloadAdam, OffloadOptions

__all__ = ["HostPlan", "plan_host_memory", "LossScaler", "OffloadAdam", "OffloadOptions", "StepResult"]
