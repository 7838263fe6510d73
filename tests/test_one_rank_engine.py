"""A ShardedAdam call or failure on one rank only, in a loop of your own (2 gloo ranks): the peer's error names the rank
and what it did (engine/sharded/peers.py), instead of gloo's "Connection closed by peer" alone or a wait until the
collective timeout; a build refused on one rank raises on every rank at once (engine/sharded/agree.py)."""
from __future__ import annotations

import time

import pytest
import torch

from _dist import run_distributed
from _models import TinyNet, batches, param_groups, run_steps
from hf_zero_offload.engine import OffloadOptions, ShardedAdam


def _engine(model, stage, lr=1e-2):
    return ShardedAdam(param_groups(model, 0.01), lr=lr, stage=stage,
                       options=OffloadOptions(num_threads=1, bucket_numel=1200))


def _said(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(e).__name__}: {e}"
    return None


def _bad_build_job(rank, world, stage, how):
    torch.manual_seed(0)
    model = TinyNet()
    if rank == 1 and how == "ram":
        import hf_zero_offload.engine.lifetime as lifetime

        def no_room(need, *_):
            raise MemoryError(f"the engine needs {need} bytes of host RAM (a test's refusal)")
        lifetime.check_host_ram = no_room
    t = time.monotonic()
    said = _said(lambda: _engine(model, stage, lr=-1.0 if (rank == 1 and how == "lr") else 1e-2))
    return said, time.monotonic() - t


@pytest.mark.parametrize("stage,how", [(2, "lr"), (1, "ram")])
def test_a_build_refused_on_one_rank_raises_on_every_rank_naming_it(stage, how):
    # before: rank 1 raised alone; rank 0 failed in the agreement's gather with gloo's words only
    (said0, t0), (said1, _) = run_distributed(_bad_build_job, stage, how, timeout=60, collective_timeout=20)
    want = "lr must be a finite number" if how == "lr" else "needs"
    assert said1.startswith("ValueError" if how == "lr" else "MemoryError") and want in said1, said1
    assert said0.startswith("RuntimeError: rank 1 (host ") and want in said0 and "Connection" not in said0, said0
    assert t0 < 10, t0


def _close_job(rank, world, stage):
    torch.manual_seed(0)
    model = TinyNet()
    engine = _engine(model, stage)
    data = batches(3, seed=rank)
    run_steps(model, engine, data[:1])
    if rank == 0:
        engine.close()
    return _said(lambda: run_steps(model, engine, data[1:]))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_close_on_one_rank_is_named_by_the_peer(stage):
    said0, said1 = run_distributed(_close_job, stage, timeout=60, collective_timeout=20)
    assert "ShardedAdam was closed" in said0, said0
    # before: "RuntimeError: [.../pair.cc:553] Connection closed by peer ... GLHF!" alone
    assert said1.startswith("RuntimeError: rank 0 (host ") and "closed its ShardedAdam (close()) after its step 1" \
        in said1, said1
    assert ("in step()" if stage == 1 else "in the gradient reduction of a backward") in said1, said1


def _save_alone_job(rank, world, directory):
    torch.manual_seed(0)
    model = TinyNet()
    engine = _engine(model, 2)
    data = batches(3, seed=rank)
    run_steps(model, engine, data[:1])
    if rank == 0:
        return _said(lambda: engine.save_checkpoint(directory))
    return _said(lambda: run_steps(model, engine, data[1:]))


def test_a_save_on_one_rank_is_named_on_both_at_the_collective_timeout(tmp_path):
    # stage 2: rank 1 waits in its next backward's reduction; both used to time out in gloo's words alone
    said0, said1 = run_distributed(_save_alone_job, str(tmp_path / "ck"), timeout=60, collective_timeout=3)
    assert "was in save_checkpoint() and the other ranks did not come to it" in said0, said0
    # both ranks wait the same 3 s: rank 1's own timeout, or rank 0's error ending it first (then gloo's "closed")
    assert said1.startswith("RuntimeError: rank 0 (host ") and "was in save_checkpoint() (after its step 1)" in said1 \
        and ("until the collective timeout" in said1 or "until it was gone" in said1), said1
