"""``accelerator.clip_grad_norm_`` on an adapted Accelerator, and ``engine.clip_grad_norm_`` in a loop of one's own.

The engines take the gradients during backward and free ``.grad``: Accelerate's ``clip_grad_norm_`` (torch's) found
none, clipped nothing and returned 0.0, and the loop trained unclipped. Reference: the same Accelerate loop with
``torch.optim.AdamW(foreach=False)``, whose clipping clips, element by element; where torch has no counterpart (DPU,
fp16 loss scaling, int8 moments) the same engine clipping by ``OffloadOptions(max_grad_norm)``, bit for bit: the
call reuses that one clipping."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from _clip_ref import adamw_clipped, assert_ranks_match
from _dist import run_distributed
from hf_zero_offload.accelerator_patch import adapt_accelerator
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

accelerate = pytest.importorskip("accelerate")
from _accelerate_state import fresh_accelerate_state  # noqa: E402,F401 (autouse)

LR, WD, MAX = 1e-2, 0.1, 0.5
FP16 = {"enabled": True, "initial_scale_power": 8}


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batches(n):
    g = torch.Generator().manual_seed(1)  # targets far off: every step's norm is above MAX
    return [(torch.randn(8, 8, generator=g), 3 * torch.randn(8, 4, generator=g)) for _ in range(n)]


def accelerate_loop(kind, *, gas=1, clip_by="accelerator", half=False, steps=5, **options):
    """``kind`` "torch" (AdamW) or "engine" (OffloadAdam, adapted); ``clip_by`` "accelerator" (the standard Accelerate
    loop's ``clip_grad_norm_`` under ``sync_gradients``) or "options" (the engine's ``max_grad_norm``)."""
    model = net().half() if half else net()
    if kind == "torch":
        opt = engine = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    else:
        engine = opt = OffloadAdam(model.named_parameters(), lr=LR, weight_decay=WD, options=OffloadOptions(
            max_grad_norm=MAX if clip_by == "options" else 0.0, **options))
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=gas)
    if kind == "engine":
        adapt_accelerator(acc, engine)
    model, opt = acc.prepare(model, opt)
    norms = []
    for x, y in batches(steps * gas):
        with acc.accumulate(model):
            acc.backward(((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean())
            if acc.sync_gradients and clip_by == "accelerator":
                norm = acc.clip_grad_norm_(model.parameters(), MAX)
                assert isinstance(norm, torch.Tensor) and norm.dim() == 0
                norms.append(norm.item())
            opt.step()
            if acc.sync_gradients and clip_by == "options":
                norms.append(engine.last.grad_norm)
            opt.zero_grad()
    if kind == "engine":
        engine.flush()
        engine.close()
    return norms, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("gas", [1, 3])
def test_accelerator_clipping_clips_the_engines_gradients_as_adamw_loop_clips_grad(gas):
    """It returned 0.0 and clipped nothing (5e-3 off AdamW's clipped run); with ``accelerator.accumulate`` the
    window's every micro-batch is clipped, as torch clips the accumulated .grad."""
    ref_norms, ref = accelerate_loop("torch", gas=gas)
    norms, got = accelerate_loop("engine", gas=gas)
    assert min(ref_norms) > MAX  # clipping was active
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    for p, q in zip(ref, got):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [dict(dpu=True, dpu_warmup_steps=2), dict(fp16=FP16), dict(state_dtype="int8")],
                         ids=["dpu", "fp16", "int8"])
def test_accelerator_clipping_is_the_engines_one_clipping(options):
    """The delayed update, fp16 loss scaling (the norm of the unscaled gradients) and int8 moments: as the engine's
    own ``max_grad_norm`` clips, bit for bit, accumulating 2 micro-batches."""
    half = "fp16" in options
    ref_norms, ref = accelerate_loop("engine", clip_by="options", gas=2, half=half, **options)
    norms, got = accelerate_loop("engine", gas=2, half=half, **options)
    assert min(ref_norms) > MAX
    assert norms == pytest.approx(ref_norms, rel=1e-6)  # (returned as float32)
    for p, q in zip(ref, got):
        assert torch.equal(q, p)


def test_engine_clip_grad_norm_in_a_loop_without_accelerate():
    """The engine's own, with the norm first (``torch.nn.utils.clip_grad_norm_`` delegates to it: test_torch_clip.py);
    a ``zero_grad()`` after the call drops the gradients and the clipping asked for them."""
    ref_model, model = net(), net()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    engine = OffloadAdam(model.named_parameters(), lr=LR, weight_decay=WD)
    for i, (x, y) in enumerate(batches(4)):
        max_norm = MAX if i % 2 else float("inf")  # (inf: the norm alone, as transformers' Trainer asks for it)
        for m in (ref_model, model):
            ((m(x) - y) ** 2).mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        assert engine.clip_grad_norm_(max_norm).item() == pytest.approx(ref_norm.item(), rel=1e-5)
        ref_opt.step()
        engine.step()
        ref_opt.zero_grad()
        engine.zero_grad()
    for p, q in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    x, y = batches(1)[0]
    ((model(x) - y) ** 2).mean().backward()
    engine.clip_grad_norm_(MAX)
    engine.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    engine.clip_grad_norm_(MAX)  # (not "a second time": the first one's gradients were dropped)
    engine.close()


