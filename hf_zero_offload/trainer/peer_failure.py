"""A rank that stopped because a peer failed says which peer and why.

One rank raising mid-step (a callback, a forward or backward hook, a bad batch) ended its process; the others then
failed in the collective they were waiting in, in gloo's words only ("Connection reset by peer", "Connection closed
by peer [127.0.0.1]:37056 ... GLHF!"), naming neither the rank nor the cause (an outside probe, 2 gloo ranks). Now a
rank whose ``train()`` raises writes its error to the store the process group shares (one key, before its process
ends), and a rank whose own error is such a collective failure looks there for a moment and raises one line naming
the rank that failed first and its error, chained to its own. Nothing with one process or without a shared store
(a ``file://`` one: ``progress.shared_store``).

The same holds around every call of the Trainer with collectives (``NamedPeerFailures``): its constructor (a
ds_config file one node cannot read, a ``model_init`` raising on one rank: the others failed in gloo's words at the
run lock's broadcast or at ``train()``'s first gather), ``train()``'s own checks before its loop, and ``evaluate()``,
``predict()`` and a checkpoint save called from user code. A peer that raised nothing is told apart too: one that
had returned from its ``train()`` (a call made on one rank only, ``if rank == 0: trainer.evaluate()``, which fails
or hangs as under plain DDP) is named as such, and one that wrote nothing at all as stopped without an error of its
own (a SIGKILL, the out-of-memory killer), or, where this rank's wait ran out (a killed peer closes its connections
instead), as not come within the collective timeout. One store write per call that fails, one per ``train()`` that
returns and one (taking that back) at the next call; nothing per step. The store's reads are bounded and its keys
scoped by torchrun's attempt (``dist_store.GroupStore``): a rank 0 that stopped answering no longer holds this
rank's error, and a restarted attempt does not name the earlier attempt's error as its peer's.
"""
from __future__ import annotations

import contextlib
import functools
import socket
import time

import torch.distributed as dist

from ..engine.sharded.peers import TIMEOUT_WORDS as _TIMEOUT_WORDS
from ..engine.sharded.peers import collective_failure, said  # noqa: F401 - (collective_failure: by name elsewhere too)
from ..dist_store import GroupStore
from .progress import progress_count, shared_store
from .shared_dir import ranks_named

# (names in the store of this torchrun attempt: GroupStore.key)
_KEY = "failed/{}/rank{}"  # train() generation, rank
_LOST_KEY = "lost/{}/rank{}"  # a rank that met a collective failure (it is alive: not the one gone)
# "<generation>\n<step>\n<host>" at each train() that returned, taken back at this process's next Trainer call
# (GroupStore.forget: one per process, its rank, whichever Trainer wrote it)
_LEFT_KEY = "left/rank{}"
_WAIT_S = 3.0  # for the failing rank's key: it is written before its process ends and closes the connection
# (what gloo and NCCL say of a peer gone or late: engine/sharded/peers.py, which the engine's own errors use too)


def _in_place_of(e: BaseException, text: str) -> BaseException:
    """The error naming the peer, of ``e``'s type where torch's own (a script's ``except DistBackendError`` around a
    call, to retry or requeue, still catches it), else a RuntimeError (gloo's plain one, or a type that may not take
    one message)."""
    if isinstance(e, dist.DistError):
        with contextlib.suppress(Exception):  # (a subclass of another constructor: a RuntimeError, as before)
            return type(e)(text)
    return RuntimeError(text)


def peer_failed(e: BaseException, store: GroupStore | None, generation: int, rank: int, world_size: int,
                doing: str = "train()") -> BaseException | None:
    """At ``e`` leaving this rank's ``doing`` (a Trainer call): this rank's own failure written to ``store`` (None: a
    collective failure, or nothing to write); a collective failure answered with the error to raise in its place (of
    its type, _in_place_of), naming the first peer that wrote one within a moment, else the peers that had returned
    from their train() or wrote nothing (None: none of these)."""
    if store is None or not isinstance(e, Exception):
        return None
    host = socket.gethostname()
    if not collective_failure(e):
        with contextlib.suppress(Exception):  # (the store gone with rank 0: this rank's error is the one to see)
            store.set(_KEY.format(generation, rank), f"{host}\n{said(e, 400)}")
        return None
    peers = [r for r in range(world_size) if r != rank]
    give_up = time.monotonic() + _WAIT_S
    try:
        store.set(_LOST_KEY.format(generation, rank), host)
        while True:
            found = failed_peer(store, generation, peers)
            if found:
                return _in_place_of(e, f"{found}; this rank (rank {rank}) stopped in the collective it was waiting "
                                       f"in for it ({said(e, 400)[:200]})")
            if time.monotonic() > give_up:  # (the other survivors have said they are alive by now)
                return _absent(e, store, generation, rank, peers, doing)
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store gone with its host, or silent: this rank's error is the one to see
        return None


