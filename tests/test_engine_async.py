"""The engine's asynchrony: no stream race, and what only a GPU can show.

The equivalences with torch AdamW run in every mode (CPU, stream simulator, GPU) in test_engine.py.
Here:

- the asynchronous pipeline equals the same engine with every hand-off synchronised, bit for bit, on
  the stream simulator (CPU, in ``make test``) and on a GPU (``-m cuda``);
- (the simulator catching each race, a wait removed: test_engine_races.py);
- on a GPU: the arena really pinned, gradient memory bounded by the buckets.
"""
from __future__ import annotations

import os
import weakref

# cuBLAS is deterministic on one stream only with a fixed workspace; set before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from _models import TinyNet, batches, loss_fn, param_groups  # noqa: E402
from _modes import ALL, Mode, make_mode  # noqa: E402
from hf_zero_offload.engine import OffloadAdam, OffloadOptions  # noqa: E402
from hf_zero_offload.engine.buffers import PINNED_REGIONS  # noqa: E402
from hf_zero_offload.engine.streams import SimStreams  # noqa: E402

DEV = torch.device("cuda")
LR, WD = 1e-2, 0.1
SMALL = dict(bucket_numel=1000, tile_numel=300)
ASYNC_MODES = [p for p in ALL if p.id != "cpu"]


@pytest.fixture(params=ASYNC_MODES)
def amode(request):
    mode = make_mode(request.param)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(mode._compute_runs)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield mode
    torch.use_deterministic_algorithms(before)
    handle.remove()


def _wide_model(mode: Mode, width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.LayerNorm(width)]
    return mode.model(nn.Sequential(*blocks))


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
    sync = opt.streams.synchronize
    pipe = opt.pipeline
    pipe._flush = _after(pipe._flush, sync)
    pipe._retire = _after(pipe._retire, sync)
    opt.uploader._copy = _after(opt.uploader._copy, sync)
    # after the engine's own gradient hook: a hook of ours registered after it would be refused (it would run
    # once the gradient is gone), so the hooks call this object's method instead (held weakly: kept on opt)
    hooks = pipe.hooks
    hooks.detach()
    opt._synced_on_grad = _Then(pipe._on_grad, sync)
    hooks._on_grad = weakref.WeakMethod(opt._synced_on_grad.on_grad)
    hooks.attach()


class _Then:
    def __init__(self, fn, then):
        self.fn, self.then = fn, then

    def on_grad(self, p):
        self.fn(p)
        self.then()


def _train_wide(mode: Mode, opts: dict, synchronous: bool, *, steps=3):
    gpu = mode.device.type == "cuda"
    # On a GPU: wide and cheap, so a missing sync has time to show; on the simulator size is irrelevant.
    width, layers, tokens, tile = (8192, 3, 512, 1 << 18) if gpu else (64, 3, 16, 1000)
    model = _wide_model(mode, width, layers)
    # Tiny buckets and tiles: a flush per weight, many tile uploads per step in flight.
    opt = OffloadAdam(model.parameters(), lr=1e-3, weight_decay=0.01, param_dtype=torch.bfloat16,
                      options=OffloadOptions(bucket_numel=width * width, tile_numel=tile, **opts),
                      streams=mode.streams())
    assert opt.arena.pinned == gpu
    if synchronous:
        _force_synchronous(opt)
    gas = opts.get("gradient_accumulation_steps", 1)
    g = torch.Generator().manual_seed(123)
    fingerprints = []
    for _ in range(steps):
        for _ in range(gas):
            x = torch.randn(tokens, width, generator=g).to(mode.device, torch.bfloat16)
            y = torch.randn(tokens, width, generator=g).to(mode.device)
            ((model(x).float() - y).square().mean() / gas).backward()
        opt.step()
        opt.zero_grad()
        # Per-step fingerprints (exact: the same reduction over the same bits in both runs).
        mode.sync()
        fingerprints.append(torch.stack([p.detach().double().sum() for p in model.parameters()]).cpu())
        if not synchronous and not opts.get("dpu"):
            off = 0
            for p in model.parameters():  # the device holds exactly the new masters, rounded
                m = opt.master[off:off + p.numel()].view(p.shape)
                assert torch.equal(p.detach().cpu(), m.to(torch.bfloat16)), "stale or torn parameter upload"
                off += p.numel()
    opt.flush()
    mode.sync()
    out = {"params": [p.detach().cpu() for p in model.parameters()], "master": opt.master.clone(),
           "exp_avg_sq": opt.exp_avg_sq.clone(), "fingerprints": fingerprints}
    opt.close()
    del model, opt
    if gpu:
        torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("opts", [{}, {"dpu": True, "dpu_warmup_steps": 1}, {"gradient_accumulation_steps": 2}],
                         ids=["sync", "dpu", "gas2"])
