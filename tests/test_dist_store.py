"""The process group's store under the Trainer integration's lines (trainer/peer_failure.py, trainer/progress.py) as
under the engine's (engine/sharded/peers.py): reads bounded where rank 0, its host, stopped answering, no call left
waiting behind a given-up one, and keys scoped by torchrun's attempt (dist_store.GroupStore, their one owner)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from _store_server import stop, store_server
from hf_zero_offload import dist_store
from hf_zero_offload.dist_store import GroupStore, StoreSilent
from hf_zero_offload.engine.sharded import peers
from hf_zero_offload.trainer import peer_failure, progress

_TIMED_OUT = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms for recv "
                          "operation to complete")


@contextlib.contextmanager
def _stopped_store():
    """A TCPStore client (5 s timeout) whose server, a child process, is stopped (SIGSTOP), and the child's pid."""
    with store_server() as (port, pid):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=5))
        client.set("hf_zero_offload/0/progress/rank1", "1:4:passed")
        stop(pid)
        yield client, pid


def _within(seconds: float, call):
    """``call()``'s result, or "still waiting" after ``seconds`` (the call left in a daemon thread)."""
    out = []
    waiter = threading.Thread(target=lambda: out.append(call()), daemon=True)
    waiter.start()
    waiter.join(seconds)
    return out[0] if out else "still waiting"


def test_the_trainers_lookup_of_a_failed_peer_is_given_up_where_rank_0_stopped_answering(monkeypatch):
    monkeypatch.setattr(dist_store, "_READ_S", 1.0)
    monkeypatch.setattr(peer_failure, "_WAIT_S", 0.2)
    monkeypatch.setattr(progress, "_COUNT", {})
    with _stopped_store() as (client, server):
        store = GroupStore(client)
        # before: still waiting (a TCPStore client's check() waits for its answer without a timeout)
        assert _within(5, lambda: peer_failure.peer_failed(_TIMED_OUT, store, 1, 0, 2, "evaluate()")) is None
        # the progress read (the saves' agreement) raises at once, not behind the read left waiting
        start = time.monotonic()
        # before: "(served by rank 0's process, ?:?)", nothing said to do (no MASTER_ADDR: a tcp:// or store= launch)
        with pytest.raises(StoreSilent, match=rf"store at 127.0.0.1:{client.port} \(served by rank 0's process\) "
                                              r"did not answer rank \S+ within 1 s: .*kill -CONT"):
            progress.progress_count(store, 1)
        with pytest.raises(StoreSilent):
            store.set(progress.PROGRESS_KEY.format(0), "1:5:saving")
        assert time.monotonic() - start < 0.5
        os.kill(server, signal.SIGCONT)  # answering again: the waiting read returns, and the store is used again
        time.sleep(0.3)
        assert progress.progress_count(store, 1) == [1, 4]


def test_a_write_after_the_engine_gave_its_read_up_does_not_wait_behind_it(monkeypatch):
    monkeypatch.setattr(dist_store, "_READ_S", 1.0)
    monkeypatch.setattr(peer_failure, "_WAIT_S", 0.2)
    with _stopped_store() as (client, _):
        notes = peers.PeerNotes(None, 1, 2)
        notes.store = GroupStore(client)
        assert _within(5, lambda: notes.named(_TIMED_OUT, "step()")) is None  # (the engine's read, given up)
        # before: both waited for good (a TCPStore client runs one request at a time; the given-up read holds it)
        start = time.monotonic()
        assert _within(5, lambda: notes.say("raised in step(): ValueError: x")) is None
        assert _within(5, lambda: peer_failure.peer_failed(_TIMED_OUT, notes.store, 1, 1, 2, "train()")) is None
        assert time.monotonic() - start < 0.5


def test_a_restarted_attempt_does_not_read_the_earlier_attempts_trainer_lines(monkeypatch):
    # torchrun --max-restarts: the next attempt's workers share the agent's store and count from the start again
    monkeypatch.setattr(peer_failure, "_WAIT_S", 0.2)
    monkeypatch.setattr(progress, "_COUNT", {})
    shared = dist.HashStore()

    def attempt(n):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(n))
        return GroupStore(shared)
    first = attempt(0)
    # attempt 0: rank 0's constructor raised (the restart's cause); rank 1 had counted 2 train()s, 5 points
    assert peer_failure.peer_failed(KeyError("attempt 0's cause"), first, 1, 0, 2, "the Trainer's constructor") is None
    first.set(progress.PROGRESS_KEY.format(1), "2:5:passed")
    second = attempt(1)
    named = peer_failure.peer_failed(_TIMED_OUT, second, 1, 1, 2, "the Trainer's constructor")
    # before: "rank 0 (host h) failed: KeyError: \"attempt 0's cause\"; this rank (rank 1) stopped in the collective"
    assert "attempt 0's cause" not in str(named) and str(named).startswith("rank 0 did not come within the "
                                                                             "collective timeout"), named
    assert progress.progress_count(second, 1) == [0, 0]  # before: [2, 5], the earlier attempt's count
    # the same attempt still reads its own lines
    assert "attempt 0's cause" in str(peer_failure.peer_failed(_TIMED_OUT, attempt(0), 1, 1, 2, "train()"))


def test_a_write_from_another_thread_behind_a_read_in_flight_is_bounded(monkeypatch):
    # a callback's thread, a finalizer: the write waited behind the other thread's read, not given up yet, for good
    monkeypatch.setattr(dist_store, "_READ_S", 1.0)
    with _stopped_store() as (client, _):
        store = GroupStore(client)
        def read():
            with contextlib.suppress(Exception):  # (given up, or the server killed at the end)
                store.read(["progress/rank1"])
        threading.Thread(target=read, daemon=True).start()
        time.sleep(0.2)  # (the read in flight, holding the client)

        def write():
            try:
                store.set("failed/1/rank0", "h\nValueError: x")
            except StoreSilent as e:
                return e
        assert isinstance(_within(4, write), StoreSilent)  # before: "still waiting"


class _SlowAnswer:
    def check(self, keys):
        time.sleep(0.05)  # (the store's answer on its way, the GIL let go)
        return False


def test_an_answered_read_is_not_taken_as_silent_where_another_thread_held_the_gil(monkeypatch):
    # a thread in a C++ call that keeps the GIL past the deadline: the answered read could not return, and was
    # StoreSilent (a probe: 5 of 10)
    monkeypatch.setattr(dist_store, "_READ_S", 0.2)
    hog = ctypes.PyDLL(None).usleep  # (holds the GIL while it sleeps)
    for _ in range(6):
        holder = threading.Thread(target=lambda: (time.sleep(0.02), hog(350_000)))
        holder.start()
        assert GroupStore(_SlowAnswer(), attempt="0").read(["progress/rank1"]) == {}  # before: StoreSilent
        holder.join()


def test_under_torchrun_the_silent_store_is_named_as_its_agents(monkeypatch):
    # the workers' store is the agent's (TORCHELASTIC_USE_AGENT_STORE): rank 0 stopped leaves it answering
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "3")
    assert GroupStore(dist.HashStore())._silence().startswith(
        "the process group's store at node0:29500 (served by torchrun's agent there) did not answer rank 3")
