"""A step that stops part way. The Adam pass runs tile by tile with the step counts already advanced: Ctrl-C between
two tiles left some params with the step's update and the rest without, and training went on from the mix without a
word; a failed delayed (DPU) step was raised again at every later call, counted steps it never took, and kept its
worker thread and host arena through close(). Now Ctrl-C lands after the step (the state whole), any other failure
makes step and save refuse by name until a load, and a failed delayed step is raised once."""
from __future__ import annotations

import copy
import signal
import threading

import pytest
import torch

from _models import TinyNet, batches, loss_fn, param_groups
from hf_zero_offload import ops
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

LR, WD = 1e-2, 0.1
SMALL = dict(num_threads=1, bucket_numel=1000, tile_numel=300)  # many tiles per step


def _pair(**opts):
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    return ref_model, ref, model, OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL, **opts))


def _backward(model, k):
    ids, labels, use_branch = batches(k + 1)[k]
    loss_fn(model, ids, labels, use_branch).backward()


def _train_on_and_compare(ref_model, ref, model, opt, batch_indices) -> None:
    """Both optimizers on the same batches, then the engine's params against torch AdamW's."""
    for k in batch_indices:
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            _backward(m, k)
            o.step()
    opt.close()
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=n)


def _on_call(monkeypatch, n, action):
    """ops.adam_step runs ``action`` before its n-th call (counted from now), then as usual."""
    real, calls = ops.adam_step, [0]

    def adam_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "adam_step", adam_step)
    return calls


def test_ctrl_c_inside_the_adam_pass_lands_after_the_step(monkeypatch):
    ref_model, ref, model, opt = _pair()
    for k in range(2):
        for m, o in ((ref_model, ref), (model, opt)):
            _backward(m, k)
            o.step()
            o.zero_grad()
    calls = _on_call(monkeypatch, 3, lambda: signal.raise_signal(signal.SIGINT))  # Ctrl-C on the 3rd tile
    _backward(model, 2)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert calls[0] > 3  # the pass went on to its last tile before the interrupt was delivered
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    _backward(ref_model, 2)
    ref.step()
    _train_on_and_compare(ref_model, ref, model, opt, range(3, 5))  # from a whole step 3


def test_a_second_ctrl_c_interrupts_at_once(monkeypatch):
    _, _, model, opt = _pair()
    calls = _on_call(monkeypatch, 2, lambda: [signal.raise_signal(signal.SIGINT) for _ in range(2)])
    _backward(model, 0)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert calls[0] == 2 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(RuntimeError, match=r"step 1 stopped part way \(KeyboardInterrupt: \), so some params hold its "
                                           r"update and some do not: load a state"):
        opt.step()
    opt.close()


def test_a_step_that_failed_part_way_refuses_step_and_save_until_a_load(monkeypatch, tmp_path):
    ref_model, ref, model, opt = _pair()
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    good = opt.state_dict()

    def fail():
        raise MemoryError("no room")

    _on_call(monkeypatch, 4, fail)
    _backward(model, 1)
    with pytest.raises(MemoryError):
        opt.step()
    monkeypatch.undo()
    for action in (opt.step, lambda: opt.save_checkpoint(str(tmp_path / "c"))):
        with pytest.raises(RuntimeError, match=r"step 2 stopped part way \(MemoryError: no room\)"):
            action()
    assert not (tmp_path / "c").exists()
    opt.load_state_dict(good)  # a whole state again: it trains as if step 2 had not happened
    _backward(ref_model, 0)
    ref.step()
    ref.zero_grad()
    _train_on_and_compare(ref_model, ref, model, opt, (1, 2))


def test_a_failed_delayed_step_is_raised_once_then_refused_by_name_and_close_frees_the_worker(monkeypatch, caplog):
    _, _, model, opt = _pair(dpu=True, dpu_warmup_steps=0)

    def fail():
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("worker broke")

    _on_call(monkeypatch, 1, fail)
    _backward(model, 0)
    opt.step()  # submitted to the worker, which fails
    opt.zero_grad()
    _backward(model, 1)
    with pytest.raises(RuntimeError, match="worker broke"):
        opt.step()  # its failure, once
    steps = opt.global_steps
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"the delayed \(DPU\) step stopped part way \(RuntimeError: worker "
                                               r"broke\), so some params"):
            opt.step()
    assert opt.global_steps == steps  # refused steps are not counted
    opt.close()  # no error: the worker stops and the arena goes
    assert not [t for t in threading.enumerate() if t.name.startswith("hzo-dpu")]


def test_a_scripts_own_sigint_handler_gets_the_signal_after_the_step_and_an_ignored_one_stays_ignored(monkeypatch):
    """A training script's graceful-stop handler (a flag) is called once the step is whole; SIG_IGN is left alone
    (a second Ctrl-C must not raise KeyboardInterrupt where the script ignores SIGINT)."""
    seen = []
    _, _, model, opt = _pair()
    old = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(opt.global_steps))
    try:
        _on_call(monkeypatch, 2, lambda: signal.raise_signal(signal.SIGINT))
        _backward(model, 0)
        opt.step()  # no exception: the script's handler took it, after the step
        assert seen == [1]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _on_call(monkeypatch, 2, lambda: [signal.raise_signal(signal.SIGINT) for _ in range(2)])
        opt.zero_grad()
        _backward(model, 1)
        opt.step()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN and opt.global_steps == 2
    finally:
        signal.signal(signal.SIGINT, old)
    opt.close()


def test_ctrl_c_while_the_step_is_decided_counts_no_step(monkeypatch):
    """The step count and the loss scaler moved before the guarded part: a Ctrl-C there counted a step never taken
    (with DPU the delayed mode then began a step early, and the params left the uninterrupted run's)."""
    from hf_zero_offload.engine import core

    _, _, model, opt = _pair()
    real = core.decide_step

    def decide(*args, **kwargs):
        out = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(core, "decide_step", decide)
    _backward(model, 0)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert opt.global_steps == 1 and opt._step_failed is None  # the step it counted was taken, whole
    opt.close()
