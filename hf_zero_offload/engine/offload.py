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

Params without a gradient in a window are skipped like ``torch.optim.AdamW`` skips them (their own
step count does not advance). Tied parameters are one ``Parameter`` and get one master.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .. import ops
from . import checkpoint
from .buffers import HostArena, plan_host_memory, store_dtype
from .loss_scaler import LossScaled, LossScaler, StepResult, decide_step, unscaled_norm
from .pipeline import GradPipeline
from .streams import Streams, make_streams
from .runs import Run, flat_layout, make_runs, training_dtype
from .upload import ParamUploader


@dataclass(frozen=True)
class OffloadOptions:
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 0.0              # 0: no clipping
    fp16: dict | None = None                # LossScaler.from_fp16 keywords; None: no loss scaling
    bucket_numel: int = 200_000_000
    tile_numel: int = 1 << 22
    pin_memory: bool = True
    dpu: bool = False
    dpu_warmup_steps: int = 40
    num_threads: int | None = None
    scatter_thread: bool | None = None      # gradient scatter on a helper thread (default: on CUDA)


class OffloadAdam(LossScaled, torch.optim.Optimizer):
    def __init__(self, params, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, param_dtype: torch.dtype | None = None,
                 options: OffloadOptions = OffloadOptions(), streams: Streams | None = None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        super().__init__(params, defaults)
        self.options = options
        self.scaler = LossScaler.from_fp16(**(options.fp16 or {"enabled": False}))
        self._slots, self.numel, device = flat_layout(self.param_groups, "OffloadAdam")  # per group: (p, off, n)
        all_slots = [s for g in self._slots for s in g]
        self.param_dtype = training_dtype(param_dtype, options.fp16, all_slots[0][0])
        # ``streams``: injected by tests (simstreams.SimStreams); by default the device's own.
        self.streams = streams if streams is not None else make_streams(device)
        gas = options.gradient_accumulation_steps
        self.plan = plan_host_memory(
            self.numel, param_dtype=self.param_dtype, gradient_accumulation_steps=gas,
            delayed_param_update=options.dpu, bucket_numel=options.bucket_numel, tile_numel=options.tile_numel,
            max_param_numel=max(n for _, _, n in all_slots), cuda=self.streams.async_copies)
        self.arena = HostArena(self.plan, pin=options.pin_memory and self.streams.cuda)
        r = self.arena.regions
        self.master, self.exp_avg, self.exp_avg_sq = r["master"], r["exp_avg"], r["exp_avg_sq"]
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self._stores = list(r["grad_store"].view(2 if options.dpu else 1, self.numel).unbind(0))
        self._store_index = 0
        self.param_staging = r["param_staging"]
        with torch.no_grad():
            for p, off, n in all_slots:
                # Masters come from the parameters as given (fp32 for a model about to be cast):
                # casting first and copying back would lose the low mantissa bits for good.
                self.master[off:off + n].copy_(p.detach().reshape(-1))
                if p.dtype != self.param_dtype:
                    p.data = p.data.to(self.param_dtype)
        if options.dpu:
            # _publish_all uploads the whole staging: it must hold every parameter, also those that
            # have not received a gradient yet (their masters, rounded like the kernel rounds).
            self.param_staging.copy_(self.master)
        bucket_n = self.plan.regions["grad_buckets"][0] // 2
        buckets = torch.empty(2, bucket_n, dtype=self.param_dtype, device=device)
        staging = r["grad_staging"].view(2, bucket_n) if "grad_staging" in r else None
        self.pipeline = GradPipeline(all_slots, streams=self.streams, buckets=buckets, staging=staging,
                                     accumulate=store_dtype({self.param_dtype}, gas) == torch.float32,
                                     scatter_thread=options.scatter_thread)
        self.pipeline.new_window(self._stores[0])
        self._param_steps = torch.zeros(len(all_slots), dtype=torch.int64)
        self._slot_index = {off: i for i, (_, off, _) in enumerate(all_slots)}
        self._group_slots = [[self._slot_index[off] for _, off, _ in g] for g in self._slots]
        self.global_steps = 0        # step() calls, skipped ones included (the DPU warm-up counts these)
        self._worker = self.streams.executor("hzo-dpu") if options.dpu else None
        self._pending: Future | None = None
        self.needs_publish = False   # DPU: masters are ahead of the device parameters
        self.last = StepResult(False, 0.0, self.scaler.scale)
        self.uploader = ParamUploader(self.streams, all_slots, self.param_staging, full=options.dpu,
                                      tile_numel=options.tile_numel)
        self._prepared = None

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        runs, sumsq = self._prepare()
        self._prepared = None
        store = self.pipeline.store
        self.global_steps += 1
        self.last, grad_scale = decide_step(self.scaler, sumsq, self.options.max_grad_norm)
        # DPU: the delayed step in flight finishes and its parameters are published, whatever comes
        # next (an overflow step is synchronous, a delayed step must not overwrite staging in use)
        self._wait_worker()
        self._publish_all()
        if grad_scale is None:  # fp16 overflow: skipped, masters and step counts untouched
            self.pipeline.new_window(store)
            return loss
        hyper = [dict(g) for g in self.param_groups]  # snapshot: the LR scheduler steps right after
        for run in runs:
            self._param_steps[run.slots] += 1
        if self._worker is not None and self.global_steps > self.options.dpu_warmup_steps:
            next_store = self._stores[self._store_index ^ 1]
            self._store_index ^= 1
            self.pipeline.new_window(next_store)
            self._pending = self._worker.submit(self._dpu_step, runs, store, grad_scale, hyper)
            self.needs_publish = True
        else:
            self._adam_runs(runs, store, grad_scale, hyper, True)
            self.pipeline.new_window(store)
        return loss

    def _prepare(self):
        """Wait for this step's gradients; (runs, squared norm of the loss-scaled gradients)."""
        if self._prepared is None:
            self.pipeline.drain()
            runs = self._runs()
            store = self.pipeline.store
            sumsq = sum(ops.grad_norm_sq(store[r.start:r.end], num_threads=self.options.num_threads) for r in runs)
            self._prepared = (runs, sumsq)
        return self._prepared

    def grad_norm(self) -> float:
        """The global L2 norm of this step's (unscaled) gradients, before clipping; inf on overflow.
        Computed once per step (``step()`` reuses it), so the Trainer can log it before stepping."""
        return unscaled_norm(self.scaler, self._prepare()[1])

    def _runs(self) -> list[Run]:
        """Maximal runs of consecutive params of one group that all received a gradient and share a
        step count. One kernel call (tile by tile) covers a run."""
        received = self.pipeline.received
        return make_runs(self._group_slots, self.uploader.slots,
                         [off in received for _, off, _ in self.uploader.slots], self._param_steps.tolist())

    def _adam_runs(self, runs, store, grad_scale: float, hyper: list[dict], publish: bool) -> None:
        """The fused CPU Adam over each run, tile by tile. ``publish``: each updated tile goes to the
        device as soon as it is written, overlapping the next tile's compute; otherwise (a DPU step)
        the full-size staging keeps the result until ``_publish_all``."""
        up = self.uploader
        k = 0
        for run in runs:
            h = hyper[run.group]
            a = run.start
            while a < run.end:
                b = min(run.end, a + up.tile_numel)
                out = up.out_buffer(k, a, b)
                ops.adam_step(self.master[a:b], store[a:b], self.exp_avg[a:b], self.exp_avg_sq[a:b],
                              step=run.step, lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1], eps=h["eps"],
                              weight_decay=h["weight_decay"], adamw=h["adamw_mode"], grad_scale=grad_scale,
                              param_out=out, num_threads=self.options.num_threads)
                if publish:
                    up.upload(k, out, a, b)
                k += 1
                a = b
        if publish:
            up.finish()

    def _dpu_step(self, runs, store, grad_scale: float, hyper: list[dict]) -> None:
        self._adam_runs(runs, store, grad_scale, hyper, publish=False)

    def _publish_all(self) -> None:
        """DPU: the masters computed on the worker reach the device parameters."""
        if self.needs_publish:
            self.uploader.publish_all(self.numel)
            self.needs_publish = False

    def _wait_worker(self) -> None:
        if self._pending is not None:
            self._pending.result()  # re-raises a failure of the worker here
            self._pending = None

    def flush(self) -> None:
        """Finish an in-flight DPU step and publish its parameters (end of training, final save)."""
        self._wait_worker()
        self._publish_all()
        self.uploader.wait_all()

    def slot_params(self) -> list[list[torch.nn.Parameter]]:
        """Trainable params per group, in flat-layout order (names for checkpoints come from these)."""
        return [[p for p, _, _ in g] for g in self._slots]

    # -- state ---------------------------------------------------------------------------------
    def state_meta(self) -> dict:
        """Everything but the big tensors (JSON-serialisable)."""
        self._wait_worker()  # the masters must be final; the device may stay one step behind (DPU)
        return {
            "format": "hf_zero_offload.offload/1",
            "numel": self.numel,
            "param_dtype": str(self.param_dtype).replace("torch.", ""),
            "param_groups": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                             for g in self.param_groups],
            "slots": [[[off, n, list(p.shape)] for p, off, n in g] for g in self._slots],
            "param_steps": self._param_steps.tolist(),
            "loss_scaler": self.scaler.state_dict(),
            "global_steps": self.global_steps,
            "needs_publish": self.needs_publish,
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Views of the arena (no copy): the checkpoint writer streams them to disk."""
        self._wait_worker()
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def state_dict(self) -> dict:
        # Clones: torch.save of a view would write the whole arena (gradient stores included).
        return {**self.state_meta(), **{k: v.clone() for k, v in self.state_tensors().items()}}

    def load_state_dict(self, state: dict) -> None:
        self.load_state_meta(state)
        for name, dst in self.state_tensors().items():
            dst.copy_(state[name])
        self.finish_load()

    def load_state_meta(self, meta: dict) -> None:
        if meta.get("format") != "hf_zero_offload.offload/1":
            raise ValueError(f"not an hf_zero_offload offload state (format={meta.get('format')!r})")
        mine = [[[off, n, list(p.shape)] for p, off, n in g] for g in self._slots]
        if meta["numel"] != self.numel or meta["slots"] != mine:
            raise ValueError(f"optimizer state does not match this model: saved {meta['numel']} trainable elements "
                             f"in {sum(map(len, meta['slots']))} params, this model has {self.numel} in "
                             f"{sum(map(len, mine))}")
        self._wait_worker()
        self._prepared = None
        for group, saved in zip(self.param_groups, meta["param_groups"]):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
        self._param_steps.copy_(torch.tensor(meta["param_steps"], dtype=torch.int64))
        self.scaler.load_state_dict(meta["loss_scaler"])
        self.global_steps = meta["global_steps"]
        self.needs_publish = meta["needs_publish"]

    def finish_load(self) -> None:
        """After the tensors are in place: rebuild what a checkpoint does not store."""
        if self.options.dpu:
            # DPU staging is the masters rounded to the training dtype (nearest even, like the kernel).
            self.param_staging.copy_(self.master)
        elif self.needs_publish:
            # A DPU state loaded without DPU: its masters are one step ahead of the saved parameters
            # and nothing would publish them later (the staging holds two tiles, not the model).
            with torch.no_grad():
                for p, off, n in self.uploader.slots:
                    p.data.view(-1).copy_(self.master[off:off + n])  # rounded to nearest even, as the kernel
            self.needs_publish = False

    def save_checkpoint(self, directory: str) -> None:
        """Atomically write this engine's state to ``directory/rank0_of_1.hzo``."""
        checkpoint.write_state(checkpoint.rank_file(directory, 0, 1), self.state_meta(), self.state_tensors())

    def load_checkpoint(self, directory: str) -> None:
        """Load ``directory/rank0_of_1.hzo`` straight into the arena (no second copy in RAM)."""
        path = checkpoint.rank_file(directory, 0, 1)
        meta, _, _ = checkpoint.read_header(path)
        self.load_state_meta(meta)
        checkpoint.read_into(path, self.state_tensors())
        self.finish_load()

    def close(self) -> None:
        self._wait_worker()
        self.streams.synchronize()  # no copy may still read the arena we unpin
        self.pipeline.close()
        if self._worker is not None:
            self._worker.shutdown()
        self.arena.close()