def test_async_pipeline_matches_fully_synchronised_run(amode, opts):
    """A missing stream wait (bucket reused before its copy landed, staging tile rewritten while
    uploading, grad freed under a pending copy) shows up as a bit difference against the same
    engine with the device drained after every hand-off."""
    fast = _train_wide(amode, opts, synchronous=False)
    slow = _train_wide(amode, opts, synchronous=True)
    for k, (a, b) in enumerate(zip(fast["fingerprints"], slow["fingerprints"])):
        assert torch.equal(a, b), f"step {k + 1}: device params differ from the synchronised run"
    for i, (a, b) in enumerate(zip(fast["params"], slow["params"])):
        assert torch.equal(a, b), f"param {i}"
    assert torch.equal(fast["master"], slow["master"])
    assert torch.equal(fast["exp_avg_sq"], slow["exp_avg_sq"])


# -- the simulator catches races ------------------------------------------------------------------

@pytest.mark.parametrize("dtype, gas, dpu, down, up", [
    (torch.bfloat16, 1, False, 2, 2), (torch.float16, 1, True, 2, 2), (torch.bfloat16, 3, False, 6, 2),
    (torch.float32, 1, False, 4, 4)], ids=["bf16", "fp16-dpu", "bf16-gas3", "fp32"])
def test_bytes_over_the_bus_per_step(dtype, gas, dpu, down, up):
    """Gradients go down in their own dtype once per micro-batch, parameters come up once per step:
    4 bytes per parameter per step for a 16-bit model (DeepSpeed moves 4 B/param down alone)."""
    s = SimStreams()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    n = sum(p.numel() for p in model.parameters())
    opts = dict(bucket_numel=1000, tile_numel=300, gradient_accumulation_steps=gas, dpu=dpu, dpu_warmup_steps=1,
                fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 4} if dtype == torch.float16 else None)
    opt = OffloadAdam(model.parameters(), lr=LR, param_dtype=dtype, streams=s, options=OffloadOptions(**opts))
    model.to(dtype)
    seen = []
    for _ in range(4):
        before = (s.bytes_down, s.bytes_up)
        for _ in range(gas):
            opt.scale_loss(model(torch.randn(8, 32, dtype=dtype)).float().square().mean() / gas).backward()
        opt.step()
        opt.zero_grad()
        seen.append(((s.bytes_down - before[0]) / n, (s.bytes_up - before[1]) / n))
    opt.close()
    # steady state; the first delayed step uploads nothing (its result goes up at the next step)
    assert seen[2:] == [(down, up)] * 2 and seen[1] == (down, 0 if dpu else up), seen


# -- what only a GPU can show ------------------------------------------------------------------
def _registered(t: torch.Tensor) -> bool:
    """Whether the driver sees ``t``'s own first byte as page-locked host memory. Not ``t.is_pinned()``:
    torch asks about the tensor's storage base, which for a region of the arena is the arena's first
    (pageable) byte, so every region read as unpinned on a GPU (the H200 check's first run)."""
    import ctypes
    with open("/proc/self/maps") as f:  # the libcudart torch loaded; else the loader's own
        path = next((line.split()[-1] for line in f if "libcudart" in line and line.split()[-1].startswith("/")),
                    "libcudart.so")
    attrs = ctypes.create_string_buffer(256)  # cudaPointerAttributes: its first field is the memory type
    err = ctypes.CDLL(path).cudaPointerGetAttributes(attrs, ctypes.c_void_p(t.data_ptr()))
    assert err == 0, f"cudaPointerGetAttributes: error {err}"
    return ctypes.c_int.from_buffer(attrs).value == 1  # cudaMemoryTypeHost


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arena_is_really_pinned():
    torch.manual_seed(0)
    opt = OffloadAdam(param_groups(TinyNet().to(DEV), WD), lr=LR, options=OffloadOptions(**SMALL))
    assert opt.arena.pinned
    regions = opt.arena.regions
    assert {"master", "exp_avg", "exp_avg_sq", "grad_store", "grad_staging", "param_staging"} <= set(regions)
    assert all(t.device.type == "cpu" for t in regions.values())
    # Only what crosses PCIe is registered (buffers.PINNED_REGIONS); masters, moments and the gradient
    # store stay pageable. (exp_avg: a page away from both ends of the arena, whose first and last
    # pages may be shared with other allocations.)
    for name in PINNED_REGIONS:
        assert _registered(regions[name]), name
    assert not _registered(regions["exp_avg"])
    assert _registered(opt.pipeline.staging) and _registered(opt.param_staging)
    arena, staging = opt.arena, regions["grad_staging"]
    opt.close()  # the engine lets go of its arena (None), which it unpinned first
    assert opt.arena is None and not arena.pinned and not _registered(staging)

    torch.manual_seed(0)
    unpinned = OffloadAdam(param_groups(TinyNet().to(DEV), WD), lr=LR,
                           options=OffloadOptions(pin_memory=False, **SMALL))
    assert not unpinned.arena.pinned and not _registered(unpinned.exp_avg)
    unpinned.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
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
    gpu = Mode("cuda", DEV)
    plain = _wide_model(gpu, width, layers).bfloat16()
    grad_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    before, peak = backward_peak(plain, x)
    assert peak - before >= 0.9 * grad_bytes  # without the engine every gradient stays on the device
    del plain
    torch.cuda.empty_cache()

    model = _wide_model(gpu, width, layers)
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


