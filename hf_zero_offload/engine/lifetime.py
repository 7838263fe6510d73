"""How an engine ends, and what it gives back then: ``close()``, or its replacement by a new engine built on the same
params (``grad_hooks.claim``).

Either way the engine can no longer be used, so everything it allocated goes at once: the host arena (fp32 masters,
Adam moments, gradient stores, staging: ~14 B per trainable param, pinned or not), the device gradient buckets and
other buffers, and the helper threads (a delayed step in flight ends first). What stays is what a clear refusal needs
(``_done_why``) and what is small (the groups a scheduler reads, the layout, the plan). Both used to keep the arena
until the garbage collector freed the engine: re-running a notebook cell ``trainer = ...; trainer.train()`` held two
arenas, an OOM for a model that fit once (peak RSS 2582 MiB against 1637 MiB now, 50M params, two engines).

Order: a new engine replaces the old ones (releasing their memory) before it allocates its own, so the peak is one
arena; every check that can refuse the build runs before (the host-RAM check counts what they give back). A build
that still fails after that (an allocation past what the check saw) says that the engine it replaced is done, and
gives back what it had allocated itself.

No reference cycle runs through an engine (its helpers hold it weakly, ``weak_label``; hooks hold their callback
weakly, ``grad_hooks.GradHooks``), so dropping the last reference to an engine frees its memory at once too, without
the garbage collector; ``close()`` frees it whoever still holds the engine (a Trainer, a scheduler, a traceback).

A mixin of ``AdamCore`` (core.py), as ``SavedState`` is: its methods read the core's fields as their own.
"""
from __future__ import annotations

import contextlib
import logging
import traceback
import weakref

from . import torch_clip
from .grad_hooks import claim, holders
from .memory_limits import check_host_ram
from .runs import host_bytes_leaving
from .step_guard import DeferredSigint

logger = logging.getLogger("hf_zero_offload")


def weak_label(method):
    """``method`` (an engine's ``_param_label``) for a helper to call without holding the engine: a bound method
    stored on an object the engine owns made a cycle that only the garbage collector freed, arena included."""
    ref = weakref.WeakMethod(method)

    def label(p) -> str:
        f = ref()
        return f(p) if f is not None else f"of shape {tuple(p.shape)}"
    return label


