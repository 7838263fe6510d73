"""Port of transformers' tests/deepspeed/test_deepspeed.py (TrainerIntegrationDeepSpeed), its checkpoint
parts, to hf_zero_offload on CPU: saving checkpoints, resuming (a new or the same Trainer), loading the state dict
of a ZeRO checkpoint, load_best_model_at_end, the hyperparameter search. Element by element against the plain
Trainer; the dtype x offload x optimizer x scheduler combinations beyond the first are in the slow tier."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from _peer import (assert_same_state, assert_tracks, ds_config, get_regression_trainer, plain_trainer, weights,
                   with_dtype)
from _t5 import ToyDataset, best_eval_step, tiny_t5
from _peer_ds import DTYPES, OFFLOADS, TOL, dist_env_1, fast, slow  # noqa: F401 (a fixture)


# --------------------------------------------------------------------------- checkpoints and resuming
@pytest.mark.parametrize("dtype", fast(*DTYPES))
def test_save_checkpoints(dtype, tmp_path, dist_env_1):
    """Peer: checkpoint-{5,10,15,20} hold the model files and the ZeRO state (its global_stepN/, our zero_offload/);
    here also each checkpoint's weights are the plain Trainer's at that step."""
    kw = dict(save_steps=5)
    trainer = get_regression_trainer(output_dir=str(tmp_path / "ours"), **kw,
                                     **with_dtype({"zero_offload": ds_config(scale_power=1)}, dtype))
    trainer.train()
    ref = plain_trainer(tmp_path / "plain", lr_scheduler_type="constant", **kw)
    ref.train()
    for step in range(5, 3 * 64 // 8, 5):
        ck = tmp_path / "ours" / f"checkpoint-{step}"
        for f in ["model.safetensors", "training_args.bin", "trainer_state.json", "config.json"]:
            assert (ck / f).is_file(), ck / f
        assert (ck / "zero_offload").is_dir() and any((ck / "zero_offload").iterdir()), sorted(os.listdir(ck))
        ours, theirs = load_file(ck / "model.safetensors"), load_file(tmp_path / "plain" / ck.name / "model.safetensors")
        assert_tracks([ours["a"].float(), ours["b"].float()], [theirs["a"], theirs["b"]], (0, 0), TOL[dtype][0])


RESUME = [("fp32", "cpu", "ds_optim", "ds_scheduler"), ("bf16", "cpu", "ds_optim", "ds_scheduler")] + [
    pytest.param(d, o, opt, s, marks=slow) for d in DTYPES for o in OFFLOADS for opt in ("hf_optim", "ds_optim")
    for s in ("hf_scheduler", "ds_scheduler") if not (o == "cpu" and opt == "ds_optim" and s == "ds_scheduler"
                                                      and d != "fp16")]


@pytest.mark.parametrize("dtype,offload,optim,scheduler", RESUME)
def test_can_resume_training_normal(dtype, offload, optim, scheduler, tmp_path, dist_env_1):
    """Peer: resuming from checkpoint-5 and from checkpoint-15 (across an epoch) ends with exactly the weights and
    the state of the uninterrupted run (the peer skips hf_optim + hf_scheduler, 'slowly diverges'; ours runs it)."""
    ds = ds_config(offload, optimizer=optim == "ds_optim", scheduler=scheduler == "ds_scheduler",
                   scale_power=1 if dtype == "fp16" else None)
    kw = with_dtype(dict(output_dir=str(tmp_path), train_len=128, save_steps=5, learning_rate=0.1, zero_offload=ds),
                    dtype)
    trainer = get_regression_trainer(**kw)
    trainer.train()
    a, b = weights(trainer)
    assert min(abs(a), abs(b)) > 0.1  # it trained: a resume that kept the start would differ
    for ck in ["checkpoint-5", "checkpoint-15"]:
        resumed = get_regression_trainer(**kw)
        resumed.train(resume_from_checkpoint=str(tmp_path / ck))
        assert weights(resumed) == (a, b), ck
        assert_same_state(trainer.state, resumed.state)


@pytest.mark.parametrize("dtype", fast(*DTYPES))
def test_resume_same_trainer_instance(dtype, tmp_path, dist_env_1):
    """Peer comments this out (DeepSpeed bug #1612): train() again on the same Trainer from a checkpoint."""
    kw = with_dtype(dict(output_dir=str(tmp_path), train_len=128, save_steps=5, learning_rate=0.1,
                         zero_offload=ds_config(scale_power=1 if dtype == "fp16" else None)), dtype)
    trainer = get_regression_trainer(**kw)
    trainer.train()
    a, b = weights(trainer)
    assert min(abs(a), abs(b)) > 0.1
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-15"))
    assert weights(trainer) == (a, b)


@pytest.mark.parametrize("offload", fast(*OFFLOADS))
@pytest.mark.parametrize("dtype", fast(*DTYPES))
def test_load_state_dict_from_zero_checkpoint(dtype, offload, tmp_path, dist_env_1):
    """Peer: deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint(model, last_ckpt) gives the trained
    weights. Ours: hf_zero_offload.consolidate (the fp32 masters), loaded into a fresh model: the trained weights
    exactly (fp32), or the masters rounded to the training dtype are (bf16, fp16)."""
    from transformers.trainer_utils import get_last_checkpoint

    from hf_zero_offload.consolidate import consolidate
    kw = with_dtype(dict(output_dir=str(tmp_path / "run"), train_len=4, per_device_train_batch_size=4,
                         save_strategy="steps", save_steps=1, learning_rate=0.1,
                         zero_offload=ds_config(offload, scale_power=1 if dtype == "fp16" else None)),
                    dtype)
    trainer = get_regression_trainer(**kw)
    trainer.train()
    trained = [p.detach().clone() for p in (trainer.model.a, trainer.model.b)]
    assert all(t.item() != 0 for t in trained)
    consolidate(get_last_checkpoint(str(tmp_path / "run")), str(tmp_path / "fp32"))
    sd = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in sd.values())
    fresh = get_regression_trainer(**kw).model
    fresh.load_state_dict(sd)
    for got, want in zip((fresh.a, fresh.b), trained):
        assert torch.equal(got.detach().to(want.dtype), want), (got, want)


