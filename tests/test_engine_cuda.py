"""The offload engine on a GPU: the equivalences of test_engine.py with streams, events and pinned
memory really in play, plus the properties only a GPU can show (no stream race, gradient memory
bounded by the buckets, the arena really pinned).

Every test is marked ``cuda`` (deselected by the default ``-m 'not slow and not cuda'``; run them
with ``pytest -m cuda``) and skipped on a machine without CUDA, so this file imports and collects on
a CPU-only machine.
"""
from __future__ import annotations

import copy
import os

# cuBLAS is deterministic on one stream only with a fixed workspace; set before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from _models import TinyNet, batches, loss_fn, param_groups  # noqa: E402
from hf_zero_offload.engine import OffloadAdam, OffloadOptions  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
LR, WD = 1e-2, 0.1
SMALL = dict(bucket_numel=1000, tile_numel=300)  # several buckets and tiles even on a tiny model


@pytest.fixture
def deterministic():
    """Bit-for-bit comparisons between two GPU runs need deterministic kernels."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before)


def on_device(data):
    return [(ids.to(DEV), labels.to(DEV), use_branch) for ids, labels, use_branch in data]


def make_pair(seed=0, **opts):
    torch.manual_seed(seed)
    ref_model = TinyNet().to(DEV)
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**{**SMALL, **opts}))
    return ref_model, ref, model, opt


def assert_models_close(a, b, **tol):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.detach().float(), pa.detach().float(), msg=name, **tol)


def step_both(ref_model, ref, model, opt, ids, labels, use_branch):
    loss_fn(ref_model, ids, labels, use_branch).backward()
    ref.step()
    ref.zero_grad()
    loss_fn(model, ids, labels, use_branch).backward()
    opt.step()
    opt.zero_grad()


# -- the equivalences of test_engine.py, on the GPU --------------------------------------------
def test_cuda_fp32_matches_adamw_with_frozen_tied_and_unused_params():
    ref_model, ref, model, opt = make_pair()
    assert opt.streams.cuda and opt.pipeline.buckets.is_cuda
    frozen_before = model.frozen.weight.detach().clone()
    branch_steps = 0
    for ids, labels, use_branch in on_device(batches(20)):
        step_both(ref_model, ref, model, opt, ids, labels, use_branch)
        branch_steps += use_branch
    torch.cuda.synchronize()
    assert_models_close(ref_model, model, rtol=1e-5, atol=1e-6)
    assert torch.equal(model.frozen.weight, frozen_before)
    assert model.head.weight is model.embed.weight
    assert ref.state[ref_model.branch.weight]["step"].item() == branch_steps < 20
    opt.close()


def test_cuda_gradient_accumulation_matches_adamw_accumulating_on_device():
    ref_model, ref, model, opt = make_pair(gradient_accumulation_steps=3)
    for ids, labels, use_branch in on_device(batches(12)):
        for m in (ref_model, model):
            for i in range(3):
                (loss_fn(m, ids[i:i + 1], labels[i:i + 1], use_branch) / 3).backward()
        ref.step()
        ref.zero_grad()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    assert_models_close(ref_model, model, rtol=1e-5, atol=1e-6)
    opt.close()


def test_cuda_gradient_accumulation_1_vs_4_same_global_batch():
    torch.manual_seed(0)
    m1 = TinyNet().to(DEV)
    m4 = copy.deepcopy(m1)
    o1 = OffloadAdam(param_groups(m1, WD), lr=LR, options=OffloadOptions(**SMALL))
    o4 = OffloadAdam(param_groups(m4, WD), lr=LR, options=OffloadOptions(gradient_accumulation_steps=4, **SMALL))
    for ids, labels, _ in on_device(batches(8, batch=8)):
        loss_fn(m1, ids, labels, True).backward()
        o1.step()
        o1.zero_grad()
        for i in range(4):
            sl = slice(2 * i, 2 * i + 2)
            (loss_fn(m4, ids[sl], labels[sl], True) / 4).backward()
        o4.step()
        o4.zero_grad()
    torch.cuda.synchronize()
    assert_models_close(m1, m4, rtol=2e-5, atol=2e-6)


def test_cuda_clipping_matches_clip_grad_norm():
    ref_model, ref, model, opt = make_pair(max_grad_norm=0.05)
    norms = []
    for ids, labels, use_branch in on_device(batches(10)):
        loss_fn(ref_model, ids, labels, use_branch).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05).item())
        ref.step()
        ref.zero_grad()
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
        assert opt.last.grad_norm == pytest.approx(norms[-1], rel=1e-5)
    assert min(norms) > 0.05
    torch.cuda.synchronize()
    assert_models_close(ref_model, model, rtol=1e-5, atol=1e-6)


def test_cuda_fp16_overflow_skips_step_and_follows_hysteresis():
    torch.manual_seed(0)
    model = TinyNet().to(DEV)
    fp16 = dict(enabled=True, loss_scale=0, initial_scale_power=8, loss_scale_window=1000, hysteresis=2,
                min_loss_scale=1)
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(fp16=fp16, **SMALL))
    model.half()
    assert model.body[0].weight.dtype == torch.float16 and model.body[0].weight.is_cuda
    skipped, scales = [], []
    for k, (ids, labels, use_branch) in enumerate(on_device(batches(6))):
        loss = opt.scale_loss(loss_fn(model, ids, labels, use_branch))
        if k in (2, 3):
            loss = loss * float("inf")
        masters = opt.master.clone()
        params = [p.detach().clone() for p in model.parameters()]
        loss.backward()
        opt.step()
        opt.zero_grad()
        skipped.append(opt.last.skipped)
        scales.append(opt.loss_scale)
        if k in (2, 3):
            torch.cuda.synchronize()
            assert torch.equal(opt.master, masters)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert skipped == [False, False, True, True, False, False]
    assert scales == [256, 256, 256, 128, 128, 128]
    assert int(opt._param_steps.max()) == 4


def test_cuda_bf16_device_params_are_the_rounded_masters():
    torch.manual_seed(0)
    model = TinyNet().to(DEV)
    opt = OffloadAdam(param_groups(model, WD), lr=LR, param_dtype=torch.bfloat16, options=OffloadOptions(**SMALL))
    model.bfloat16()
    for ids, labels, use_branch in on_device(batches(10)):
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        for g in opt._slots:
            for p, off, n in g:
                assert torch.equal(p.detach().cpu(), opt.master[off:off + n].view(p.shape).to(torch.bfloat16))


def _dpu_reference(data, warmup):
    """AdamW on fp32 masters (on the GPU); the device model's params lag one step after the warm-up."""
    torch.manual_seed(0)
    device_model = TinyNet().to(DEV)
    master_model = copy.deepcopy(device_model)
    ref = torch.optim.AdamW(param_groups(master_model, WD), lr=LR, foreach=False)
    pairs = [(d, m) for d, m in zip(device_model.parameters(), master_model.parameters()) if d.requires_grad]
    for k, (ids, labels, use_branch) in enumerate(data, start=1):
        loss_fn(device_model, ids, labels, use_branch).backward()
        for d, m in pairs:
            m.grad, d.grad = d.grad, None
        with torch.no_grad():
            if k > warmup:
                for d, m in pairs:
                    d.copy_(m)
            ref.step()
            ref.zero_grad()
            if k <= warmup:
                for d, m in pairs:
                    d.copy_(m)
    return device_model, master_model


