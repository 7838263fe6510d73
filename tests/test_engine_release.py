"""An engine that can no longer be used gives its memory back (engine/lifetime.py).

A closed engine kept its host arena (fp32 masters, moments, gradient stores, staging: ~14 B per trainable param) and
its buffers while anything held it; a replaced one too (a notebook re-running ``trainer = ...; trainer.train()``:
two arenas, peak RSS 2582 MiB against 1637 MiB now for 50M params); and dropping the last reference freed nothing
until the garbage collector ran (a bound method stored on the engine's helpers made a cycle). Checked on the storages
themselves (``StorageWeakRef``), not on RSS.
"""
from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from _dist import run_distributed
from _models import TinyNet, batches, loss_fn, param_groups, run_steps
from _t5 import OFFLOAD, ToyDataset, tiny_t5
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam, offload
from hf_zero_offload.engine.sharded import optimizer as sharded_optimizer

DPU = {"dpu": True, "dpu_warmup_steps": 1}
KINDS = {"offload": (OffloadAdam, {}, {}), "offload-dpu": (OffloadAdam, {}, DPU),
         "offload-int8": (OffloadAdam, {}, {"state_dtype": "int8"}),
         "zero2-offload-dpu": (ShardedAdam, {"stage": 2}, DPU),
         "zero1-device": (ShardedAdam, {"stage": 1, "offload": False}, {})}


def build(kind, model):
    cls, extra, opts = KINDS[kind]
    return cls(param_groups(model, 0.01), lr=1e-2, options=OffloadOptions(num_threads=1, **opts), **extra)


def trained(kind):
    """A model and its engine after 2 steps (DPU, warm-up 1: the second still in flight on the worker)."""
    torch.manual_seed(0)
    model = TinyNet()
    engine = build(kind, model)
    run_steps(model, engine, batches(2))
    assert engine.needs_publish == ("dpu" in kind)
    return model, engine


def buffers(engine) -> list[StorageWeakRef]:
    """Every tensor of a model's size or more that the engine reaches through its fields (the arena's regions, the
    gradient buckets and stores, staging, the reducer's buffers), the params left out; as storage weak refs."""
    params = {p.untyped_storage().data_ptr() for g in engine.param_groups for p in g["params"]}
    found, seen = {}, set()

    def walk(x, depth):
        if id(x) in seen or depth > 4:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            if x.numel() >= 256 and s.data_ptr() not in params:
                found[s.data_ptr()] = StorageWeakRef(s)
        elif isinstance(x, dict):
            [walk(v, depth + 1) for v in x.values()]
        elif isinstance(x, (list, tuple)):
            [walk(v, depth + 1) for v in x]
        elif type(x).__module__.startswith("hf_zero_offload") and hasattr(x, "__dict__"):
            [walk(v, depth + 1) for k, v in vars(x).items() if k not in ("param_groups", "_flat", "_slots", "slots")]

    walk(engine, 0)
    assert len(found) >= 2, "the arena and the gradient buffers at least"
    return list(found.values())


