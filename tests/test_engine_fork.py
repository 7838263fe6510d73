"""An engine with a delayed update (DPU) in a fork()ed child (a trial runner, a user's multiprocessing "fork"): the
child trains on as the parent would, and a fork while a delayed step runs leaves a child that refuses to step, by
name. The DPU worker is a thread: the child has none, and a child's step waited forever for it."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading

import pytest
import torch

from hf_zero_offload.engine import OffloadAdam, OffloadOptions

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork start method")


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    engine = OffloadAdam(model.parameters(), lr=1e-2, options=OffloadOptions(num_threads=1, dpu=True,
                                                                             dpu_warmup_steps=1))
    g = torch.Generator().manual_seed(1)
    return model, engine, [torch.randn(4, 32, generator=g) for _ in range(6)]


def _step(model, engine, x):
    engine.zero_grad()
    model(x).square().mean().backward()
    engine.step()


def _child_run(model, engine, xs, queue):
    torch.set_num_threads(1)  # as DataLoader workers do: a child's OpenMP region after the parent's can hang (libgomp)
    try:
        for x in xs:
            _step(model, engine, x)
        engine.flush()
        queue.put([p.detach().numpy().copy() for p in model.parameters()])
    except Exception as e:  # noqa: BLE001 - reported to the parent
        first = f"{type(e).__name__}: {e}"
        try:  # once raised, the step that stopped part way is refused by name
            _step(model, engine, xs[-1])
            queue.put(first + " || then stepped")
        except Exception as again:  # noqa: BLE001
            queue.put(f"{first} || {type(again).__name__}: {again}")


def _child_step(model, engine, xs, queue):  # the step of a backward the parent ran
    torch.set_num_threads(1)
    try:
        engine.step()
        queue.put("stepped")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        queue.put(f"{type(e).__name__}: {e}")


def _in_child(model, engine, xs, target=_child_run) -> list | str:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(model, engine, xs, queue))
    proc.start()
    try:
        return queue.get(timeout=60)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def test_a_forked_child_trains_on_as_the_parent_does():
    model, engine, xs = _setup()
    for x in xs[:3]:
        _step(model, engine, x)
    engine.flush()
    got = _in_child(model, engine, xs[3:])
    assert not isinstance(got, str), got
    for x in xs[3:]:
        _step(model, engine, x)
    engine.flush()
    for a, b in zip(got, model.parameters()):
        assert torch.equal(torch.from_numpy(a), b.detach())
    engine.close()


def test_a_fork_during_a_delayed_step_leaves_a_child_that_refuses_by_name():
    model, engine, xs = _setup()
    _step(model, engine, xs[0])  # the warm-up step runs in place
    release, original = threading.Event(), engine._adam_pass

    def held(*args, **kwargs):
        release.wait(30)
        return original(*args, **kwargs)

    engine._adam_pass = held
    _step(model, engine, xs[1])  # a delayed step, held on the worker thread
    try:
        got = _in_child(model, engine, xs[2:4])
    finally:
        release.set()
    assert isinstance(got, str) and got.startswith("ForkedMidTask: this process was forked while the task ran"), got
    assert "|| RuntimeError: the delayed (DPU) step stopped part way (ForkedMidTask" in got and "load a state" in got
    engine._adam_pass = original
    for x in xs[2:4]:  # the parent's step went on
        _step(model, engine, x)
    engine.flush()
    engine.close()


def test_a_fork_during_a_gradient_scatter_leaves_a_child_that_refuses():
    """The scatter thread (on CUDA by default, opt-in on a CPU): a child forked while a scatter ran waited forever."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    engine = OffloadAdam(model.parameters(), lr=1e-2, options=OffloadOptions(num_threads=1, scatter_thread=True,
                                                                             bucket_numel=2048))
    release, original, parent = threading.Event(), engine.pipeline._retire, os.getpid()

    def held(*args, **kwargs):  # held in the parent only: a child's own scatter runs at once
        if os.getpid() == parent:
            release.wait(30)
        return original(*args, **kwargs)

    engine.pipeline._retire = held
    engine.zero_grad()
    model(torch.randn(4, 32)).square().mean().backward()  # scatters queued, held on the helper thread
    try:
        got = _in_child(model, engine, [], target=_child_step)
    finally:
        release.set()
    assert got.startswith("ForkedMidTask: this process was forked while the task ran"), got
    engine.step()  # the parent's goes on
    engine.close()
