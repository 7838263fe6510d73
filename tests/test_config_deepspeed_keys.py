"""DeepSpeed's own ds_config keys that hf_zero_offload does not run (those of DeepSpeed 0.17-0.19: precision_config,
zero/config, zero/offload_config, runtime/config, the engine's optimizer kwargs) are named as DeepSpeed's: loaded
where they change nothing (switched off, DeepSpeed's default, or a stage-3 setting below stage 3), refused as "not
supported by hf_zero_offload" with what to use while on. They were "unknown key" errors (a "did you mean" pointing
at another key), which reads as a typo in a config that ran under DeepSpeed."""
from __future__ import annotations

import pytest

from hf_zero_offload import config
from hf_zero_offload.config import ConfigError

OFFLOAD = {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def _zero(**kw):
    return {"zero_optimization": {**OFFLOAD, **kw}}


def _offload(**kw):
    return {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", **kw}}}


def _params(**kw):
    return {"optimizer": {"type": "AdamW", "params": kw}}


# configs that run as under DeepSpeed: each key off, at DeepSpeed's default, or without effect at stage 2
HARMLESS = {
    "managed_gradient_accumulation": {"managed_gradient_accumulation": True},
    "gradient_allreduce_op": {"gradient_allreduce_op": "mean"},
    "log_level": {"log_level": "info"},
    "expert_parallel": {"expert_parallel": {"enabled": False, "autoep_size": 1}},
    "datastates_ckpt": {"datastates_ckpt": False},
    "weight_quantization": {"weight_quantization": {}},
    "data_types": {"data_types": {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None}},
    "optimizer.legacy_fusion": {"optimizer": {"type": "AdamW", "legacy_fusion": False}},
    "fp32_optimizer_states": _params(fp32_optimizer_states=True),
    "set_grad_none": _params(set_grad_none=True),
    "bf16 masters off": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": False,
                                  "bf16_optimizer_states": False}},
    "zenflow null": _zero(zenflow=None),
    "stage-3 names": _zero(module_granularity_threshold=0, use_all_reduce_for_fetch_params=False,
                           allgather_sequential=False, enable_sanity_checks=False,
                           save_muon_momentum_buffer_in_memory=False, leaf_module={"classes": [], "names": []}),
    "super_offload off": _offload(super_offload=False, cpuadam_cores_perc=0.8),
}


@pytest.mark.parametrize("raw", list(HARMLESS.values()), ids=list(HARMLESS))
def test_deepspeed_keys_that_change_nothing_load(raw):
    cfg = config.resolve(raw)
    assert cfg.optimizer is None or (cfg.optimizer.type, cfg.optimizer.lr) == ("AdamW", 1e-3)


@pytest.mark.parametrize("raw, path, says", [
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation", "--gradient_accumulation_steps"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op", "averaged"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "expert_parallel", "expert parallelism"),
    ({"datastates_ckpt": {}}, "datastates_ckpt", "the Trainer saves checkpoints"),
    ({"weight_quantization": {"enabled": True}}, "weight_quantization", "not implemented"),
    ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype", "--bf16"),
    ({"data_types": {"buffer_dtype": "bf16"}}, "data_types.buffer_dtype", "buffers"),
    (_params(fp32_optimizer_states=False), "optimizer.params.fp32_optimizer_states", '"state_dtype": "bf16"'),
    (_params(max_grad_norm=1.0), "optimizer.params.max_grad_norm", "gradient_clipping"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "bf16.bf16_master_weights_and_grads",
     "fp32 on the host"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states",
     '"state_dtype": "bf16"'),
    # on whenever the block is given (DeepSpeed: zenflow is not None), whatever its values
    (_zero(zenflow={"overlap_step": False}), "zero_optimization.zenflow", "ZenFlow"),
    (_offload(super_offload=True), "zero_optimization.offload_optimizer.super_offload", "SuperOffload"),
])
def test_deepspeed_features_switched_on_are_unsupported_not_unknown(raw, path, says):
    with pytest.raises(ConfigError) as e:
        config.resolve(raw)
    msg = str(e.value)
    assert msg.startswith(f"<dict>: {path}: ") and "is not supported by hf_zero_offload" in msg and says in msg, msg
    assert "unknown key" not in msg


@pytest.mark.parametrize("raw, path", [
    (_offload(cpuadam_cores_perc=0), "zero_optimization.offload_optimizer.cpuadam_cores_perc"),
    (_offload(cpuadam_cores_perc="auto"), "zero_optimization.offload_optimizer.cpuadam_cores_perc"),
    ({"log_level": 20}, "log_level"),
    (_params(set_grad_none="yes"), "optimizer.params.set_grad_none"),
    (_zero(leaf_module=["Linear"]), "zero_optimization.leaf_module"),
])
def test_their_values_are_type_checked(raw, path):
    with pytest.raises(ConfigError, match=f"^<dict>: {path}: "):
        config.resolve(raw)


def test_harmless_ones_are_named_in_the_start_log_list():
    checked = config.check({"log_level": "info", **_offload(cpuadam_cores_perc=0.5)})
    assert {"log_level", "zero_optimization.offload_optimizer.cpuadam_cores_perc"} <= set(checked.no_effect)
