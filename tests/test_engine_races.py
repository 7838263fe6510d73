"""The stream simulator catches races: each wait the engine relies on, removed, gives wrong numbers (the pipeline
with every wait equals the synchronised run: test_engine_async.py)."""
from __future__ import annotations

import pytest
import torch

from _models import TinyNet, batches, loss_fn, param_groups
from _modes import ALL
from hf_zero_offload.engine import OffloadAdam, OffloadOptions
from hf_zero_offload.engine.streams import SimStreams

LR, WD = 1e-2, 0.1
SMALL = dict(bucket_numel=1000, tile_numel=300)


def _skip_host_waits(obj, method: str, streams):
    """``obj.method`` runs with ``streams.host_wait`` turned into a no-op."""
    orig = getattr(obj, method)

    def patched(*args):
        real, streams.host_wait = streams.host_wait, lambda ev: None
        try:
            return orig(*args)
        finally:
            streams.host_wait = real
    setattr(obj, method, patched)


def _no_upload_wait(opt):          # the forward does not wait for the updated parameters
    opt.uploader.finish = lambda: None


def _no_tile_reuse_wait(opt):      # a staging tile is rewritten while its upload is still queued
    _skip_host_waits(opt.uploader, "out_buffer", opt.streams)


def _no_bucket_reuse_wait(opt):    # a bucket is refilled before its copy down ran
    s, real = opt.streams, opt.streams.wait
    s.wait = lambda stream, ev: None if stream is s.compute() and ev is not None and ev.stream is s.d2h \
        else real(stream, ev)


def _no_staging_reuse_wait(opt):   # the copy down lands in staging still being scattered
    pipe, orig = opt.pipeline, opt.pipeline._flush

    def flush():
        real, pipe._wait = pipe._wait, lambda slot: None
        try:
            orig()
        finally:
            pipe._wait = real
    pipe._flush = flush


def _no_scatter_wait(opt):         # the scatter reads staging before the copy down landed
    _skip_host_waits(opt.pipeline, "_retire", opt.streams)


def _no_bucket_filled_wait(opt):   # the copy down reads a bucket before the gradients copied into it landed
    s, real = opt.streams, opt.streams.wait
    s.wait = lambda stream, ev: None if stream is s.d2h and ev is not None and ev.stream is s.compute() \
        else real(stream, ev)


def _one_gradient_store(opt):      # DPU: the next backward writes the store the CPU step still reads
    opt._stores[1] = opt._stores[0]


RACES = [
    pytest.param(_no_upload_wait, {}, "sim-lazy", id="upload-sync"),
    pytest.param(_no_upload_wait, {"dpu": True}, "sim-eager", id="upload-dpu"),
    pytest.param(_no_tile_reuse_wait, {}, "sim-lazy", id="tile-reuse-sync"),
    pytest.param(_no_tile_reuse_wait, {"dpu": True}, "sim-eager", id="tile-reuse-dpu"),
    pytest.param(_no_bucket_reuse_wait, {}, "sim-lazy", id="bucket-reuse"),
    pytest.param(_no_staging_reuse_wait, {}, "sim-lazy", id="staging-reuse"),
    pytest.param(_no_scatter_wait, {}, "sim-eager", id="scatter-before-copy"),
    pytest.param(_one_gradient_store, {"dpu": True}, "sim-lazy", id="dpu-store"),
    pytest.param(_no_bucket_filled_wait, {}, "sim-late", id="bucket-filled-sync"),
    pytest.param(_no_bucket_filled_wait, {"dpu": True}, "sim-late", id="bucket-filled-dpu"),
]


def _train_tiny(sim: str, opts: dict, mutate=None):
    kwargs = {p.id: p.values[0][1] for p in ALL}[sim]
    s = SimStreams(**kwargs)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: s.run_compute_waits())
    try:
        torch.manual_seed(0)
        model = TinyNet()
        opt = OffloadAdam(param_groups(model, WD), lr=LR, streams=s,
                          options=OffloadOptions(**SMALL, **({"dpu_warmup_steps": 0} if opts.get("dpu") else {}),
                                                 **opts))
        if mutate is not None:
            mutate(opt)
        for ids, labels, use_branch in batches(8):
            loss_fn(model, ids, labels, use_branch).backward()
            opt.step()
            opt.zero_grad()
        s.synchronize()
        device_params = [p.detach().clone() for p in model.parameters()]
        opt.flush()
        master = opt.master.clone()  # (close() releases it)
        opt.close()
        return device_params, master, s.copies
    finally:
        handle.remove()


@pytest.mark.parametrize("mutate, opts, sim", RACES)
def test_simulator_turns_each_missing_wait_into_wrong_numbers(mutate, opts, sim):
    good_params, good_master, copies = _train_tiny(sim, opts)
    bad_params, bad_master, _ = _train_tiny(sim, opts, mutate)
    assert copies > 100  # the simulated GPU path really ran: staging copies both ways
    differs = not torch.equal(good_master, bad_master) or any(
        not torch.equal(a, b) for a, b in zip(good_params, bad_params))
    assert differs, f"the simulator did not notice {mutate.__name__}"


def _sharded_offload_params(streams):
    from hf_zero_offload.engine import ShardedAdam
    torch.manual_seed(0)
    model = TinyNet()
    opt = ShardedAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(bucket_numel=1200, tile_numel=300),
                      streams=streams)
    for ids, labels, use_branch in batches(6):
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_sharded_offload_upload_path_on_the_simulator():
    """ShardedAdam's GPU offload path (Adam tiles up through two staging tiles, then the all-gather
    waits for the last upload) equals its CPU path; without either wait the simulator notices."""
    cpu = _sharded_offload_params(None)
    assert torch.equal(_sharded_offload_params(SimStreams()), cpu)
    assert torch.equal(_sharded_offload_params(SimStreams(late_compute=True)), cpu)
    no_tile_wait = SimStreams()
    no_tile_wait.host_wait = lambda ev: None
    assert not torch.equal(_sharded_offload_params(no_tile_wait), cpu)
    no_gather_wait = SimStreams()
    real = no_gather_wait.wait
    no_gather_wait.wait = lambda stream, ev: None if stream is no_gather_wait.compute() else real(stream, ev)
    assert not torch.equal(_sharded_offload_params(no_gather_wait), cpu)
