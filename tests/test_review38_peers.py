"""What a peer of a ShardedAdam rank that left the lockstep says (engine/sharded/peers.py), 2 gloo ranks: a rank
interrupted (Ctrl-C: KeyboardInterrupt) in a collective method is named as such, and a rank killed inside the same
save as this one is named as in that save too, not blamed for the order of the calls."""
from __future__ import annotations

import os

import pytest
import torch

from _dist import DistributedError, run_distributed
from _models import TinyNet, batches, param_groups, run_steps
from hf_zero_offload.engine import OffloadOptions, ShardedAdam


def _engine(model, stage):
    return ShardedAdam(param_groups(model, 0.01), lr=1e-2, stage=stage,
                       options=OffloadOptions(num_threads=1, bucket_numel=1200))


def _said(call):
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - the test reads what each rank raised (a KeyboardInterrupt too)
        return f"{type(e).__name__}: {e}"
    return None


def _interrupted_step_job(rank, world):
    torch.manual_seed(0)
    model = TinyNet()
    engine = _engine(model, 1)
    data = batches(3, seed=rank)
    run_steps(model, engine, data[:1])
    if rank == 0:
        def interrupted(*_):
            raise KeyboardInterrupt
        engine._prepare = interrupted  # (inside step(), before its first collective)
    return _said(lambda: run_steps(model, engine, data[1:]))


def test_a_rank_interrupted_in_step_is_named_by_its_peer():
    said0, said1 = run_distributed(_interrupted_step_job, timeout=60, collective_timeout=20)
    assert said0 == "KeyboardInterrupt: ", said0
    # before: gloo's "Connection reset by peer ... GLHF!" alone (a KeyboardInterrupt is no Exception: nothing said)
    assert said1.startswith("RuntimeError: rank 0 (host ") and "was interrupted (KeyboardInterrupt) in step()" in said1 \
        and "see that rank's error" in said1 and "same order" not in said1, said1


def _killed_in_save_job(rank, world, directory):
    torch.manual_seed(0)
    model = TinyNet()
    engine = _engine(model, 2)
    run_steps(model, engine, batches(1, seed=rank))
    if rank == 1:
        engine._barrier = lambda: os._exit(9)  # killed inside the save, after it said it was in it
    said = _said(lambda: engine.save_checkpoint(os.path.join(directory, "ck")))
    with open(os.path.join(directory, f"said{rank}"), "w") as f:
        f.write(str(said))


def test_a_rank_killed_in_the_same_save_is_not_blamed_for_the_order_of_calls(tmp_path):
    with pytest.raises(DistributedError, match="exited with code 9"):
        run_distributed(_killed_in_save_job, str(tmp_path), timeout=60, collective_timeout=20)
    said0 = (tmp_path / "said0").read_text()
    # before: "rank 1 ... was in save_checkpoint() (after its step 1); this rank (rank 0) waited for it in
    # save_checkpoint() until it was gone: every rank must make the same ShardedAdam calls ... in the same order"
    assert said0.startswith("RuntimeError: rank 1 (host ") and "was in save_checkpoint() too, as this rank (rank 0) " \
        "was, and ended without a word" in said0 and "same order" not in said0, said0


def _many_engines_job(rank, world, n):
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    model = TinyNet()
    keys = []
    for _ in range(n):  # a long run's engines: built, trained a step, saved nothing, closed
        engine = _engine(model, 2)
        run_steps(model, engine, batches(1, seed=rank))
        keys += [engine._peers.key(r) for r in range(world)]
        engine.close()
    dist.barrier()
    return [bool(store.check([key])) for key in keys]


def test_the_lines_of_engines_every_rank_left_are_taken_back_at_the_next_build():
    # before: each close left its line in the store for good (one key per engine and rank of a long run)
    kept0, kept1 = run_distributed(_many_engines_job, 4, timeout=60, collective_timeout=20)
    assert kept0 == kept1 == [False] * 6 + [True] * 2, (kept0, kept1)
