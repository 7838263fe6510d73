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

Step 1 is ``reduce.GradReducer``; the step outline, the DPU schedule, Adam (step 3) and the state
files are ``core.AdamCore``'s; steps 2 and 4 are this class's.

Delayed parameter update (offload only; OffloadAdam's schedule): after the warm-up, step 3 of step k
runs on a worker thread reading one of two gradient stores while forward/backward k+1 fill the
other, and step 4 (the all-gather, a collective every rank issues at the same point) happens at
step k+1, just before step k+1's Adam starts.

Partitioning: equal flat slices of the flat layout (trainable params in param-group order, padded to
a multiple of W). Chosen over a greedy per-parameter assignment because memory per rank is then
exactly N/W (a greedy split of a model with a few huge embeddings can be far off), all collectives
move equal pieces (reduce-scatter/all-gather need that), and a checkpoint can be re-cut for any
world size by plain offset arithmetic. The price is that a parameter may straddle two ranks; that
only matters to bookkeeping (``layout``).

Reduction (``reduce``): stage 1 reduces shard-aligned rounds of the full ``.grad``s at
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
passes per step, each touching at least one trainable parameter; only the optimizer's parameters are
broadcast from rank 0 (not frozen params left out of the param groups, nor module buffers: the
Trainer's --sharded_ddp sets those, trainer/buffer_sync.py; a loop of your own seeds or loads them
equally). Gradients are summed over ranks in
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

import os

import torch
import torch.distributed as dist

from ... import ops
from ..buffers import HostArena, HostPlan
from ..core import AdamCore
from ..lifetime import weak_label
from ..options import OffloadOptions
from ..streams import Streams
from ..upload import ParamUploader
from .agree import check_arguments, check_ranks_agree, hyper_disagreement
from .peers import PeerNotes, SaidToPeers, said
from .layout import Partition
from .plan import make_plan
from .reduce import GradReducer

FORCE_REDUCE_SCATTER = False  # tests: run the NCCL layout's reduce-scatter on gloo too
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedAdam(SaidToPeers, AdamCore):
    """Adam/AdamW over replicated parameters with the optimizer state sharded across ranks.

    The public surface is ``OffloadAdam``'s (``AdamCore``). ``stage``: 1 or 2 (0: one process, gradients taken
    from ``.grad`` at ``step()``, as stage 1); ``offload``: optimizer state and step on the CPU; ``reduce_scatter``:
    False reduces each owner's piece to it; ``process_group``: default group when None (no initialised group: one
    process, world size 1). ``device_adam`` (no offload only): "auto" (torch's fused AdamW on CUDA, the fused CPU
    kernel on the CPU), or "torch" / "kernel" to force one (tests run the CUDA path's math on the CPU with "torch").
    """
    _RELEASED = AdamCore._RELEASED + ("regions", "_gather_buf", "reducer")  # (lifetime.EngineEnd)

    def __init__(self, params, *, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, param_dtype: torch.dtype | None = None,
                 options: OffloadOptions = OffloadOptions(), stage: int = 2, offload: bool = True,
                 process_group=None, allgather_bucket_numel: int = 200_000_000, device_adam: str = "auto",
                 reduce_scatter: bool = True, streams: Streams | None = None, device=None):
        # the group first: whatever this rank refuses from here is said to the others at the agreement below (one
        # rank's bad argument or host-RAM check raised there alone; its peers waited in the gather with gloo's words)
        W, rank = 1, 0
        if dist.is_available() and dist.is_initialized():
            W, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        elif process_group is not None:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        self._peers = PeerNotes(process_group, rank, W)
        setup, failure, others = {}, None, []
        try:
            options = check_arguments(stage, offload, options, device_adam, W)  # (a dict of options: taken)
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                             param_dtype=param_dtype, options=options, streams=streams, device=device)
            self.stage, self.offload, self.process_group = stage, offload, process_group
            self.world_size, self.rank = W, rank
            setup = self._setup_description(reduce_scatter, device_adam, allgather_bucket_numel)
            tiled = self._lay_out(device_adam, reduce_scatter, allgather_bucket_numel)
            others = self._room_for_build()
        except Exception as e:  # noqa: BLE001 - raised by check_ranks_agree, after every rank has heard of it
            failure = e
            self._peers.say(f"failed to build its ShardedAdam: {said(e)}")
        for o in others:  # said before the agreement, where this rank waits if its peers are still training with them
            if isinstance(o, SaidToPeers):
                o._said_replaced("began to build")
        # every rank's setup compared, and every rank's verdict: all go on or all raise, naming the rank
        check_ranks_agree(setup, process_group, W, failure=failure)
        self._peers.forget_older()  # (every rank is here: none is still in an earlier engine's collectives)
        self._divisor = self.world_size  # the store holds the sum over ranks: grad_scale also averages
        # every check first; then an engine on these params is replaced (it publishes nothing, lifetime.py)
        with self._peers.call("the ShardedAdam's build"), self._taking_params(others):
            self._build_state(self.streams.cuda, tiled, allgather_bucket_numel)

    def _lay_out(self, device_adam: str, reduce_scatter: bool, allgather_bucket_numel: int) -> bool:
        """The partition, the reducer and the plan (no allocation, no collective); whether updates go up tiled."""
        options, offload, stage, process_group = self.options, self.offload, self.stage, self.process_group
        # The simulator (``streams``) covers the offload upload path; reductions stay synchronous
        # (gloo) there.
        cuda = self.streams.cuda
        if options.state_dtype != "fp32" and not offload:
            raise ValueError(f"state_dtype={options.state_dtype!r} (compact Adam moments) is for the CPU step: it "
                             "needs offload_optimizer.device='cpu'; without offload use state_dtype='fp32'")
        self.partition = part = Partition(self.numel, self.world_size, options.shard_align)
        S, W = part.shard_numel, self.world_size
        self._torch_adam = device_adam == "torch" or (device_adam == "auto" and not offload and cuda)
        if self._torch_adam and offload:
            raise ValueError("device_adam='torch' steps on the device: it needs offload=False")
        if device_adam == "kernel" and not offload and cuda:
            raise ValueError("device_adam='kernel' is the CPU kernel: on CUDA use offload=True or device_adam='torch'")
        # reduce-scatter where the layout allows it and the config does not turn it off, except on gloo
        # (see reduce). Stage 0 (one process) runs the stage-1 path: gradients from .grad at step().
        use_rs = W > 1 and reduce_scatter and (FORCE_REDUCE_SCATTER or dist.get_backend(process_group) != "gloo")
        self.reducer = GradReducer(slots=self._flat, partition=part, rank=self.rank, process_group=process_group,
                                   streams=self.streams, param_dtype=self.param_dtype, stage=stage,
                                   bucket_numel=options.bucket_numel, num_threads=options.num_threads, use_rs=use_rs,
                                   label=weak_label(self._param_label), who=type(self).__name__, peers=self._peers)
        self._index, self._slot_of = self.reducer.index, self.reducer.slot_of
        self._gchunk = max(1, min(allgather_bucket_numel // W, S))
        tiled = offload and self.streams.async_copies
        self.plan = make_plan(S, self.reducer.seg, self.reducer.buffer_numel, self._gchunk, W,
                              param_dtype=self.param_dtype, options=options, stage=stage, offload=offload, cuda=cuda,
                              tiled=tiled, torch_adam=self._torch_adam)
        return tiled

    # -- construction ----------------------------------------------------------------------------
    def _build_state(self, cuda: bool, tiled: bool, allgather_bucket_numel: int) -> None:
        """The arena and the buffers, bound; rank 0's weights to every rank, the masters from them."""
        r = self._allocate(cuda)
        self._bind_state(r, self.partition.start(self.rank), self.partition.end(self.rank))
        self.shard_start, self.shard_end = self.lo, self.hi
        self.mirror = r.get("shard_out")          # the updated shard in the training dtype, ready to gather
        self._gather_buf = r["gather_buffer"]
        if tiled:  # updated tiles go up through staging into the device shard
            self.uploader = ParamUploader(self.streams, [(self.mirror, 0, self.partition.shard_numel)],
                                          r["param_staging"], full=False, tile_numel=self.options.tile_numel)
        self._broadcast_params(allgather_bucket_numel)
        self._init_masters(self._index)
        with torch.no_grad():  # after the weights leaving for the device freed their pages (the host-RAM credit)
            for t in self._stores:
                t.zero_()
        self.reducer.bind(r["grad_buckets"], self.store, r.get("grad_staging"))

    def _setup_description(self, reduce_scatter: bool, device_adam: str, allgather_bucket_numel: int) -> dict:
        """What every rank must agree on (``agree.check_ranks_agree``). CPU threads, tiles, pinning and the scatter
        thread are each rank's own: they change neither the collectives nor the bits."""
        o = self.options
        d = {"stage": self.stage, "offload": self.offload, "reduce_scatter": reduce_scatter, "device_adam": device_adam,
             "allgather_bucket_numel": allgather_bucket_numel, "param_dtype": str(self.param_dtype),
             "state_dtype": o.state_dtype, "gradient_accumulation_steps": o.gradient_accumulation_steps,
             "max_grad_norm": o.max_grad_norm, "bucket_numel": o.bucket_numel, "dpu": o.dpu,
             "dpu_warmup_steps": o.dpu_warmup_steps, "fp16 loss scaling": repr(self.scaler),
             "param groups": len(self._slots)}
        for i, (g, slots) in enumerate(zip(self.param_groups, self._slots)):
            d[f"group {i} param shapes"] = tuple(tuple(p.shape) for p, _, _ in slots)
            d.update({f"group {i} {k}": float(g[k]) for k in ("lr", "eps", "weight_decay")})
            d[f"group {i} betas"] = tuple(float(b) for b in g["betas"])
            d[f"group {i} adamw_mode"] = bool(g["adamw_mode"])
        return d

    def _allocate(self, cuda: bool) -> dict:
        """The plan's regions (host RAM checked before: ``_taking_params``)."""
        host = {k: v for k, v in self.plan.regions.items() if v[2] == "host"}
        self.arena = HostArena(HostPlan(self.plan.numel, host), pin=self.options.pin_memory and cuda,
                               check_ram=False) if host else None
        r = dict(self.arena.regions) if self.arena else {}
        for k, (n, dt, where) in self.plan.regions.items():
            if where == "device":
                r[k] = torch.empty(n, dtype=dt, device=self.device)
        self.regions = r
        return r

    @torch.no_grad()
    def _broadcast_params(self, cap: int) -> None:
        """Rank 0's trainable weights to every rank, in coalesced chunks (the Trainer sets the frozen ones and the
        buffers: trainer/buffer_sync.py)."""
        if self.world_size == 1:
            return
        unique = list({id(p): p for g in self.param_groups for p in g["params"]}.values())
        chunk: list[torch.Tensor] = []
        size = 0  # the chunk's elements, kept as it grows (summed again per param: quadratic in the param count)

        def send():
            nonlocal size
            size = 0
            # params still on the CPU (moved to the engine's device by _init_masters): through the device, which
            # NCCL needs; one chunk at a time, in their own dtype (the masters are taken from these values)
            flat = torch.cat([p.detach().reshape(-1) for p in chunk]).to(self.device)
            dist.broadcast(flat, group=self.process_group, group_src=0)
            o = 0
            for p in chunk:
                p.data.copy_(flat[o:o + p.numel()].view_as(p))
                o += p.numel()
            chunk.clear()

        for p in unique:
            if chunk and (p.dtype != chunk[0].dtype or p.device != chunk[0].device or size + p.numel() > cap):
                send()
            chunk.append(p)
            size += p.numel()
        send()

    # -- what differs from the core --------------------------------------------------------------
    def _gradients(self) -> tuple[float, list[bool]]:
        """Finish this step's reduction; (global sum of squares, which params any rank updated)."""
        if self.stage != 2:
            self.reducer.reduce_full()
        else:
            self.reducer.drain()
            if self.reducer.micro == 0:
                self.store.zero_()  # no backward in this window: no gradient anywhere
            self._say_if_summed_in_16_bits(self.store, self.reducer.received)
            self.reducer.reduce_late()  # (every rank: one small all-reduce of flags)
        stats = self._global_stats()
        return stats[0], [c > 0 for c in stats[1:]]

    def _global_stats(self) -> list[float]:
        """[sum of squares of the summed gradient, then per param: ranks that produced a gradient],
        all-reduced in one small collective."""
        real = self.store[:self.hi - self.lo]
        if real.device.type == "cpu":
            sq = torch.tensor([ops.grad_norm_sq(real, num_threads=self.options.num_threads)], dtype=torch.float64)
        else:
            sq = torch.linalg.vector_norm(real, dtype=torch.float64).square().reshape(1)
        # a param this rank holds a zeroed .grad for (zero_grad(set_to_none=False)) counts as received: on
        # every rank alike after the sum, so all step it with the zero gradient the store holds for it
        counts = torch.tensor([r + k for r, k in zip(self.reducer.received, self._kept_grad)], dtype=torch.float64)
        # last: ranks holding a .grad the engine would ignore (core._stray_grad), so that every rank
        # raises after this collective rather than one rank alone before it (the others would hang)
        stray = self._stray_grad() if self.world_size > 1 else None
        stats = torch.cat([sq.to(self.device), counts.to(self.device),
                           torch.tensor([float(stray is not None)], dtype=torch.float64, device=self.device)])
        if self.world_size > 1:
            dist.all_reduce(stats, group=self.process_group)
        if stats[-1] > 0:
            raise ValueError(stray or f"{type(self).__name__}: another rank holds a .grad the engine would ignore "
                             "(see its error)")
        return stats[:-1].tolist()

    def _check_hyper(self, steps: list[int] | None = None) -> None:
        # several ranks, once built: at every step() (every rank calls it, also after grad_norm()), each rank's verdict
        # and values in one collective, so that all raise together and none steps its shard with a lr of its own
        if self.world_size == 1 or not hasattr(self, "reducer"):
            return super()._check_hyper(steps)
        name = type(self).__name__
        if differs := hyper_disagreement(self.param_groups, len(self._built_groups), self.process_group, self.device,
                                         self.global_steps + 1, self._hyper_problem(steps)):
            raise ValueError(differs if differs.startswith(name) else f"{name}: {differs}")

    def _hyper_problem(self, steps: list[int] | None) -> str | None:
        name = type(self).__name__
        try:
            if problem := self._layout_problem():  # (step() names it on one rank)
                return problem
            super()._check_hyper(steps)
        except Exception as e:  # noqa: BLE001 - said on every rank (a key deleted from a group: a KeyError)
            return str(e) if str(e).startswith(name) else f"{name}: {type(e).__name__}: {e}"
        return None

    def _hooks(self):
        reducer = getattr(self, "reducer", None)
        return reducer.hooks if reducer is not None else None

    def _begin_window(self) -> None:
        self.reducer.store = self.store
        self.reducer.new_window()

    def _drain_window(self) -> None:
        self.reducer.drain()

    def _arrivals(self):
        # stage 2: backward passes taken; stages 0 and 1 take .grad at step() and free it
        if self.stage == 2:
            return self.reducer.micro
        return sum(p.grad is not None for p, _, _ in self._flat)

    def _window_received(self) -> list[bool]:
        # stages 0 and 1 read .grad at step(): a zeroed one is still there and counted then
        return [c > 0 for c in self.reducer.received] if self.stage == 2 else [False] * len(self._flat)

    @property
    def _grads_from_backward(self) -> bool:
        return self.stage == 2  # stages 0 and 1 read .grad at step()

    def _after_update(self) -> None:
        self._gather(self._gather_source())

    def _gather_source(self) -> torch.Tensor:
        return self.mirror if self.mirror is not None else self.master

    def _publish_params(self) -> None:
        """The masters computed on the worker reach every rank's parameters (a collective: every
        rank publishes at the same step)."""
        s = self.streams
        s.wait(s.compute(), self._uploaded)  # the all-gather reads what the worker uploaded
        self._gather(self._gather_source())

    def _publish_masters(self) -> None:
        self._gather(self._gather_source())  # the mirror was set from the masters by the load

    @torch.no_grad()
    def _gather(self, src: torch.Tensor) -> None:
        """Every rank's updated shard into the model's parameters, ``allgather_bucket_numel`` at a time."""
        W, S, g, N = self.world_size, self.partition.shard_numel, self._gchunk, self.numel
        if W == 1:
            self._write_params(0, N, src[:N])
            return
        for k0 in range(0, S, g):
            gk = min(g, S - k0)
            out = self._gather_buf[:W * gk]
            # Reusing ``out``: a collective starts after the work already queued on the current
            # stream, so the previous round's copies into the params have read it by then.
            _all_gather(out, src[k0:k0 + gk], group=self.process_group)
            for r in range(W):
                a = r * S + k0
                b = min(a + gk, N)
                if b > a:
                    self._write_params(a, b, out[r * gk:r * gk + b - a])

    def _write_params(self, a: int, b: int, src: torch.Tensor) -> None:
        for p, off, lo, hi in self._index.pieces(a, b):
            p.data.view(-1)[lo - off:hi - off].copy_(src[lo - a:hi - a])

    def _partition_ranges(self) -> list[list[int]]:
        return self.partition.ranges()

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.process_group)

    def _shared_token(self) -> str:
        if self.world_size == 1:
            return super()._shared_token()
        # rank 0's draw, summed with the others' zeros: every rank calls save_checkpoint, so every rank is here
        mine = int.from_bytes(os.urandom(7), "little") if self.rank == 0 else 0
        token = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(token, group=self.process_group)
        return f"{int(token.item()):014x}"

    def _ranks_that_failed(self, failed: bool) -> list[int]:
        if self.world_size == 1:
            return super()._ranks_that_failed(failed)
        # every rank calls load_checkpoint, so every rank reaches this gather, failed or not
        flags = torch.tensor([int(failed)], dtype=torch.int32, device=self.device)
        out = [torch.zeros_like(flags) for _ in range(self.world_size)]
        dist.all_gather(out, flags, group=self.process_group)
        return [r for r, f in enumerate(out) if int(f.item())]

    def flush(self) -> None:
        """Also finishes in-flight reductions (every rank calls it)."""
        self.check_open("flush()")
        with self._said("flush()"):
            self.reducer.drain()
            super().flush()

    def _stop_helpers(self, drain: bool) -> None:
        # a close drains what is in flight; a replacement only stops taking gradients (no wait on a collective
        # whose peers may never join it: replacement happens at a time that differs between ranks)
        if (reducer := getattr(self, "reducer", None)) is not None:
            reducer.close() if drain else reducer.stop()
