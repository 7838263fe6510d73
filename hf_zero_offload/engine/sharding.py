"""ZeRO stage 1/2 across data-parallel ranks, with or without CPU offload: ``ShardedAdam``.

Every rank holds the whole model (replicated, no DDP wrapper: the engine does the only gradient
reduction) and 1/W of the optimizer: fp32 master weights, Adam moments and the reduced gradients of
its shard. One step:

1. gradients are summed across ranks so that each rank gets only its shard's sum. Stage 2: during
   backward, in buckets (post-accumulate-grad hooks; the device gradients are freed as soon as they
   are in a bucket). Stage 1: at ``step()``, from the ordinary full ``.grad`` of every rank;
2. each rank's squared norm (fp64) and its "which params got a gradient" counts are all-reduced in
   one small collective: the global norm clips like ``clip_grad_norm_``, a non-finite sum (fp16
   overflow on any rank) makes every rank skip, and the loss scaler stays identical everywhere;
3. each rank runs Adam over its shard (offload: the fused CPU kernel over a ``HostArena`` built from
   ``plan_host_memory(shard_numel)``; no offload: on the device, ``torch._fused_adamw_`` on CUDA or
   the fused CPU kernel when the device is the CPU). Gradients are averaged like DDP: the sum is
   multiplied by 1/W inside the optimizer pass (``grad_scale``), not in a separate pass;
4. the updated shards are all-gathered in buckets of ``allgather_bucket_numel`` elements and copied
   into the model's parameters.

Step 1 is ``sharding_reduce``; steps 2-4 are ``sharding_update``; checkpoints are ``sharding_ckpt``.

Delayed parameter update (offload only; OffloadAdam's schedule): after the warm-up, step 3 of step k
runs on a worker thread reading one of two gradient stores while forward/backward k+1 fill the
other, and step 4 (the all-gather, a collective every rank issues at the same point) happens at
step k+1, just before step k+1's Adam starts.

Partitioning: equal flat slices of the flat layout (trainable params in param-group order, padded to
a multiple of W). Chosen over a greedy per-parameter assignment because memory per rank is then
exactly N/W (a greedy split of a model with a few huge embeddings can be far off), all collectives
move equal pieces (reduce-scatter/all-gather need that), and a checkpoint can be re-cut for any
world size by plain offset arithmetic. The price is that a parameter may straddle two ranks; that
only matters to bookkeeping (``sharding_layout``).

Reduction (``sharding_reduce``): stage 1 reduces shard-aligned rounds of the full ``.grad``s at
``step()``; stage 2 reduces whole-parameter buckets to their owners during backward, in bucket
order, with the buckets still waiting launched at the end of every backward, so all ranks issue the
same collectives in the same order even when they used different parameters. Equal owner pieces go
through one reduce-scatter (NCCL), otherwise each piece is reduced to its owner (and always on
gloo, whose reduce-scatter is slower). Gradient accumulation: stage 1 accumulates in ``.grad`` and
communicates once per step; stage 2 reduces every micro-batch (a local accumulator would be
full-size, which is what stage 2 exists to avoid) and sums into the shard's fp32 gradient store.

Params that no rank touched in a step are skipped like ``torch.optim.AdamW`` skips them (their step
count stays); a param used on some ranks only counts as zero gradient on the others (DDP's
``find_unused_parameters`` behaviour). Limits: every rank must run the same number of backward
passes per step, each touching at least one trainable parameter; only the optimizer's parameters are broadcast from rank 0 (not frozen params left out of the
param groups, nor module buffers: seed or load those equally). Gradients are summed over ranks in
their own dtype, as DDP does (fp16: an overflow of the sum is an overflow like any other).

Launch with torchrun; the engine uses the default process group (or the one given). The caller
initialises it: ``dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")`` and,
on GPUs, ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``::

    # one node, 8 GPUs
    torchrun --standalone --nproc_per_node=8 train.py ...
    # two nodes: run on each node, with NODE_RANK 0 and 1 and MASTER_ADDR the first node's address
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \\
             --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 --rdzv_id=job1 train.py ...
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import sharding_ckpt, sharding_update
from .buffers import HostArena, HostPlan
from .loss_scaler import LossScaled, LossScaler, StepResult, decide_step, unscaled_norm
from .offload import OffloadOptions
from .runs import flat_layout, make_runs, training_dtype
from .sharding_layout import Partition
from .sharding_plan import make_plan
from .sharding_reduce import GradReducer
from .streams import Streams, make_streams

FORCE_REDUCE_SCATTER = False  # tests: run the NCCL layout's reduce-scatter on gloo too


class ShardedAdam(LossScaled, torch.optim.Optimizer):
    """Adam/AdamW over replicated parameters with the optimizer state sharded across ranks.

    The public surface is ``OffloadAdam``'s (``step``, ``zero_grad``, ``scale_loss``, ``loss_scale``,
    ``last``, ``flush``, ``close``, ``state_meta``, ``state_tensors``, ``save_checkpoint``,
    ``load_checkpoint``, ``numel``, ``plan``) plus ``memory_bytes()``. ``stage``: 1 or 2;
    ``offload``: optimizer state and step on the CPU; ``process_group``: default group when None
    (no initialised group: one process, world size 1). ``device_adam`` (no offload only): "auto"
    (torch's fused AdamW on CUDA, the fused CPU kernel when the device is the CPU), or "torch" /
    "kernel" to force one (the tests run the CUDA path's math on the CPU with "torch").
    """

    def __init__(self, params, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, param_dtype: torch.dtype | None = None,
                 options: OffloadOptions = OffloadOptions(), stage: int = 2, offload: bool = True,
                 process_group=None, allgather_bucket_numel: int = 200_000_000, device_adam: str = "auto",
                 streams: Streams | None = None):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        if options.dpu and not offload:
            raise ValueError("the delayed parameter update hides the CPU step: it needs offload=True")
        if device_adam not in ("auto", "torch", "kernel"):
            raise ValueError(f"device_adam must be 'auto', 'torch' or 'kernel', got {device_adam!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        super().__init__(params, defaults)
        self.options, self.stage, self.offload = options, stage, offload
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        elif process_group is not None:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        else:
            self.world_size, self.rank = 1, 0  # one process: same engine, no collectives
        self.scaler = LossScaler.from_fp16(**(options.fp16 or {"enabled": False}))

        per_group, self.numel, self.device = flat_layout(self.param_groups, "ShardedAdam")
        self._slots: list[tuple[torch.nn.Parameter, int, int]] = [s for g in per_group for s in g]  # flat
        self._groups: list[list[int]] = []                             # per group: flat slot indices
        for g in per_group:
            first = sum(map(len, self._groups))
            self._groups.append(list(range(first, first + len(g))))
        self._broadcast_params(allgather_bucket_numel)
        self.param_dtype = training_dtype(param_dtype, options.fp16, self._slots[0][0])

        # ``streams``: injected by tests (simstreams.SimStreams); by default the device's own. The
        # simulator covers the offload upload path; reductions stay synchronous (gloo) there.
        self.streams = streams if streams is not None else make_streams(self.device)
        cuda = self.streams.cuda
        self.partition = part = Partition(self.numel, self.world_size)
        S, W = part.shard_numel, self.world_size
        self.shard_start, self.shard_end = part.start(self.rank), part.end(self.rank)
        self._real = self.shard_end - self.shard_start
        self._torch_adam = device_adam == "torch" or (device_adam == "auto" and not offload and cuda)
        if self._torch_adam and offload:
            raise ValueError("device_adam='torch' steps on the device: it needs offload=False")
        if device_adam == "kernel" and not offload and cuda:
            raise ValueError("device_adam='kernel' is the CPU kernel: on CUDA use offload=True or device_adam='torch'")
        # reduce-scatter where the layout allows it, except on gloo (see sharding_reduce)
        use_rs = W > 1 and (FORCE_REDUCE_SCATTER or dist.get_backend(process_group) != "gloo")
        self.reducer = GradReducer(slots=self._slots, partition=part, rank=self.rank, process_group=process_group,
                                   streams=self.streams, param_dtype=self.param_dtype, stage=stage,
                                   bucket_numel=options.bucket_numel, num_threads=options.num_threads, use_rs=use_rs)
        self._index, self._slot_of = self.reducer.index, self.reducer.slot_of
        self._gchunk = max(1, min(allgather_bucket_numel // W, S))
        self.plan = make_plan(S, self.reducer.seg, self.reducer.buffer_numel, self._gchunk, W,
                              param_dtype=self.param_dtype, options=options, stage=stage, offload=offload, cuda=cuda,
                              tiled=offload and self.streams.async_copies, torch_adam=self._torch_adam)
        self._allocate(cuda)
        self._init_state()
        self.reducer.bind(self.regions["grad_buckets"], self.store, self.regions.get("grad_staging"))
        self._param_steps = [0] * len(self._slots)
        self._prepared = None
        self.global_steps = 0
        self.needs_publish = False                 # DPU: the masters are one step ahead of the parameters
        self.last = StepResult(False, 0.0, self.scaler.scale)
        self._worker = self.streams.executor("hzo-dpu") if options.dpu else None
        self._pending = None
        self._uploaded = None                      # DPU: event of the worker's last upload into shard_out

    # -- construction ----------------------------------------------------------------------------
    def _allocate(self, cuda: bool) -> None:
        host = {k: v for k, v in self.plan.regions.items() if v[2] == "host"}
        self.arena = HostArena(HostPlan(self.plan.numel, host), pin=self.options.pin_memory and cuda) if host else None
        r = dict(self.arena.regions) if self.arena else {}
        for k, (n, dt, where) in self.plan.regions.items():
            if where == "device":
                r[k] = torch.empty(n, dtype=dt, device=self.device)
        self.regions = r
        self.allocated_bytes = self.plan.bytes_by_region()  # exact sizes (the arena rounds each to a page)
        self.master, self.exp_avg, self.exp_avg_sq = r["master"], r["exp_avg"], r["exp_avg_sq"]
        # DPU: two gradient stores, the CPU step reads one while the next backward fills the other
        self._stores = list(r["grad_store"].view(2 if self.options.dpu else 1, -1).unbind(0))
        self.store = self._stores[0]
        self.shard_out = r.get("shard_out")
        self._gather_buf = r["gather_buffer"]
        if "param_staging" in r:
            self._tiles = r["param_staging"].view(2, -1)
            self._tile_events = [None, None]

    @torch.no_grad()
    def _init_state(self) -> None:
        for t in (self.master, self.exp_avg, self.exp_avg_sq, *self._stores):
            t.zero_()
        lo = self.shard_start
        for p, off, a, b in self._index.pieces(lo, self.shard_end):
            # Masters come from the parameters as given (fp32 for a model about to be cast).
            self.master[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - off:b - off])
        for p, _, _ in self._slots:
            if p.dtype != self.param_dtype:
                p.data = p.data.to(self.param_dtype)
        if self.shard_out is not None:
            self.shard_out.zero_()
            self.shard_out.copy_(self.master)  # params not updated in a step are gathered unchanged

    @torch.no_grad()
    def _broadcast_params(self, cap: int) -> None:
        """Rank 0's weights (trainable and frozen) to every rank, in coalesced chunks."""
        if self.world_size == 1:
            return
        unique = list({id(p): p for g in self.param_groups for p in g["params"]}.values())
        chunk: list[torch.Tensor] = []

        def send():
            flat = torch.cat([p.detach().reshape(-1) for p in chunk])
            dist.broadcast(flat, group=self.process_group, group_src=0)
            o = 0
            for p in chunk:
                p.data.copy_(flat[o:o + p.numel()].view_as(p))
                o += p.numel()
            chunk.clear()

        for p in unique:
            if chunk and (p.dtype != chunk[0].dtype or p.device != chunk[0].device
                          or sum(q.numel() for q in chunk) + p.numel() > cap):
                send()
            chunk.append(p)
        send()

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        total, received = self._prepare()
        self._prepared = None
        self.global_steps += 1
        # the store holds the sum over ranks: the kernel's grad_scale also averages
        self.last, grad_scale = decide_step(self.scaler, total, self.options.max_grad_norm, self.world_size)
        # DPU: the delayed step in flight finishes and its parameters are published (a collective,
        # at the same step on every rank: the overflow flag is global), whatever comes next
        self._wait_worker()
        self._publish()
        if grad_scale is None:  # every rank skips
            self.reducer.new_window()
            return loss
        runs = make_runs(self._groups, self._slots, received, self._param_steps)
        for run in runs:
            for i in run.slots:
                self._param_steps[i] += 1
        hyper = [dict(g) for g in self.param_groups]  # snapshot: the LR scheduler steps right after
        if self._worker is not None and self.global_steps > self.options.dpu_warmup_steps:
            # The schedule of OffloadAdam's DPU: this step's Adam runs on the worker while the device
            # computes the next step on the parameters published just now (one step behind).
            store = self.store
            self.store = self.reducer.store = self._stores[1] if store is self._stores[0] else self._stores[0]
            self._pending = self._worker.submit(sharding_update.adam, self, runs, grad_scale, hyper, store, False)
            self.needs_publish = True
        else:
            sharding_update.adam(self, runs, grad_scale, hyper, self.store, True)
            sharding_update.gather(self, self._gather_source())
        self.reducer.new_window()
        return loss

    def _gather_source(self) -> torch.Tensor:
        return self.shard_out if self.shard_out is not None else self.master

    def _publish(self) -> None:
        """DPU: the masters computed on the worker reach every rank's parameters (a collective:
        every rank publishes at the same step)."""
        if self.needs_publish:
            s = self.streams
            s.wait(s.compute(), self._uploaded)  # the all-gather reads what the worker uploaded
            sharding_update.gather(self, self._gather_source())
            self.needs_publish = False

    def _wait_worker(self) -> None:
        if self._pending is not None:
            self._uploaded = self._pending.result()  # re-raises a failure of the worker here
            self._pending = None

    def _prepare(self) -> tuple[float, list[bool]]:
        """Finish this step's reduction; (global sum of squares, which params any rank updated)."""
        if self._prepared is None:
            if self.stage == 1:
                self.reducer.reduce_full()
            else:
                self.reducer.drain()
                if self.reducer.micro == 0:
                    self.store.zero_()  # no backward in this window: no gradient anywhere
            stats = sharding_update.global_stats(self)
            self._prepared = (stats[0], [c > 0 for c in stats[1:]])
        return self._prepared

    def grad_norm(self) -> float:
        """Global L2 norm of this step's averaged, unscaled gradients before clipping; inf on overflow.
        Computed once per step (``step()`` reuses it), so the Trainer can log it before stepping."""
        return unscaled_norm(self.scaler, self._prepare()[0], self.world_size)

    def slot_params(self) -> list[list[torch.nn.Parameter]]:
        """Trainable params per group, in flat-layout order (names for checkpoints come from these)."""
        return [[self._slots[i][0] for i in idxs] for idxs in self._groups]

    def flush(self) -> None:
        """Finish in-flight reductions and an in-flight DPU step, and publish its parameters (end of
        training, before evaluation or a final save; every rank calls it)."""
        self.reducer.drain()
        self._wait_worker()
        self._publish()

    # -- state -----------------------------------------------------------------------------------
    def state_meta(self) -> dict:
        self._wait_worker()  # the masters must be final; the parameters may stay one step behind (DPU)
        return sharding_ckpt.state_meta(self)

    def _slot_meta(self) -> list:
        return [[[self._slots[i][1], self._slots[i][2], list(self._slots[i][0].shape)] for i in g]
                for g in self._groups]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's shard (views, no padding): the checkpoint writer streams them to disk."""
        self._wait_worker()
        n = self._real
        return {"master": self.master[:n], "exp_avg": self.exp_avg[:n], "exp_avg_sq": self.exp_avg_sq[:n]}

    def state_dict(self) -> dict:
        return {**self.state_meta(), **{k: v.clone() for k, v in self.state_tensors().items()}}

    def load_state_dict(self, state: dict) -> None:
        """Same world size only (a checkpoint directory can be re-partitioned: ``load_checkpoint``)."""
        if state.get("world_size") != self.world_size or state.get("shard_start") != self.shard_start:
            raise ValueError(f"this state is rank {state.get('rank')} of {state.get('world_size')}; this engine is "
                             f"rank {self.rank} of {self.world_size}: use save_checkpoint/load_checkpoint to "
                             "change the world size")
        self.load_state_meta(state)
        for k, dst in self.state_tensors().items():
            dst.copy_(state[k])

    def load_state_meta(self, meta: dict) -> None:
        sharding_ckpt.check_model(meta, self.numel, self._slot_meta())
        self._wait_worker()
        self._prepared = None
        sharding_ckpt.apply_meta(self, meta)

    def save_checkpoint(self, directory: str) -> None:
        """Every rank writes ``rank{r}_of_{W}.hzo`` atomically; then rank 0 writes ``meta.json``
        (the partition map) atomically, so a complete ``meta.json`` means a complete checkpoint."""
        sharding_ckpt.save(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        """Loads a checkpoint of any world size (ShardedAdam's, or OffloadAdam's ``rank0_of_1.hzo``):
        each rank reads the slices of the saved shards that overlap its own."""
        sharding_ckpt.load(self, directory)

    def publish_masters(self) -> None:
        """Set the model's parameters from the fp32 masters (after loading an OffloadAdam DPU state,
        whose masters were ahead of the saved parameters)."""
        self._wait_worker()
        src = self.master
        if self.shard_out is not None:
            self.shard_out.copy_(self.master)
            src = self.shard_out
        sharding_update.gather(self, src)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank allocated, by role (``plan`` has them by region)."""
        b = self.allocated_bytes
        get = lambda *ks: sum(b.get(k, 0) for k in ks)  # noqa: E731
        return {"optimizer_state": get("master", "exp_avg", "exp_avg_sq"),
                "grad_store": get("grad_store"),
                "grad_buffers": get("grad_buckets", "grad_staging"),
                "param_buffers": get("shard_out", "gather_buffer", "param_staging"),
                "host": self.plan.host_bytes, "device": self.plan.device_bytes}

    def close(self) -> None:
        self.reducer.close()
        self._wait_worker()
        if self._worker is not None:
            self._worker.shutdown()
        self.streams.synchronize()  # no copy may still read the arena we unpin
        if self.arena is not None:
            self.arena.close()