# --------------------------------------------------------------------------- load_best_model_at_end (tiny T5)
def _tiny_t5_trainer(out_dir, ds, dtype, **extra):
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
    args = dict(per_device_train_batch_size=1, per_device_eval_batch_size=1, learning_rate=1e-4, num_train_epochs=1,
                do_train=True, do_eval=True, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                save_steps=1, load_best_model_at_end=True, max_steps=1, report_to="none", use_cpu=True,
                disable_tqdm=True)
    targs = ZeroOffloadSeq2SeqTrainingArguments(str(out_dir), zero_offload=ds, **with_dtype({**args, **extra}, dtype))
    return ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), args=targs, train_dataset=ToyDataset(8),
                                     eval_dataset=ToyDataset(4, seed=1))


def _assert_model_is(model, checkpoint):
    saved = load_file(os.path.join(checkpoint, "model.safetensors"))
    own = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(own[k].cpu(), v), k


@pytest.mark.parametrize("dtype", fast(*DTYPES))
def test_load_best_model(dtype, tmp_path, dist_env_1):
    """Peer: hf optimizer + hf scheduler + load_best_model_at_end, max_steps 1: train() then evaluate() work. Ours:
    AdamW (Adafactor is refused by design, checked); the model after train() is checkpoint-1's, trained."""
    ds = ds_config(optimizer=False, scheduler=False)
    ds["zero_force_ds_cpu_optimizer"] = False
    ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    trainer = _tiny_t5_trainer(tmp_path / "adamw", ds, dtype)
    trainer.train()
    _assert_model_is(trainer.model, trainer.state.best_model_checkpoint)
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    init = tiny_t5().state_dict()
    assert any(not torch.equal(v.float().cpu(), init[k]) for k, v in trainer.model.state_dict().items())
    m = trainer.evaluate()
    assert m["eval_loss"] == trainer.state.log_history[0]["eval_loss"]
    with pytest.raises(Exception) as e:
        _tiny_t5_trainer(tmp_path / "adafactor", ds, dtype, optim="adafactor")
    assert "adafactor" in str(e.value).lower(), str(e.value)


@pytest.mark.parametrize("dtype", fast("fp32", "bf16"))
def test_load_best_model_multi_steps(dtype, tmp_path, dist_env_1):
    """Extension: 4 steps, eval and save at each, the best not the last: the model after train() is the best
    checkpoint's, element by element."""
    trainer = _tiny_t5_trainer(tmp_path, ds_config(), dtype, max_steps=4, metric_for_best_model="eval_loss",
                               greater_is_better=True, learning_rate=1e-2)
    trainer.train()
    step = best_eval_step(trainer.state)
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{step}")
    _assert_model_is(trainer.model, trainer.state.best_model_checkpoint)


def test_hyperparameter_search_zero2(tmp_path):
    pytest.importorskip("optuna")
