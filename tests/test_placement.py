"""The model reaches the device through the engine, in the training dtype (trainer/placement.py): the Trainer's own
placement in fp32 (4 B/param on the device, the device peak of t5-3b's first H200 run) is deferred to the engine's
build, which takes each fp32 master first and then moves the param, cast, to the device."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration, Trainer, TrainerCallback

from _dist import run_distributed
from _models import TinyNet, batches, param_groups, run_steps
from _t5 import OFFLOAD, TINY, ToyDataset, tiny_t5
from hf_zero_offload import ZeroOffloadSeq2SeqTrainingArguments, ZeroOffloadTrainer
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam
from hf_zero_offload.engine import memory_limits
from hf_zero_offload.engine.runs import host_bytes_leaving, place_params
from hf_zero_offload.engine.streams import SimStreams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Another device on a CPU-only machine: torch.device("cpu", 0) != torch.device("cpu"), so every "params elsewhere"
# branch (the move after the masters, the sharded broadcast through the device, the host-RAM credit) runs in CI.
ELSEWHERE = torch.device("cpu", 0)
OPTS = OffloadOptions(bucket_numel=1000, tile_numel=300)
SMALL_BUCKETS = {"zero_optimization": {**OFFLOAD["zero_optimization"], "reduce_bucket_size": 1_000_000}}


def _args(tmp_path, **kw):
    return ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, report_to=[], logging_steps=1,
        save_strategy="no", seed=0, disable_tqdm=True, learning_rate=1e-2, **kw)


def test_the_trainer_leaves_the_placement_to_the_engine(tmp_path, monkeypatch):
    placed = []
    original = Trainer._move_model_to_device
    monkeypatch.setattr(Trainer, "_move_model_to_device", lambda self, m, d: placed.append(d) or original(self, m, d))
    Trainer(model=tiny_t5(), args=_args(tmp_path, use_cpu=True), train_dataset=ToyDataset())
    assert placed == [torch.device("cpu")]  # the plain Trainer places it in __init__

    placed.clear()
    model = tiny_t5()
    trainer = ZeroOffloadTrainer(model=model, args=_args(tmp_path, use_cpu=True, bf16=True, zero_offload=OFFLOAD),
                                 train_dataset=ToyDataset())
    assert placed == [] and trainer._zo_place_on == torch.device("cpu")
    trainer.train()
    assert trainer._zo_place_on is None
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cpu", torch.bfloat16)}
    # a second train() on the same Trainer builds no new placement (the engine is there)
    trainer._move_model_to_device(model, torch.device("cpu"))
    assert placed == [torch.device("cpu")] and trainer._zo_place_on is None


def test_an_evaluation_before_any_training_is_placed_as_the_plain_trainers(tmp_path):
    trainer = ZeroOffloadTrainer(model=tiny_t5(), args=_args(tmp_path, use_cpu=True, zero_offload=OFFLOAD),
                                 eval_dataset=ToyDataset(8))
    plain = Trainer(model=tiny_t5(), args=_args(tmp_path, use_cpu=True), eval_dataset=ToyDataset(8))
    assert trainer.evaluate()["eval_loss"] == plain.evaluate()["eval_loss"]


@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
@pytest.mark.parametrize("sim", [False, True], ids=["cpu", "sim"])
def test_an_engine_over_params_elsewhere_equals_one_over_placed_params(sim, dpu):
    torch.manual_seed(0)
    placed = TinyNet()
    kept = copy.deepcopy(placed)
    streams = (lambda: SimStreams()) if sim else (lambda: None)
    opts = OffloadOptions(bucket_numel=1000, tile_numel=300, dpu=dpu, dpu_warmup_steps=2)
    a = OffloadAdam(param_groups(placed, 0.1), lr=1e-2, param_dtype=torch.bfloat16, options=opts, streams=streams())
    placed.to(torch.bfloat16)
    b = OffloadAdam(param_groups(kept, 0.1), lr=1e-2, param_dtype=torch.bfloat16, options=opts, streams=streams(),
                    device=ELSEWHERE)
    assert b.device == ELSEWHERE and torch.equal(a.master, b.master)
    assert {p.dtype for p in kept.parameters() if p.requires_grad} == {torch.bfloat16}
    kept.to(device=ELSEWHERE, dtype=torch.bfloat16)
    run_steps(placed, a, batches(6))
    run_steps(kept, b, batches(6))
    a.flush(), b.flush()
    assert torch.equal(a.master, b.master) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
    for p, q in zip(placed.parameters(), kept.parameters()):
        assert torch.equal(p, q)


def test_a_device_too_small_leaves_the_model_whole_where_it_was(monkeypatch):
    """Every new tensor is made before any param is rebound: an out-of-memory part way left some params on the
    device in 16 bits and the rest in fp32 on the CPU (a retry then failed on 'the same device')."""
    params = list(TinyNet().parameters())
    before = [p.detach().clone() for p in params]
    made, to = [], torch.Tensor.to

    def flaky(self, *args, **kwargs):
        made.append(1)
        if len(made) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return to(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", flaky)
    with pytest.raises(torch.OutOfMemoryError):
        place_params(params, ELSEWHERE, torch.bfloat16)
    monkeypatch.undo()
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(params, before))


def test_the_host_ram_check_credits_only_what_the_move_frees(tmp_path, monkeypatch):
    """Weights leaving the host for a GPU free their pages after the arena's check: credited, but only anonymous
    storages a param holds whole, once each; a checkpoint mapped from a file (transformers' safetensors loading)
    is page cache that MemAvailable already counts, so crediting it admitted arenas that did not fit."""
    gpu = torch.device("cuda", 0)  # a device object only: nothing is allocated on it
    own, big = torch.nn.Parameter(torch.zeros(1000)), torch.zeros(3000)
    view = torch.nn.Parameter(big[:1000])  # a view of a larger storage: moving it frees nothing
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(4 * 1000))
    mapped = torch.nn.Parameter(torch.from_file(str(path), shared=True, size=1000))
    flat = [(own, 0, 1000), (view, 1000, 1000), (mapped, 2000, 1000)]
    assert host_bytes_leaving(flat, gpu) == 4000
    assert host_bytes_leaving(flat, ELSEWHERE) == 0 and host_bytes_leaving(flat, torch.device("cpu")) == 0

    monkeypatch.setattr(memory_limits, "host_memory_limits", lambda **_: [("MemAvailable", 10_000)])
    memory_limits.check_host_ram(12_000, freed=4000)
    with pytest.raises(MemoryError, match=r"counting 0.00 GiB of weights it moves to the device"):
        memory_limits.check_host_ram(15_000, freed=4000)
    with pytest.raises(MemoryError):
        memory_limits.check_host_ram(12_000)


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_a_device_that_cannot_hold_the_params_is_refused_before_anything(device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is there")
    model = TinyNet()
    with pytest.raises(ValueError, match=f"device={device}.*cannot hold"):
        OffloadAdam(param_groups(model, 0.1), lr=1e-2, options=OPTS, device=device)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _sharded_elsewhere(rank, world):
    out = []
    for device in (None, ELSEWHERE):
        torch.manual_seed(rank)  # each rank's own init: rank 0's reaches every rank through the (other) device
        model = TinyNet()
        opt = ShardedAdam(param_groups(model, 0.1), lr=1e-2, param_dtype=torch.bfloat16, options=OPTS, stage=2,
                          offload=True, device=device)
        model.to(device=device, dtype=torch.bfloat16)
        run_steps(model, opt, batches(4, seed=rank))
        opt.flush()
        out.append([p.detach().clone() for p in model.parameters() if p.requires_grad])  # (the frozen: each rank's)
    return out


def test_a_sharded_engine_over_params_elsewhere_equals_one_over_placed_params():
    ranks = run_distributed(_sharded_elsewhere)
    for placed, kept in ranks:
        assert all(torch.equal(p, q) for p, q in zip(placed, kept))
    assert all(torch.equal(p, q) for p, q in zip(ranks[0][1], ranks[1][1]))  # one model on both ranks


def test_the_trainer_places_through_the_engine_with_the_same_numbers(tmp_path):
    runs = []
    for place in (None, ELSEWHERE):
        model = tiny_t5()
        trainer = ZeroOffloadTrainer(model=model, args=_args(tmp_path, use_cpu=True, bf16=True, zero_offload=OFFLOAD),
                                     train_dataset=ToyDataset())
        if place is not None:
            trainer._zo_place_on = place  # as the Trainer's _move_model_to_device left it, for another device
        trainer.train()
        assert trainer.zero_engine.device == (place or torch.device("cpu"))
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_a_model_the_trainer_did_not_place_goes_to_its_device(tmp_path):
    """model_init with --fp16_full_eval (or place_model_on_device=False) left the model unplaced, and Accelerate's
    prepare then moved it under an engine built on the CPU (CPU streams, an unpinned arena)."""
    trainer = ZeroOffloadTrainer(model=tiny_t5(), args=_args(tmp_path, use_cpu=True, zero_offload=OFFLOAD),
                                 train_dataset=ToyDataset())
    trainer._zo_place_on = None
    assert trainer._zo_placement(trainer.model) == trainer.args.device


# -- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.cuda
@cuda
def test_an_engine_over_a_cpu_model_equals_one_over_the_placed_model():
    """Masters from the fp32 CPU weights, the params moved to the device in bf16 one at a time: the same masters,
    the same steps, bit for bit, as the engine built over the fp32 model placed on the device first."""
    dev, opts = torch.device("cuda"), OffloadOptions(bucket_numel=1000, tile_numel=300)
    torch.manual_seed(0)
    placed = TinyNet().to(dev)
    kept = copy.deepcopy(placed).cpu()
    a = OffloadAdam(param_groups(placed, 0.1), lr=1e-2, param_dtype=torch.bfloat16, options=opts)
    placed.to(torch.bfloat16)
    b = OffloadAdam(param_groups(kept, 0.1), lr=1e-2, param_dtype=torch.bfloat16, options=opts, device=dev)
    assert {(p.device.type, p.dtype) for p in kept.parameters() if p.requires_grad} == {("cuda", torch.bfloat16)}
    kept.to(device=dev, dtype=torch.bfloat16)  # the frozen ones: the Trainer's part
    assert b.arena.pinned and torch.equal(a.master, b.master)
    data = [(ids.to(dev), labels.to(dev), branch) for ids, labels, branch in batches(4)]
    run_steps(placed, a, data)
    run_steps(kept, b, data)
    torch.cuda.synchronize()
    assert torch.equal(a.master, b.master)
    for p, q in zip(placed.parameters(), kept.parameters()):
        assert torch.equal(p, q)
    a.close()
    b.close()


@pytest.mark.cuda
@cuda
def test_the_fp32_model_never_reaches_the_gpu(tmp_path):
    model = T5ForConditionalGeneration(T5Config(**{**TINY, "vocab_size": 8192, "d_model": 512, "d_kv": 64,
                                                   "d_ff": 2048, "num_layers": 4, "num_decoder_layers": 4}))
    n = sum(p.numel() for p in model.parameters())

    class Peak(TrainerCallback):
        at_start = None

        def on_train_begin(self, args, state, control, **kwargs):
            Peak.at_start = torch.cuda.max_memory_allocated()

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    trainer = ZeroOffloadTrainer(model=model, args=_args(tmp_path, bf16=True, zero_offload=SMALL_BUCKETS),
                                 train_dataset=ToyDataset(), callbacks=[Peak()])
    assert next(model.parameters()).device.type == "cpu"
    trainer.train()
    # the bf16 model (2 B/param) and two buckets (each as large as the largest param, the 4.2M-element embedding),
    # with 16 MiB to spare; placed in fp32 first, the peak was 4 B/param (more than this bound by 2 B/param - 33 MiB)
    buckets = trainer.zero_engine.pipeline.buckets
    assert Peak.at_start - base <= 2 * n + buckets.numel() * buckets.element_size() + 2**24, (Peak.at_start - base, n)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cuda", torch.bfloat16)}
    trainer.zero_engine.close()
