"""The default process group's store, as this package uses it: one owner of every read, write and delete of its keys.

The sharded engine (``engine/sharded/peers.py``: a rank that leaves the lockstep says so) and the Trainer integration
(``trainer/peer_failure.py``: a rank's error, named by its peers; ``trainer/progress.py``: where each rank is, for the
saves' agreement) keep a few lines each in the store ``init_process_group`` set up, served by rank 0's process.
``GroupStore`` gives them three things they all need:

- Reads and deletes bounded (``_READ_S``): a TCPStore client's ``check()``, ``get()`` and ``delete_key()`` wait for
  the answer without a timeout (the store's timeout is ``wait()``'s only), and a rank 0 that stopped answering
  without closing its connections (SIGSTOP, a debugger, a node gone) held the reader for good (probes: a read still
  waiting after 10 minutes; the Trainer's lookup of a failed peer and its progress read hung so). The call runs on a
  daemon thread given up after ``_READ_S``; it is then ``StoreSilent``.
- Nothing sent while a given-up call still waits: a TCPStore client runs one request at a time (a lock its waiting
  call holds), so any later call of the process on that store, a write too, waited behind it for good (a probe: the
  engine gave its read up, then the Trainer's ``set()`` of the same error hung). Such a call raises ``StoreSilent``
  at once instead; once the waiting call has returned, the store is used again. A call from another thread of the
  process waits for the one in flight (``_lock``) within the same bound.
- Keys scoped by torchrun's attempt (``TORCHELASTIC_RESTART_COUNT``): under ``--max-restarts`` the workers of the
  next attempt share the store of the one before (its agent's) and count from the start again, and read the earlier
  attempt's lines, the cause of the restart, as their peers' (a probe, 2 workers: a key written by attempt 0 was
  seen by attempt 1). An earlier attempt's keys are left in the store (a few per rank and attempt; the agent's store
  ends with the job): their names are not all known to the next attempt.

The keys a process wrote with a ``tag`` are remembered, and ``forget`` deletes those of a kind (the engine's lines
about engines every rank has left, the Trainer's "returned from train()" line), so a long run leaves no line per
engine. Never imports transformers; the engine and the Trainer integration both use it.
"""
from __future__ import annotations

import math
import os
import threading

import torch.distributed as dist

_ROOT = "hf_zero_offload"
_READ_S = 10.0  # a store's answer waited for this long at most (a healthy one answers in microseconds)
# then a moment more with the caller's GIL let go: another thread of this process that held the GIL past _READ_S
# (a C++ call that keeps it) left an answered call unable to return, and it was taken as silent (a probe: 5 of 10)
_GRACE_S = 0.5


class StoreSilent(TimeoutError):
    """The process group's store did not answer (its server, rank 0's process or torchrun's agent, stopped or
    unreachable)."""


def default_store(process_group=None):
    """The store of the default process group (None: ``process_group`` is another group, there is none, or it is a
    FileStore, whose file would grow by a line per write)."""
    if process_group is not None and process_group != dist.group.WORLD:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return None if isinstance(_innermost(store), dist.FileStore) else store