@pytest.mark.parametrize("value, simulated", [("1", True), ("yes", True), ("on", True), ("", False), ("0", False),
                                              ("false", False), ("No", False), (" 0 ", False), ("off", False),
                                              ("n", False), ("disable", False), ("maybe", None), ("2", None)])
def test_the_simulator_switch_reads_off_as_the_debug_switch_does(monkeypatch, value, simulated):
    """HF_ZERO_OFFLOAD_SIMULATE_STREAMS=false (or no) turned the simulator on; later "off", "n" and "disable" still did.
    A word that is neither on nor off is refused by name (HF_ZERO_OFFLOAD_BLOCKING_WAITS alike)."""
    from hf_zero_offload.engine.streams import BLOCKING_ENV, SIMULATE_ENV, SimStreams, make_streams
    monkeypatch.setenv(SIMULATE_ENV, value)
    if simulated is None:
        with pytest.raises(ValueError, match=f"HF_ZERO_OFFLOAD_SIMULATE_STREAMS='{value}' is not an on/off value"):
            make_streams(torch.device("cpu"))
        monkeypatch.setenv(SIMULATE_ENV, "0")
        monkeypatch.setenv(BLOCKING_ENV, value)
        with pytest.raises(ValueError, match=f"HF_ZERO_OFFLOAD_BLOCKING_WAITS='{value}' is not an on/off value"):
            make_streams(torch.device("cpu"))
    else:
        assert isinstance(make_streams(torch.device("cpu")), SimStreams) is simulated


def test_a_load_waits_for_uploads_in_flight_before_rewriting_the_dpu_staging():
    """An outside review's race checker: a synchronous step (DPU warm-up) queued its uploads from the param staging,
    then load_state_dict of a DPU state saved mid-delay rewrote that staging on the host (that state's masters reach
    the params at the next step, not now): the uploads still queued carried the loaded masters, one step early."""
    import copy

    torch.manual_seed(0)
    model = TinyNet()
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL, dpu=True, dpu_warmup_steps=1))
    for ids, labels, use_branch in batches(3):
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["needs_publish"]
    opt.close()

    def run(drain_first):
        s = SimStreams(executor="lazy", defer_compute_waits=True)  # the uploads run when the next forward would
        torch.manual_seed(1)
        model = TinyNet()
        opt = OffloadAdam(param_groups(model, WD), lr=LR, streams=s,
                          options=OffloadOptions(**SMALL, dpu=True, dpu_warmup_steps=3))
        ids, labels, use_branch = batches(1)[0]
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()  # synchronous (warm-up): its uploads stay queued
        if drain_first:
            s.synchronize()
        opt.load_state_dict(saved)
        s.synchronize()
        out = [p.detach().clone() for p in model.parameters()]
        opt.flush()
        opt.close()
        return out

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_host_waits_sleep_when_asked(monkeypatch):
    """HF_ZERO_OFFLOAD_BLOCKING_WAITS: the GPU check's A/B of sleeping against spinning host waits."""
    from hf_zero_offload.engine.streams import BLOCKING_ENV, make_streams

    for value, want in (("1", True), ("false", False), ("", False)):
        monkeypatch.setenv(BLOCKING_ENV, value)
        assert make_streams(torch.device("cpu")).blocking_waits is want
