"""A param on another device than the one its engine was built for is refused by name (grad_hooks.device_moved).

An engine built over a model still on the CPU, whose model then moved (``model.to("cuda")``, ``accelerator.prepare``,
a plain Trainer placing the model in its ``__init__`` after the user built the engine), kept its CPU buckets and
streams and copied each gradient through them: unverified on a GPU, and not what the engine was built for. Now the next
backward (the gradient hooks), step or ``adopt_changed_params`` (a Trainer's train()) refuses, naming the param.

On a CPU-only machine torch cannot put a CPU param on another device (``p.data = meta`` is refused as an incompatible
tensor type, and ``torch.utils.swap_tensors`` refuses a tensor the engine holds a weak reference to), so the CPU tests
pretend the engine was built on ``meta`` (``built_on``); the CUDA tier moves the model for real.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from _models import TinyNet, batches, loss_fn, param_groups, run_steps
from _t5 import ToyDataset, tiny_t5
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DPU = {"dpu": True, "dpu_warmup_steps": 1}
KINDS = {"offload": (OffloadAdam, {}, {}), "offload-dpu": (OffloadAdam, {}, DPU),
         "zero2-offload-dpu": (ShardedAdam, {"stage": 2}, DPU),
         "zero1-device": (ShardedAdam, {"stage": 1, "offload": False}, {})}


def build(kind, model, **kw):
    cls, extra, opts = KINDS[kind]
    return cls(model.named_parameters(), lr=1e-2, options=OffloadOptions(num_threads=1, **opts), **extra, **kw)


def built_on(engine, device: str) -> None:
    """Stand-in: the engine (and its gradient hooks) believe they were built on ``device``."""
    engine._params_on = torch.device(device)
    for owner in ("pipeline", "reducer"):
        hooks = getattr(getattr(engine, owner, None), "hooks", None)
        if hooks is not None:
            for k in hooks._device:
                hooks._device[k] = engine._params_on


def refusal(cls, built, now, name=""):
    return (rf"{cls.__name__} was built with its params on {built}; param {name}.*? is now on {now}: "
            r"an engine's gradient buckets .* Build the engine after moving the model")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_param_on_another_device_is_refused_by_name_and_loses_nothing(kind):
    torch.manual_seed(0)
    model = TinyNet()
    engine = build(kind, model)
    run_steps(model, engine, batches(2))
    engine.flush()
    masters, steps = engine.master.clone(), engine.global_steps
    built_on(engine, "meta")
    body = model.body[0].weight
    body.data = body.data.clone()  # rebound (as .to() rebinds): a step looks at it
    match = refusal(type(engine), "meta", "cpu")
    if kind == "zero1-device":  # gradients read from .grad at step(): refused there
        loss_fn(model, *batches(1)[0]).backward()
        with pytest.raises(RuntimeError, match=refusal(type(engine), "meta", "cpu", r"body\.0\.weight")):
            engine.step()
    else:  # at the first gradient of backward
        with pytest.raises(RuntimeError, match=match):
            loss_fn(model, *batches(1)[0]).backward()
        with pytest.raises(RuntimeError, match=refusal(type(engine), "meta", "cpu", r"body\.0\.weight")):
            engine.step()
    with pytest.raises(RuntimeError, match=match):  # what a Trainer's train() calls first
        engine.adopt_changed_params()
    assert engine.global_steps == steps and torch.equal(engine.master, masters)
    engine.close()


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.out = nn.Conv2d(3, 4, 3), nn.Linear(64, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.conv(x)).flatten(1))


def test_moves_on_the_engines_own_device_are_adopted_as_adamw_takes_them():
    """Not refused: ``.to("cpu")`` of a CPU model, ``.to(memory_format=...)`` (a rebind, made contiguous again), an
    engine given ``device="cpu:0"`` (its params' device reads "cpu": it was compared as another device)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 3, 6, 6, generator=g), torch.randn(2, 2, generator=g)) for _ in range(4)]
    runs = []
    for kind in ("adamw", "engine"):
        model = Conv()
        if kind == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        else:
            opt = OffloadAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1, device="cpu:0")
        for i, (x, y) in enumerate(data):
            if i == 1:
                model.to(memory_format=torch.channels_last)
            if i == 2:
                model.to("cpu")
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append(model)
    for (n, a), b in zip(runs[0].named_parameters(), runs[1].parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=n)


def _callback_trainer(tmp_path, model, engine, **kw):
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from hf_zero_offload import ZeroOffloadCallback
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                                    save_strategy="no", disable_tqdm=True, max_grad_norm=0.0, **kw)
    return Seq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset(), optimizers=(engine, None),
                          callbacks=[ZeroOffloadCallback()])


