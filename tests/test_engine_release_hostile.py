"""The end of an engine (close, replacement) at the worst times: mid-backward from a user's hook, from another thread
during step(), with a Ctrl-C or a failure part way; and what an ended engine still reports (test_engine_release.py has
the ordinary cases)."""
from __future__ import annotations

import copy
import signal
import threading
import time

import pytest
import torch

from _models import TinyNet, batches, loss_fn, run_steps
from hf_zero_offload.engine import moments
from test_engine_release import KINDS, build, buffers, helper_threads, trained


@pytest.mark.parametrize("kind", ["zero2-offload-dpu", "offload"])
def test_close_from_a_users_hook_mid_backward_leaves_the_rest_of_backward_plain_torch(kind):
    """A user's post-accumulate-grad hook closes the engine: the engine's hook on that param (torch had taken its
    list of hooks already) ran and refused as "registered after the engine's"; ZeRO-2's end-of-backward callback
    then reduced its waiting bucket (a collective of a closed engine) and took 7 params' .grad, lost."""
    torch.manual_seed(0)
    model = TinyNet()
    armed = []

    def close_once(p):
        if armed:
            armed.clear()
            engine.close()
    model.body[0].weight.register_post_accumulate_grad_hook(close_once)
    engine = build(kind, model)
    run_steps(model, engine, batches(2))
    engine.flush()
    ref = copy.deepcopy(model)  # (its hooks are not copied: plain torch)
    data = batches(1, seed=3)[0]
    loss_fn(ref, *data).backward()
    armed.append(1)
    loss_fn(model, *data).backward()
    assert engine.memory_bytes()["host"] == 0
    got = dict(model.named_parameters())
    kept = [n for n, p in ref.named_parameters() if p.requires_grad and got[n].grad is not None]
    if kind.startswith("zero2"):  # one bucket, not yet reduced when the hook closed it: every gradient stays
        assert len(kept) == sum(p.requires_grad for p in ref.parameters())
    assert "body.0.weight" in kept
    for n in kept:
        torch.testing.assert_close(got[n].grad, dict(ref.named_parameters())[n].grad, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["offload", "offload-dpu", "zero1-device"])
def test_close_from_another_thread_waits_for_the_step_in_progress(kind, monkeypatch):
    """It released the buffers under the step: AttributeError/TypeError on a None, or "cannot schedule new futures
    after shutdown" (DPU), half way through the update."""
    model, engine = trained(kind)
    loss_fn(model, *batches(1, seed=4)[0]).backward()
    adam = moments.Moments.adam
    monkeypatch.setattr(moments.Moments, "adam", lambda *a, **k: (time.sleep(0.2), adam(*a, **k))[1])
    errors = []

    def step():
        try:
            engine.step()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=step)
    held = buffers(engine)
    t.start()
    time.sleep(0.1)
    engine.close()
    t.join()
    assert not errors
    assert all(ref.expired() for ref in held) and not helper_threads()


@pytest.mark.parametrize("kind", ["offload-dpu", "zero2-offload-dpu"])
def test_a_failure_or_ctrl_c_during_close_still_releases_everything(kind):
    """A stream sync that raised (or a Ctrl-C) part way: the engine refused from then on, kept its arena and its
    worker, and a second close() returned at once without releasing them."""
    for interrupt in ("raise", "sigint"):
        model, engine = trained(kind)
        held = buffers(engine)

        def sync():
            if interrupt == "raise":
                raise RuntimeError("CUDA error: an illegal memory access")
            signal.raise_signal(signal.SIGINT)  # held until the release is done, then delivered
        engine.streams.synchronize = sync
        with pytest.raises(RuntimeError if interrupt == "raise" else KeyboardInterrupt):
            engine.close()
        assert all(ref.expired() for ref in held) and not helper_threads()
        engine.close()  # nothing
        with pytest.raises(RuntimeError, match="was closed; build a new engine"):
            engine.step()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_memory_bytes_says_zero_once_the_engine_ended(kind):
    """ShardedAdam reported its allocation after the release; OffloadAdam had no memory_bytes()."""
    model, engine = trained(kind)
    mem = engine.memory_bytes()
    assert mem["host"] == (engine.arena.nbytes if engine.arena is not None else 0)
    assert mem["optimizer_state"] > 0 and mem["device"] == engine.plan.device_bytes
    new = build(kind, model)
    assert set(engine.memory_bytes().values()) == {0}  # replaced
    new.close()
    assert set(new.memory_bytes().values()) == {0}
