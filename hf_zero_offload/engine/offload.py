"""The ZeRO-Offload optimizer: fp32 master weights and Adam moments on the CPU.

``OffloadAdam`` is a ``torch.optim.Optimizer`` over the device parameters (so LR schedulers work on
its ``param_groups``). The device keeps only the parameters, in the training dtype, and two gradient
buckets; gradients stream down during backward (``pipeline.GradPipeline``), and ``step()`` runs:

1. wait for the last gradient copy; one fused pass per run of parameters gives the squared norm in
   fp64, whose finiteness is the overflow flag;
2. fp16 overflow: skip (masters, moments and step counts untouched), report it, lower the scale;
   with DPU the step is synchronous: the delayed step in flight finishes and is published first;
3. ``grad_scale = clip_coef / loss_scale`` and the fused CPU Adam over the flat arena, tile by tile,
   writing each updated tile in the training dtype to staging that is copied to the device at once,
   so CPU compute overlaps the transfer;
4. with the delayed parameter update (DPU) after its warm-up, step 3 runs on a worker thread while
   the device computes the next step on the previous parameters.

The outline, the DPU schedule, the Adam call and the state are ``core.AdamCore``'s; this class adds
how gradients arrive (``pipeline.GradPipeline``) and how the updated parameters go up
(``upload.ParamUploader`` straight into the parameters).

Params without a gradient in a window are skipped like ``torch.optim.AdamW`` skips them (their own
step count does not advance). Tied parameters are one ``Parameter`` and get one master.
"""
from __future__ import annotations

import logging

import torch

from .. import ops
from .buffers import HostArena, plan_host_memory
from .core import AdamCore
from .lifetime import weak_label
from .options import OffloadOptions, as_options
from .pipeline import GradPipeline
from .runs import FlatIndex, make_runs
from .streams import Streams
from .upload import ParamUploader

logger = logging.getLogger("hf_zero_offload")


class OffloadAdam(AdamCore):
    stage = 2  # one process; gradients leave the device during backward, as in ZeRO-2
    _RELEASED = AdamCore._RELEASED + ("param_staging", "pipeline")  # (lifetime.EngineEnd)

    def __init__(self, params, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, param_dtype: torch.dtype | None = None,
                 options: OffloadOptions = OffloadOptions(), streams: Streams | None = None, device=None):
        """``device``: where the params train (default: where they are); see ``AdamCore._init_masters``.
        ``options``: an ``OffloadOptions`` or a dict of its fields."""
        options = as_options(options, "OffloadAdam")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                         param_dtype=param_dtype, options=options, streams=streams, device=device)
        self._say_if_ranks_train_alone()
        gas = options.gradient_accumulation_steps
        self.plan = plan_host_memory(
            self.numel, param_dtype=self.param_dtype, gradient_accumulation_steps=gas,
            delayed_param_update=options.dpu, bucket_numel=options.bucket_numel, tile_numel=options.tile_numel,
            max_param_numel=max(n for _, _, n in self._flat), cuda=self.streams.async_copies,
            state_dtype=options.state_dtype)
        bucket_n = self.plan.regions["grad_buckets"][0] // 2
        # every check first (host RAM: the arena, and on a CPU run the gradient buckets); then an engine that held
        # these params is replaced, its memory released before this one allocates (lifetime.py)
        with self._taking_params():
            self._allocate(bucket_n)

    def _allocate(self, bucket_n: int) -> None:
        """The arena and the buffers, bound; the masters from the params."""
        options = self.options
        self.arena = HostArena(self.plan, pin=options.pin_memory and self.streams.cuda, check_ram=False)
        r = self.arena.regions
        self._bind_state(r, 0, self.numel)
        self.param_staging = r["param_staging"]
        # DPU: the full-size staging is published whole, so it mirrors every master
        self.mirror = self.param_staging if options.dpu else None
        buckets = torch.empty(2, bucket_n, dtype=self.param_dtype, device=self.device)
        self._init_masters(FlatIndex(self._flat))
        staging = r["grad_staging"].view(2, bucket_n) if "grad_staging" in r else None
        self.pipeline = GradPipeline(self._flat, streams=self.streams, buckets=buckets, staging=staging,
                                     scatter_thread=options.scatter_thread, num_threads=options.num_threads,
                                     label=weak_label(self._param_label), who=type(self).__name__)
        self._begin_window()
        self.uploader = ParamUploader(self.streams, self._flat, self.param_staging, full=options.dpu,
                                      tile_numel=options.tile_numel)

    @staticmethod
    def _say_if_ranks_train_alone() -> None:
        """Under a process group of several ranks each OffloadAdam steps its own rank's gradients: in a data-parallel
        loop the copies drift apart without a word (an outside probe: 0.076 apart after a few steps). Said, not
        refused: ranks that each own other params (pipeline or model parallelism) use it rightly."""
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            logger.warning("hf_zero_offload: OffloadAdam is one process's engine and averages no gradient across the "
                           "%d ranks of this process group: for data parallelism use ShardedAdam(..., offload=True) "
                           "(ZeRO-2 with offload); ranks that each train "
                           "their own params may ignore this", dist.get_world_size())

    # -- what differs from the core ------------------------------------------------------------
    def _gradients(self) -> tuple[float, list[bool]]:
        """Wait for this step's gradients; (squared norm of the loss-scaled gradients, which params
        received one). The norm sums one fused pass per run of parameters, in fp64."""
        self.pipeline.drain()
        self._say_if_summed_in_16_bits(self.pipeline.store, self.pipeline.received)
        received = self._window_received()
        runs = make_runs(self._groups, self._flat, received, self._param_steps.tolist())
        store = self.pipeline.store
        sumsq = sum(ops.grad_norm_sq(store[r.start:r.end], num_threads=self.options.num_threads) for r in runs)
        return sumsq, received

    def _arrivals(self) -> int:
        return self.pipeline.arrivals

    def _window_received(self) -> list[bool]:
        return self.pipeline.taken()

    @torch.no_grad()
    def _zero_grads(self, which: list[bool]) -> None:
        # the pipeline writes only the params it received: the rest of the store may hold an
        # earlier window's gradients
        for (_, off, n), w in zip(self._flat, which):
            if w:
                self.pipeline.store[off:off + n].zero_()

    def _hooks(self):
        pipeline = getattr(self, "pipeline", None)
        return pipeline.hooks if pipeline is not None else None

    def _begin_window(self) -> None:
        self.pipeline.new_window(self.store)

    def _drain_window(self) -> None:
        self.pipeline.drain()

    def _after_update(self) -> None:
        """The tiles went up during the Adam pass."""

    def _publish_params(self) -> None:
        self.uploader.publish_all(self.numel)

    @torch.no_grad()
    def _publish_masters(self) -> None:
        # A DPU state loaded without DPU: its masters are one step ahead of the saved parameters and
        # nothing would publish them later (the staging holds two tiles, not the model).
        for p, off, n in self._flat:
            p.data.view(-1).copy_(self.master[off:off + n])  # rounded to nearest even, as the kernel

    def _stop_helpers(self, drain: bool) -> None:
        if getattr(self, "pipeline", None) is not None:
            self.pipeline.close()  # (its scatter thread's last copy into the store lands first)