def test_a_plain_trainer_placing_the_model_on_the_engines_device_trains(tmp_path):
    """The Trainer's own placement (``model.to(args.device)`` in its ``__init__``) on the engine's device rebinds
    nothing; an engine that believes it was built elsewhere is refused at train() (``on_train_begin``), by name."""
    model = tiny_t5()
    engine = OffloadAdam(model.named_parameters(), lr=1e-2)
    ptrs = [p.data_ptr() for p in model.parameters()]
    trainer = _callback_trainer(tmp_path, model, engine, use_cpu=True)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    trainer.train()
    assert engine.global_steps == 2
    built_on(engine, "meta")
    with pytest.raises(RuntimeError, match=refusal(OffloadAdam, "meta", "cpu")):
        trainer.train()
    engine.close()


# -- on a GPU: the real move -----------------------------------------------------------------------
@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_model_moved_to_the_gpu_after_the_build_is_refused(kind):
    torch.manual_seed(0)
    model = TinyNet()
    engine = build(kind, model)  # on the CPU: its buckets and streams too
    model.to("cuda")
    ids, labels, branch = (t.cuda() if torch.is_tensor(t) else t for t in batches(1)[0])
    match = refusal(type(engine), "cpu", r"cuda:\d")
    if kind == "zero1-device":
        loss_fn(model, ids, labels, branch).backward()
        with pytest.raises(RuntimeError, match=match):
            engine.step()
    else:
        with pytest.raises(RuntimeError, match=match):
            loss_fn(model, ids, labels, branch).backward()
    engine.close()
    # built with device="cuda" (the params moved by the engine), a later model.to("cuda") is nothing: it trains
    model = TinyNet()
    engine = build(kind, model, device="cuda")
    model.to("cuda")
    run_steps(model, engine, [tuple(t.cuda() if torch.is_tensor(t) else t for t in b) for b in batches(2)])
    assert engine.global_steps == 2
    engine.close()


@pytest.mark.cuda
@cuda
def test_accelerate_moving_a_model_under_a_cpu_engine_is_refused():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from hf_zero_offload.accelerator_patch import adapt_accelerator
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        model = TinyNet()
        engine = OffloadAdam(param_groups(model, 0.0), lr=1e-2)
        acc = accelerate.Accelerator()
        adapt_accelerator(acc, engine)
        model, opt = acc.prepare(model, engine)
        assert next(model.parameters()).device.type == "cuda"
        ids, labels, branch = batches(1)[0]
        with pytest.raises(RuntimeError, match=refusal(OffloadAdam, "cpu", r"cuda:\d", "of shape")):
            acc.backward(loss_fn(model, ids.cuda(), labels.cuda(), branch))
        engine.close()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.cuda
@cuda
def test_a_plain_trainer_moving_the_model_after_the_build(tmp_path):
    """Built on the CPU model, refused at train(); built with ``device=args.device``, the Trainer's move is nothing."""
    model = tiny_t5()
    engine = OffloadAdam(model.named_parameters(), lr=1e-2)
    trainer = _callback_trainer(tmp_path / "cpu", model, engine)
    with pytest.raises(RuntimeError, match=refusal(OffloadAdam, "cpu", r"cuda:\d")):
        trainer.train()
    engine.close()
    model = tiny_t5()
    engine = OffloadAdam(model.named_parameters(), lr=1e-2, device="cuda")
    trainer = _callback_trainer(tmp_path / "cuda", model, engine)
    trainer.train()
    assert engine.global_steps == 2
    engine.close()


@pytest.mark.parametrize("kind", ["offload-dpu", "zero2-offload-dpu"])
def test_flush_of_a_moved_model_is_refused_by_name_and_keeps_the_step_in_flight(kind):
    """flush() (a delayed step's publish) was the one use of an engine whose model moved that was not refused: it
    published across devices. Now refused as backward, step() and adopt_changed_params() are, leaving the step in
    flight; once the model is back, the flush publishes it, equal to an engine never refused."""
    torch.manual_seed(0)
    model, ref = TinyNet(), TinyNet()
    ref.load_state_dict(model.state_dict())
    engine, ref_engine = build(kind, model), build(kind, ref)
    run_steps(model, engine, batches(3))
    run_steps(ref, ref_engine, batches(3))
    assert engine.needs_publish  # a delayed step in flight
    before = [p.detach().clone() for p in model.parameters()]
    built_on(engine, "meta")
    with pytest.raises(RuntimeError, match=refusal(type(engine), "meta", "cpu", "embed.weight")):
        engine.flush()
    assert engine.needs_publish and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    built_on(engine, "cpu")
    engine.flush()
    ref_engine.flush()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    engine.close()
    ref_engine.close()
