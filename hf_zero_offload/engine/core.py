"""``AdamCore``: what every engine shares, written once.

An engine is a ``torch.optim.Optimizer`` over the device parameters (LR schedulers work on its ``param_groups``) that
keeps fp32 masters and Adam moments for a *slice* [lo, hi) of the flat layout of the trainable parameters: the whole
layout for ``OffloadAdam``, one rank's shard for ``ShardedAdam``. The core owns:

- the step outline: wait for this step's gradients (their squared norm, fp64, and which params got
  one), ``decide_step`` (fp16 overflow skip, loss scale, clipping), then Adam over the slice;
- the delayed parameter update (DPU): after its warm-up the Adam pass of step k runs on a worker
  thread reading one of two gradient stores while backward k+1 fills the other; its parameters are
  published at step k+1 (or ``flush``), before anything else touches the masters;
- the Adam call on a range of the slice, ``_adam``: the one place that reads and writes moments;
- the state: ``state_meta``/``state_tensors``, one state-file format (``checkpoint``) and one checkpoint directory
  layout (``checkpoint.folder``) that any engine at any world size loads, in the mixin ``SavedState`` (saved_state.py);
- its end (``close()``, or replacement by a new engine on the same params), which releases its memory: the mixin
  ``EngineEnd`` (lifetime.py).

A subclass supplies what differs: ``_gradients()`` (how gradients arrive and are summed), ``_begin_window()`` (the
next step's gradients go to ``self.store``), ``_after_update()`` (how the updated slice reaches the device
synchronously), ``_publish_params()`` (same, for a DPU step) and ``_publish_masters()`` (the parameters set from the
masters, after loading a DPU state).
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future

import torch

from .. import ops
from ..adam.flags import listed_once
from . import param_names
from .clipping import StepClipping
from .delayed import DelayedUpdate
from .grad_hooks import ParamOwner
from .lifetime import EngineEnd
from .group_flags import check_group_flags, layout_change, torch_style_groups, value
from .moments import Moments, Q
from .loss_scaler import LossScaled, LossScaler, StepResult, decide_step, unscaled_norm
from .options import OffloadOptions
from .runs import Run, make_contiguous, flat_layout, make_runs, param_label, place_params, training_dtype
from .saved_state import SavedState, logger
from .step_guard import DeferredSigint
from .streams import Streams, make_streams
from .torch_import import TorchStateImport


class AdamCore(SavedState, TorchStateImport, ParamOwner, EngineEnd, DelayedUpdate, LossScaled, StepClipping,
               torch.optim.Optimizer):
    stage: int | None = None      # ZeRO stage (None: one process holding everything)
    _grads_from_backward = True   # gradients come from backward hooks, not from .grad at step()
    _step_supports_amp_scaling = True  # GradScaler.step() calls step() directly, which names the problem (above)
    offload: bool = True          # optimizer state and step on the CPU
    world_size, rank = 1, 0

    def __init__(self, params, *, lr: float, betas, eps: float, weight_decay: float, adamw_mode: bool,
                 param_dtype: torch.dtype | None, options: OffloadOptions, streams: Streams | None, device=None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        super().__init__(torch_style_groups(params), defaults)
        self._layout_fixed = True  # from here on add_param_group refuses (see there)
        self._lock = threading.RLock()  # held by step() and by the engine's end (lifetime.EngineEnd._end)
        param_names.check_given(self.param_groups, type(self).__name__)  # a load compares them (param_names.py)
        self.options = options
        self._check_hyper()
        self.scaler = LossScaler.from_options(options.fp16_fields)
        make_contiguous(self.param_groups)
        # per group: (param, flat offset, numel); ``_flat``: all of them in order; ``_groups``: indices
        self._slots, self.numel, self.device = flat_layout(self.param_groups, type(self).__name__, device)
        self._built_groups = [tuple(map(id, g["params"])) for g in self.param_groups]  # (group_flags.layout_change)
        self._flat = [s for g in self._slots for s in g]
        self._groups, first = [], 0
        for g in self._slots:
            self._groups.append(list(range(first, first + len(g))))
            first += len(g)
        self.param_dtype = training_dtype(param_dtype, options.fp16_enabled, [p for p, _, _ in self._flat])
        # ``streams``: injected by tests (streams.SimStreams); by default the device's own.
        self.streams = streams if streams is not None else make_streams(self.device)
        self._param_steps = torch.zeros(len(self._flat), dtype=torch.int64)  # AdamW's per-param step
        self.global_steps = 0        # step() calls, skipped ones included (the DPU warm-up counts these)
        self.needs_publish = False   # DPU: the masters are one step ahead of the device parameters
        # ... because of a step of this engine (not a loaded state that was saved so): what a close or a drop loses
        self._step_unpublished = False
        self._said_empty_step = False  # step() without any gradient is said once (step)
        self.last = StepResult(False, 0.0, self.scaler.scale)
        self._worker = self.streams.executor("hzo-dpu") if options.dpu else None
        self._pending: Future | None = None
        self._uploaded = None        # DPU: event of the worker's last upload (None: nothing to wait for)
        self._prepared = None        # this step's (sumsq, received), computed once
        self._prepared_at = None     # _arrivals() when it was: a gradient after that makes it stale
        # torch.optim's zero_grad(set_to_none=False) leaves a zero .grad on every param that had one,
        # and AdamW then steps it with a zero gradient. The engines free each .grad as they take it,
        # so they remember which params would hold one: ``_last_received`` (the last step's, until a
        # zero_grad(set_to_none=True)) and those of the window so far, folded into ``_kept_grad`` by
        # zero_grad(set_to_none=False); set_to_none=True clears both.
        self._last_received = [False] * len(self._flat)
        self._kept_grad = [False] * len(self._flat)
        self._divisor = 1            # the gradient store holds the sum over this many ranks
        self._torch_adam = False     # Adam with torch's fused kernel on the device (ZeRO without offload)
        self.uploader = None         # a ParamUploader when updated tiles go up through staging
        self.mirror = None           # the slice in the training dtype, kept equal to the masters' rounding

    def _param_label(self, p) -> str:
        """How a message names ``p``: its name where its group keeps names, and its shape."""
        group = next((g for g in self.param_groups if any(q is p for q in g["params"])), {"params": []})
        return param_label(group, p)

    def add_param_group(self, param_group: dict) -> None:
        # torch's __init__ adds the groups through here; once built, the flat layout, the arena and
        # the gradient hooks are fixed, and a group added later would silently never be stepped
        if getattr(self, "_layout_fixed", False):
            raise RuntimeError(f"{type(self).__name__}.add_param_group: the engine's flat layout of parameters is "
                               "fixed when it is built; build a new engine with every param group")
        super().add_param_group(listed_once(self.param_groups, param_group, type(self).__name__))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's meaning: the gradients of this step so far are dropped, those already
        handed to the engine during backward included, so a ``step()`` right after updates nothing.
        ``set_to_none=False``: the params that got a gradient in the last step, or in this window before
        this call, keep stepping with a zero gradient until a ``zero_grad(set_to_none=True)``, as
        torch.optim steps their zeroed ``.grad``. (On several ranks a param any rank holds a zero for
        steps: the flags join the step's one all-reduce, see ShardedAdam._global_stats.)"""
        self.check_open("zero_grad()")
        super().zero_grad(set_to_none)
        self._drain_window()  # no copy still in flight may land in the window started next
        self._zeros_kept = not set_to_none  # (what a close hands back: ParamOwner._hand_back_zero_grads)
        if set_to_none:  # torch: every .grad is None now, the last step's too
            self._kept_grad = [False] * len(self._flat)
            self._last_received = [False] * len(self._flat)
        else:  # read after the drain: the window's last gradients are counted by then
            self._kept_grad = [k or r or w for k, r, w in
                               zip(self._kept_grad, self._last_received, self._window_received())]
        self._prepared = self._clip_request = None  # (the gradients a clip_grad_norm_ was for are dropped)
        self._begin_window()

    def _window_received(self) -> list[bool]:
        """Per param: a gradient reached the engine in the current window (its ``.grad`` already freed)."""
        raise NotImplementedError

    def _stray_grad(self) -> str | None:
        """A ``.grad`` this engine would not use, where torch.optim would step its param: on a param
        frozen when the engine was built (it has no state), or, for an engine that takes gradients
        from backward (which frees each ``.grad`` as it leaves), one assigned outside backward."""
        name, trainable = type(self).__name__, {id(p) for p, _, _ in self._flat}
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if id(p) not in trainable:
                    return (f"{name} param group {i}: a {tuple(p.shape)} param has a .grad but was frozen "
                            "(requires_grad=False) when the engine was built, so it has no optimizer state and "
                            "would never be updated; build the engine after unfreezing it")
                if self._grads_from_backward:
                    return (f"{name} param group {i}: a {tuple(p.shape)} param has a .grad that the engine did not "
                            "take from backward (which frees it): one assigned by hand, or DistributedDataParallel's "
                            "(a model wrapped in DDP, or prepared by Accelerate on several processes; leave it "
                            "unwrapped: the engine reduces the gradients itself) would be ignored")
        return None

    # -- set up by the subclass once the arena exists ------------------------------------------
    def _bind_state(self, regions: dict, lo: int, hi: int) -> None:
        """The state of the slice [lo, hi) (padded regions may be longer) and its gradient stores."""
        self.lo, self.hi = lo, hi
        self.master = regions["master"]
        self.moments = Moments(regions, self.options.state_dtype, origin=lo)
        # the moment arrays (int8: the codes; their scales are in ``moments.state``)
        self.exp_avg, self.exp_avg_sq = self.moments.state["exp_avg"], self.moments.state["exp_avg_sq"]
        # DPU: two gradient stores, the CPU step reads one while the next backward fills the other
        self._stores = list(regions["grad_store"].view(2 if self.options.dpu else 1, -1).unbind(0))
        self._store_index = 0
        self.store = self._stores[0]

    @torch.no_grad()
    def _init_masters(self, index) -> None:
        """Masters from the parameters as given (fp32 for a model about to be cast: casting first and copying back
        would lose the low mantissa bits for good); then the cast, and params elsewhere moved to ``self.device``."""
        self.master.zero_()
        lo = self.lo
        for p, off, a, b in index.pieces(lo, self.hi):
            self.master[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - off:b - off])
        place_params([p for p, _, _ in self._flat], self.device, self.param_dtype)
        self._params_on = self._flat[0][0].device  # as placed ("cpu" for device="cpu:0"): _refuse_moved compares it
        self.moments.zero_()  # after: their pages resident only once params leaving for the device freed theirs
        self._sync_mirror()
        self._mark_params()

    def _sync_mirror(self) -> None:
        # Params not updated in a DPU step are published from here: it must hold every parameter,
        # rounded like the kernel rounds (nearest even).
        if self.mirror is not None:
            if self.uploader is not None:  # a synchronous step's uploads from it (or into it) may still be in flight
                self.uploader.wait_all()
            self.mirror.copy_(self.master[:self.mirror.numel()])

    # -- the step ------------------------------------------------------------------------------
    @torch._disable_dynamo  # never traced (raw pointers into the arena; CPUAdam.step says why)
    @torch.no_grad()
    def step(self, closure=None):
        with self._lock:
            return self._step(closure)

    def _step(self, closure):
        if getattr(self, "found_inf", None) is not None:  # set by torch.amp.GradScaler.step just before this call
            self._refuse_torch_grad_scaler(self._grads_from_backward)
        self.check_open()
        self._check_intact()
        self._check_hyper(self._next_steps())  # before anything moves (a scheduler may have set them)
        if problem := self._layout_problem():
            raise ValueError(problem)
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self.check_open()  # (the closure's backward may have closed it: a user's hook)
        self._adopt_written_params()
        max_norm = self._step_max_norm()  # (clipping.py: clip_grad_norm_'s for this step, or the options')
        sumsq, received = self._prepare()
        self._prepared = None
        if not any(received) and not self._said_empty_step:
            self._said_empty_step = True  # once: a loop that steps without backward does it every time
            logger.warning("hf_zero_offload: %s.step() with no gradient since the last step: nothing to apply. The "
                           "engine takes the gradients during backward and each step consumes them (as DeepSpeed's "
                           "does): unlike a torch optimizer without zero_grad(), no .grad is kept to apply again or "
                           "to add the next backward to", type(self).__name__)
        self._last_received = received
        # before anything moves: the step stays untaken (DeepSpeed stops the run there: it would skip every step)
        self.scaler.refuse_overflow_at_minimum(not math.isfinite(sumsq), self.global_steps + 1)
        with DeferredSigint():  # Ctrl-C from here lands after the state is whole (step_guard.py)
            try:
                # the count and the loss scaler move with the update: a Ctrl-C between them counted a step never
                # taken (with DPU the delayed mode then began one step early)
                self.global_steps += 1
                self.last, grad_scale = decide_step(self.scaler, sumsq, max_norm, self._divisor,
                                                    self.options.skip_nonfinite)
                self._clip_request = None
                self._update(grad_scale)
            except BaseException as e:
                # some params hold this step's update and some do not: step and save refuse until a load
                self._step_failed = (self._step_failed  # (a delayed step's failure, raised here, names itself)
                                     or f"step {self.global_steps} stopped part way ({type(e).__name__}: {e})")
                raise
        return loss

    def _update(self, grad_scale: float | None) -> None:
        """``step()``'s part that writes the state: the publish of a delayed step, the step counts, Adam."""
        # DPU: the delayed step in flight finishes and its parameters are published, whatever comes
        # next (an overflow step is synchronous, a delayed step must not overwrite staging in use;
        # sharded, the publish is a collective every rank issues here: the overflow flag is global)
        self._wait_worker()
        self._publish()
        if grad_scale is None:  # fp16 overflow (or a non-finite step, skip_nonfinite): skipped, state untouched
            self._begin_window()
            self._mark_params()
            return
        runs = make_runs(self._groups, self._flat, self._last_received, self._param_steps.tolist())
        for run in runs:
            self._param_steps[run.slots] += 1
        # snapshot of values, not of references: the LR scheduler steps right after, and torch's write a tensor lr in
        # place (fill_), which a delayed step's worker read after it (the next step's lr for its last tiles)
        hyper = [{"lr": value(g["lr"]), "betas": tuple(map(value, g["betas"])), "eps": value(g["eps"]),
                  "weight_decay": value(g["weight_decay"]), "adamw_mode": g["adamw_mode"]} for g in self.param_groups]
        if self._worker is not None and self.global_steps > self.options.dpu_warmup_steps:
            # This step's Adam runs on the worker while the device computes the next step on the
            # parameters published just now (one step behind).
            store = self.store
            self._store_index ^= 1
            self.store = self._stores[self._store_index]
            self._begin_window()
            self._pending = self._worker.submit(self._adam_pass, runs, store, grad_scale, hyper, True)
            self.needs_publish = self._step_unpublished = True
        else:
            self._adam_pass(runs, self.store, grad_scale, hyper, False)
            self._after_update()
            self._begin_window()
        self._mark_params()  # the params as this step (or the publish of the last one) left them

    def _layout_problem(self) -> str | None:  # how the groups' param lists changed since the build (None: not)
        changed = layout_change(self._built_groups, self.param_groups)
        return changed and f"{type(self).__name__}: {changed}"

    def _next_steps(self) -> list[int]:
        """Per group, the earliest step its params take next: its largest step size lr / (1 - beta1^t), which
        must fit in fp32 (a group appended by hand has none: step 1, then ``_layout_problem`` refuses it)."""
        return [ops.next_step(self._param_steps[idx].tolist()) for idx in self._groups]

    def _check_hyper(self, steps: list[int] | None = None) -> None:
        for i, g in enumerate(self.param_groups):
            try:
                check_group_flags(g, self.options.state_dtype)
                ops.check_hyperparameters(lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"],
                                          adamw=g["adamw_mode"], step=steps[i] if i < len(steps or ()) else 1)
            except ValueError as e:
                raise ValueError(f"{type(self).__name__} param group {i}: {e}") from None

    def _arrivals(self):
        """A value that changes when a gradient reaches the engine (``_prepare``'s cache key)."""
        raise NotImplementedError

    def _prepare(self) -> tuple[float, list[bool]]:
        # A backward after grad_norm() (accumulation by hand, a norm logged mid-window) adds to this
        # step's gradients: prepared again, the norm and the step see them (they were left for the next step).
        if self._prepared is not None and self._prepared_at != self._arrivals():
            self._prepared = None
        if self._prepared is None:
            stray = self._stray_grad() if self.world_size == 1 else None  # (ranks: see ShardedAdam)
            if stray is not None:
                raise ValueError(stray)
            sumsq, received = self._gradients()
            # a param holding a zeroed .grad in torch (zero_grad(set_to_none=False)) steps with a zero
            # gradient, as AdamW steps it (moments decay, weight decay applies); it was skipped
            kept = [k and not r for k, r in zip(self._kept_grad, received)]
            if any(kept):
                self._zero_grads(kept)
                received = [r or k for r, k in zip(received, kept)]
            self._prepared, self._prepared_at = (sumsq, received), self._arrivals()
        return self._prepared

    def _zero_grads(self, which: list[bool]) -> None:
        """The gradient store holds zeros for these params (which no rank sent a gradient in this
        window). Sharded: it does already (GradReducer zero-fills what a rank did not produce)."""

    def grad_norm(self) -> float:
        """The global L2 norm of this step's (unscaled, averaged) gradients before clipping: inf with an infinite
        gradient, nan with a NaN one, as torch's clip_grad_norm_ returns. Computed once per step (``step()`` reuses
        it), so the Trainer can log it first."""
        self.check_open("grad_norm()")
        return unscaled_norm(self.scaler, self._prepare()[0], self._divisor)

    def _adam_pass(self, runs: list[Run], store: torch.Tensor, grad_scale: float, hyper: list[dict],
                   delayed: bool):
        """Adam over this slice's part of every run, gradients from ``store``. With an uploader the
        slice goes tile by tile, each updated tile written in the training dtype to staging that is
        uploaded at once (CPU compute overlaps the copy), except in a delayed step of a full-size
        staging, which keeps the result until ``_publish``. Returns the event of the last upload of
        a delayed step (None otherwise)."""
        lo, hi, up = self.lo, self.hi, self.uploader
        upload = up is not None and not (delayed and up.full)
        if upload:
            up.begin()
        k = 0
        for run in runs:
            a, b = max(run.start, lo) - lo, min(run.end, hi) - lo
            if b <= a:
                continue
            h = hyper[run.group]
            if up is None:
                self._adam(a, b, run.step, h, store[a:b], grad_scale, None if self.mirror is None else self.mirror[a:b])
                continue
            t = a
            while t < b:
                e = min(b, self._tile_end(t, up.tile_numel))
                out = up.out_buffer(k, t, e)
                self._adam(t, e, run.step, h, store[t:e], grad_scale, out)
                if upload:
                    up.upload(k, out, t, e)
                k += 1
                t = e
        if not upload:
            return None
        if delayed:
            return self.streams.event(self.streams.h2d)  # the publish (main thread) waits for it
        up.finish()
        return None

    def _tile_end(self, t: int, tile: int) -> int:
        # int8 moments: tiles end on block boundaries, so a block is encoded once per step
        # (a shared block is decoded and re-encoded per part: moments.Moments.adam)
        if self.moments.state_dtype == "int8" and (t + tile) // Q * Q > t:
            return (t + tile) // Q * Q
        return t + tile

    def _adam(self, a: int, b: int, step: int, h: dict, grad: torch.Tensor, grad_scale: float,
              out: torch.Tensor | None) -> None:
        """Adam on [a, b) of the slice's state; ``out``: also the updated params in the training
        dtype. The one call site of the optimizer kernels (moment storage is decided here)."""
        master = self.master[a:b]
        if self._torch_adam:
            m, v = self.moments.state["exp_avg"][a:b], self.moments.state["exp_avg_sq"][a:b]
            fused = torch._fused_adamw_ if h["adamw_mode"] else torch._fused_adam_
            # torch.full, not torch.tensor: a fill kernel, no host-to-device copy that would wait for
            # the device's queue on every run
            fused([master], [grad], [m], [v], [], [torch.full((), float(step), device=master.device)],
                  lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1], weight_decay=h["weight_decay"],
                  eps=h["eps"], amsgrad=False, maximize=False, found_inf=None,
                  grad_scale=torch.full((), 1.0 / grad_scale, device=master.device))  # it divides
            if out is not None:
                out.copy_(master)
            return
        self.moments.adam(a, b, master, grad, out, step=step, lr=h["lr"], beta1=h["betas"][0],
                          beta2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"], adamw=h["adamw_mode"],
                          grad_scale=grad_scale, num_threads=self.options.num_threads)

    def slot_params(self) -> list[list[torch.nn.Parameter]]:
        """Trainable params per group, in flat-layout order (names for checkpoints come from these)."""
        return [[p for p, _, _ in g] for g in self._slots]

    def _partition_ranges(self) -> list[list[int]]:
        """[start, end) of every rank's slice (one process: the whole layout)."""
        return [[0, self.numel]]

    def _barrier(self) -> None:
        """All ranks reach this point (one process: nothing to wait for)."""