@pytest.mark.parametrize("warmup", [0, 3])
def test_cuda_dpu_follows_the_delayed_schedule(warmup):
    data = on_device(batches(9))
    ref_device, ref_master = _dpu_reference(data, warmup)
    torch.manual_seed(0)
    model = TinyNet().to(DEV)
    opt = OffloadAdam(param_groups(model, WD), lr=LR,
                      options=OffloadOptions(dpu=True, dpu_warmup_steps=warmup, **SMALL))
    for ids, labels, use_branch in data:
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    assert opt.needs_publish == (len(data) > warmup)
    assert_models_close(ref_device, model, rtol=1e-5, atol=1e-6)
    opt.flush()
    torch.cuda.synchronize()
    assert_models_close(ref_master, model, rtol=1e-5, atol=1e-6)
    opt.close()


def test_cuda_dpu_keeps_params_that_never_got_a_gradient():
    torch.manual_seed(0)
    used, unused = nn.Linear(16, 16, device=DEV), nn.Linear(16, 16, device=DEV)
    before = unused.weight.detach().clone()
    opt = OffloadAdam(list(used.parameters()) + list(unused.parameters()), lr=LR,
                      options=OffloadOptions(dpu=True, dpu_warmup_steps=0, **SMALL))
    for _ in range(3):
        used(torch.randn(4, 16, device=DEV)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    torch.cuda.synchronize()
    assert torch.equal(unused.weight, before)
    opt.close()


@pytest.mark.parametrize("opts", [{}, {"dpu": True, "dpu_warmup_steps": 2}, {"gradient_accumulation_steps": 2}],
                         ids=["sync", "dpu", "gas2"])
def test_cuda_resume_is_bit_exact(opts, tmp_path, deterministic):
    data = on_device(batches(10))
    gas = opts.get("gradient_accumulation_steps", 1)

    def train(model, opt, part):
        for ids, labels, use_branch in part:
            for i in range(gas):
                (loss_fn(model, ids[i::gas], labels[i::gas], use_branch) / gas).backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    full = TinyNet().to(DEV)
    init = copy.deepcopy(full)
    o_full = OffloadAdam(param_groups(full, WD), lr=LR, options=OffloadOptions(**{**SMALL, **opts}))
    train(full, o_full, data)

    first = copy.deepcopy(init)
    o_first = OffloadAdam(param_groups(first, WD), lr=LR, options=OffloadOptions(**{**SMALL, **opts}))
    train(first, o_first, data[:5])
    o_first.save_checkpoint(str(tmp_path))
    torch.cuda.synchronize()
    model_state = copy.deepcopy(first.state_dict())
    o_first.close()

    second = copy.deepcopy(init)
    second.load_state_dict(model_state)
    o_second = OffloadAdam(param_groups(second, WD), lr=LR, options=OffloadOptions(**{**SMALL, **opts}))
    o_second.load_checkpoint(str(tmp_path))
    train(second, o_second, data[5:])
    torch.cuda.synchronize()
    for a, b in zip(full.parameters(), second.parameters()):
        assert torch.equal(a, b)
    o_full.flush()
    o_second.flush()
    torch.cuda.synchronize()
    for a, b in zip(full.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(o_full.master, o_second.master)
    assert torch.equal(o_full.exp_avg_sq, o_second.exp_avg_sq)


# -- what only a GPU can show ------------------------------------------------------------------
def test_cuda_arena_is_really_pinned():
    _, _, model, opt = make_pair()
    assert opt.arena.pinned
    regions = opt.arena.regions
    assert {"master", "exp_avg", "exp_avg_sq", "grad_store", "grad_staging", "param_staging"} <= set(regions)
    for name, t in regions.items():
        assert t.device.type == "cpu" and t.is_pinned(), name
    assert opt.pipeline.staging.is_pinned() and opt.param_staging.is_pinned()
    opt.close()
    assert not opt.arena.pinned

    torch.manual_seed(0)
    unpinned = OffloadAdam(param_groups(TinyNet().to(DEV), WD), lr=LR,
                           options=OffloadOptions(pin_memory=False, **SMALL))
    assert not unpinned.arena.pinned and not unpinned.master.is_pinned()
    unpinned.close()


def _wide_model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width, device=DEV), nn.LayerNorm(width, device=DEV)]
    return nn.Sequential(*blocks)


