"""The offload engine's delayed parameter update (DPU) against its reference schedule, element by element.

Tests taking the ``mode`` fixture run on the plain CPU path, on the stream simulator and on a GPU when there is one
(``-m cuda``); see tests/_modes.py.
"""
from __future__ import annotations

import copy
import logging
import os

# cuBLAS is deterministic on one stream only with a fixed workspace; set before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

from _engine_pair import LR, WD, assert_models_close, engine, resume_and_train  # noqa: E402
from _models import (TinyNet, batches, delayed_update_reference, loss_fn, param_groups, run_steps,  # noqa: E402
                     write_some_params)
from hf_zero_offload.engine import OffloadAdam, OffloadOptions  # noqa: E402


@pytest.mark.parametrize("warmup", [0, 3])
def test_dpu_follows_the_delayed_schedule(mode, warmup):
    data = mode.data(batches(9))
    torch.manual_seed(0)
    ref_device, ref_master = delayed_update_reference(mode.model(TinyNet()), data, warmup, lr=LR, weight_decay=WD)
    torch.manual_seed(0)
    model = mode.model(TinyNet())
    opt = engine(mode, model, dpu=True, dpu_warmup_steps=warmup)
    for ids, labels, use_branch in data:
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
    assert opt.needs_publish == (len(data) > warmup)
    mode.sync()
    assert_models_close(ref_device, model, rtol=1e-5, atol=1e-6)  # device one step behind
    opt.flush()
    mode.sync()
    assert_models_close(ref_master, model, rtol=1e-5, atol=1e-6)  # masters are the latest step
    opt.close()


@pytest.mark.parametrize("at", [2, 5, 8], ids=["warm-up", "in-flight", "last"])
def test_dpu_params_written_between_steps_are_what_the_next_step_starts_from(mode, at):
    """A write while a delayed step was in flight (a Trainer callback's edit) was published over, with a warning
    to flush() first: the plain Trainer trains on from the written weights (docs/TORCH_CONVENTIONS.md: a param written between steps
    is what the next step starts from)."""
    data = mode.data(batches(8))
    torch.manual_seed(0)
    ref_device, ref_master = delayed_update_reference(mode.model(TinyNet()), data, 3, lr=LR, weight_decay=WD,
                                                      edit=(at, write_some_params))
    torch.manual_seed(0)
    model = mode.model(TinyNet())
    opt = engine(mode, model, dpu=True, dpu_warmup_steps=3)
    for k, (ids, labels, use_branch) in enumerate(data, start=1):
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
        if k == at:
            mode.host_write()
            write_some_params(model)
    mode.sync()
    assert_models_close(ref_device, model, rtol=1e-5, atol=1e-6)
    opt.flush()
    mode.sync()
    assert_models_close(ref_master, model, rtol=1e-5, atol=1e-6)
    assert model.body[0].weight.eq(0.5).all() == (at == 8)
    opt.close()


def test_dpu_a_param_written_during_every_delayed_step_is_warned_about(caplog):
    """Each write keeps its values over the delayed step's update (above), so a param written during every delayed
    step (nn.Embedding(max_norm=...) renormalises its weight at each forward) no longer trains: an INFO line per step
    was all; a warning names its shape after three in a row, once. A write at every other step does not warn."""
    caplog.set_level(logging.INFO, logger="hf_zero_offload")
    torch.manual_seed(0)
    model = TinyNet()
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(num_threads=1, dpu=True,
                                                                            dpu_warmup_steps=0))
    every, other = model.body[0].weight, model.body[2].weight
    for k, (ids, labels, use_branch) in enumerate(batches(7), start=1):
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            every.mul_(1.0)  # a write that changes nothing, at every step
            if k % 2:
                other.mul_(1.0)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "in place" in r.getMessage()]
    assert warned == [f"hf_zero_offload: a parameter of shape {tuple(every.shape)} was written in place during each "
                      "of the last 3 delayed steps (DPU): each write keeps its values and drops that step's update, "
                      "so it no longer trains. Find what writes it at every step (nn.Embedding(max_norm=...) "
                      "renormalises its weight at each forward), or turn delayed_param_update off"]
    opt.close()


