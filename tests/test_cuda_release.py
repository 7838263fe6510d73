"""On a GPU: what an engine gives back when it ends (engine/lifetime.py), and ``adapt_accelerator`` with Accelerate's
own device placement (accelerator_patch.py). Both changed after the last GPU session and had only run on a CPU.

- close, replacement and ``del`` (no garbage collector): ``torch.cuda.memory_allocated()`` drops by the device
  buffers (gradient buckets, the reducer's), a replacement's peak holds one engine's, the host arena's
  ``cudaHostRegister`` is undone (``cudaHostUnregister`` of its pointer fails afterwards), and a new engine on the same
  params trains bit for bit as one built on a fresh copy of the model;
- ``adapt_accelerator`` with ``Accelerator()`` on CUDA: ``prepare`` leaves the masters and moments on the host (no
  12 B/param on the device), an fp16 engine's overflow step is reported skipped, ``mixed_precision="fp16"`` refused.
Each test is small (TinyNet, a few MB)."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from _dist import run_distributed
from _models import TinyNet, batches, param_groups, run_steps
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam, buffers

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DPU = OffloadOptions(dpu=True, dpu_warmup_steps=1, num_threads=2, bucket_numel=4096)
ENDS = ("close", "replace", "del")


def cuda_batches(n, seed=0):
    return [(ids.cuda(), labels.cuda(), branch) for ids, labels, branch in batches(n, seed=seed)]


def net():
    torch.manual_seed(0)
    return TinyNet(vocab=64, dim=64).cuda()


def unregister_fails(view: torch.Tensor) -> bool:
    """cudaHostUnregister of a pointer no longer registered returns an error (cleared: torch's next launch check
    would raise it as its own)."""
    err = torch.cuda.cudart().cudaHostUnregister(view.data_ptr())
    buffers._clear_last_cuda_error()
    return int(getattr(err, "value", err)) != 0


def device_bytes(engine) -> int:
    held = [engine.pipeline.buckets] if hasattr(engine, "pipeline") else list(engine.regions.values())
    return sum(t.numel() * t.element_size() for t in held if t.is_cuda)


def end_and_rebuild(model, engine, end: str, make):
    """Ends ``engine`` as ``end`` says (after two steps); returns the device bytes freed, those it held, the peak
    above the start (a replacement: under what it held, as the old buffers go first), whether its pinning was undone,
    and a new engine on the same params (the replacing one, or one built after)."""
    run_steps(model, engine, cuda_batches(2))
    engine.flush()
    assert engine.arena.pinned
    pinned, held = engine.arena._pinned_range, device_bytes(engine)  # (the view keeps the arena's memory to probe)
    assert held > 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    new = None
    if end == "close":
        engine.close()
    elif end == "replace":
        new = make(model)
    else:
        gc.collect()
        gc.disable()
        try:
            del engine
        finally:
            gc.enable()
    freed = start - torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated() - start
    undone = unregister_fails(pinned)
    return freed, held, peak, undone, new if new is not None else make(model)


def trains_as_fresh(model, new, make) -> bool:
    fresh_model = net()
    fresh_model.load_state_dict(model.state_dict())
    fresh = make(fresh_model)
    data = cuda_batches(3, seed=1)
    run_steps(model, new, data)
    run_steps(fresh_model, fresh, data)
    new.flush()
    fresh.flush()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))
    same = same and torch.equal(new.master, fresh.master)
    new.close()
    fresh.close()
    return same


@pytest.mark.parametrize("end", ENDS)
def test_offload_dpu_engine_gives_back_device_buffers_and_pinning(end):
    def make(m):
        return OffloadAdam(param_groups(m, 0.01), lr=1e-2, options=DPU)
    model = net()
    freed, held, peak, undone, new = end_and_rebuild(model, make(model), end, make)
    if end == "replace":  # the old buckets went before the new ones were allocated
        assert freed >= 0 and peak < held, (freed, peak, held)
    else:
        assert freed >= held, (freed, held)
    assert undone, "the arena's pinned range is still registered with CUDA"
    assert trains_as_fresh(model, new, make)


def _sharded_rank(rank, world, end):
    def make(m):
        return ShardedAdam(param_groups(m, 0.01), lr=1e-2, stage=2, offload=True, options=DPU)
    model = net()
    freed, held, peak, undone, new = end_and_rebuild(model, make(model), end, make)
    return freed, held, peak, undone, trains_as_fresh(model, new, make)


@pytest.mark.parametrize("end", ENDS)
def test_sharded_engine_on_one_nccl_rank_gives_back_device_buffers_and_pinning(end):
    (out,) = run_distributed(_sharded_rank, end, world_size=1, backend="nccl")
    freed, held, peak, undone, same = out
    assert (freed >= 0 and peak < held) if end == "replace" else freed >= held, out
    assert undone and same, out


# -- adapt_accelerator with Accelerate's placement on the GPU ------------------------------------------
@pytest.fixture
def accelerate():
    acc = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield acc
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)).cuda()


def data(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 256, generator=g).cuda(), torch.randn(8, 256, generator=g).cuda()) for _ in range(n)]


def test_prepare_leaves_the_engine_state_on_the_host_and_trains_as_adamw(accelerate):
    from hf_zero_offload.accelerator_patch import adapt_accelerator
    model, ref = mlp(), mlp()
    n = sum(p.numel() for p in model.parameters())
    engine = OffloadAdam(model.named_parameters(), lr=1e-2, weight_decay=0.1)
    acc = accelerate.Accelerator()
    assert acc.device.type == "cuda"
    adapt_accelerator(acc, engine)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    prepared, opt = acc.prepare(model, engine)
    torch.cuda.synchronize()
    assert {engine.master.device.type, engine.exp_avg.device.type, engine.exp_avg_sq.device.type} == {"cpu"}
    assert torch.cuda.memory_allocated() - before < 4 * n  # Accelerate's placement: 12 B/param (masters, moments)
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for x, y in data():
        acc.backward(((prepared(x) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        adamw.step()
        adamw.zero_grad()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    engine.close()


def test_an_fp16_overflow_step_is_reported_skipped_and_fp16_mixed_precision_refused(accelerate):
    from hf_zero_offload.accelerator_patch import adapt_accelerator
    model = mlp().half()
    engine = OffloadAdam(model.named_parameters(), lr=1e-2,
                         options=OffloadOptions(fp16={"enabled": True, "initial_scale_power": 16}))
    with pytest.raises(ValueError, match="mixed_precision='fp16'.*GradScaler"):
        adapt_accelerator(accelerate.Accelerator(mixed_precision="fp16"), engine)
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)
    acc = accelerate.Accelerator()
    adapt_accelerator(acc, engine)
    prepared, opt = acc.prepare(model, engine)
    skipped, steps = [], []
    for i, (x, y) in enumerate(data()):
        loss = ((prepared(x.half()).float() - y) ** 2).mean() * (1e30 if i == 1 else 1.0)
        acc.backward(loss)
        opt.step()
        skipped.append(acc.optimizer_step_was_skipped)
        steps.append(engine.last.skipped)
        opt.zero_grad()
    assert skipped == steps == [False, True, False]
    engine.close()
