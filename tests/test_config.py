"""ds_config.json validation and "auto" resolution (hf_zero_offload.config)."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from _config import errmsg, zero2
from hf_zero_offload.config import (
    ArgsView,
    DPUConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    TrainingConfig,
    ZeroConfig,
    check,
    load_config,
    resolve,
)

DATA = Path(__file__).parent / "data" / "configs"
BLOG_1GPU = DATA / "ds_config_1gpu.json"
BLOG_MULTI = DATA / "ds_config.json"
MODERN = DATA / "ds_config_zero2_auto.json"

# The blog's command line (lr 3e-5, warmup 500, fp16), on 2 GPUs.
BLOG_ARGS = ArgsView(per_device_train_batch_size=20, world_size=2, learning_rate=3e-5, weight_decay=3e-7,
                     warmup_steps=500, fp16=True)


# ---------------------------------------------------------------- the reference configs


@pytest.mark.parametrize("path", [BLOG_1GPU, BLOG_MULTI])
def test_blog_configs_load_unchanged(path):
    before = path.read_text()
    raw = load_config(path)
    assert raw == json.loads(before)
    for args in (None, BLOG_ARGS):
        cfg = resolve(path, args)
        assert cfg.source == str(path)
        assert cfg.fp16 == FP16Config(enabled=True, loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000,
                                      hysteresis=2, min_loss_scale=1.0)
        assert not cfg.bf16
        z = cfg.zero
        assert (z.stage, z.offload, z.pin_memory, z.overlap_comm, z.reduce_scatter, z.contiguous_gradients) == (
            2, True, True, True, True, True)
        assert z.reduce_bucket_size == z.allgather_bucket_size == 200_000_000
        assert isinstance(z.reduce_bucket_size, int)
        assert cfg.optimizer == OptimizerConfig("Adam", 3e-5, (0.9, 0.999), 1e-8, 3e-7, True)
        assert cfg.scheduler == SchedulerConfig("WarmupLR", 0.0, 3e-5, 500, "log", None)
    assert path.read_text() == before
    # with args, the missing batch keys and gradient_clipping follow TrainingArguments
    cfg = resolve(path, BLOG_ARGS)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (40, 20, 1)
    assert cfg.gradient_clipping == 1.0


def test_modern_auto_config_resolves_every_auto_key():
    args = ArgsView(per_device_train_batch_size=4, gradient_accumulation_steps=3, world_size=2, max_grad_norm=0.5,
                    learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6, weight_decay=0.01,
                    warmup_steps=7, max_steps=1000, bf16=True, hidden_size=1024)
    cfg = resolve(MODERN, args)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 3, 24)
    assert cfg.gradient_clipping == 0.5
    assert cfg.optimizer == OptimizerConfig("AdamW", 2e-4, (0.8, 0.99), 1e-6, 0.01, True)
    assert cfg.scheduler == SchedulerConfig("WarmupDecayLR", 0.0, 2e-4, 7, "log", 1000)
    assert cfg.fp16.enabled is False and cfg.bf16 is True
    assert cfg.zero.reduce_bucket_size == cfg.zero.allgather_bucket_size == 1024 * 1024
    assert cfg.zero.offload and cfg.zero.pin_memory and cfg.zero.round_robin_gradients
    assert cfg.steps_per_print == 2000
    # warmup_steps 0 -> 1 (DeepSpeed rejects 0), fp16 from --fp16
    cfg = resolve(MODERN, dataclasses.replace(args, warmup_steps=0, bf16=False, fp16=True))
    assert cfg.scheduler.warmup_num_steps == 1 and cfg.fp16.enabled and not cfg.bf16


def test_auto_without_args_names_every_key():
    msg = errmsg(MODERN)
    assert str(MODERN) in msg and "TrainingArguments" in msg
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_max_lr",
                "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps",
                "zero_optimization.reduce_bucket_size"):
        assert key in msg
    # auto values that do not come from TrainingArguments resolve without them
    cfg = resolve({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto"}},
                   **zero2(reduce_bucket_size=123, allgather_bucket_size="auto")})
    assert cfg.scheduler.warmup_min_lr == 0.0 and cfg.zero.allgather_bucket_size == 123


def test_auto_needs_hidden_size_and_max_steps():
    raw = json.loads(MODERN.read_text())
    msg = errmsg(raw, ArgsView(max_steps=None, hidden_size=None, fp16=True))
    assert "zero_optimization.reduce_bucket_size" in msg and "hidden_size" in msg
    assert "scheduler.params.total_num_steps" in msg
    raw["scheduler"]["params"].pop("total_num_steps")
    assert "required by WarmupDecayLR" in errmsg(raw, ArgsView(hidden_size=8))
    assert resolve(raw, ArgsView(hidden_size=8, max_steps=50)).scheduler.total_num_steps == 50


def test_auto_bucket_sizes_find_the_width_where_transformers_finds_it():
    """reduce_bucket_size "auto" on a ConvNext (hidden_sizes) or a Llava (text_config) failed at train(), after the
    model had loaded, where transformers' DeepSpeed integration takes max(hidden_sizes) / the text model's width."""
    from types import SimpleNamespace

    from transformers import ConvNextConfig, GPT2Config, LlamaConfig, LlavaConfig, PretrainedConfig, T5Config

    from hf_zero_offload.args_view import hidden_size_of
    llava = LlavaConfig(text_config=LlamaConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=2))
    for cfg, width in ((ConvNextConfig(hidden_sizes=[8, 16, 40, 24]), 40), (llava, 48), (T5Config(d_model=32), 32),
                       (GPT2Config(n_embd=24), 24), (PretrainedConfig(), None)):
        assert hidden_size_of(SimpleNamespace(config=cfg)) == width, type(cfg).__name__


def test_mismatches_are_listed_together():
    raw = json.loads(BLOG_1GPU.read_text())
    raw["gradient_clipping"] = 0.0
    raw["train_micro_batch_size_per_gpu"] = 16
    args = dataclasses.replace(BLOG_ARGS, learning_rate=5e-5, adam_epsilon=1e-6, adam_beta1=0.8, fp16=False)
    msg = errmsg(raw, args)
    assert "\n" not in msg  # one line: a command line prints it after "error:"
    head, _, listed = msg.partition("TrainingArguments values): ")
    items = listed.split("; ")
    assert "optimizer.params.lr=3e-05 vs --learning_rate 5e-05" in items
    assert "optimizer.params.eps=1e-08 vs --adam_epsilon 1e-06" in items
    assert "optimizer.params.betas=[0.9, 0.999] vs --adam_beta1/--adam_beta2 [0.8, 0.999]" in items
    assert "scheduler.params.warmup_max_lr=3e-05 vs --learning_rate 5e-05" in items
    assert "gradient_clipping=0.0 vs --max_grad_norm 1.0" in items
    assert "train_micro_batch_size_per_gpu=16 vs --per_device_train_batch_size 20" in items
    assert "fp16.enabled=True vs --fp16 False" in items
    assert len(items) == 7 and head.startswith("<dict>: ") and '"auto"' in head


def test_train_batch_size_consistency():
    assert "train_batch_size=64 vs world_size" in errmsg(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, ArgsView(per_device_train_batch_size=4,
                                                                               world_size=2))
    ok = resolve({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
                 ArgsView(per_device_train_batch_size=4, gradient_accumulation_steps=4, world_size=2))
    assert ok.train_batch_size == 32
    # without args the world size is unknown: train_batch_size must be a multiple of micro * gas
    assert "not a multiple" in errmsg({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                                       "gradient_accumulation_steps": 1})
    c = resolve({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4})
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (12, 4, 3)
    c = resolve({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    assert c.train_batch_size == 8


# ---------------------------------------------------------------- defaults and semantics


def test_defaults_for_missing_sections():
    cfg = resolve({})
    assert cfg == TrainingConfig(source="<dict>")
    assert cfg.zero == ZeroConfig(0, False, True, False, True, True, 500_000_000, True, 500_000_000, False,
                                  DPUConfig(False, 40))
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.gradient_clipping == 0.0  # DeepSpeed's: off
    assert cfg.steps_per_print == 10 and not cfg.fp16.enabled and not cfg.bf16
    with_args = resolve({}, ArgsView(max_grad_norm=0.3, fp16=True, per_device_train_batch_size=2))
    assert with_args.gradient_clipping == 0.3 and with_args.fp16.enabled and with_args.train_batch_size == 2
    # a bare optimizer block: DeepSpeed's defaults without args, TrainingArguments' with them
    assert resolve({"optimizer": {"type": "Adam"}}).optimizer == OptimizerConfig("Adam", 1e-3, (0.9, 0.999),
                                                                                 1e-8, 0.0, True)
    assert resolve({"optimizer": {"type": "Adam"}}, ArgsView(weight_decay=0.1)).optimizer.weight_decay == 0.1
    assert resolve({"scheduler": {"type": "WarmupLR"}}).scheduler == SchedulerConfig()


def test_adamw_with_adam_w_mode_false_is_adamw_as_in_deepspeed(caplog):
    # issue 12: DeepSpeed accepts it and runs AdamW (adam_w_mode is not read for "AdamW"); so do we, and say so
    with caplog.at_level("WARNING", logger="hf_zero_offload"):
        opt = resolve({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}).optimizer
    assert opt.adam_w_mode is True
    assert "decoupled weight decay" in caplog.text and '"type": "Adam"' in caplog.text


def test_keys_without_effect_are_named_once(caplog):
    from hf_zero_offload.config import check
    c = check({"steps_per_print": 5, "memory_breakdown": False,
               "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_scatter": False}})
    assert sorted(c.no_effect) == ["memory_breakdown", "steps_per_print", "zero_optimization.overlap_comm"]
    assert resolve(c).zero.reduce_scatter is False  # validated once, resolved from the checked form


def test_optimizer_type_semantics():
    assert resolve({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer.adam_w_mode is False
    assert resolve({"optimizer": {"type": "adamw"}}).optimizer.type == "AdamW"
    assert "optimizer.type" in errmsg({"optimizer": {"params": {"lr": 1e-3}}})
    assert resolve({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}).optimizer is not None


def test_legacy_spellings_and_offload_rules():
    assert resolve({"bfloat16": {"enabled": True}}).bf16
    assert "bfloat16" in errmsg({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    z = resolve(zero2(cpu_offload=True, cpu_offload_use_pin_memory=False)).zero
    assert z.offload and not z.pin_memory
    assert "cpu_offload" in errmsg(zero2(cpu_offload=False, offload_optimizer={"device": "cpu"}))
    assert not resolve(zero2(offload_optimizer={"device": "none"})).zero.offload
    # a missing stage was reported as "got 0" (the README's extensions snippet pasted alone)
    assert ("optimizer offload needs ZeRO stage 1 or 2, and the key is missing (DeepSpeed's default is 0): add "
            '"stage": 2') in errmsg({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert "stage 1 or 2, got 0" in errmsg({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    dpu = zero2(delayed_param_update={"enabled": True, "warmup_steps": 10})
    assert "offload" in errmsg(dpu)
    dpu["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert resolve(dpu).zero.delayed_param_update == DPUConfig(True, 10)


def test_harmless_deepspeed_keys_are_ignored():
    raw = {
        "zero_allow_untested_optimizer": True, "checkpoint": {"use_node_local_storage": True},
        "amp": {"enabled": False, "opt_level": "O1"}, "tensorboard": {"enabled": False, "output_path": "x"},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "number_checkpoints": None},
        "sparse_gradients": False, "gradient_predivide_factor": 1.0, "data_types": {"grad_accum_dtype": "fp32"},
        "fp16": {"enabled": True, "auto_cast": False, "consecutive_hysteresis": False},
        "bf16": {"enabled": False},
        **zero2(offload_optimizer={"device": "cpu", "pin_memory": True, "nvme_path": None, "ratio": 1.0},
                offload_param={"device": "none"}, stage3_gather_16bit_weights_on_model_save=False,
                sub_group_size=1e9, load_from_fp32_weights=True),
    }
    cfg = resolve(raw)
    assert cfg.zero.offload and cfg.fp16.enabled


def test_stage3_tuning_keys_have_no_effect_below_stage_3():
    """A stage-3 config switched to stage 2 runs, as under DeepSpeed: its stage-3 keys ("auto" included) change
    nothing, and the start log names them; a value no stage-3 key takes is refused by name."""
    keys = dict(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                stage3_max_live_parameters=1e9, stage3_max_reuse_distance=1e9,
                stage3_gather_16bit_weights_on_model_save=True, prefetch_bucket_size=5e7,
                param_persistence_threshold=1e4, max_live_parameters=None,
                stage3_some_future_key=False)
    raw = zero2(offload_optimizer={"device": "cpu"}, **keys)
    checked = check(raw)
    assert sorted(checked.no_effect) == sorted(f"zero_optimization.{k}" for k in keys)
    assert "stage3" not in json.dumps(checked.cfg)
    assert resolve(raw) == resolve(zero2(offload_optimizer={"device": "cpu"}))
    for bad in ("x", {"a": 1}, [1]):
        msg = errmsg(zero2(stage3_prefetch_bucket_size=bad))
        assert "zero_optimization.stage3_prefetch_bucket_size" in msg and "stage-3" in msg, msg
    assert "stage 3" in errmsg({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}})


# ---------------------------------------------------------------- dataclasses


def test_to_dict_round_trip_and_frozen():
    cfg = resolve(MODERN, ArgsView(max_steps=10, hidden_size=64, fp16=True))
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["zero"]["stage"] == 2 and d["optimizer"]["betas"] == [0.9, 0.999] and d["source"] == str(MODERN)
    assert TrainingConfig.from_dict(copy.deepcopy(d)) == cfg
    assert TrainingConfig.from_dict(resolve({}).to_dict()) == resolve({})
    for obj, name in ((cfg, "gradient_clipping"), (cfg.zero, "stage"), (cfg.fp16, "enabled"),
                      (cfg.optimizer, "lr"), (cfg.scheduler, "warmup_num_steps"),
                      (cfg.zero.delayed_param_update, "enabled"), (ArgsView(), "fp16")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 0)
    hash(cfg)


def test_config_module_stays_free_of_transformers():
    import hf_zero_offload.config as config

    files = sorted(Path(config.__file__).parent.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "training.py", "loader.py", "resolver.py", "schema.py", "checks.py"}
    for f in files:
        src = f.read_text()
        for banned in ("import transformers", "import argparse", "from transformers", "from .engine", "from ..engine",
                       "import torch"):
            assert banned not in src


FIRST_IMPORTS = ["hf_zero_offload.presets", "hf_zero_offload.config.schema", "hf_zero_offload.config.resolver",
                 "hf_zero_offload.run_lock"]


@pytest.fixture(scope="module")
def imports_in_each_order():
    """One interpreter per first import, forked from one that has imported torch alone (tests/_forked.py: each
    imports hf_zero_offload anew; four fresh interpreters, each mostly importing torch, took ~7 s on 2 cores)."""
    from _forked import run_forked
    codes = [(f"import {first}\n"
              "from hf_zero_offload import presets\n"
              "from hf_zero_offload.config import ArgsView, ConfigError, resolve\n"
              "assert presets.ConfigError is ConfigError\n"
              "print(resolve('zero2-offload', ArgsView(hidden_size=8)).zero.offload)") for first in FIRST_IMPORTS]
    return dict(zip(FIRST_IMPORTS, run_forked(codes)))


@pytest.mark.parametrize("first", FIRST_IMPORTS)
def test_config_package_imports_in_any_order(first, imports_in_each_order):
    # presets raises the package's ConfigError and the package's loader calls presets: each imports the other
    out = imports_in_each_order[first]
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_last_batch_iteration_other_than_minus_one_is_refused():
    """It was accepted "without effect" (an outside probe with real configs): DeepSpeed starts the schedule at
    last_batch_iteration, here it started at 0. -1, DeepSpeed's default, still loads. (bf16.check_grad_overflow, also
    ignored then, is run now: tests/test_skip_nonfinite.py.)"""
    from hf_zero_offload import config
    raw = {"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 100}}}
    with pytest.raises(config.ConfigError, match=r"<dict>: scheduler.params.last_batch_iteration: 100 is not "
                                                 r"supported by hf_zero_offload: the schedule starts at step 0"):
        config.check(raw)
    raw["scheduler"]["params"]["last_batch_iteration"] = -1
    config.check(raw)
    assert config.resolve({"bf16": {"enabled": True, "check_grad_overflow": True}}).check_grad_overflow


@pytest.mark.parametrize("key, on", [
    ("activation_checkpointing", {"partition_activations": True}), ("flops_profiler", {"enabled": True}),
    ("tensorboard", {"enabled": True, "output_path": "tb"}), ("wandb", {"enabled": True, "project": "p"}),
    ("csv_monitor", {"enabled": True}), ("comet", {"enabled": True}), ("comms_logger", {"enabled": True}),
])
def test_observability_blocks_load_and_are_named_when_on(key, on):
    """They stopped configs that ran under DeepSpeed + the Trainer (an outside probe with DeepSpeed's tutorials'
    configs), where none changes what the model computes."""
    from hf_zero_offload import config
    assert config.check({key: on}).no_effect == [key]
    assert config.check({key: {"enabled": False}}).no_effect == [] == config.check({key: None}).no_effect
    with pytest.raises(config.ConfigError, match=rf"<dict>: {key}: expected an object"):
        config.check({key: 1})


def test_check_grad_overflow_without_bf16_says_it_does_nothing(caplog):
    """An fp32 run with the key was silent about it (an outside probe): as in DeepSpeed it only acts with bf16."""
    from hf_zero_offload import config
    from hf_zero_offload.config import resolver
    resolver.reset_warnings()
    with caplog.at_level("WARNING", logger="hf_zero_offload"):
        cfg = config.resolve({"bf16": {"enabled": False, "check_grad_overflow": True}})
    assert not cfg.check_grad_overflow
    assert "bf16.check_grad_overflow has no effect in a run without bf16" in caplog.text