def helper_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("hzo-dpu", "hzo-scatter"))]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_close_releases_the_memory_and_any_later_use_says_why(kind):
    """DPU: the worker's step in flight ends first (it reads the gradient store: the store could not be freed while
    it ran), and the thread stops."""
    model, engine = trained(kind)
    held = buffers(engine)
    engine.close()
    assert all(ref.expired() for ref in held)
    assert not helper_threads()
    for use in (engine.step, engine.state_dict, engine.zero_grad, engine.grad_norm, engine.flush,
                engine.adopt_changed_params, engine.attach_hooks, lambda: engine.save_checkpoint("unused"),
                lambda: engine.load_state_dict({})):
        with pytest.raises(RuntimeError, match=rf"{type(engine).__name__} was closed; build a new engine .*Its "
                                               "optimizer state and memory were released then"):
            use()
    engine.close()  # again: nothing
    loss_fn(model, *batches(1)[0]).backward()  # the model is plain torch
    assert model.body[0].weight.grad is not None


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_replaced_engine_is_released_before_the_new_one_allocates(kind, monkeypatch):
    """The old engine, still referenced, gave its memory back before the new arena existed: the peak is one arena."""
    model, old = trained(kind)
    held, seen = buffers(old), []
    for module in (offload, sharded_optimizer):
        class Arena(module.HostArena):
            def __init__(self, *args, **kwargs):
                seen.append(all(ref.expired() for ref in held))
                super().__init__(*args, **kwargs)
        monkeypatch.setattr(module, "HostArena", Arena)
    new = build(kind, model)
    assert seen in ([True], []) and all(ref.expired() for ref in held)  # (zero1-device: no host arena)
    assert not helper_threads() or "dpu" in kind and len(helper_threads()) == 1  # the new one's worker only
    with pytest.raises(RuntimeError, match=rf"{type(old).__name__} was replaced by a new {type(new).__name__} built "
                                           r"on the same parameters \(e.g. another Trainer on this model\)"):
        old.state_dict()
    old.close()  # nothing: its refusal keeps saying why
    with pytest.raises(RuntimeError, match=rf"{type(old).__name__} was replaced by a new"):
        old.save_checkpoint("unused")
    run_steps(model, new, batches(2))  # the new one trains
    new.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dropping_the_last_reference_frees_the_memory_without_the_garbage_collector(kind):
    model, engine = trained(kind)
    engine.flush()
    held = buffers(engine)
    gc.collect()
    gc.disable()
    try:
        del engine
        assert all(ref.expired() for ref in held)
    finally:
        gc.enable()
    loss_fn(model, *batches(1)[0]).backward()  # its hooks went with it
    assert model.body[0].weight.grad is not None


def _one_gloo_rank_job(rank, world):
    out = {}
    for kind in ("zero2-offload-dpu", "zero1-device"):
        model, engine = trained(kind)
        held = buffers(engine)
        new = build(kind, model)
        out[f"{kind} replaced"] = all(ref.expired() for ref in held)
        held = buffers(new)
        new.close()
        out[f"{kind} closed"] = all(ref.expired() for ref in held)
        model, engine = trained(kind)
        engine.flush()
        held = buffers(engine)
        gc.collect()
        gc.disable()
        del engine
        out[f"{kind} dropped"] = all(ref.expired() for ref in held)
        gc.enable()
    return out


def test_sharded_engines_under_a_process_group_release_alike():
    """One gloo rank (a process group initialised): the reducer's collectives path."""
    (out,) = run_distributed(_one_gloo_rank_job, world_size=1)
    assert all(out.values()), out


def test_a_second_trainer_on_the_model_holds_one_arena_at_a_time(tmp_path, monkeypatch):
    """The notebook case: a second Trainer's train() on the model of a first one still alive (and its engine) built
    its arena while the first's was still allocated. Now the first's is gone when the second's is allocated."""
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    def trainer(name):
        args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path / name), zero_offload=OFFLOAD, max_steps=2,
                                                   per_device_train_batch_size=4, use_cpu=True, report_to=[],
                                                   save_strategy="no", disable_tqdm=True)
        return ZeroOffloadSeq2SeqTrainer(model=model, args=args, train_dataset=ToyDataset())

    model = tiny_t5()
    t1 = trainer("t1")
    t1.train()
    held, seen = buffers(t1.zero_engine), []

    class Arena(offload.HostArena):
        def __init__(self, *args, **kwargs):
            seen.append(all(ref.expired() for ref in held))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(offload, "HostArena", Arena)
    t2 = trainer("t2")
    t2.train()
    assert seen == [True]
    with pytest.raises(RuntimeError, match=r"OffloadAdam was replaced by a new OffloadAdam built on the same "
                                           r"parameters \(e.g. another Trainer on this model\)"):
        t1.train()


def test_del_trainer_frees_the_engine_without_the_garbage_collector(tmp_path):
    """A hyperparameter search, or a notebook dropping its Trainer: the plain Trainer is freed at ``del trainer``;
    ours lived on with its engine's host arena until the garbage collector ran (the Accelerator patch's closures held
    the Trainer and the Accelerator's own bound methods; the optimizer wrapper held a bound method to itself)."""
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    args = ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(tmp_path), zero_offload=OFFLOAD, max_steps=2,
                                               per_device_train_batch_size=4, use_cpu=True, report_to=[],
                                               save_strategy="no", disable_tqdm=True)
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=ToyDataset())
    trainer.train()
    held = buffers(trainer.zero_engine)
    gc.collect()
    gc.disable()
    try:
        del trainer
        assert all(ref.expired() for ref in held)
    finally:
        gc.enable()