def _after(fn, then):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        then()
        return out
    return wrapped


def _force_synchronous(opt: OffloadAdam) -> None:
    """The same engine with every asynchronous hand-off made synchronous: the device is drained
    after every gradient hook, bucket flush/retire and parameter-tile upload. (Patches private
    methods on this instance only: the pipeline calls self._flush/self._retire, the uploader
    self._copy, so instance attributes take precedence.)"""
    sync = torch.cuda.synchronize
    pipe = opt.pipeline
    pipe._flush = _after(pipe._flush, sync)
    pipe._retire = _after(pipe._retire, sync)
    opt.uploader._copy = _after(opt.uploader._copy, sync)
    for p, _, _ in opt._flat_slots:
        p.register_post_accumulate_grad_hook(lambda _p: sync())  # runs after the engine's own hook


def _train_wide(opts: dict, synchronous: bool, *, width=8192, layers=3, steps=3, tokens=512):
    model = _wide_model(width, layers)
    n = sum(p.numel() for p in model.parameters())
    # Tiny buckets and tiles: a flush per weight, hundreds of tile uploads per step in flight.
    opt = OffloadAdam(model.parameters(), lr=1e-3, weight_decay=0.01, param_dtype=torch.bfloat16,
                      options=OffloadOptions(bucket_numel=width * width, tile_numel=1 << 18, **opts))
    assert opt.arena.pinned
    if synchronous:
        _force_synchronous(opt)
    gas = opts.get("gradient_accumulation_steps", 1)
    g = torch.Generator().manual_seed(123)
    fingerprints = []
    for _ in range(steps):
        for _ in range(gas):
            x = torch.randn(tokens, width, generator=g).to(DEV, torch.bfloat16, non_blocking=False)
            y = torch.randn(tokens, width, generator=g).to(DEV)
            ((model(x).float() - y).square().mean() / gas).backward()
        opt.step()
        opt.zero_grad()
        # Per-step fingerprints (exact: the same reduction over the same bits in both runs).
        fingerprints.append(torch.stack([p.detach().double().sum() for p in model.parameters()]).cpu())
        if not synchronous and not opts.get("dpu"):
            torch.cuda.synchronize()
            off = 0
            for p in model.parameters():  # the device holds exactly the new masters, rounded
                m = opt.master[off:off + p.numel()].view(p.shape)
                assert torch.equal(p.detach().cpu(), m.to(torch.bfloat16)), "stale or torn parameter upload"
                off += p.numel()
    opt.flush()
    torch.cuda.synchronize()
    out = {"params": [p.detach().cpu() for p in model.parameters()], "master": opt.master.clone(),
           "exp_avg_sq": opt.exp_avg_sq.clone(), "fingerprints": fingerprints, "numel": n}
    opt.close()
    del model, opt
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("opts", [{}, {"dpu": True, "dpu_warmup_steps": 1}, {"gradient_accumulation_steps": 2}],
                         ids=["sync", "dpu", "gas2"])
