"""Shared by the ``test_peer_deepspeed*`` files: the port's dtypes, offloads and tolerances, the default/slow
tier split of a parameter list, the peer's one-process "distributed" environment, and the check of a run against
the plain Trainer."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from _peer import assert_tracks, plain_trainer, steps, weights

HERE = Path(__file__).resolve().parent
DTYPES = ["fp32", "bf16", "fp16"]  # the peer's bf16, fp16 (GPU); fp32 added on CPU
OFFLOADS = ["cpu", "none"]  # the peer's zero2 offloads to cpu; "none" = ZeRO-2 without offload
#: per dtype: the weights' distance from the fp32 reference (absolute), the logged losses' (relative)
TOL = {"fp32": (1e-7, 1e-6), "bf16": (1e-5, 2e-2), "fp16": (1e-6, 3e-3)}
slow = pytest.mark.slow


def fast(first, *rest):
    """Parameter values: the first in the default tier, the rest marked slow."""
    return [first, *(pytest.param(v, marks=slow) for v in rest)]


@pytest.fixture
def dist_env_1(monkeypatch):
    """The peer's mockenv for a one-process "distributed" run (a notebook / no launcher), on a free port rather than
    the peer's fixed 10999: the Trainer binds it, and two test runs on one machine would collide."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    was = torch.distributed.is_initialized()
    yield
    if not was and torch.distributed.is_initialized():  # the Trainer's one-rank group: later tests run without one
        torch.distributed.destroy_process_group()


def check_against_plain(trainer, tmp_path, dtype, ds_scheduler=True, **kw):
    """``trainer`` (trained) against the plain Trainer with the same arguments: weights and each logged step's
    loss and learning rate. The peer's WarmupLR with warmup_num_steps "auto" (--warmup_steps 0) is a constant."""
    ref = plain_trainer(tmp_path / "plain", lr_scheduler_type="constant" if ds_scheduler else "linear", **kw)
    ref.train()
    wtol, ltol = TOL[dtype]
    assert_tracks(weights(trainer), weights(ref), (kw.get("a", 0), kw.get("b", 0)), wtol)
    ours, theirs = steps(trainer, "loss", "learning_rate"), steps(ref, "loss", "learning_rate")
    assert len(ours) == len(theirs) > 0
    assert [lr for _, lr in ours] == pytest.approx([lr for _, lr in theirs], rel=1e-6)
    assert [loss for loss, _ in ours] == pytest.approx([loss for loss, _ in theirs], rel=ltol)
