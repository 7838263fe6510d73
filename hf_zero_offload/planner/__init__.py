"""Memory planner: model-state bytes per configuration and the largest batch that fits a GPU.

``hf-zero-offload estimate --model CONFIG --gpus N`` (or ``plan(...)`` / ``print_plan(...)``) prints one
row per training configuration, per rank:

- model states on the device and on the host: one documented function per configuration below
  (``states_*``); every row our engines run calls the engine's own plan (``plan_host_memory`` for
  ``OffloadAdam``, ``sharded.plan.plan_for`` for ``ShardedAdam``), so the planner and the engines
  cannot disagree about what they allocate (tested region by region on 2 ranks);
- activations: measured, not guessed, by tracing one forward + backward of the model built on the
  meta device (``planner.trace``), in the dtype the configuration trains in;
- with ``--gradient-checkpointing`` the traced step is the checkpointed one (Transformers'
  non-reentrant checkpointing of each block: the forward keeps block inputs, the backward recomputes);
- the largest batch whose peak fits ``--gpu-mem-gib`` minus a safety margin of
  ``SAFETY_BYTES`` (0.5 GiB: CUDA context outside torch's accounting, cuBLAS/cuDNN workspaces) plus
  ``SAFETY_FRACTION`` (5 % of the card: caching-allocator rounding and fragmentation).

Not modelled: optimizer-step temporaries (the step runs after backward freed the activations, and
fused/foreach AdamW temporaries are far below the activation peak), eval/generation (beam search),
label smoothing computed outside the model, frozen parameters (every
parameter counts as trainable), dynamic padding (``--seq-len``/``--tgt-len`` are the padded lengths:
with padding to the longest in the batch, real batches are shorter and more samples fit).
"""
from .plan import (GiB, SAFETY_BYTES, SAFETY_FRACTION, EngineSettings, Plan, Row, RowSpec, _max_batch,  # noqa: F401
                   device_budget, plan, row_specs, row_states)
from .report import cuda_memory_gib, format_plan, print_plan  # noqa: F401
from .cli import add_arguments, main  # noqa: F401
