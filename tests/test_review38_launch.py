"""Processes of one hand-made launch started with different WORLD_SIZE values (hf_zero_offload/launch_watch.py):
each names the mismatch and stops, where torch's rendezvous waited for ranks that never come until its timeout (30
minutes by default; an outside probe: 2 vs 3 and 3 vs 2, both processes hung in TrainingArguments' setup)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from hf_zero_offload import launch_watch


def _master():
    """Rank 0's rendezvous store, as torch's env:// rendezvous serves it."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))


def _watch_on(master, rank: int, world: int, said: list, slot: int, me: str | None = None) -> None:
    """One process's watch, run in a thread of this one with its own client of ``master``: what it would print (and
    end its process with) in ``said[slot]``."""
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=20))
    launch_watch._watch(lambda: client, rank, world, lambda m: said.__setitem__(slot, m), me=me)


def _watch_all(worlds: list, monkeypatch) -> list:
    monkeypatch.setattr(launch_watch, "_POLL_S", 0.1)  # (its 1 s between the watches' looks took each test 1 s)
    master = _master()
    said: list = [None] * len(worlds)

    def one(rank, world):
        _watch_on(master, rank, world, said, rank)
    threads = [threading.Thread(target=one, args=(r, w)) for r, w in enumerate(worlds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    return said


@pytest.mark.parametrize("worlds", [[2, 3], [3, 2]])
def test_another_world_size_on_a_peer_is_named_on_every_process(worlds, monkeypatch):
    said = _watch_all(worlds, monkeypatch)
    for rank, world in enumerate(worlds):
        other = worlds[1 - rank]
        assert f"WORLD_SIZE={world} on this process (rank {rank}) but WORLD_SIZE={other} on rank {1 - rank}: every " \
               "process of a run must be started with the same WORLD_SIZE" in said[rank], said


def test_two_processes_started_with_the_same_rank_are_named_on_every_process(monkeypatch):
    monkeypatch.setattr(launch_watch, "_POLL_S", 0.2)  # (the duplicate reads the first one's beat: alive)
    # before: ranks 0, 1, 1 of 3 all waited in the rendezvous (a probe: the TrainingArguments' setup, killed after 70 s)
    master = _master()
    said: list = [None] * 3

    def one(i, rank):
        _watch_on(master, rank, 3, said, i, me=f"h pid {i}")
    threads = []
    for i, rank in enumerate((0, 1, 1)):
        threads.append(threading.Thread(target=one, args=(i, rank)))
        threads[-1].start()
        if i == 1:  # (process 1 claims rank 1 first)
            threads[-1].join(0.3)
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    named = "LaunchError: RANK=1 on two processes, h pid 1 and h pid 2{}: every process of a run must be started " \
            "with its own RANK"
    assert [named.format(" (this one)" if i == 2 else "") in m for i, m in enumerate(said)] == [True] * 3, said


def test_the_same_world_size_everywhere_ends_the_watch_without_a_word(monkeypatch):
    assert _watch_all([2, 2], monkeypatch) == [None, None]


def test_torchrun_and_one_process_start_no_watch(monkeypatch):
    monkeypatch.setattr(launch_watch, "_STARTED", [])
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0"}
    for env in ({**base, "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, {**base, "WORLD_SIZE": "1"}, {}):
        launch_watch.watch_world_size(env)
    assert launch_watch._STARTED == []


_SCRIPT = """
from hf_zero_offload import ZeroOffloadSeq2SeqTrainingArguments
a = ZeroOffloadSeq2SeqTrainingArguments(output_dir={out!r}, use_cpu=True, report_to=[], zero_offload="zero2-offload")
print("world", a.world_size, flush=True)
import torch.distributed as dist
dist.barrier()  # (training's first collective: rank 0, through its rendezvous, waits here for a rank still in it)
"""


@pytest.mark.slow
def test_the_trainer_arguments_of_two_processes_with_another_world_size_stop_naming_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, world in enumerate((2, 3)):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, "-c", _SCRIPT.format(out=str(tmp_path / "out"))], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]  # before: both waited until the 30-minute timeout
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 1], outs
    assert "WORLD_SIZE=3 on this process (rank 1) but WORLD_SIZE=2 on rank 0" in outs[1], outs[1]


def test_a_rank_relaunched_after_its_first_process_died_is_not_a_second_process(monkeypatch):
    # before: the relaunch (and rank 0) stopped naming "RANK=1 on two processes" where torch's rendezvous took it
    # (a probe: ranks 0, 1 of 3, rank 1 killed in the rendezvous and started again, then rank 2: all three trained)
    monkeypatch.setattr(launch_watch, "_POLL_S", 0.1)
    master = _master()
    master.compare_set("hf_zero_offload/launch/rank1/process", "", "h pid 1")  # the first process: claimed, beat, died
    master.set("hf_zero_offload/launch/rank1/beat", "4")
    said: list = [None] * 2

    def one(rank):
        _watch_on(master, rank, 2, said, rank, me=f"h pid {rank + 2}")
    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert said == [None, None]
    assert master.get("hf_zero_offload/launch/rank1/process") == b"h pid 3"


def test_a_process_started_with_a_rank_after_the_launch_agreed_is_still_a_second_process(monkeypatch):
    # (its rank's first process held its claim at the end of its watch: the beat that stood still is not of a death)
    monkeypatch.setattr(launch_watch, "_POLL_S", 0.1)
    master = _master()
    said: list = [None] * 3

    def one(i, rank):
        _watch_on(master, rank, 2, said, i, me=f"h pid {i}")
    for started in (((0, 0), (1, 1)), ((2, 1),)):  # (process, its RANK): the launch, then a late RANK=1
        threads = [threading.Thread(target=one, args=ir) for ir in started]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert said[:2] == [None, None] and "RANK=1 on two processes, h pid 1 and h pid 2 (this one)" in said[2], said