class EngineEnd:
    _done_why: str | None = None  # closed or replaced: why it may no longer be used
    # what an ended engine drops (a subclass adds its own): every view of the arena, the buffers, their owners
    _RELEASED = ("master", "moments", "exp_avg", "exp_avg_sq", "_stores", "store", "mirror", "uploader", "_prepared",
                 "_uploaded", "_pending")

    def close(self) -> None:
        """The engine is done: its hooks removed, helper threads stopped (a delayed step not flushed before is
        dropped) and its memory released (host arena, buffers); any later use is refused, saying why. Calling it
        again, or on a replaced engine (already released; its refusal keeps saying so), does nothing."""
        if self._done_why is not None:
            return
        if self._step_unpublished:
            logger.warning("hf_zero_offload: %s closed with a delayed (DPU) step not published: the model keeps the "
                           "weights of one step before the masters; call flush() before close()", type(self).__name__)
        self._end("closed", drain=True)

    def _replaced(self, by) -> None:
        if self._done_why is not None:
            return
        # No publish (for ShardedAdam a collective) and no drain of reductions in flight: whether this engine is
        # still alive to be replaced depends on when the garbage collector ran, which differs between ranks. The
        # new engine starts from the model's weights as they are; this one's worker's step in flight ends first.
        self._end(f"replaced by a new {type(by).__name__} built on the same parameters (e.g. another Trainer on this "
                  "model): its masters no longer describe the model", drain=False)

    def _end(self, why: str, *, drain: bool) -> None:
        # under the step's lock: a close() from another thread waits for a step() in progress, which released buffers
        # under it failed on a None (or on a stopped worker) half way through its update
        with self._lock:
            if self._done_why is not None:
                return  # (two closes at once: the second found the first's reason)
            self._done_why = why
            try:
                with DeferredSigint():  # a Ctrl-C lands once the memory is released (a second one at once)
                    self._stop_all(why, drain)
            finally:
                # whatever failed above (a stream sync, a helper's close, a second Ctrl-C), the engine refuses from
                # here on, so its memory goes now: a second close() returns at once and would never release it
                self._release()

    def _stop_all(self, why: str, drain: bool) -> None:
        self._stop_helpers(drain)  # no hook, scatter or reduction writes into the buffers from here
        self.detach_hooks()
        self._hand_back_zero_grads()
        try:
            self._wait_worker()
        except Exception as e:  # noqa: BLE001 - no reason to keep the worker and the arena: said, not raised
            logger.warning("hf_zero_offload: the %s %s; its delayed (DPU) step had failed (%s: %s)",
                           why.split(" ")[0], type(self).__name__, type(e).__name__, e)
        self.streams.synchronize()  # no copy may still read or write the memory released below

    def _release(self) -> None:
        self.needs_publish = self._step_unpublished = False  # nothing can publish it any more (close() said so)
        worker, self._worker = self._worker, None
        arena, self.arena = getattr(self, "arena", None), None
        for name in self._RELEASED:
            if name in self.__dict__:
                setattr(self, name, None)
        if worker is not None:
            worker.shutdown()
        if arena is not None:
            arena.close()  # (unpinned)

    def _stop_helpers(self, drain: bool) -> None:
        """The subclass's helpers (gradient pipeline, reducer) stop; ``drain``: reductions in flight land first."""

    @property
    def is_open(self) -> bool:
        """Neither closed nor replaced: its params are still its own (torch_clip.py asks)."""
        return self._done_why is None

    def check_open(self, what: str = "step()") -> None:
        """Raises, naming why, once the engine was closed or replaced (``what``: the call that found it so)."""
        if self._done_why is not None:
            raise RuntimeError(f"{type(self).__name__} was {self._done_why}; build a new engine (a new Trainer) to "
                               f"train these parameters. Its optimizer state and memory were released then, so "
                               f"{what} has nothing to work on (to keep the state, take state_dict() or "
                               "save_checkpoint() before close() or before building the next engine)")

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this engine (this rank) holds, by role (``plan`` has them by region; exact sizes, where the arena
        rounds each region to a page): all 0 once it ended, its memory released (a monitor may still read it)."""
        b = {} if self._done_why is not None else self.plan.bytes_by_region()
        get = lambda *ks: sum(b.get(k, 0) for k in ks)  # noqa: E731
        return {"optimizer_state": get("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"),
                "grad_store": get("grad_store"),
                "grad_buffers": get("grad_buckets", "grad_staging"),
                "param_buffers": get("shard_out", "gather_buffer", "param_staging"),
                "host": self.plan.host_bytes if b else 0, "device": self.plan.device_bytes if b else 0}

    def _ram_beside_arena(self) -> int:
        """Host RAM the plan allocates outside the arena: on a CPU run its "device" regions (the gradient buckets)."""
        return self.plan.device_bytes if self.device.type == "cpu" else 0

    def _held_host_bytes(self) -> int:
        """Host RAM this engine gives back when it ends (its arena, and what it allocated beside it)."""
        if self._done_why is not None or getattr(self, "plan", None) is None:
            return 0
        arena = getattr(self, "arena", None)
        return (arena.nbytes if arena is not None else 0) + self._ram_beside_arena()

    def _room_for_build(self) -> list:
        """The host-RAM check (the plan's host bytes and what it allocates beside the arena, against what is free plus
        what the build frees: the params leaving for the device and the arenas of the engines it replaces); returns
        those engines. Before ``_taking_params`` (a sharded build agrees on every rank's verdict in between)."""
        others = holders(self, [p for p, _, _ in self._flat])
        check_host_ram(self.plan.host_bytes + self._ram_beside_arena(),
                       host_bytes_leaving(self._flat, self.device) + sum(o._held_host_bytes() for o in others))
        return others

    @contextlib.contextmanager
    def _taking_params(self, others: list | None = None):
        """The build's allocations (its ``plan``) run in this block, once its params are taken: first the host-RAM
        check (``_room_for_build``, unless its ``others`` are given: it ran), then those engines are replaced, which
        releases their memory, so the peak is one arena. A failure in the block gives back what this engine
        allocated, and says the replaced are done."""
        params = [p for p, _, _ in self._flat]
        others = self._room_for_build() if others is None else others
        claim(self, params)
        torch_clip.install(self, params)  # torch.nn.utils.clip_grad_norm_ over these params: this engine's clipping
        self._take_zero_grads()
        try:
            yield
        except BaseException as e:
            # the traceback (a notebook's sys.last_traceback) would keep the build's views of the arena alive in its
            # finished frames' locals (the build keeps none in the frame running this block)
            traceback.clear_frames(e.__traceback__)
            try:
                self._end(f"not built ({type(e).__name__}: {e})", drain=False)
            except Exception as again:  # noqa: BLE001 - the build's own error is the one raised
                logger.warning("hf_zero_offload: releasing the %s that failed to build: %s", type(self).__name__, again)
            if others:
                names = " and ".join(sorted({type(o).__name__ for o in others}))
                note = (f"the {names} that held these parameters was replaced (its memory released) before this "
                        f"{type(self).__name__} failed to build: it can no longer train them; build a new engine "
                        "once the cause is fixed")
                e.add_note(f"hf_zero_offload: {note}")
                for o in others:
                    o._done_why += f"; that new {type(self).__name__} then failed to build ({type(e).__name__})"
            raise
