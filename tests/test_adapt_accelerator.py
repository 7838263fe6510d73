"""``adapt_accelerator`` beyond one process and one training (tests/test_user_loops.py has the one-process loops):
two gloo ranks running a ``ShardedAdam`` through Accelerate, element by element against ``torch.optim.AdamW`` over
the whole batch, with a non-finite gradient on one rank only; ``free_memory()``/``clear()`` between two trainings;
a model prepared before adapting."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

from _dist import run_distributed
from hf_zero_offload.accelerator_patch import adapt_accelerator
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

accelerate = pytest.importorskip("accelerate")
from _accelerate_state import fresh_accelerate_state  # noqa: E402,F401 (autouse)

LR, WD, STEPS = 1e-2, 0.1, 6


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def sharded_rank(rank, world, stage, gas, overflow_at):
    """Each rank takes its half of every batch; on ``overflow_at`` rank 1 alone has an infinite loss, which the
    engine skips (``skip_nonfinite``, as fp16 skips an overflow)."""
    from hf_zero_offload.engine import ShardedAdam

    model = net()
    engine = ShardedAdam(model.named_parameters(), lr=LR, weight_decay=WD, stage=stage, offload=True,
                         options=OffloadOptions(skip_nonfinite=True))
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=gas)
    adapt_accelerator(acc, engine)
    prepared, opt, sched = acc.prepare(model, engine, L.LambdaLR(engine, lambda s: 1 / (1 + s)))
    skipped = []
    for i, (x, y) in enumerate(batches()):
        with acc.accumulate(prepared):
            loss = ((prepared(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean()
            acc.backward(loss * (float("inf") if i == overflow_at and rank == 1 else 1.0))
            opt.step()
            sched.step()
            if acc.sync_gradients:
                skipped.append(acc.optimizer_step_was_skipped)
            opt.zero_grad()
    engine.close()
    return type(prepared).__name__, skipped, [p.detach().clone() for p in model.parameters()]


def adamw_run(gas, overflow_at):
    """The whole batch in one process; the step of the overflowing window skipped, its LR held. Accelerate steps a
    prepared scheduler once per process (its batches are per process), as it does for DDP + AdamW."""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    sched = L.LambdaLR(opt, lambda s: 1 / (1 + s))
    skipped = []
    for i, (x, y) in enumerate(batches()):
        (((model(x) - y) ** 2).mean() / gas).backward()
        if (i + 1) % gas == 0:
            skip = overflow_at // gas == i // gas
            if not skip:
                opt.step()
                for _ in range(2):
                    sched.step()
            skipped.append(skip)
            opt.zero_grad()
    return skipped, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("stage,gas", [(2, 1), (1, 2)])
def test_two_ranks_of_a_sharded_engine_train_as_adamw_on_the_whole_batch(stage, gas):
    """Prepared on two processes, the model gets no DDP wrapper (the engine reduces), the ranks agree bit for bit,
    a non-finite gradient on rank 1 alone is a skipped step on both, and the LR holds on it."""
    overflow_at = 2
    ranks = run_distributed(sharded_rank, stage, gas, overflow_at, world_size=2)
    ref_skipped, ref = adamw_run(gas, overflow_at)
    assert any(ref_skipped)
    for wrapped, skipped, got in ranks:
        assert wrapped == "Sequential" and skipped == ref_skipped
        for p, q in zip(ref, got):
            torch.testing.assert_close(q, p, atol=1e-7, rtol=0)
    for p, q in zip(ranks[0][2], ranks[1][2]):
        assert torch.equal(p, q)


@pytest.mark.parametrize("reset", ["free_memory", "clear"])
def test_free_memory_releases_the_engine_and_the_accelerator_runs_plain_again(reset):
    """It kept the released engine: the next loop's losses scaled by its fp16 scale (a torch AdamW's gradients
    65536x), the engine alive, and another engine refused."""
    model = net()
    engine = OffloadAdam(model.named_parameters(), lr=LR,
                         options=OffloadOptions(fp16={"enabled": True, "initial_scale_power": 16}))
    acc = accelerate.Accelerator(cpu=True)
    adapt_accelerator(acc, engine)
    prepared, opt = acc.prepare(model, engine)
    x, y = batches()[0]
    acc.backward(((prepared(x.half()).float() - y) ** 2).mean())
    opt.step()
    getattr(acc, reset)(prepared, opt)
    engine.close()
    gone = weakref.ref(engine)
    del prepared, opt, engine
    gc.collect()
    assert gone() is None

    model, ref = net(), net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    model, opt = acc.prepare(model, opt)
    acc.backward(((model(x) - y) ** 2).mean())
    ((ref(x) - y) ** 2).mean().backward()
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(q.grad, p.grad)
    acc.free_memory()
    adapt_accelerator(acc, OffloadAdam(net().named_parameters()))  # another engine, the same Accelerator


def test_a_model_prepared_before_adapting_is_refused():
    """On several processes that model is in DDP already, whose reduction the engine then refused at its step."""
    model = net()
    acc = accelerate.Accelerator(cpu=True)
    acc.prepare(model)
    engine = OffloadAdam(model.named_parameters())
    with pytest.raises(RuntimeError, match="before accelerator.prepare.*a model already"):
        adapt_accelerator(acc, engine)
    engine.close()


@pytest.mark.parametrize("fp16", [False, True])
def test_another_optimizer_beside_the_engine(fp16):
    """A GAN's second optimizer on the adapted Accelerator: with fp16 loss scaling every accelerator.backward is
    scaled by the engine's scale, and that optimizer stepped the scaled gradients (65536x) without a word: refused,
    and on an Accelerator of its own it trains as AdamW alone. Without loss scaling it is Accelerate's to prepare."""
    gen, disc, ref = net(), net(), net()
    options = OffloadOptions(fp16={"enabled": True, "initial_scale_power": 16} if fp16 else None)
    engine = OffloadAdam(gen.named_parameters(), lr=LR, options=options)
    acc = accelerate.Accelerator(cpu=True)
    adapt_accelerator(acc, engine)
    gen, engine_w = acc.prepare(gen, engine)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR, foreach=False) for m in (disc, ref))
    if fp16:
        with pytest.raises(ValueError, match=r"fp16 loss scaling.*another optimizer prepared on it \(AdamW\)"):
            acc.prepare(opt)
        acc = accelerate.Accelerator(cpu=True)
    disc, opt = acc.prepare(disc, opt)
    for x, y in batches()[:3]:
        acc.backward(((disc(x) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert not acc.optimizer_step_was_skipped
    for p, q in zip(ref.parameters(), acc.unwrap_model(disc).parameters()):
        assert torch.equal(q, p)
    engine.close()


def fp16_window_run(order, gas=2, overflow_at=2):
    """fp16 loss scaling, ``gas`` micro-batches a step, an overflow on a window's first micro-batch. ``order`` None:
    no Accelerate, by hand (the reference): the window's losses scaled and divided, the LR held on a skipped step."""
    model = net()
    engine = OffloadAdam(model.named_parameters(), lr=LR, weight_decay=WD, options=OffloadOptions(
        fp16={"enabled": True, "initial_scale_power": 16}, gradient_accumulation_steps=gas))
    opt, sched = engine, L.LambdaLR(engine, lambda s: 1 / (1 + s))
    acc = None
    if order is not None:
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=gas)
        adapt_accelerator(acc, engine)
        if order == "scheduler-first":
            sched, opt, model = acc.prepare(sched, opt, model)
        else:  # one call each, the scheduler last
            model, opt, sched = acc.prepare(model), acc.prepare(opt), acc.prepare(sched)
    skipped, lrs = [], []
    for i, (x, y) in enumerate(batches()):
        loss = ((model(x.half()).float() - y) ** 2).mean() * (1e30 if i == overflow_at else 1.0)
        if acc is None:
            engine.scale_loss(loss / gas).backward()
            if (i + 1) % gas:
                continue
            opt.step()
            if not engine.last.skipped:
                sched.step()
            skipped.append(engine.last.skipped)
        else:
            with acc.accumulate(model):
                acc.backward(loss)
                opt.step()
                sched.step()
                if not acc.sync_gradients:
                    opt.zero_grad()
                    continue
                skipped.append(acc.optimizer_step_was_skipped)
        opt.zero_grad()
        lrs.append(engine.param_groups[0]["lr"])
    engine.close()
    return skipped, lrs, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("order", ["scheduler-first", "separate-calls"])
def test_an_overflow_inside_an_accumulation_window_skips_that_step_and_holds_the_lr(order):
    ref_skipped, ref_lrs, ref = fp16_window_run(None)
    assert ref_skipped == [False, True, False]
    skipped, lrs, got = fp16_window_run(order)
    assert (skipped, lrs) == (ref_skipped, ref_lrs)
    for p, q in zip(ref, got):
        assert torch.equal(q, p)


def test_an_adapted_accelerator_dropped_frees_its_engine_without_the_garbage_collector():
    """Its patches held the Accelerator (and the prepared optimizer itself) in reference cycles: the engine a loop
    had dropped lived on, host arena included, until the garbage collector ran."""
    from accelerate import Accelerator

    def loop():
        model = torch.nn.Linear(8, 4)
        engine = OffloadAdam(model.named_parameters(), lr=1e-3)
        accelerator = Accelerator(cpu=True)
        adapt_accelerator(accelerator, engine)
        model, opt = accelerator.prepare(model, engine)
        accelerator.backward(model(torch.randn(2, 8)).square().sum())
        opt.step()
        opt.zero_grad()
        return weakref.ref(engine), weakref.ref(accelerator)

    gc.collect()
    gc.disable()
    try:
        engine, accelerator = loop()
        assert accelerator() is None and engine() is None
    finally:
        gc.enable()
