"""A rank that stopped because a peer failed says which peer and why.

One rank raising mid-step (a callback, a forward or backward hook, a bad batch) ended its process; the others then
failed in the collective they were waiting in, in gloo's words only ("Connection reset by peer", "Connection closed
by peer [127.0.0.1]:37056 ... GLHF!"), naming neither the rank nor the cause (an outside probe, 2 gloo ranks). Now a
rank whose ``train()`` raises writes its error to the store the process group shares (one key, before its process
ends), and a rank whose own error is such a collective failure looks there for a moment and raises one line naming
the rank that failed first and its error, chained to its own. Nothing with one process or without a shared store
(a ``file://`` one: ``CheckpointSaving._zo_store``).
"""
from __future__ import annotations

import contextlib
import socket
import time

import torch.distributed as dist

_KEY = "hf_zero_offload/failed/{}/rank{}"  # train() generation, rank
_WAIT_S = 3.0  # for the failing rank's key: it is written before its process ends and closes the connection
# what gloo and NCCL say when a peer is gone or never came (torch raises some of them as a plain RuntimeError)
_COLLECTIVE_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
                     "timeout caused pair closure", "gloo/transport", "NCCL", "ProcessGroup")


def collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective's failure (a peer gone), as opposed to a failure of this rank's own."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(w in str(e) for w in
                                                                                   _COLLECTIVE_WORDS))


def _said(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}" if text else type(e).__name__


def peer_failed(e: BaseException, store, generation: int, rank: int, world_size: int) -> BaseException | None:
    """At ``e`` leaving this rank's ``train()``: this rank's own failure written to ``store`` (None: a collective
    failure, or nothing to write); a collective failure answered with the error to raise in its place, naming the
    first peer that wrote one within a moment (None: none did)."""
    if store is None or not isinstance(e, Exception):
        return None
    if not collective_failure(e):
        with contextlib.suppress(Exception):  # (the store gone with rank 0: this rank's error is the one to see)
            store.set(_KEY.format(generation, rank), f"{socket.gethostname()}\n{_said(e)}")
        return None
    give_up = time.monotonic() + _WAIT_S
    try:
        while True:
            found = failed_peer(store, generation, [r for r in range(world_size) if r != rank])
            if found:
                return RuntimeError(f"{found}; this rank (rank {rank}) stopped in the collective it was waiting in for "
                                    f"it ({_said(e)[:200]})")
            if time.monotonic() > give_up:
                return None
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store gone with its host: this rank's error is the one to see
        return None


def failed_peer(store, generation: int, ranks) -> str | None:
    """"rank R (host H) failed: <its error>" for the first of ``ranks`` whose train() of this ``generation`` raised
    (None: none). Also for a rank that waits on its peers through the store rather than in a collective (the saves'
    agreement: a peer that failed before the save point left it looking until --ddp_timeout)."""
    for r in ranks:
        key = _KEY.format(generation, r)
        if store.check([key]):
            host, _, why = store.get(key).decode().partition("\n")
            return f"rank {r} (host {host}) failed: {why}"
    return None
