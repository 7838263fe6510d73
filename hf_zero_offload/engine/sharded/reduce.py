"""Gradient reduction for ``ShardedAdam``: every rank ends up with the sum, over ranks, of its shard.

Stage 2 (during backward): buckets hold whole parameters in backward order (``make_buckets``). A
post-accumulate-grad hook marks a parameter ready; the next bucket in index order is launched once
all its parameters are ready: their gradients are copied into a bucket buffer (two alternate) and
freed, and each owner's piece of the bucket is summed onto its owner. A callback queued on the
autograd engine launches, at the end of every backward, the buckets still waiting (zero-filled
where a parameter got no gradient on this rank). So every rank issues the same collectives in the
same order, once per backward, whatever parameters it used; micro-batches of one step are summed
into the store (first backward overwrites).

Stage 1 (at ``step()``): round k takes element range k of every rank's shard from the full
``.grad``s, so the round buffer is W equal owner pieces.

A buffer whose owner pieces are equal goes through one reduce-scatter, except on gloo, where (torch
2.13, 2 ranks) reduce-scatter took 1.7x the time of reducing each piece to its owner; otherwise
each owner's piece goes to it with ``dist.reduce`` (the same bytes per rank as a reduce-scatter).

On CUDA the collectives run asynchronously from a side stream and a buffer's result is delivered
to the store when the buffer is needed again (or at ``step()``); on the CPU everything is
synchronous, which is what the tests run. With offload that delivery (the copy down through the
one pinned staging and the CPU's accumulation into the store) runs in the backward hook that needs
the buffer, so backward waits for it bucket by bucket (an outside audit, session 29); the one-process
engine hands the same work to a helper thread (``pipeline.GradPipeline``). Not changed while no two
GPUs can run this path.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..buffers import write_grad
from ..grad_hooks import GradHooks, check_dense
from ..runs import FlatIndex, grad_dtype_error
from ..streams import Streams
from .layout import Partition, make_buckets

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def buffer_layout(slots: list, partition: Partition, stage: int, bucket_numel: int, use_rs: bool):
    """(stage-2 buckets in launch order, ``seg``, device buffer elements). Stage 2: two alternating
    bucket buffers of the largest bucket (``seg``). Stage 1: rounds of ``seg`` elements per rank (the
    round input for every rank, plus its output when reduce-scattering). Only the (offset, numel) of
    the slots matter: the planner calls this without a model."""
    W, S = partition.world_size, partition.shard_numel
    if stage == 2:
        cap = max(min(bucket_numel, partition.padded_numel), max(n for _, _, n in slots))
        buckets = make_buckets(slots, cap, partition.padded_numel)
        seg = max(b.numel for b in buckets)
        return buckets, seg, 2 * seg
    seg = max(1, min(bucket_numel // W, S))
    return [], seg, (W + use_rs) * seg


class GradReducer:
    def __init__(self, *, slots: list, partition: Partition, rank: int, process_group, streams: Streams,
                 param_dtype: torch.dtype, stage: int, bucket_numel: int, num_threads: int | None, use_rs: bool,
                 label=lambda p: f"of shape {tuple(p.shape)}", who: str = "the engine", peers=None):
        self.slots, self.partition, self.rank = slots, partition, rank
        self._peers = peers  # (peers.PeerNotes) a collective failure in backward names the peer that left
        self._label, self._who = label, who  # how an error names a param (the engine's param_label) and the engine
        self.world_size = partition.world_size
        self.process_group, self.streams, self.param_dtype = process_group, streams, param_dtype
        self.stage, self.num_threads, self.use_rs = stage, num_threads, use_rs
        self.comm_stream = torch.cuda.Stream(device=streams.device) if streams.cuda else None
        self.index = FlatIndex(slots)
        self.slot_of = {id(p): i for i, (p, _, _) in enumerate(slots)}
        # where this rank's piece of the *padded* layout begins (segments are cut in it); not
        # ``partition.start``, which clamps to the model's end: a rank whose shard is all padding
        # (int8 blocks of 256 on a small model, or more ranks than elements) delivered its piece at
        # the clamped offset, past its store's end, and failed inside backward with its peers waiting
        self.shard_start = rank * partition.shard_numel
        self.buckets, self.seg, self.buffer_numel = buffer_layout(slots, partition, stage, bucket_numel, use_rs)
        self.chunk = self.seg  # stage 1: elements per rank and round
        self.bucket_of = [0] * len(slots)
        for k, b in enumerate(self.buckets):
            for i in b.slots:
                self.bucket_of[i] = k
        self.received = [0] * len(slots)  # gradients received in this window, per param (this rank)
        self._late = {}
        self.micro = 0                    # stage 2: backward passes reduced in this window
        self._full_rounds = 0
        self._buf_slot = 0
        self._inflight = [None, None]     # CUDA: per buffer, the reduction not yet delivered
        self.hooks: GradHooks | None = None  # stage 2: set by ``bind``
        self._stopped = False  # its engine ended (``stop``)
        self._reset_backward()

    def bind(self, buffer: torch.Tensor, store: torch.Tensor, staging: torch.Tensor | None) -> None:
        """``buffer``: ``buffer_numel`` elements on the device; ``store``: this rank's flat gradient
        shard; ``staging``: pinned host memory for ``seg`` elements (offload on CUDA), else None."""
        self.store, self.staging = store, staging
        if self.stage == 2:
            self.bucket_bufs = buffer.view(2, -1)
            self.hooks = GradHooks([p for p, _, _ in self.slots], self._on_grad, label=self._label, who=self._who)
        else:
            W, c = self.world_size, self.chunk
            self.round_in, self.round_out = buffer[:W * c], (buffer[W * c:] if self.use_rs else None)

    def new_window(self) -> None:
        self.received = [0] * len(self.slots)
        self.micro = 0
        self._full_rounds = 0  # stage 1: reduce_full calls in this window (a second one adds to the first)
        self._late = {}  # slot -> the gradient pieces that came after its bucket was reduced (this window)
        # a backward that raised part way (an OOM) never ran its end callback: its marks must not
        # carry over (the next backward would queue no callback and launch no bucket)
        self._reset_backward()

    def close(self) -> None:
        self.drain()
        self.stop()

    def stop(self) -> None:
        """Its engine ended: no gradient taken, no reduction launched from here (no wait either: a replacement's peers
        may never join one). An end of backward queued before, by a close mid-backward (a user's hook), launched the
        buckets still waiting: a collective of an ended engine, which took the gradients the model keeps now."""
        self._stopped = True
        if self.hooks is not None:
            self.hooks.detach()

    # -- stage 2: backward side ------------------------------------------------------------------
    def _reset_backward(self) -> None:
        self._in_backward = False
        self._next = 0
        self._hooked = [False] * len(self.slots)
        self._ready = [0] * len(self.buckets)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad is None:
            return
        if p.grad.dtype != self.param_dtype:
            raise grad_dtype_error(self._label(p), p.grad.dtype, self.param_dtype, p)
        i = self.slot_of[id(p)]
        if not self._in_backward:
            self._in_backward = True
            # Runs once the whole backward is done: launches the buckets still waiting.
            Variable._execution_engine.queue_callback(self._end_backward)
        if self._hooked[i]:
            # A second piece of this backward's gradient (a weight used in two segments checkpointed with
            # use_reentrant=True: each segment's backward accumulates into .grad on its own). Before its bucket went,
            # .grad holds the sum; after, the piece is kept here and reduced at the step (``reduce_late``): whether
            # a bucket had gone is this rank's own (a param unused here holds it back), so no collective now.
            if self.bucket_of[i] < self._next:
                g = p.grad.reshape(-1)
                p.grad = None
                self._late[i] = self._late[i].add_(g) if i in self._late else g
            return
        self._hooked[i] = True
        self._ready[self.bucket_of[i]] += 1
        # Strictly in bucket order, so every rank issues the same collectives in the same order.
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].slots):
            self._launch(self._next)
            self._next += 1

    def _end_backward(self) -> None:
        if self._stopped:
            return self._reset_backward()
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._reset_backward()
        self.micro += 1

    @torch.no_grad()
    def reduce_late(self) -> None:
        """At the step, after ``drain``: the late pieces of every bucket that has one on any rank, reduced and added
        to the store. One small all-reduce of per-bucket flags first, so every rank issues the same reductions."""
        if self.world_size == 1 and not self._late:
            return  # nothing to agree on, nothing late: no tensor, no device sync on the step's path
        late = {self.bucket_of[i] for i in self._late}
        flags = torch.tensor([float(k in late) for k in range(len(self.buckets))], device=self.bucket_bufs.device)
        if self.world_size > 1:
            dist.all_reduce(flags, group=self.process_group)
        for k in flags.nonzero().flatten().tolist():
            self._launch(k, late=True)
        self.drain()
        self._late = {}

    @torch.no_grad()
    def _launch(self, k: int, late: bool = False) -> None:
        """Reduce bucket ``k``'s gradients; ``late``: the pieces kept in ``_late``, added to what it delivered."""
        b = self.buckets[k]
        j = self._buf_slot
        self._buf_slot ^= 1
        self._retire(j)  # CUDA: this buffer's previous reduction has been read and delivered
        buf = self.bucket_bufs[j, :b.numel]
        for i in b.slots:
            p, off, n = self.slots[i]
            dst = buf[off - b.start:off - b.start + n]
            if late:
                if i in self._late:
                    dst.copy_(self._late[i])
                else:
                    dst.zero_()
            elif self._hooked[i]:
                dst.copy_(p.grad.reshape(-1))
                # Freed on the compute stream right after the copy that reads it was queued there:
                # the caching allocator reuses memory in stream order, so the copy reads valid data.
                p.grad = None
                self.received[i] += 1
            else:
                dst.zero_()  # no gradient on this rank in this backward: contributes zero
        numel = self.partition.numel
        if b.end > numel:
            buf[numel - b.start:].zero_()
        segs = self.partition.segments(b.start, b.end)
        mine = [lo for r, lo, _ in segs if r == self.rank]
        try:
            self._reduce(buf, [(r, lo - b.start, hi - b.start) for r, lo, hi in segs],
                         mine[0] - self.shard_start if mine else 0, j, first=self.micro == 0 and not late)
        except Exception as e:
            named = self._peers.named(e, "the gradient reduction of a backward") if self._peers is not None else None
            if named is not None:
                raise named from e
            raise

    # -- stage 1 -----------------------------------------------------------------------------------
    @torch.no_grad()
    def reduce_full(self) -> None:
        """Round k: element range k of every rank's shard, from the full ``.grad``s."""
        for p, _, _ in self.slots:
            check_dense(p)
        W, S, c, N = self.world_size, self.partition.shard_numel, self.chunk, self.partition.numel
        for k0 in range(0, S, c):
            ck = min(c, S - k0)
            x = self.round_in[:W * ck]
            for r in range(W):
                a = r * S + k0
                piece = x[r * ck:(r + 1) * ck]
                for p, off, lo, hi in self.index.pieces(a, min(a + ck, N)):
                    if p.grad is None:
                        piece[lo - a:hi - a].zero_()
                    else:
                        piece[lo - a:hi - a].copy_(p.grad.reshape(-1)[lo - off:hi - off])
                if a + ck > N:
                    piece[max(N - a, 0):].zero_()
            self._reduce(x, [(r, r * ck, (r + 1) * ck) for r in range(W)], k0, 0, first=self._full_rounds == 0,
                         out=self.round_out)
            self._retire(0)  # CUDA: deliver now (the next round rewrites x)
        self._full_rounds += 1
        for i, (p, _, _) in enumerate(self.slots):
            if p.grad is not None:
                self.received[i] = 1
                p.grad = None  # reduced: the full gradient is no longer needed

    # -- both stages -------------------------------------------------------------------------------
    def _reduce(self, buf: torch.Tensor, pieces: list, at: int, j: int, *, first: bool,
                out: torch.Tensor | None = None) -> None:
        """Sum ``buf`` across ranks; ``pieces``: (owner, lo, hi) ranges of ``buf`` in rank order. The
        sum of this rank's piece lands in its gradient store at ``at``."""
        mine = [(lo, hi) for r, lo, hi in pieces if r == self.rank]
        if self.world_size == 1:
            for lo, hi in mine:
                self._deliver(buf[lo:hi], at, first)
            return
        cuda, pg = self.streams.cuda, self.process_group
        if cuda:
            # The buffer was filled on the compute stream: the collective, queued from the comm
            # stream, must start after those copies.
            self.streams.wait(self.comm_stream, self.streams.event())
        works, src = [], None
        with self.streams.use(self.comm_stream):
            c = buf.numel() // self.world_size
            if self.use_rs and len(pieces) == self.world_size and all(hi - lo == c for _, lo, hi in pieces):
                src = out[:c] if out is not None else torch.empty(c, dtype=buf.dtype, device=buf.device)
                works.append(_reduce_scatter(src, buf, group=pg, async_op=cuda))
            else:
                for owner, lo, hi in pieces:
                    works.append(dist.reduce(buf[lo:hi], group=pg, group_dst=owner, async_op=cuda))
                src = buf[mine[0][0]:mine[0][1]] if mine else None
        if cuda:  # retired when buffer j is needed again (or at step): the works still read it
            self._inflight[j] = (works, src, at, first)
        elif src is not None:
            self._deliver(src, at, first)

    def _retire(self, j: int) -> None:
        """CUDA: finish buffer ``j``'s reduction and deliver this rank's part (no-op on CPU)."""
        if self._inflight[j] is None:
            return
        works, src, at, first = self._inflight[j]
        self._inflight[j] = None
        s = self.streams
        with s.use(self.comm_stream):
            for w in works:
                w.wait()  # the comm stream waits for the collective before reading its result
            if src is not None:
                self._deliver(src, at, first)
        # The compute stream refills this buffer (and step() reads the store) next: it waits until
        # the delivery is done.
        s.wait(s.compute(), s.event(self.comm_stream))

    def drain(self) -> None:
        """Every launched reduction delivered (step, flush, close)."""
        for j in (self._buf_slot, self._buf_slot ^ 1):  # the older launch first
            self._retire(j)

    def _deliver(self, src: torch.Tensor, at: int, first: bool) -> None:
        """``store[at:at + n] = src`` (first gradient of the window) or ``+= src``."""
        n = src.numel()
        dst = self.store[at:at + n]
        if self.store.device.type != "cpu":            # device store (CUDA, no offload); comm stream
            dst.copy_(src) if first else dst.add_(src)
            return
        if src.device.type != "cpu":                   # offload on CUDA: down through pinned staging
            stage = self.staging[:n]
            stage.copy_(src, non_blocking=True)        # on the current stream, after the reduction
            # The host reads the staging next (and the next delivery may rewrite it): wait for the copy.
            self.streams.host_wait(self.streams.event(torch.cuda.current_stream(self.streams.device)))
            src = stage
        write_grad(dst, src, first=first, num_threads=self.num_threads)