def test_what_cannot_be_honoured_is_refused_by_name():
    model, other = net(), net()
    engine = OffloadAdam(model.named_parameters(), lr=LR, options=OffloadOptions(gradient_accumulation_steps=1))
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    adapt_accelerator(acc, engine)
    model, opt = acc.prepare(model, engine)
    x, y = batches(1)[0]

    def backward():
        acc.backward(((model(x) - y) ** 2).mean())

    with acc.accumulate(model):  # the window's first micro-batch
        backward()
        with pytest.raises(RuntimeError, match="sync_gradients is False.*`if accelerator.sync_gradients:`"):
            acc.clip_grad_norm_(model.parameters(), MAX)
    with acc.accumulate(model):
        backward()
        with pytest.raises(ValueError, match=r"norm_type=inf: .*L2 norm"):
            acc.clip_grad_norm_(model.parameters(), MAX, norm_type=float("inf"))
        with pytest.raises(ValueError, match=r"leave out 2 of the engine's 4 trainable params \(0.weight"):
            acc.clip_grad_norm_(model[2].parameters(), MAX)
        with pytest.raises(ValueError, match=r"4 of the given params \(\(16, 8\).*not trainable params of this"):
            acc.clip_grad_norm_([*model.parameters(), *other.parameters()], MAX)
        with pytest.raises(ValueError, match=r"a param \(2.bias.*\) is given more than once"):
            acc.clip_grad_norm_([*model.parameters(), model[2].bias], MAX)
        for wrong in ((model.parameters(), 1.0), (model[2].weight, 1.0), (nn.Parameter(torch.ones(())), MAX)):
            with pytest.raises(TypeError, match=r"max_norm must be a number, got .*: the engine's takes max_norm first"):
                engine.clip_grad_norm_(*wrong)  # torch's order (it was refused as norm_type=1.0)
        with pytest.raises(ValueError, match="max_norm=0.0: need a number > 0"):
            acc.clip_grad_norm_(model.parameters(), 0.0)
        with pytest.raises(ValueError, match="clip_grad_value_ on the params of OffloadAdam.*clip_grad_norm_"):
            acc.clip_grad_value_(model.parameters(), 0.1)
        acc.clip_grad_norm_(model.parameters(), MAX)
        with pytest.raises(RuntimeError, match=r"a second time for this step \(clipped by 0.5 already\)"):
            acc.clip_grad_norm_(model.parameters(), MAX)
        backward()  # a backward after the clip, before the step
        with pytest.raises(RuntimeError, match="a gradient arrived after clip_grad_norm_.*step is not taken"):
            opt.step()
    assert engine.global_steps == 0
    engine.options = dataclasses.replace(engine.options, max_grad_norm=1.0)  # (as a Trainer's next train() sets it)
    engine.zero_grad()
    backward()
    with pytest.raises(ValueError, match=r"max_norm=0.5 but .*OffloadOptions.max_grad_norm=1: the two would be two"):
        acc.clip_grad_norm_(model.parameters(), MAX)
    acc.clip_grad_norm_(model.parameters(), 1.0)  # the same value: the one clipping
    engine.close()


def test_another_optimizers_params_are_accelerates_to_clip():
    """A GAN's discriminator beside the engine: its .grad is there, and Accelerate clips it as it would alone."""
    gen, disc, ref = net(), net(), net()
    engine = OffloadAdam(gen.named_parameters(), lr=LR)
    acc = accelerate.Accelerator(cpu=True)
    adapt_accelerator(acc, engine)
    gen, _ = acc.prepare(gen, engine)
    disc, opt = acc.prepare(disc, torch.optim.AdamW(disc.parameters(), lr=LR, foreach=False))
    x, y = batches(1)[0]
    for m in (disc, ref):
        ((m(x) - y) ** 2).mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX)
    assert torch.equal(acc.clip_grad_norm_(disc.parameters(), MAX), ref_norm)
    acc.clip_grad_value_(disc.parameters(), 0.01)
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
    for p, q in zip(ref.parameters(), disc.parameters()):
        assert torch.equal(q.grad, p.grad)
    engine.close()


# -- two gloo ranks of a ShardedAdam --------------------------------------------------------------------------------
def sharded_rank(rank, world):
    """Stage 2 (gradients reduce-scattered during backward) and stage 1 (.grad reduced at the step) with 2
    micro-batches: each rank clips by the global norm of the averaged gradients."""
    from hf_zero_offload.engine import ShardedAdam

    out = []
    for stage in (2, 1):
        model = net()
        engine = ShardedAdam(model.named_parameters(), lr=LR, weight_decay=WD, stage=stage, offload=True)
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        adapt_accelerator(acc, engine)
        model, opt = acc.prepare(model, engine)
        norms = []
        for x, y in batches(6):
            with acc.accumulate(model):
                acc.backward(((model(x.chunk(world)[rank]) - y.chunk(world)[rank]) ** 2).mean())
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), MAX).item())
                opt.step()
                opt.zero_grad()
        engine.close()
        out.append((norms, [p.detach().clone() for p in model.parameters()]))
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return out


def test_two_ranks_of_a_sharded_engine_clip_by_the_global_norm():
    """On each rank torch's clipping found no .grad (stage 2) or this rank's .grad before the average (stage 1)."""
    model = net()
    norms = adamw_clipped(model, batches(6), MAX, lr=LR, weight_decay=WD)
    assert_ranks_match(run_distributed(sharded_rank, world_size=2), model, norms, rel=1e-5)
