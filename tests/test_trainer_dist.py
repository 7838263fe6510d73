"""--sharded_ddp through the Trainer on 2 gloo processes, against plain DDP."""
from __future__ import annotations

import pytest
import torch

from _dist import run_distributed


def _train(rank, world_size, mode, out_dir):
    from transformers import Seq2SeqTrainer

    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    kw = dict(output_dir=f"{out_dir}/{mode}", per_device_train_batch_size=4, max_steps=4, use_cpu=True,
              ddp_backend="gloo", report_to=[], logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
              learning_rate=1e-3, weight_decay=0.01, max_grad_norm=0.5, warmup_steps=1)
    model = tiny_t5()
    if mode == "ddp":
        trainer = Seq2SeqTrainer(model=model, args=ZeroOffloadSeq2SeqTrainingArguments(optim="adamw_torch", **kw),
                                 train_dataset=ToyDataset())
    else:
        cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none" if mode == "sharded" else "cpu"}}}
        if mode == "offload-dpu":
            cfg["zero_optimization"]["delayed_param_update"] = {"enabled": True, "warmup_steps": 1}
        trainer = ZeroOffloadSeq2SeqTrainer(
            model=model, args=ZeroOffloadSeq2SeqTrainingArguments(sharded_ddp=True, zero_offload=cfg, **kw),
            train_dataset=ToyDataset())
    trainer.train()
    engine = getattr(trainer, "zero_engine", None)
    extra = {}
    if mode == "offload-dpu":  # after train(): the last delayed step is published, the model = the masters
        flat = torch.cat([p.detach().reshape(-1) for g in engine.slot_params() for p in g])
        extra = {"needs_publish": engine.needs_publish, "delayed_steps": engine.global_steps - 1,
                 "shard_equals_masters": torch.equal(flat[engine.shard_start:engine.shard_end],
                                                     engine.master[:engine.shard_end - engine.shard_start])}
    return {**extra, "params": [p.detach().clone() for p in model.parameters()],
            "engine": type(engine).__name__ if engine is not None else None,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


@pytest.mark.parametrize("mode", ["sharded", "offload"])
def test_sharded_ddp_equals_ddp(mode, tmp_path):
    ref = run_distributed(_train, "ddp", str(tmp_path), timeout=300)
    ours = run_distributed(_train, mode, str(tmp_path), timeout=300)
    assert ours[0]["engine"] == "ShardedAdam"
    for a, b in zip(ours[0]["params"], ours[1]["params"]):
        assert torch.equal(a, b)  # ranks stay identical
    for a, b in zip(ref[0]["params"], ours[0]["params"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert ours[0]["losses"] == pytest.approx(ref[0]["losses"], rel=1e-5)


def test_sharded_ddp_with_the_delayed_parameter_update(tmp_path):
    ours = run_distributed(_train, "offload-dpu", str(tmp_path), timeout=300)
    for a, b in zip(ours[0]["params"], ours[1]["params"]):
        assert torch.equal(a, b)  # ranks stay identical
    for r in ours:
        assert r["engine"] == "ShardedAdam" and r["delayed_steps"] == 3
        assert not r["needs_publish"] and r["shard_equals_masters"]
    assert len(ours[0]["losses"]) == 4 and ours[0]["losses"][-1] < ours[0]["losses"][0]


def _resume(rank, world_size, out_dir):
    """2 ranks, ZeRO-2 + offload + DPU: 6 steps saving at 3 (mid-delay), then a fresh run resumed from
    checkpoint-3."""
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                 "delayed_param_update": {"enabled": True, "warmup_steps": 1}}}

    def trainer(name, seed):
        model = tiny_t5(seed)
        targs = ZeroOffloadSeq2SeqTrainingArguments(
            output_dir=f"{out_dir}/{name}", per_device_train_batch_size=4, max_steps=6, use_cpu=True,
            ddp_backend="gloo", report_to=[], logging_steps=1, save_strategy="steps", save_steps=3, seed=0,
            disable_tqdm=True, learning_rate=1e-3, sharded_ddp=True, zero_offload=cfg)
        return model, ZeroOffloadSeq2SeqTrainer(model=model, args=targs, train_dataset=ToyDataset())

    full_model, full = trainer("full", 0)
    full.train()
    model, resumed = trainer("resumed", 1)  # another init: everything comes from the checkpoint
    resumed.train(resume_from_checkpoint=f"{out_dir}/full/checkpoint-3")
    return {"same": all(torch.equal(a, b) for a, b in zip(full_model.parameters(), model.parameters())),
            "files": sorted(__import__("os").listdir(f"{out_dir}/full/checkpoint-3/zero_offload"))}


def test_sharded_dpu_resume_through_the_trainer_is_exact(tmp_path):
    for r in run_distributed(_resume, str(tmp_path), timeout=300):
        assert r["same"]
        assert r["files"] == ["meta.json", "param_names.json", "rank0_of_2.hzo", "rank1_of_2.hzo"]


def _train_batchnorm(rank, world_size, mode, out_dir, gas, per_rank_start=False):
    import torch.nn as nn
    from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

    from hf_zero_offload import ZeroOffloadTrainer, ZeroOffloadTrainingArguments

    class Net(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            # (no bias before the norm: its gradient is rounding noise, which Adam scales up to lr-sized steps)
            self.a, self.bn, self.b = nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.Linear(8, 1)
            self.post_init()

        def forward(self, x, y):
            out = self.b(torch.relu(self.bn(self.a(x))))
            return {"loss": ((out.squeeze(-1) - y) ** 2).mean(), "logits": out}

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(6, generator=g) * (1 + i % 5), "y": torch.randn((), generator=g)} for i in range(48)]
    torch.manual_seed(rank if per_rank_start else 0)
    model = Net(PretrainedConfig())
    kw = dict(output_dir=f"{out_dir}/{mode}{gas}{per_rank_start}", per_device_train_batch_size=4, max_steps=4,
              use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
              learning_rate=1e-2, gradient_accumulation_steps=gas)
    if per_rank_start:  # each rank's own weights and statistics; a frozen layer; an evaluation before any step
        model.a.requires_grad_(False)
        model.bn.running_mean.fill_(rank)
        kw.update(eval_on_start=True, eval_strategy="steps", eval_steps=2, label_names=["y"])
    sets = dict(train_dataset=data, eval_dataset=data[:8])
    if mode == "ddp":
        trainer = Trainer(model=model, args=TrainingArguments(optim="adamw_torch", **kw), **sets)
    else:
        trainer = ZeroOffloadTrainer(model=model, **sets, args=ZeroOffloadTrainingArguments(
            sharded_ddp=True, zero_offload={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            **kw))
    trainer.train()
    return {"buffers": {n: b.clone() for n, b in model.named_buffers()},
            "params": [p.detach().clone() for p in model.parameters()],
            "eval_loss": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]}


