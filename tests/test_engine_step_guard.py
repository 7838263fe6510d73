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


@pytest.mark.parametrize("dpu", [False, True])
def test_fp16_overflow_at_the_minimum_scale_stops_as_deepspeed_does(dpu):
    """A step that overflows with the dynamic scale at min_loss_scale and the hysteresis spent can only be skipped, and
    so can every later one (a NaN loss): the run went on skipping with no word. DeepSpeed's DynamicLossScaler raises
    there; so does the engine, in its words, before anything moves: the step untaken, the state whole."""
    from hf_zero_offload.engine.loss_scaler import LossScaleAtMinimum

    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=2, loss_scale_window=1000, hysteresis=1,
                min_loss_scale=1)
    _, _, model, opt = _pair(fp16=fp16, dpu=dpu, dpu_warmup_steps=0)
    model.half()  # frozen params and buffers; the engine cast the trainable ones
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    opt.flush()
    masters, steps = opt.master.clone(), opt._param_steps.clone()
    scales = []
    with pytest.raises(LossScaleAtMinimum, match=r"^Current loss scale already at minimum - cannot decrease scale "
                                                  r"anymore\. Exiting run\. \(hf_zero_offload: step 4 overflowed"):
        for _ in range(5):
            (opt.scale_loss(torch.tensor(float("nan"))) * model.body[0].weight.sum()).backward()
            opt.step()
            scales.append(opt.loss_scale)
            opt.zero_grad()
    assert scales == [2, 1]  # 4 -> 2 -> 1, then the third overflow at 1 raises
    assert opt.global_steps == 3 and opt.loss_scale == 1
    opt.flush()
    assert torch.equal(opt.master, masters) and torch.equal(opt._param_steps, steps)
    opt.zero_grad()  # the refused step's gradients dropped: the engine trains on
    _backward(model, 1)
    opt.step()
    assert opt.global_steps == 4 and not opt.last.skipped
    opt.close()


@pytest.mark.parametrize("change, named", [
    (dict(hysteresis=0), "hysteresis must be an integer >= 1, got 0"),
    (dict(loss_scale_window=0), "loss_scale_window must be an integer >= 1, got 0"),
    (dict(initial_scale_power=2000), r"initial_scale_power must be an integer in \[0, 126\], got 2000"),
    (dict(min_loss_scale=0.0), r"min_loss_scale must be a number in \[2\*\*-126, 2\*\*126\], got 0.0"),
    (dict(min_loss_scale=1e9), r"min_loss_scale must be at most the initial scale"),
    (dict(loss_scale=0.5), r"loss_scale must be 0 \(dynamic\) or a static scale in \[1, 2\*\*126\], got 0.5"),
    (dict(hysteresis=True), "hysteresis must be an integer >= 1, got True"),
])
def test_fp16_options_without_a_ds_config_are_checked_as_the_ds_config_is(change, named):
    """The ds_config refuses these by key; OffloadOptions.fp16 took them: a window of 0 failed with a
    ZeroDivisionError at the third step (then reported as a step stopped part way), hysteresis 0 never lowered the
    scale, a power of 2000 raised an OverflowError naming nothing."""
    fp16 = {**dict(enabled=True, loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                   min_loss_scale=1.0), **change}
    model = TinyNet()
    with pytest.raises(ValueError, match=r"OffloadOptions\.fp16\." + named):
        OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(fp16=fp16))