def test_cuda_async_pipeline_matches_fully_synchronised_run(opts, deterministic):
    """A missing stream wait (bucket reused before its copy landed, staging tile rewritten while
    uploading, grad freed under a pending copy) shows up as a bit difference against the same
    engine with the device drained after every hand-off."""
    fast = _train_wide(opts, synchronous=False)
    slow = _train_wide(opts, synchronous=True)
    for k, (a, b) in enumerate(zip(fast["fingerprints"], slow["fingerprints"])):
        assert torch.equal(a, b), f"step {k + 1}: device params differ from the synchronised run"
    for i, (a, b) in enumerate(zip(fast["params"], slow["params"])):
        assert torch.equal(a, b), f"param {i}"
    assert torch.equal(fast["master"], slow["master"])
    assert torch.equal(fast["exp_avg_sq"], slow["exp_avg_sq"])


def test_cuda_gradient_memory_is_bounded_by_the_buckets():
    width, layers, tokens = 4096, 6, 64
    torch.cuda.empty_cache()

    def backward_peak(model, x):
        loss = model(x).float().square().mean()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()      # params + activations (+ buckets, allocated at init)
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        return before, torch.cuda.max_memory_allocated()

    x = torch.randn(tokens, width, device=DEV, dtype=torch.bfloat16)
    plain = _wide_model(width, layers).bfloat16()
    grad_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    before, peak = backward_peak(plain, x)
    assert peak - before >= 0.9 * grad_bytes  # without the engine every gradient stays on the device
    del plain
    torch.cuda.empty_cache()

    model = _wide_model(width, layers)
    opt = OffloadAdam(model.parameters(), lr=1e-3, param_dtype=torch.bfloat16,
                      options=OffloadOptions(bucket_numel=width * width + width))
    model.bfloat16()
    buckets = opt.pipeline.buckets.numel() * opt.pipeline.buckets.element_size()  # both buckets
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    before, peak = backward_peak(model, x)
    grads_in_flight = peak - (before - buckets)      # buckets + whatever gradients are alive at once
    activation_grads = 4 * tokens * width * 4 + (1 << 20)  # a few [tokens, width] fp32 temporaries
    assert grads_in_flight <= buckets + largest + activation_grads, (grads_in_flight, buckets, largest)
    assert grads_in_flight < buckets + grad_bytes / 2
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    torch.cuda.synchronize()  # the last tile uploads read the pinned arena that close() unregisters
    opt.close()
