"""ZeRO stage 1/2 across data-parallel ranks: the optimizer (``optimizer.ShardedAdam``), its gradient
reduction (``reduce``), the partition and bucket arithmetic (``layout``) and its memory plan (``plan``)."""
from .optimizer import ShardedAdam

__all__ = ["ShardedAdam"]