def test_dpu_overflow_step_is_synchronous(mode):
    """fp16 + DPU with overflows injected at steps 4 and 5: the overflow step finishes and publishes
    the delayed step in flight and runs no Adam (DESIGN.md's timeline), against a hand-written fp16
    reference driven in lockstep with the engine's loss scale."""
    torch.manual_seed(0)
    model = mode.model(TinyNet())
    ref_device = copy.deepcopy(model).half()
    master = copy.deepcopy(model)
    ref = torch.optim.AdamW(param_groups(master, WD), lr=LR, foreach=False)
    pairs = [(d, m) for d, m in zip(ref_device.parameters(), master.parameters()) if d.requires_grad]
    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=8, hysteresis=2)
    opt = engine(mode, model, fp16=fp16, dpu=True, dpu_warmup_steps=1)
    model.half()
    overflow_at, warmup = (4, 5), 1
    for k, (ids, labels, use_branch) in enumerate(mode.data(batches(9)), start=1):
        scale = opt.loss_scale
        for m in (model, ref_device):
            loss = loss_fn(m, ids, labels, use_branch) * scale
            (loss * float("inf") if k in overflow_at else loss).backward()
        opt.step()
        opt.zero_grad()
        grads = [None if d.grad is None else d.grad.float() / scale for d, _ in pairs]
        for d, _ in pairs:
            d.grad = None
        with torch.no_grad():
            publish = lambda: [d.copy_(m) for d, m in pairs]  # noqa: E731
            if k in overflow_at:
                publish()
                continue
            for (_, m), g in zip(pairs, grads):
                m.grad = g
            if k > warmup:
                publish()
            ref.step()
            ref.zero_grad()
            if k <= warmup:
                publish()
    assert not opt.last.skipped and opt.loss_scale == 128  # two overflows, hysteresis 2: halved once
    mode.sync()
    assert_models_close(ref_device, model, rtol=2e-3, atol=2e-3)  # fp16 params, one step behind
    opt.flush()
    mode.sync()
    assert_models_close(master.half(), model, rtol=2e-3, atol=2e-3)
    opt.close()


def test_dpu_keeps_params_that_never_had_a_gradient(mode):
    torch.manual_seed(0)
    model = mode.model(TinyNet())
    before = model.branch.weight.detach().clone()
    opt = engine(mode, model, dpu=True, dpu_warmup_steps=0)
    for ids, labels, _ in mode.data(batches(4)):
        loss_fn(model, ids, labels, False).backward()  # the branch never runs
        opt.step()
        opt.zero_grad()
    opt.flush()
    mode.sync()
    assert torch.equal(model.branch.weight, before)
    opt.close()


@pytest.mark.parametrize("via", ["checkpoint", "state_dict"])
@pytest.mark.parametrize("engine_first", [False, True], ids=["model-then-engine", "engine-then-model"])
def test_dpu_resume_loads_the_model_and_the_engine_in_either_order(tmp_path, via, engine_first):
    """A state saved with a delayed step in flight, resumed: the model's weights of that moment may be loaded before or
    after the engine's state. Loaded after (a loop of one's own: engine.load_checkpoint, then model.load_state_dict),
    they counted as a write during the delayed step, which kept them and dropped that step's update: the resumed run
    went on one update short, 1.3e-2 off the uninterrupted one, without a word (docs/LOOPS.md's resume)."""
    data = batches(8)
    torch.manual_seed(0)
    model = TinyNet()
    options = OffloadOptions(num_threads=1, dpu=True, dpu_warmup_steps=2)
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=options)
    run_steps(model, opt, data[:5])
    assert opt.needs_publish  # saved mid-delay: the masters one step ahead of the model
    weights = copy.deepcopy(model.state_dict())
    state = opt.state_dict() if via == "state_dict" else opt.save_checkpoint(str(tmp_path)) and None
    run_steps(model, opt, data[5:])
    opt.flush()
    opt.close()

    load_state = (lambda e: e.load_state_dict(state)) if via == "state_dict" else (
        lambda e: e.load_checkpoint(str(tmp_path)))
    again, resumed = resume_and_train(weights, load_state, options, data[5:], engine_first=engine_first)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    resumed.close()
