"""Port of transformers' tests/deepspeed/test_deepspeed.py, its ZeRO-2 parts (TrainerIntegrationDeepSpeed and
TestDeepSpeedWithLauncher), to hf_zero_offload on CPU: the peer's ``deepspeed=`` config is our ``zero_offload=``,
its regression model and Trainer are in tests/_peer.py, its run_translation.py / run_clm.py launches are
tests/_peer_launch.py under torchrun (2 gloo ranks, --sharded_ddp).

Refused by design, and ported as "refused by name" checks: ZeRO-3 (and zero.Init), NVMe offload, Adafactor.
fp32 is added to the peer's bf16 / fp16; offload "none" (ZeRO-2 without offload) to its "cpu". Where the peer only
checks that a run trains, this port compares it element by element against a reference run: transformers' own
Trainer (fp32, torch AdamW) on the same model and data, within each dtype's tolerance.

The default tier runs one dtype per case family; every dtype x offload x optimizer x scheduler combination and
every torchrun launch are in the slow tier: ``make test-all``, or ``pytest -m slow tests/test_peer_deepspeed.py``.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _dist import run_distributed
from _peer import (assert_same_state, assert_tracks, ds_config, get_regression_trainer, plain_trainer, steps,
                   weights, with_dtype)
from _procs import run_together
from _t5 import ToyDataset, best_eval_step, tiny_t5

HERE = Path(__file__).resolve().parent
DTYPES = ["fp32", "bf16", "fp16"]  # the peer's bf16, fp16 (GPU); fp32 added on CPU
OFFLOADS = ["cpu", "none"]  # the peer's zero2 offloads to cpu; "none" = ZeRO-2 without offload
#: per dtype: the weights' distance from the fp32 reference (absolute), the logged losses' (relative)
TOL = {"fp32": (1e-7, 1e-6), "bf16": (1e-5, 2e-2), "fp16": (1e-6, 3e-3)}
slow = pytest.mark.slow


def fast(first, *rest):
    """Parameter values: the first in the default tier, the rest marked slow."""
    return [first, *(pytest.param(v, marks=slow) for v in rest)]


@pytest.fixture
def dist_env_1(monkeypatch):
    """The peer's mockenv for a one-process "distributed" run (a notebook / no launcher), on a free port rather than
    the peer's fixed 10999: the Trainer binds it, and two test runs on one machine would collide."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    was = torch.distributed.is_initialized()
    yield
    if not was and torch.distributed.is_initialized():  # the Trainer's one-rank group: later tests run without one
        torch.distributed.destroy_process_group()


def check_against_plain(trainer, tmp_path, dtype, ds_scheduler=True, **kw):
    """``trainer`` (trained) against the plain Trainer with the same arguments: weights and each logged step's
    loss and learning rate. The peer's WarmupLR with warmup_num_steps "auto" (--warmup_steps 0) is a constant."""
    ref = plain_trainer(tmp_path / "plain", lr_scheduler_type="constant" if ds_scheduler else "linear", **kw)
    ref.train()
    wtol, ltol = TOL[dtype]
    assert_tracks(weights(trainer), weights(ref), (kw.get("a", 0), kw.get("b", 0)), wtol)
    ours, theirs = steps(trainer, "loss", "learning_rate"), steps(ref, "loss", "learning_rate")
    assert len(ours) == len(theirs) > 0
    assert [lr for _, lr in ours] == pytest.approx([lr for _, lr in theirs], rel=1e-6)
    assert [loss for loss, _ in ours] == pytest.approx([loss for loss, _ in theirs], rel=ltol)


# --------------------------------------------------------------------------- config and refusals
def test_hf_ds_config_mismatch(tmp_path):
    """Peer: every contradicting key is named in one exception."""
    ds = ds_config()
    ds["train_micro_batch_size_per_gpu"] = 2 + 2
    ds["train_batch_size"] = 1000
    ds["gradient_accumulation_steps"] = 2 + 2
    ds["gradient_clipping"] = 1.0 + 0.1
    ds["optimizer"]["params"]["betas"] = [0.9 - 0.1, 0.99 - 0.1]
    ds["fp16"]["enabled"] = False
    with pytest.raises(Exception) as e:  # ours raises at construction already; the peer's at train()
        get_regression_trainer(fp16=True, zero_offload=ds, per_device_train_batch_size=2,
                               gradient_accumulation_steps=2, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.99,
                               output_dir=str(tmp_path)).train()
    for key in ["per_device_train_batch_size", "train_batch_size", "gradient_accumulation_steps", "max_grad_norm",
                "betas", "fp16"]:
        assert key in str(e.value), f"{key} is not in the exception message:\n{e.value}"


