"""ds_config errors: unknown keys (with the closest known one), unsupported features, wrong types and values, the
file's own problems; each names the key or the file."""
from __future__ import annotations

import pytest

from _config import errmsg, zero2
from hf_zero_offload.config import ArgsView, ConfigError, load_config, resolve


def test_unknown_keys_suggest_the_closest():
    msg = errmsg({"gradient_acumulation_steps": 2})
    assert "gradient_acumulation_steps" in msg and "did you mean 'gradient_accumulation_steps'?" in msg
    msg = errmsg(zero2(overlap_com=True))
    assert "zero_optimization.overlap_com" in msg and "did you mean 'overlap_comm'?" in msg
    msg = errmsg(zero2(offload_optimizer={"device": "cpu", "pin_memroy": True}))
    assert "zero_optimization.offload_optimizer.pin_memroy" in msg and "'pin_memory'" in msg
    assert "did you mean" not in errmsg({"completely_unrelated": 1})


@pytest.mark.parametrize("raw, path, hint", [
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "stage 3"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}, "zero_optimization.stage", ""),
    (zero2(offload_param={"device": "cpu"}), "zero_optimization.offload_param", "stage 3"),
    (zero2(offload_optimizer={"device": "nvme", "nvme_path": "/x"}), "zero_optimization.offload_optimizer.device",
     "NVMe"),
    (zero2(offload_optimizer={"device": "cpu", "ratio": 0.3}), "zero_optimization.offload_optimizer.ratio", ""),
    ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 5}}}, "optimizer.type", "Adam/AdamW"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type", "Adam/AdamW"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0}}}, "scheduler.type", "--lr_scheduler_type"),
    ({"scheduler": {"type": "LRRangeTest"}}, "scheduler.type", "--lr_scheduler_type"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp", "--fp16"),
    ({"sparse_gradients": True}, "sparse_gradients", ""),
    ({"communication_data_type": "fp16"}, "communication_data_type", ""),
    ({"elasticity": {"enabled": True}}, "elasticity", ""),
    ({"pipeline": {"stages": "auto"}}, "pipeline", ""),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "fp16.consecutive_hysteresis", ""),
])
def test_unsupported_features(raw, path, hint):
    msg = errmsg(raw)
    assert f"<dict>: {path}:" in msg and "not supported by hf_zero_offload" in msg and hint in msg


@pytest.mark.parametrize("raw, path, expected", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "one of 0, 1, 2"),
    (zero2(reduce_bucket_size=-5), "zero_optimization.reduce_bucket_size", "positive integer"),
    (zero2(allgather_bucket_size=2.5e0), "zero_optimization.allgather_bucket_size", "positive integer"),
    (zero2(overlap_comm="yes"), "zero_optimization.overlap_comm", "true or false"),
    (zero2(offload_optimizer={"device": "gpu"}), "zero_optimization.offload_optimizer.device", "'cpu', 'none'"),
    # a slip of case was "not supported by hf_zero_offload: remove the 'scheduler' block"
    ({"scheduler": {"type": "warmupdecaylr"}}, "scheduler.type", "(did you mean 'WarmupDecayLR'? names are case-"),
    ({"fp16": {"enabled": 1}}, "fp16.enabled", "true or false"),
    ({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}}, "optimizer.params.lr", "a number"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas", "two numbers"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, "scheduler.params.warmup_type",
     "'log', 'linear'"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu", "positive integer"),
    ({"gradient_clipping": -1}, "gradient_clipping", ">= 0"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window", ">= 1"),
    # 2**1024 is no float: it used to pass here and crash with an OverflowError when the engine was built; past
    # 2**126 the kernel's fp32 1/scale is no normal number
    ({"fp16": {"enabled": True, "initial_scale_power": 127}}, "fp16.initial_scale_power", "in [0, 126]"),
    ({"zero_optimization": "2"}, "zero_optimization", "an object"),
])
def test_wrong_types_and_values(raw, path, expected):
    msg = errmsg(raw)
    assert f"<dict>: {path}:" in msg and "expected" in msg and expected in msg
    with pytest.raises(ConfigError):
        load_config(raw)


def test_value_rules():
    assert "both" in errmsg({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "both" in errmsg({"bf16": {"enabled": True}}, ArgsView(fp16=True, bf16=True))
    assert '"auto" is not accepted' in errmsg({"zero_optimization": {"stage": "auto"}})
    assert "only used by WarmupDecayLR" in errmsg(
        {"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}})
    # DeepSpeed's number spellings: integral floats become ints
    assert resolve({"train_micro_batch_size_per_gpu": 8.0, **zero2(reduce_bucket_size=5e8)}).zero \
        .reduce_bucket_size == 500_000_000
    assert isinstance(ConfigError("x"), ValueError)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError, match=rf"{bad}:2:\d+: invalid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'missing.json'}: cannot read"):
        resolve(str(tmp_path / "missing.json"))
    bad.write_text('{"steps_per_print": 1, "steps_per_print": 2}')
    with pytest.raises(ConfigError, match="duplicate key 'steps_per_print'"):
        load_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(bad)
    bad.write_text('{"zero_optimization": {"stage": 3}}')
    with pytest.raises(ConfigError, match=rf"^{bad}: zero_optimization.stage: 3 is not supported"):
        resolve(bad)
