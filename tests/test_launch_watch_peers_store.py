"""The peers' lines read after a collective failure (engine/sharded/peers.py) when the store's host, rank 0, stopped
answering without closing its connections (a node gone, a stopped process): the read is given up, and the
collective's own error raised, where a TCPStore client's ``check``/``get`` wait for an answer without a timeout."""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import torch.distributed as dist

from _store_server import stop, store_server
from hf_zero_offload import dist_store
from hf_zero_offload.engine.sharded import peers

@contextlib.contextmanager
def _notes_on_a_child_store():
    """Rank 1's PeerNotes on a TCPStore served by a child process (the test stops it with SIGSTOP), and its pid."""
    with store_server() as (port, pid):
        notes = peers.PeerNotes(None, 1, 2)
        notes.store = dist_store.GroupStore(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                                          timeout=timedelta(seconds=5)))
        yield notes, pid


def test_a_store_host_that_stopped_answering_does_not_hold_the_collectives_error(monkeypatch):
    monkeypatch.setattr(dist_store, "_READ_S", 1.0)
    with _notes_on_a_child_store() as (notes, server):
        notes.store.set(peers._KEY.format(notes.number, 0), "host0\nclosed its ShardedAdam (close()) after its step 3")
        failure = RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
        assert "rank 0 (host host0) closed its ShardedAdam" in str(notes.named(failure, "step()"))  # (answering)
        stop(server)
        start = time.monotonic()
        # before: check() still waiting after 10 minutes (a 5 s store timeout: check and get do not use it)
        assert notes.named(failure, "step()") is None
        assert time.monotonic() - start < 5


def test_taking_lines_back_from_a_store_host_that_stopped_answering_is_given_up(monkeypatch):
    monkeypatch.setattr(dist_store, "_READ_S", 1.0)
    with _notes_on_a_child_store() as (notes, server):
        notes.say("was in save_checkpoint() (after its step 1)")
        notes.store.set("an older engine's line", "h\nclosed", tag=("engine", notes.number - 1))
        stop(server)
        start = time.monotonic()
        notes.unsay()  # (the end of a save) before: delete_key() still waiting when given up after 8 s
        notes.forget_older()  # (the next build)
        assert time.monotonic() - start < 5
        # the line not known to be deleted is kept in the list, for the next build to try again
        assert notes.store.written() == {notes.key(1): ("engine", notes.number)}


def test_a_line_of_torchruns_earlier_attempt_is_not_read_by_the_next(monkeypatch):
    # torchrun --max-restarts: the workers of the next attempt share the store of the one before (its agent's: a probe,
    # 2 workers, a key written by attempt 0 seen by attempt 1), and count their engines from 1 again
    store = dist.HashStore()
    failure = RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")

    def notes_of(attempt):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        monkeypatch.setattr(peers, "_BUILT", [0])
        notes = [peers.PeerNotes(None, r, 2) for r in range(2)]
        for n in notes:
            n.store, n.number = dist_store.GroupStore(store), 1
        return notes
    old0, _ = notes_of("0")
    old0.say("raised in step(): OutOfMemoryError: the cause of attempt 0's restart")
    _, new1 = notes_of("1")
    # before: "rank 0 (host h) raised in step(): OutOfMemoryError: the cause of attempt 0's restart; this rank ..."
    assert new1.named(failure, "step()") is None
    assert "the cause of attempt 0's restart" in str(notes_of("0")[1].named(failure, "step()"))  # (the same attempt)
