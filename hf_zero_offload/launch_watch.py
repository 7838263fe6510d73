"""Processes of one launch started with different ``WORLD_SIZE`` values, found and named instead of a hang.

``launch_checks.check_launch_env`` checks one process's variables; it cannot see that rank 1 was started with
``WORLD_SIZE=3`` while rank 0 has ``WORLD_SIZE=2`` (a hand-made launch, a script that sets the variables per
process). torch does not compare them either: rank 0's store waits for 3 workers, or rank 1's gloo rendezvous waits
for a rank 2 that never comes, inside ``init_process_group`` (TrainingArguments' setup), until the process group's
timeout, 30 minutes by default, with no word (an outside probe: 2 processes, 2 vs 3 and 3 vs 2, both hung).

Here each process of such a launch writes its ``WORLD_SIZE`` to rank 0's rendezvous store (``MASTER_ADDR``:
``MASTER_PORT``, the TCPStore torch's ``env://`` rendezvous serves there) from a daemon thread; rank 0 reads the
others' and writes its verdict, the others read rank 0's value and that verdict: a process that finds another value
prints one error naming the ranks and values and ends (its main thread is blocked inside torch's C++ rendezvous,
where no Python exception reaches). All alike: the thread ends, and nothing more is done.

Two processes started with the same ``RANK`` (ranks 0, 1, 1 of 3) hung alike (a probe: the three still waiting in
the TrainingArguments' setup when killed after 70 s): each process claims its ``RANK`` in the store first (one
``compare_set``, its host and pid); the second to claim one says so there and stops naming both processes, and
rank 0, which looks for that line once a second, stops with it and writes it as its verdict, which the others read.
A claim is held while its process's watch runs (a count moved on once a second): a process relaunched with the RANK
of one that died (killed while it waited in the rendezvous) takes over a claim that stood still 3 seconds, as
torch's rendezvous takes it in; one that ended with the launch agreed stays held.
Not under torchrun (its variables are consistent by construction, and its agent's store outlives a restart with
another world size) nor under MPI launchers.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .launch_checks import _MPI_RANK_VARS, launch_count

_KEY = "hf_zero_offload/launch/world_size/rank{}"
_VERDICT = "hf_zero_offload/launch/world_size/verdict"  # rank 0's: "" (all agree) or "<its value>\n<the others'>"
# (or "twice\n<what _TWICE said>")
_CLAIM = "hf_zero_offload/launch/rank{}/process"  # "<host> pid <pid>" of the first process that claimed that RANK
_TWICE = "hf_zero_offload/launch/twice"  # "RANK=<r> on two processes, <first> and <second>", by the second
_BEAT = "hf_zero_offload/launch/rank{}/beat"  # a count the claim's holder moves on once a poll while its watch runs
_GONE_POLLS = 3  # a claim whose beat stood still this many polls is of a process gone: a relaunch takes it over
_ENDED = "ended"  # the beat of a watch that ended with the launch agreed: its process went on, holding its claim
_POLL_S = 1.0
_WATCH_S = 600.0  # then the thread gives up quietly (a peer that never came is torch's timeout to report)
_STARTED: list = []


def watch_world_size(env=None) -> None:
    """Start the watch for this process (once), where ``env`` (``os.environ``) is a hand-made multi-process launch."""
    env = os.environ if env is None else env
    if _STARTED or (dist.is_available() and dist.is_initialized()) or "TORCHELASTIC_RUN_ID" in env \
            or any(n in env for n in _MPI_RANK_VARS):
        return
    world, rank = launch_count(env, "WORLD_SIZE"), launch_count(env, "RANK")
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if not world or world < 2 or rank is None or not addr or not port.strip().isdecimal():
        return
    _STARTED.append(True)

    def connect():
        # a plain socket first, until rank 0's store listens: a TCPStore client retrying a port not yet served
        # logs a C++ traceback per try, in every healthy launch whose rank 0 starts last
        deadline = time.monotonic() + _WATCH_S
        while True:
            try:
                socket.create_connection((addr, int(port)), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        return dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=_WATCH_S))

    threading.Thread(target=_watch, args=(connect, rank, world, _end_process), daemon=True,
                     name="hf_zero_offload launch watch").start()


def _watch(connect, rank: int, world: int, on_mismatch, me: str | None = None) -> None:
    """Write ``world`` as rank ``rank``'s; rank 0 reads the others' until all ``world`` ranks said the same and writes
    its verdict, the others read rank 0's value and then that verdict: ``on_mismatch(message)`` where one said
    another value, else return. ``connect()``: the store client. Only rank 0 reads every rank's key: every process
    reading all of them put W² reads a second on rank 0's store during the rendezvous (by count, up to 262,144 for
    a 512-process SLURM-style launch), and a mismatch anywhere is one with rank 0's value. ``me``: this process, as
    its claim of ``rank`` names it (its host and pid)."""
    me = f"{socket.gethostname()} pid {os.getpid()}" if me is None else me
    try:
        store = connect()
        first = store.compare_set(_CLAIM.format(rank), "", me).decode()
        if first != me and _gone(store, rank):  # (a relaunch of a process that died: torch's rendezvous takes it)
            first = store.compare_set(_CLAIM.format(rank), first, me).decode()
        if first != me:
            found = f"RANK={rank} on two processes, {first} and {me}"
            store.set(_TWICE, found)  # (for rank 0, and through its verdict the others)
            return on_mismatch(_twice(f"{found} (this one)"))
        store.set(_KEY.format(rank), str(world))
        deadline = time.monotonic() + _WATCH_S
        seen: dict = {}
        beats = 0
        while time.monotonic() < deadline:
            beats += 1
            store.set(_BEAT.format(rank), str(beats))  # (this process still holds its claim: _gone)
            if rank == 0:
                if (found := _read(store, _TWICE)) is not None:
                    store.set(_VERDICT, f"twice\n{found}")
                    return on_mismatch(_twice(found))
                for r in range(max([world, *[int(v) for v in seen.values()]])):
                    if r not in seen and (value := _read(store, _KEY.format(r))) is not None:
                        seen[r] = value
                other = {r: v for r, v in seen.items() if v != str(world)}
                if other:
                    shown = ", ".join(f"WORLD_SIZE={v} on rank {r}" for r, v in sorted(other.items()))
                    store.set(_VERDICT, f"{world}\n{shown}")  # (for the ranks that agree with rank 0)
                    return on_mismatch(_message(f"WORLD_SIZE={world} on this process (rank {rank}) but {shown}"))
                if len(seen) >= world:
                    store.set(_VERDICT, "")
                    return store.set(_BEAT.format(rank), _ENDED)
            elif 0 not in seen:
                if (value := _read(store, _KEY.format(0))) is not None:
                    seen[0] = value
                    if seen[0] != str(world):
                        return on_mismatch(_message(f"WORLD_SIZE={world} on this process (rank {rank}) but "
                                                    f"WORLD_SIZE={seen[0]} on rank 0"))
                    continue
            elif (verdict := _read(store, _VERDICT)) is not None:
                world0, _, shown = verdict.partition("\n")
                if world0 == "twice":
                    return on_mismatch(_twice(shown))
                if shown:
                    return on_mismatch(_message(f"WORLD_SIZE={world0} on rank 0 and on this process (rank {rank}) but "
                                                f"{shown}"))
                return store.set(_BEAT.format(rank), _ENDED)
            time.sleep(_POLL_S)
    except Exception:  # noqa: BLE001 - no store to reach (another launch's port, a peer gone): torch says it
        return


def _gone(store, rank: int) -> bool:
    """Whether the process that claimed ``rank`` first has stopped: its watch's beat stood still ``_GONE_POLLS``
    polls. A rank relaunched by hand after its first process died (killed while it waited in the rendezvous for a
    later rank) was refused as a second process with that RANK, and rank 0 stopped with it, where torch's rendezvous
    takes the relaunch (a probe: ranks 0, 1 of 3, rank 1 killed and started again, then rank 2: all three trained)."""
    def beat():
        return _read(store, _BEAT.format(rank))
    before, give_up = beat(), time.monotonic() + _GONE_POLLS * _POLL_S
    if before == _ENDED:  # (a process started after the launch agreed: the rendezvous is complete without it)
        return False
    while time.monotonic() < give_up:
        time.sleep(_POLL_S / 4)
        if beat() != before:
            return False
    return True


def _read(store, key: str) -> str | None:
    """``key``'s value in the rendezvous store (None: not there yet)."""
    return store.get(key).decode() if store.check([key]) else None


def _message(found: str) -> str:
    return (f"hf_zero_offload: LaunchError: {found}: every process of a run must be started with the same WORLD_SIZE "
            "(torchrun sets it so); torch.distributed's rendezvous would wait for ranks that never come until its "
            "timeout (30 minutes by default), so this process stops now")


def _twice(found: str) -> str:
    return (f"hf_zero_offload: LaunchError: {found}: every process of a run must be started with its own RANK, 0 to "
            "WORLD_SIZE-1 (torchrun sets it so); torch.distributed's rendezvous would wait for the rank that never "
            "comes until its timeout (30 minutes by default), so this process stops now")


def _end_process(message: str) -> None:
    # the main thread is inside torch's C++ rendezvous (or a collective), which no Python exception interrupts
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(3 * _POLL_S)  # (rank 0 serves the store: its peers' watches read it before it goes)
    os._exit(1)
