"""The launch watch's reads of rank 0's rendezvous store (hf_zero_offload/launch_watch.py): only rank 0 reads every
rank's value; the others read rank 0's and its verdict, so that a launch of W processes costs O(W) reads a second on
that store, not W² (each process read every rank's key: 262,144 a second for 512 processes while they arrive)."""
from __future__ import annotations

from test_review38_launch import _watch_all

from hf_zero_offload import launch_watch

_VERDICT = "hf_zero_offload/launch/world_size/verdict"


class _CountingStore:
    def __init__(self, values: dict):
        self.values, self.checked = dict(values), []

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def compare_set(self, key, expected, desired):  # (the claim of a RANK: TCPStore's semantics)
        if self.values.get(key, b"").decode() == expected:
            self.values[key] = desired.encode()
        return self.values[key]

    def check(self, keys):
        self.checked.extend(keys)
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


def _all_said(world: int) -> dict:
    return {launch_watch._KEY.format(r): str(world).encode() for r in range(world)}


def test_a_rank_other_than_0_reads_rank_0s_value_and_verdict_only(monkeypatch):
    monkeypatch.setattr(launch_watch, "_WATCH_S", 0.5)
    monkeypatch.setattr(launch_watch, "_POLL_S", 0.1)
    store = _CountingStore(_all_said(6))
    said = []
    launch_watch._watch(lambda: store, 3, 6, said.append)  # (rank 0's verdict not written yet: one pass)
    # before: rank 3 checked the keys of ranks 0 to 5, as every rank did, each second until all had come
    assert [k for k in store.checked if "/rank" in k] == [launch_watch._KEY.format(0)], store.checked
    launch_watch._watch(lambda: store, 0, 6, said.append)  # rank 0: reads all six, says all agree
    store.checked.clear()
    launch_watch._watch(lambda: store, 3, 6, said.append)
    assert said == [] and store.checked == [launch_watch._KEY.format(0), _VERDICT], store.checked


def test_a_rank_that_agrees_with_rank_0_names_the_one_that_does_not(monkeypatch):
    said = _watch_all([3, 3, 2], monkeypatch)
    assert "WORLD_SIZE=3 on this process (rank 0) but WORLD_SIZE=2 on rank 2" in said[0], said
    assert "WORLD_SIZE=3 on rank 0 and on this process (rank 1) but WORLD_SIZE=2 on rank 2: every process of a run " \
        "must be started with the same WORLD_SIZE" in said[1], said
    assert "WORLD_SIZE=2 on this process (rank 2) but WORLD_SIZE=3 on rank 0" in said[2], said