def _innermost(store):
    """The store under ``store``'s PrefixStores (over the TCPStore or FileStore, 2 deep under torchrun)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


class GroupStore:
    """``store`` under this package's keys: names given relative (``"progress/rank1"``), scoped by the attempt."""

    _current: GroupStore | None = None  # the default group's (one object per store: it owns the waiting call)

    def __init__(self, store, attempt: str | None = None):
        self._store = store
        self._attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if attempt is None else attempt
        self._waiting: list = []  # given-up calls still waiting for the store's answer (threads)
        # held by the call the store client runs (one at a time): a write from another thread behind a read in flight
        # waited with it for good where the store stopped answering
        self._lock = threading.Lock()
        self._written: dict = {}  # key -> (kind, number) of the lines written with a tag, not yet deleted

    @classmethod
    def of_default_group(cls, process_group=None) -> GroupStore | None:
        """The default process group's (None: ``default_store`` has none); the same object while the store is."""
        store = default_store(process_group)
        if store is None:
            return None
        if cls._current is None or not cls._current.holds(store):
            cls._current = cls(store)
        return cls._current

    def holds(self, store) -> bool:
        return self._store is store

    def key(self, name: str) -> str:
        """The store's key of ``name`` (``"engine/3/rank1"``) in this attempt."""
        return f"{_ROOT}/{self._attempt}/{name}"

    def set(self, name: str, value: str, tag: tuple | None = None) -> None:
        """Written (no answer awaited: a TCPStore's set() does not wait for one). ``tag``: (kind, number), for
        ``forget``. StoreSilent while a given-up call waits (this one would wait behind it)."""
        self._check_answering()
        if not self._lock.acquire(timeout=_READ_S):  # (another thread's call in flight, not answered)
            raise StoreSilent(self._silence())
        try:
            self._store.set(self.key(name), value)
        finally:
            self._lock.release()
        if tag is not None:
            self._written[self.key(name)] = tag

    def get(self, name: str) -> str | None:
        """``name``'s value (None: not there)."""
        return self.read([name]).get(name)

    def read(self, names) -> dict:
        """{name: value} of those of ``names`` that are there, read in one bounded call."""
        def op(store):
            out = {}
            for name in names:
                if store.check([self.key(name)]):
                    out[name] = store.get(self.key(name)).decode()
            return out
        return self._bounded(op)

    def delete(self, name: str) -> None:
        key = self.key(name)
        self._bounded(lambda store: store.delete_key(key))
        self._written.pop(key, None)

    def forget(self, kind: str, below: float = math.inf) -> None:
        """This process's lines of ``kind`` numbered below ``below``, deleted (dropped from the list even where a
        delete fails: a store since replaced, or not answering)."""
        keys = [k for k, (what, number) in list(self._written.items()) if what == kind and number < below]
        if not keys:
            return
        for k in keys:
            del self._written[k]

        def op(store):
            for k in keys:
                try:
                    store.delete_key(k)
                except Exception:  # noqa: BLE001 - (not there any more): the others are still deleted
                    pass
        self._bounded(op)

    def written(self) -> dict:
        """{key: (kind, number)} of the lines this process wrote with a tag and has not deleted."""
        return dict(self._written)

    def _check_answering(self) -> None:
        self._waiting = [t for t in self._waiting if t.is_alive()]
        if self._waiting:
            raise StoreSilent(self._silence())

    def _bounded(self, op):
        """``op(store)``, on a daemon thread given up after ``_READ_S`` (no Python call interrupts a TCPStore client's
        wait); its error raised here."""
        self._check_answering()
        out, err = [], []

        def run():
            try:
                with self._lock:
                    out.append(op(self._store))
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                err.append(e)
        caller = threading.Thread(target=run, daemon=True, name="hf_zero_offload store call")
        caller.start()
        caller.join(_READ_S)
        if caller.is_alive():
            caller.join(_GRACE_S)
        if caller.is_alive():
            self._waiting.append(caller)
            raise StoreSilent(self._silence())
        if err:
            raise err[0]
        return out[0]

    def _silence(self) -> str:
        """Which store (its host and port, from the store itself: an ``init_method="tcp://..."`` or ``store=``
        launch sets no MASTER_ADDR), who serves it (torchrun's agent, not rank 0, under torchrun), this rank, and
        what to do."""
        under = _innermost(self._store)
        host = getattr(under, "host", None) or os.environ.get("MASTER_ADDR", "?")
        port = getattr(under, "port", None) or os.environ.get("MASTER_PORT", "?")
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # (as torch's env:// rendezvous reads it)
        server = "torchrun's agent there" if agent else "rank 0's process"
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else os.environ.get("RANK", "?")
        return (f"the process group's store at {host}:{port} (served by {server}) did not answer rank {rank} within "
                f"{_READ_S:g} s: that process stopped (SIGSTOP, a debugger: resume it, kill -CONT) or its host gone "
                "or unreachable from this one; see its log and its host. This rank's store calls raise this at once "
                "until the one left waiting returns")