@pytest.mark.parametrize("gas", [1, 2])
def test_sharded_ddp_broadcasts_buffers_as_ddp_does(gas, tmp_path):
    """Rank 1 kept its own BatchNorm statistics (0.19 off DDP's rank 1): DDP sets rank 0's before each synced
    forward; its evaluate() on 2 ranks gave another loss with equal weights."""
    ref = run_distributed(_train_batchnorm, "ddp", str(tmp_path), gas, timeout=300)
    ours = run_distributed(_train_batchnorm, "ours", str(tmp_path), gas, timeout=300)
    for r in range(2):
        for name, b in ref[r]["buffers"].items():
            torch.testing.assert_close(ours[r]["buffers"][name], b, rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
        for a, b in zip(ref[r]["params"], ours[r]["params"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ours[0]["buffers"]["bn.running_mean"], ours[1]["buffers"]["bn.running_mean"])


def test_sharded_ddp_starts_from_rank0s_frozen_params_and_buffers_as_ddp_does(tmp_path):
    """DDP's wrap sets rank 0's params (frozen ones too) and buffers on every rank; the engine set only the trainable
    params: ranks that built the model with their own seed kept their own frozen layer (0.9 apart for a whole run,
    another eval loss per rank), and an eval_on_start used each rank's own statistics (9.9% off DDP's)."""
    ref = run_distributed(_train_batchnorm, "ddp", str(tmp_path), 1, True, timeout=300)
    ours = run_distributed(_train_batchnorm, "ours", str(tmp_path), 1, True, timeout=300)
    assert len(ref[0]["eval_loss"]) == 3
    for r in range(2):
        assert ours[r]["eval_loss"] == pytest.approx(ref[r]["eval_loss"], rel=1e-5)
        for a, b in zip(ref[r]["params"], ours[r]["params"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours[0]["params"], ours[1]["params"]):
        assert torch.equal(a, b)


def _started_differently(rank, world_size, out_dir, key):
    """Rank 1 given another value of ``key`` than rank 0 (the shipped WarmupLR schedule: flat after its warm-up)."""
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    other = {"max_steps": dict(max_steps=3), "save_only_model": dict(save_only_model=True), "seed": dict(seed=1),
             "logging_steps": dict(logging_steps=2), "tokens": dict(include_num_input_tokens_seen=True),
             "eval_delay": dict(eval_delay=3), "smoothing": dict(label_smoothing_factor=0.1),
             "split_batches": dict(accelerator_config={"split_batches": True})}.get(key, {}) \
        if rank == 1 else {}
    targs = ZeroOffloadSeq2SeqTrainingArguments(**{**dict(
        output_dir=f"{out_dir}/{key}", per_device_train_batch_size=4, max_steps=4, use_cpu=True, ddp_backend="gloo",
        report_to=[], save_strategy="steps", save_steps=2, seed=0, disable_tqdm=True, sharded_ddp=True,
        zero_offload="zero2-offload"), **other})
    data = ToyDataset(24 if key == "dataset" and rank == 1 else 32)
    evals = ToyDataset(12 if key == "eval set" and rank == 1 else 16)
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=targs, train_dataset=data, eval_dataset=evals)
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


@pytest.mark.parametrize("key, said", [
    ("tokens", "include_num_input_tokens_seen: "),  # (gathered at every step on that rank alone: a hang)
    ("eval set", "the evaluation set's length: {'': 16} on rank 0, {'': 12} on rank 1"),
    ("max_steps", "max_steps: 4 on rank 0, 3 on rank 1"), ("save_only_model", "save_only_model: False on rank 0, "
                                                                               "True on rank 1"),
    ("seed", "seed: 0 on rank 0, 1 on rank 1"), ("logging_steps", "logging_steps: 500 on rank 0, 2 on rank 1"),
    ("dataset", "the training set's length: 32 on rank 0, 24 on rank 1"),
    # an outside probe: one rank's --eval_delay left both in evaluation's gather until the timeout; its
    # --label_smoothing_factor or split_batches trained on a mix of the two runs
    ("eval_delay", "eval_delay: 0 on rank 0, 3 on rank 1"), ("smoothing", "label_smoothing_factor: 0.0 on rank 0, "
                                                                          "0.1 on rank 1"),
    ("split_batches", "accelerator_config.split_batches: False on rank 0, True on rank 1")])
def test_ranks_started_for_different_runs_stop_at_train_start(tmp_path, key, said):
    """An outside probe: rank 1 with another --max_steps (a flat schedule: no lr differed) exited while rank 0 died in
    gloo's words, or waited in evaluation's collective; with --save_only_model both waited in the first save until the
    timeout; with another --seed or dataset they trained on a mix (0.041 off) and marked checkpoints complete."""
    import time
    start = time.monotonic()
    ours = run_distributed(_started_differently, str(tmp_path), key, timeout=120)
    assert time.monotonic() - start < 60
    for r in ours:
        assert r["error"] and f"ConfigError: the 2 ranks were started for different runs: {said}" in r["error"], ours
    assert not (tmp_path / key / "checkpoint-2").exists()


def _trainers_around_a_reload(rank, world_size, out_dir):
    import importlib

    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
    from hf_zero_offload.trainer import saving

    import time

    from transformers import TrainerCallback

    class Late(TrainerCallback):  # rank 1 reaches the second Trainer's first save after rank 0 looked for it
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 1 and state.global_step == 1:
                time.sleep(1.0)

    steps = []
    for name in ("a", "b"):
        targs = ZeroOffloadSeq2SeqTrainingArguments(
            output_dir=f"{out_dir}/{name}", per_device_train_batch_size=4, max_steps=2, use_cpu=True,
            ddp_backend="gloo", report_to=[], save_strategy="steps", save_steps=1, seed=0, disable_tqdm=True,
            sharded_ddp=True, zero_offload={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
        trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=targs, train_dataset=ToyDataset(),
                                            callbacks=[Late()] if name == "b" else [])
        trainer.train()
        steps.append(trainer.state.global_step)
        importlib.reload(saving)  # a notebook's %autoreload between two Trainers
    return steps


def test_trainers_in_one_job_around_a_module_reload_save_together(tmp_path):
    """An outside probe: the saves' agreement counted the Trainer's log/evaluate/save points in a module global, which
    a reload set back to 0 while the peers' keys in the store held the old counts: the next save said the ranks had
    gone on without saving."""
    assert run_distributed(_trainers_around_a_reload, str(tmp_path), timeout=120) == [[2, 2], [2, 2]]


def _train_again_after_counts_drifted(rank, world_size, out_dir):
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    targs = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, max_steps=2, use_cpu=True, ddp_backend="gloo", report_to=[],
        save_strategy="steps", save_steps=1, seed=0, disable_tqdm=True, sharded_ddp=True,
        zero_offload={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=targs, train_dataset=ToyDataset())
    trainer.train()
    if rank == 1:  # as an interrupt that caught rank 1 past a log/evaluate/save point rank 0 never reached leaves it
        trainer._zo_count()[1] += 1
    trainer.args.max_steps = 4
    trainer.train(resume_from_checkpoint=f"{out_dir}/checkpoint-2")
    return trainer.state.global_step


def test_a_train_again_after_an_interrupt_saves_together(tmp_path):
    """A review: the ranks' counts of log/evaluate/save points went on across train() calls, so a retry after an
    interrupt that caught the ranks at different points gave rank 0 a false "went on without saving" and left rank 1
    waiting for the timeout. Each train() counts from 0 again."""
    assert run_distributed(_train_again_after_counts_drifted, str(tmp_path), timeout=120) == [4, 4]


def test_the_save_agreement_is_off_on_a_file_store(tmp_path, monkeypatch):
    """A review: `file://` gives a PrefixStore over a PrefixStore over the FileStore (torchrun's TCPStore sits as deep),
    and unwrapping one level missed it: the file grew a line per rank and step."""
    import types

    import torch.distributed as dist

    from hf_zero_offload.trainer.saving import CheckpointSaving

    file_store = dist.FileStore(str(tmp_path / "store"), 1)
    tcp_like = dist.HashStore()
    me = types.SimpleNamespace(args=types.SimpleNamespace(world_size=2))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for under, used in ((file_store, False), (tcp_like, True)):
        wrapped = dist.PrefixStore("default_pg", dist.PrefixStore("attempt0", under))
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda w=wrapped: w)
        store = CheckpointSaving._zo_store(me)
        assert (store is not None and store.holds(wrapped)) is used


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(64):
            src = torch.randint(2, 64, (8,), generator=g)
            yield {"input_ids": src, "attention_mask": torch.ones_like(src), "labels": src.flip(0)}


def _chained(rank, world_size, out_dir):
    from _t5 import tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
    targs = ZeroOffloadSeq2SeqTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, max_steps=2, use_cpu=True, ddp_backend="gloo",
        report_to=[], save_strategy="no", disable_tqdm=True, sharded_ddp=True, zero_offload="zero2-offload")
    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=targs,
                                        train_dataset=torch.utils.data.ChainDataset([_Stream()]))
    trainer.train()
    return trainer.state.global_step


def test_a_dataset_whose_len_raises_trains_on_two_ranks(tmp_path):
    """A review: the train()-start comparison took len() of a ChainDataset of iterable datasets (Sized, its len()
    raises TypeError, as transformers' has_length knows) and every rank failed."""
    with pytest.raises(TypeError):
        len(torch.utils.data.ChainDataset([_Stream()]))
    assert run_distributed(_chained, str(tmp_path), timeout=150) == [2, 2]