def _absent(e: BaseException, store, generation: int, rank: int, peers: list,
            doing: str) -> BaseException | None:
    """The peers of collective failure ``e`` that raised nothing: those whose train() of this generation returned,
    else those that said nothing at all (None: every peer is alive, or returned from another generation's train())."""
    left, silent, told = [], [], said(e, 400)[:200]
    seen = store.read([_LEFT_KEY.format(r) for r in peers] + [_LOST_KEY.format(generation, r) for r in peers])
    for r in peers:
        if (returned := seen.get(_LEFT_KEY.format(r))) is not None:
            g, step, host = returned.split("\n")
            if int(g) == generation:
                left.append(f"rank {r} (host {host}) had returned from its train() (at step {step})")
                continue
        if _LOST_KEY.format(generation, r) not in seen:
            silent.append(r)
    if left:
        return _in_place_of(e, f"{'; '.join(left)} and was not in the collective this rank (rank {rank}) waited in, "
                               f"in {doing}: train(), evaluate(), predict() and checkpoint saves of a sharded run "
                               "gather from every rank, so every rank must make the same calls (under plain DDP a call "
                               f"made on some ranks only fails or hangs alike) ({told})")
    if silent and any(w in str(e) for w in _TIMEOUT_WORDS):  # (a peer killed closes its connections: no timeout)
        return _in_place_of(e, f"{ranks_named(silent)} did not come within the collective timeout to the collective "
                               f"this rank (rank {rank}) waited in, in {doing}, and said no error of its own: alive "
                               "elsewhere (stuck in its data loading, a callback or another call) or stopped without a "
                               f"word; see that rank's log ({told})")
    if silent:
        return _in_place_of(e, f"{ranks_named(silent)} stopped without an error of its own while this rank (rank "
                               f"{rank}) waited for it in a collective, in {doing}: killed (SIGKILL, the out-of-memory "
                               "killer), or its script ended or went elsewhere without making this call; see that "
                               f"rank's log ({told})")
    return None


def failed_peer(store: GroupStore, generation: int, ranks) -> str | None:
    """"rank R (host H) failed: <its error>" for the first of ``ranks`` whose train() of this ``generation`` raised
    (None: none). Also for a rank that waits on its peers through the store rather than in a collective (the saves'
    agreement: a peer that failed before the save point left it looking until --ddp_timeout)."""
    seen = store.read([_KEY.format(generation, r) for r in ranks])
    for r in ranks:
        if (line := seen.get(_KEY.format(generation, r))) is not None:
            host, _, why = line.partition("\n")
            return f"rank {r} (host {host}) failed: {why}"
    return None


def _back_in() -> None:
    """This rank in a Trainer call again: its "returned from train()" key taken back (one store call, after a train()
    that returned only). Left there, a peer that lost this rank in the evaluate() both ranks make after train() (this
    rank killed in it) said it had returned and was not in the call, blaming the script."""
    with contextlib.suppress(Exception):  # (the store gone: no peer is left to read the key)
        if dist.is_available() and dist.is_initialized() and (store := GroupStore.of_default_group()) is not None:
            store.forget("left")  # (nothing sent where none was written)


class NamedPeerFailures:
    """Mixed into ``ZeroOffloadMixin``: its calls with collectives run in ``_zo_named``. Reads the process group and
    its store only (the constructor runs it before the Trainer has ``args``)."""

    def _zo_named(self, doing: str, call, next_train: bool = False):
        """``call()``; an error out of it said to the peers, or a peer's failure raised in place of gloo's words.
        ``next_train``: the constructor, whose peers look in the generation of their next train()."""
        _back_in()
        try:
            return call()
        except BaseException as e:
            named = self._zo_peer_failed(e, doing, next_train)
            if named is not None:
                raise named from e
            raise

    def _zo_peer_failed(self, e: BaseException, doing: str, next_train: bool = False) -> BaseException | None:
        if getattr(e, "_zo_seen", False):  # (met already by a call within this one: evaluate() within train())
            return None
        with contextlib.suppress(Exception):
            e._zo_seen = True
        try:
            if not (dist.is_available() and dist.is_initialized()):
                return None
            rank, world = dist.get_rank(), dist.get_world_size()
            store = shared_store(world)
            count = progress_count(store, rank)
        except Exception:  # noqa: BLE001 - the store gone: the error in flight is the one to see
            return None
        if count is None:
            return None
        named = peer_failed(e, store, count[0] + int(next_train), rank, world, doing)
        if named is not None:
            named._zo_seen = True
        return named

    def _zo_returned(self) -> None:
        """After a train() that returned: its generation and step, for a peer left in a collective this rank never
        joins (a call made on one rank only)."""
        with contextlib.suppress(Exception):  # (nothing to say it in: nothing lost)
            store = shared_store(dist.get_world_size()) if dist.is_initialized() else None
            count = progress_count(store, dist.get_rank()) if store is not None else None
            if count is not None:
                store.set(_LEFT_KEY.format(dist.get_rank()),
                          f"{count[0]}\n{self.state.global_step}\n{socket.gethostname()}", tag=("left", 0))

    def evaluate(self, *args, **kwargs):
        return self._zo_named("evaluate()", functools.partial(super().evaluate, *args, **kwargs))

    def predict(self, *args, **kwargs):
        return self._zo_named("predict()", functools.partial(super().predict, *args, **kwargs))

    def _save_checkpoint(self, *args, **kwargs):
        return self._zo_named("a checkpoint save", functools.partial(super()._save_checkpoint, *args, **kwargs))