def test_stage3_nvme_offload_refused(tmp_path):
    """Peer: ZeRO-3 with NVMe offload trains. Ours: refused by design, naming stage 3 / nvme."""
    ds = ds_config(stage=3)
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    ds["zero_optimization"]["offload_optimizer"] = ds["zero_optimization"]["offload_param"] = nvme
    with pytest.raises(Exception) as e:
        get_regression_trainer(zero_offload=ds, output_dir=str(tmp_path), save_strategy="no").train()
    msg = str(e.value).lower()
    assert "stage" in msg or "nvme" in msg, msg


def test_zero2_nvme_optimizer_offload_refused(tmp_path):
    ds = ds_config()
    ds["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    with pytest.raises(Exception) as e:
        get_regression_trainer(zero_offload=ds, output_dir=str(tmp_path), save_strategy="no").train()
    assert "nvme" in str(e.value).lower(), str(e.value)


def test_missed_zero3_init_refused(tmp_path):
    """Peer (disabled there): a zero3 config with a model not built under zero.Init. Ours: stage 3 is refused."""
    from hf_zero_offload import ZeroOffloadTrainingArguments
    with pytest.raises(Exception) as e:
        ZeroOffloadTrainingArguments(str(tmp_path), zero_offload=ds_config(stage=3), use_cpu=True, report_to="none")
        get_regression_trainer(zero_offload=ds_config(stage=3), output_dir=str(tmp_path))
    assert "3" in str(e.value)


def test_ds_config_object(tmp_path, dist_env_1):
    """Peer: zero3 then zero2 in one process, no global ds config leaking. Ours refuses zero3; a zero2 Trainer made
    after the refusal trains as the plain Trainer does, and transformers' deepspeed globals stay unset."""
    from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled
    kw = {"train_len": 8, "save_strategy": "no", "logging_steps": 1}
    with pytest.raises(Exception) as e:
        get_regression_trainer(zero_offload=ds_config(stage=3), output_dir=str(tmp_path / "z3"), **kw).train()
    assert "stage" in str(e.value).lower() or "3" in str(e.value)
    assert not is_deepspeed_zero3_enabled()
    trainer = get_regression_trainer(zero_offload=ds_config(), output_dir=str(tmp_path / "z2"), **kw)
    trainer.train()
    assert not is_deepspeed_zero3_enabled() and not deepspeed_config()
    check_against_plain(trainer, tmp_path, "fp32", **kw)


@pytest.mark.parametrize("dtype", fast(*DTYPES))
def test_can_resume_training_errors(dtype, tmp_path, dist_env_1):
    trainer = get_regression_trainer(output_dir=str(tmp_path), **with_dtype({"zero_offload": ds_config()}, dtype))
    with pytest.raises(Exception) as e:
        trainer.train(resume_from_checkpoint=True)
    assert "No valid checkpoint found in output directory" in str(e.value), str(e.value)
    with pytest.raises(Exception, match="checkpoint-5-bogus"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5-bogus"))


# --------------------------------------------------------------------------- training equals the plain Trainer
COMBOS = {"hf_sched_hf_optim": (False, False), "ds_sched_hf_optim": (True, False), "hf_sched_ds_optim": (False, True)}


@pytest.mark.parametrize("dtype", fast(*DTYPES))
@pytest.mark.parametrize("combo", list(COMBOS))
def test_optimizer_scheduler_combos(combo, dtype, tmp_path, dist_env_1):
    """Peer test_hf_scheduler_hf_optimizer / test_ds_scheduler_hf_optimizer / test_hf_scheduler_ds_optimizer:
    offload device none, initial_scale_power 1; here against the plain Trainer step by step."""
    ds_sched, ds_optim = COMBOS[combo]
    ds = ds_config("none", optimizer=ds_optim, scheduler=ds_sched, scale_power=1)
    kw = dict(save_strategy="no", logging_steps=1)
    trainer = get_regression_trainer(zero_offload=ds, output_dir=str(tmp_path / "ours"), **with_dtype(kw, dtype))
    trainer.train()
    check_against_plain(trainer, tmp_path, dtype, ds_scheduler=ds_sched, **kw)


@pytest.mark.parametrize("offload", fast(*OFFLOADS))
@pytest.mark.parametrize("dtype", fast(*DTYPES))
def test_hf_optimizer_with_offload(dtype, offload, tmp_path, dist_env_1, caplog):
    """Peer: no ds optimizer block, zero_force_ds_cpu_optimizer False: trains, the engine's start line says so."""
    ds = ds_config(offload, optimizer=False, scale_power=1)
    ds["zero_force_ds_cpu_optimizer"] = False
    kw = dict(save_strategy="no", logging_steps=1)
    trainer = get_regression_trainer(zero_offload=ds, output_dir=str(tmp_path / "ours"), **with_dtype(kw, dtype))
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        trainer.train()
    assert "hf_zero_offload: config=" in caplog.text
    assert f"offload={offload == 'cpu'}" in caplog.text
    check_against_plain(trainer, tmp_path, dtype, **kw)


@pytest.mark.parametrize("offload", fast(*OFFLOADS))
@pytest.mark.parametrize("dtype", fast(*DTYPES))
def test_fake_notebook_no_launcher(dtype, offload, tmp_path, dist_env_1, caplog):
    """Peer: the config used without a launcher (one process, the env of a notebook)."""
    kw = dict(save_strategy="no", logging_steps=1)
    trainer = get_regression_trainer(zero_offload=ds_config(offload, scale_power=1), output_dir=str(tmp_path / "o"),
                                     **with_dtype(kw, dtype))
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        trainer.train()
    assert "hf_zero_offload: config=" in caplog.text and "ranks=1" in caplog.text
    check_against_plain(trainer, tmp_path, dtype, **kw)


@pytest.mark.parametrize("ga", [1, pytest.param(4, marks=slow)])
@pytest.mark.parametrize("offload", fast(*OFFLOADS))
def test_hf_optim_hf_sched_equals_plain_trainer(offload, ga, tmp_path, dist_env_1):
    """Not in the peer (DeepSpeed is not compared to the plain Trainer there): with neither block, fp32, warm-up,
    weight decay and clipping, each step's loss, grad_norm and lr and the final weights are the plain Trainer's."""
    kw = dict(per_device_train_batch_size=16 // ga, gradient_accumulation_steps=ga, learning_rate=0.1,
              warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0, save_strategy="no", logging_steps=1)
    ours = get_regression_trainer(zero_offload=ds_config(offload, optimizer=False, scheduler=False),
                                  output_dir=str(tmp_path / "ours"), **kw)
    ours.train()
    plain = plain_trainer(tmp_path / "plain", **kw)
    plain.train()
    assert_tracks(weights(ours), weights(plain), (0, 0), 1e-6)
    keys = ("loss", "grad_norm", "learning_rate")
    lo, lp = steps(ours, *keys), steps(plain, *keys)
    assert len(lo) == len(lp) == 12
    for x, y in zip(lo, lp):
        assert x == pytest.approx(y, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("dtype", fast("fp16", "fp32", "bf16"))
def test_early_get_last_lr(dtype, tmp_path, dist_env_1):
    """Peer: logging_steps=1 while fp16's dynamic scale (2^16) skips the first steps must not fail in get_last_lr:
    with fp16 every step is skipped (a, b stay 0, the LR stays at the schedule's start); bf16 / fp32 train as the
    plain Trainer does."""
    kw = dict(a=0.0, b=0.0, train_len=8, per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
              learning_rate=1e-3)  # the peer's 5e-5 moves bf16 weights by a few of their units in 3 steps
    trainer = get_regression_trainer(zero_offload=ds_config(), output_dir=str(tmp_path / "o"), **with_dtype(kw, dtype))
    trainer.train()
    if dtype == "fp16":
        assert weights(trainer) == (0.0, 0.0)
        assert [lr for _, lr in steps(trainer, "loss", "learning_rate")] == [1e-3] * 3
    else:
        check_against_plain(trainer, tmp_path, dtype, **kw)


GA_XFAIL = pytest.mark.xfail(strict=True, reason=(
    "fp16 at the peer's initial_scale_power 16: dynamic loss scaling overflows per micro-batch, so GA=4 (4-sample "
    "micro-batches) skips step 8 where GA=1 does not: a 4.9e-5 apart; inherent to fp16 dynamic scaling, not to the "
    "accumulation arithmetic (passes at initial_scale_power 1)"))


@pytest.mark.parametrize("offload", fast(*OFFLOADS))
@pytest.mark.parametrize("dtype,scale_power", [
    ("fp32", None), ("bf16", None), pytest.param("fp16", 1, marks=slow),
    pytest.param("fp16", None, marks=[slow, GA_XFAIL])])
def test_gradient_accumulation(dtype, scale_power, offload, tmp_path, dist_env_1):
    """Peer: bs16 x GA1 == bs4 x GA4: a, b to 5e-6, training loss within 1e-3 relative, each step's LR the same."""
    kw = with_dtype(dict(a=0.0, b=0.0, zero_offload=ds_config(offload, scale_power=scale_power),
                         save_strategy="no", logging_steps=1), dtype)
    t1 = get_regression_trainer(**kw, output_dir=str(tmp_path / "1"), per_device_train_batch_size=16)
    r1 = t1.train()
    t2 = get_regression_trainer(**kw, output_dir=str(tmp_path / "2"), per_device_train_batch_size=4,
                                gradient_accumulation_steps=4)
    r2 = t2.train()
    assert_tracks(weights(t2), weights(t1), (0, 0), 5e-6)
    # the peer's one-sided (r1 - r2) / r1 < 1e-3 hides that GA=4 logs 4x: transformers sums the micro-batches' mean
    # losses of a model whose forward takes **kwargs (as the plain Trainer does; the engine warns)
    assert r2.training_loss == pytest.approx(4 * r1.training_loss, rel=1e-3)
    assert steps(t2, "learning_rate") == steps(t1, "learning_rate")


def _ga_on_ranks(rank, world_size, dtype, offload, out_dir):
    """The peer's test_gradient_accumulation on 2 ranks (--sharded_ddp): bs8 x GA1 vs bs2 x GA4 per rank."""
    ds = ds_config(offload, scale_power=1 if dtype == "fp16" else None)
    res = []
    for bs, ga in [(8, 1), (2, 4)]:
        t = get_regression_trainer(zero_offload=ds, save_strategy="no", sharded_ddp=True, ddp_backend="gloo",
                                   output_dir=f"{out_dir}/{bs}", per_device_train_batch_size=bs,
                                   gradient_accumulation_steps=ga, **with_dtype({}, dtype))
        loss = t.train().training_loss
        res.append((*weights(t), loss))
    return res


@slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradient_accumulation_distributed(dtype, tmp_path):
    """Extension: the peer's test_gradient_accumulation on 2 gloo ranks: both ranks end equal, GA1 == GA4 to 5e-6."""
    ranks = run_distributed(_ga_on_ranks, dtype, "cpu", str(tmp_path), timeout=300)
    # the weights only: the logged training loss is each rank's own, and under DDP transformers scales a **kwargs
    # model's micro-batch losses by the items of all ranks, so GA=4's is not 4x GA=1's rank by rank
    for (a1, b1, _), (a2, b2, _) in ranks:
        assert_tracks((a2, b2), (a1, b1), (0, 0), 5e-6)
    assert [r[0][:2] for r in ranks] == [ranks[0][0][:2]] * 2 and [r[1][:2] for r in ranks] == [ranks[0][1][:2]] * 2


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


# --------------------------------------------------------------------------- launcher tests (torchrun, gloo)
def _launch(nproc, out, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(HERE / "_peer_launch.py"), "--output_dir", str(out), *args]


def _run(*argvs):
    """The launches side by side (--standalone: each binds its own rendezvous port)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for r in run_together(list(argvs), timeout=420, env=env):
        assert r.returncode == 0, r.stdout[-3000:] + "\n" + r.stderr[-6000:]


def _results(out, kind):
    return json.loads((Path(out) / f"{kind}_results.json").read_text())


def check_launch(out, ref, dtype, do_train=True, do_eval=True):
    """The peer's do_checks (the results files are written), and the run against the plain Trainer's: the trained
    weights element by element and the metrics, within the dtype's tolerance (bf16 / fp16 hold weights rounded to
    their 8 / 11 bits, and train on losses computed at that precision)."""
    if do_eval:
        ours, theirs = _results(out, "eval"), _results(ref, "eval")
        assert ours["eval_accuracy"] == pytest.approx(theirs["eval_accuracy"], abs={"fp32": 1e-6}.get(dtype, 0.2))
        assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel={"fp32": 1e-4}.get(dtype, 5e-2))
    if do_train:
        assert "train_samples_per_second" in _results(out, "train")
        assert _results(out, "train")["train_loss"] == pytest.approx(_results(ref, "train")["train_loss"],
                                                                     rel={"fp32": 1e-5}.get(dtype, 2e-2))
        ours, theirs = load_file(Path(out) / "model.safetensors"), load_file(Path(ref) / "model.safetensors")
        assert ours.keys() == theirs.keys()
        for k in theirs:
            want, got = theirs[k], ours[k].float()
            if dtype == "fp32":
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
            else:  # a few units in the dtype's last place, and twice the run's summed LR (2.25e-3): Adam moves a
                # weight by about the LR a step, so a step that went the other way stays inside
                eps = torch.finfo(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])).eps
                torch.testing.assert_close(got, want, rtol=4 * eps, atol=5e-3, msg=lambda m: f"{k}: {m}")


def _launch_and_reference(tmp_path, nproc, dtype, *args):
    out, ref = tmp_path / "out", tmp_path / "ref"
    _run(_launch(nproc, out, "--dtype", dtype, *args), _launch(nproc, ref, "--reference", *args))
    return out, ref


@slow
@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_basic_distributed(dtype, offload, tmp_path):
    """Peer test_basic_distributed / test_fp32_distributed: 2 ranks, run_translation with predict_with_generate,
    group_by_length, label smoothing, warm-up 8; ours: --sharded_ddp on 2 gloo ranks."""
    out, ref = _launch_and_reference(tmp_path, 2, dtype, "--offload", offload, "--do_train", "--do_eval")
    check_launch(out, ref, dtype)


@slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fp32_non_distributed(dtype, tmp_path):
    out, ref = _launch_and_reference(tmp_path, 1, dtype, "--do_train", "--do_eval")
    check_launch(out, ref, dtype)


@slow
def test_do_eval_no_train(tmp_path):
    """Peer: zero3 only ('zero2 makes no sense with inference'); ours: an eval-only run with zero_offload gives the
    plain Trainer's metrics."""
    out, ref = _launch_and_reference(tmp_path, 1, "fp32", "--do_eval")
    check_launch(out, ref, "fp32", do_train=False)


@slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_train_not_from_ds_checkpoint(dtype, tmp_path):
    """Peer: a second run starting from the first's saved model (not its ZeRO checkpoint): both as the plain
    Trainer's first and second runs."""
    out1, ref1 = _launch_and_reference(tmp_path / "1", 2, dtype, "--do_train")
    check_launch(out1, ref1, dtype, do_eval=False)
    out2, ref2 = tmp_path / "out2", tmp_path / "ref2"
    _run(_launch(2, out2, "--dtype", dtype, "--do_train", "--model_name_or_path", str(out1)),
         _launch(2, ref2, "--reference", "--do_train", "--model_name_or_path", str(ref1)))
    check_launch(out2, ref2, dtype, do_eval=False)


@slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_clm(dtype, tmp_path):
    """Peer test_clm: a tiny GPT-2 with resize_token_embeddings, 2 ranks."""
    out, ref = _launch_and_reference(tmp_path, 2, dtype, "--do_train", "--do_eval", "--task", "clm")
    check_launch(out, ref, dtype)
