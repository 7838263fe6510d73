"""Port of transformers' tests/deepspeed/test_deepspeed.py, its ZeRO-2 parts (TrainerIntegrationDeepSpeed and
TestDeepSpeedWithLauncher), to hf_zero_offload on CPU: the peer's ``deepspeed=`` config is our ``zero_offload=``,
its regression model and Trainer are in tests/_peer.py, its run_translation.py / run_clm.py launches are
tests/_peer_launch.py under torchrun (2 gloo ranks, --sharded_ddp).

Refused by design, and ported as "refused by name" checks: ZeRO-3 (and zero.Init), NVMe offload, Adafactor.
fp32 is added to the peer's bf16 / fp16; offload "none" (ZeRO-2 without offload) to its "cpu". Where the peer only
checks that a run trains, this port compares it element by element against a reference run: transformers' own
Trainer (fp32, torch AdamW) on the same model and data, within each dtype's tolerance.

The default tier runs one dtype per case family; every dtype x offload x optimizer x scheduler combination and
every torchrun launch are in the slow tier: ``make test-all``, or ``pytest -m slow tests/test_peer_deepspeed*.py``.
This file holds the config refusals and the training runs; the checkpoints are in test_peer_deepspeed_checkpoints.py,
the torchrun launches in test_peer_deepspeed_launcher.py.
"""
from __future__ import annotations

import logging

import pytest

from _dist import run_distributed
from _peer import assert_tracks, ds_config, get_regression_trainer, plain_trainer, steps, weights, with_dtype
from _peer_ds import DTYPES, OFFLOADS, check_against_plain, dist_env_1, fast, slow  # noqa: F401 (a fixture)


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
