"""The "scheduler" block's WarmupCosineLR: its keys, the params each type takes, "auto", and --lr_scheduler_type.

DeepSpeed builds a scheduler with ``**params``: a key of another type (warmup_max_lr with WarmupCosineLR, the ratios
with WarmupLR) is a TypeError there, and one line naming the key and the type here."""
from __future__ import annotations

import dataclasses

import pytest

from hf_zero_offload.config import ArgsView, ConfigError, SchedulerConfig, TrainingConfig, resolve

ARGS = ArgsView(learning_rate=2e-4, warmup_steps=3, max_steps=20)


def errmsg(cfg, args=None) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(cfg, args)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("<dict>: "), msg
    return msg


def cosine(**params) -> dict:
    return {"scheduler": {"type": "WarmupCosineLR", "params": params}}


def test_explicit_values_and_deepspeeds_defaults():
    cfg = resolve(cosine(total_num_steps=100, warmup_min_ratio=0.1, warmup_num_steps=10, cos_min_ratio=0.05,
                         warmup_type="linear", last_batch_iteration=-1))
    assert cfg.scheduler == SchedulerConfig("WarmupCosineLR", warmup_num_steps=10, warmup_type="linear",
                                            total_num_steps=100, warmup_min_ratio=0.1, cos_min_ratio=0.05)
    # DeepSpeed's defaults: warmup_min_ratio 0, 1000 warm-up steps, cos_min_ratio 1e-4, log warm-up
    assert resolve(cosine(total_num_steps=5000)).scheduler == SchedulerConfig(
        "WarmupCosineLR", warmup_num_steps=1000, warmup_type="log", total_num_steps=5000, warmup_min_ratio=0.0,
        cos_min_ratio=1e-4)
    for ratio in (0, 1, 1.0):  # both ends of [0, 1]
        assert resolve(cosine(total_num_steps=9, cos_min_ratio=ratio)).scheduler.cos_min_ratio == ratio
    assert TrainingConfig.from_dict(cfg.to_dict()) == cfg  # checkpoint metadata


def test_auto_follows_the_arguments():
    cfg = resolve(cosine(total_num_steps="auto", warmup_num_steps="auto"), ARGS)
    assert (cfg.scheduler.total_num_steps, cfg.scheduler.warmup_num_steps) == (20, 3)
    # missing keys follow the arguments too; --warmup_steps 0 is 1 (as for WarmupLR)
    cfg = resolve(cosine(), dataclasses.replace(ARGS, warmup_steps=0))
    assert (cfg.scheduler.total_num_steps, cfg.scheduler.warmup_num_steps) == (20, 1)
    assert "total_num_steps=50 vs the number of training steps 20" in errmsg(cosine(total_num_steps=50), ARGS)
    assert "warmup_num_steps=7 vs --warmup_steps 3" in errmsg(cosine(total_num_steps=20, warmup_num_steps=7), ARGS)


def test_total_num_steps_is_required():
    assert "scheduler.params.total_num_steps: required by WarmupCosineLR" in errmsg(cosine())
    assert "scheduler.params.total_num_steps: required by WarmupCosineLR" in errmsg(
        cosine(), dataclasses.replace(ARGS, max_steps=None))
    assert "scheduler.params.total_num_steps" in errmsg(cosine(total_num_steps="auto"))  # needs args


@pytest.mark.parametrize("key", ["warmup_min_ratio", "cos_min_ratio"])
def test_ratios_are_fractions_of_the_lr(key):
    for bad in (-0.1, 1.5, 2):
        msg = errmsg(cosine(total_num_steps=9, **{key: bad}))
        assert f"<dict>: scheduler.params.{key}: expected a number in [0, 1]" in msg
    assert f"<dict>: scheduler.params.{key}: expected a number" in errmsg(cosine(total_num_steps=9, **{key: "0.1"}))
    # transformers fills neither ratio: DeepSpeed would get the string "auto"
    assert f"<dict>: scheduler.params.{key}: \"auto\" is not accepted" in errmsg(
        cosine(total_num_steps=9, **{key: "auto"}), ARGS)


@pytest.mark.parametrize("kind, key", [
    ("WarmupCosineLR", "warmup_min_lr"), ("WarmupCosineLR", "warmup_max_lr"),
    ("WarmupLR", "warmup_min_ratio"), ("WarmupLR", "cos_min_ratio"), ("WarmupLR", "total_num_steps"),
    ("WarmupDecayLR", "warmup_min_ratio"), ("WarmupDecayLR", "cos_min_ratio"),
])
def test_a_key_of_another_type_names_the_key_and_the_type(kind, key):
    params = {key: 10 if key == "total_num_steps" else 0.0}
    if kind != "WarmupLR":
        params.setdefault("total_num_steps", 10)
    for value in (params[key], "auto") if key.endswith("_lr") else (params[key],):  # the LRs take "auto"
        msg = errmsg({"scheduler": {"type": kind, "params": {**params, key: value}}}, ARGS)
        assert msg.startswith(f"<dict>: scheduler.params.{key}: not a parameter of {kind}"), msg


def test_goes_with_the_trainers_cosine_schedules():
    raw = cosine(total_num_steps="auto")
    for kind in ("linear", "cosine", "cosine_with_min_lr", "cosine_warmup_with_min_lr"):  # linear: the default
        assert resolve(raw, dataclasses.replace(ARGS, lr_scheduler_type=kind)).scheduler.type == "WarmupCosineLR"
    for kind in ("constant_with_warmup", "constant", "polynomial", "cosine_with_restarts"):
        msg = errmsg(raw, dataclasses.replace(ARGS, lr_scheduler_type=kind))
        assert f"scheduler.type='WarmupCosineLR' vs --lr_scheduler_type {kind}" in msg


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR"])
def test_a_warmup_min_lr_above_the_max_is_refused_naming_both(kind):
    # it warmed down: step 1 ran at warmup_min_lr, 100x --learning_rate, without a word
    params = {"warmup_min_lr": 1e-2, "warmup_max_lr": "auto", "total_num_steps": "auto"}
    if kind == "WarmupLR":
        del params["total_num_steps"]
    msg = errmsg({"scheduler": {"type": kind, "params": params}}, dataclasses.replace(ARGS, learning_rate=1e-4))
    assert msg == ("<dict>: scheduler.params.warmup_min_lr: 0.01 is above scheduler.params.warmup_max_lr 0.0001 (from "
                   "--learning_rate): the warm-up would go down; lower warmup_min_lr (0 is DeepSpeed's default)")
    params.update(warmup_max_lr=1e-3, **({"total_num_steps": 20} if kind == "WarmupDecayLR" else {}))
    assert "warmup_max_lr 0.001: the warm-up" in errmsg({"scheduler": {"type": kind, "params": params}})
    params.update(warmup_min_lr=1e-3)  # equal: a constant LR
    cfg = resolve({"scheduler": {"type": kind, "params": params}}, dataclasses.replace(ARGS, learning_rate=1e-3))
    assert cfg.scheduler.warmup_min_lr == cfg.scheduler.warmup_max_lr == 1e-3


@pytest.mark.parametrize("block", [
    {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1000, "total_num_steps": 10}},
    {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 11, "total_num_steps": 10}},
])
def test_a_warmup_longer_than_the_run_is_warned_about(block, caplog):
    with caplog.at_level("WARNING", logger="hf_zero_offload"):
        resolve({"scheduler": block})
    warmup, total = block["params"]["warmup_num_steps"], block["params"]["total_num_steps"]
    assert [r.getMessage() for r in caplog.records] == [
        f"<dict>: scheduler.params.total_num_steps {total} is less than warmup_num_steps {warmup}: {block['type']} "
        "warms up for the whole run (it never reaches its peak LR nor decays)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_zero_offload"):
        resolve({"scheduler": {"type": block["type"], "params": {"warmup_num_steps": 10, "total_num_steps": 10}}})
    assert not caplog.records


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_a_warmup_of_0_loads_as_the_readme_says(kind):
    """The docs say (docs/CONFIGURATION.md) a warmup_num_steps of 0 or 1 stays 1 (DeepSpeed takes 0 and makes it 2), but 0 was refused as
    "expected an integer >= 1"; and a config's 500 was said to contradict "--warmup_steps 1", a value the user never
    gave (the default is 0: the message showed the max(1, .) it becomes)."""
    block = {"scheduler": {"type": kind, "params": {"warmup_num_steps": 0,
                                                    **({} if kind == "WarmupLR" else {"total_num_steps": 20})}}}
    for args in (None, dataclasses.replace(ARGS, warmup_steps=0), dataclasses.replace(ARGS, warmup_steps=1)):
        assert resolve(block, args).scheduler.warmup_num_steps == 0
    assert "warmup_num_steps=0 vs --warmup_steps 3" in errmsg(block, ARGS)
    block["scheduler"]["params"]["warmup_num_steps"] = 500
    message = errmsg(block, dataclasses.replace(ARGS, warmup_steps=0))
    assert "warmup_num_steps=500 vs --warmup_steps 0" in message and "--warmup_steps 1" not in message
    block["scheduler"]["params"]["warmup_num_steps"] = -1
    assert "expected an integer >= 0, got -1" in errmsg(block)


def test_a_left_out_warmup_max_lr_peaks_where_deepspeeds_would_without_the_trainers_arguments():
    """DeepSpeed's WarmupLR peaks at the optimizer's lr when warmup_max_lr is left out (its default is None: the first
    group's lr); WarmupDecayLR's default stays 1e-3. Resolved without arguments, both took 1e-3."""
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 5e-5}}, "scheduler": {"type": "WarmupLR", "params": {}}}
    assert resolve(cfg).scheduler.warmup_max_lr == 5e-5
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}
    assert resolve(cfg).scheduler.warmup_max_lr == 1e-3
    assert resolve({"scheduler": {"type": "WarmupLR"}}).scheduler.warmup_max_lr == 1e-3  # no lr anywhere
    # with the Trainer's arguments, as "auto" would (the README's documented difference)
    assert resolve({"scheduler": {"type": "WarmupLR"}}, ARGS).scheduler.warmup_max_lr == 2e-4


@pytest.mark.parametrize("cfg, said", [
    ({"zero_optimization": True}, r'zero_optimization: expected an object, got true \(DeepSpeed\'s legacy form of '
                                  r'\{"stage": 1\}: write that\)'),
    ({"zero_optimization": {"stage": 2, "cpu_offload_param": True}},
     r"zero_optimization.cpu_offload_param: true is not supported by hf_zero_offload: parameter offload needs ZeRO "
     r"stage 3"),
], ids=["legacy-bool", "cpu_offload_param"])
def test_deepspeeds_legacy_zero_spellings_are_named(cfg, said):
    """DeepSpeed's deprecated cpu_offload_param was refused as unknown (did you mean 'cpu_offload_params', a name
    DeepSpeed never had); false is its default and loads."""
    import re
    assert re.search(said, errmsg(cfg))
    resolve({"zero_optimization": {"stage": 2, "cpu_offload_param": False}})


@pytest.mark.parametrize("block, given, warmup_type, said", [
    ("WarmupLR", "constant_with_warmup", None, ["logarithmic"]),
    ("WarmupLR", "constant_with_warmup", "linear", []),
    ("WarmupLR", "linear", None, []),  # the default: no choice was made
    ("WarmupCosineLR", "cosine", None, ["logarithmic", "one step later"]),
    ("WarmupCosineLR", "cosine_with_min_lr", "linear", ["one step later"]),
])
def test_an_explicit_schedule_the_block_runs_in_another_shape_is_said(caplog, block, given, warmup_type, said):
    """An outside probe: --lr_scheduler_type constant_with_warmup beside WarmupLR ran DeepSpeed's log warm-up
    (0.005 at step 1 where the Trainer's is at 0.0025; weights 0.056 apart after 8 steps), said at INFO only."""
    params = {"total_num_steps": "auto"} if block == "WarmupCosineLR" else {}
    if warmup_type:
        params["warmup_type"] = warmup_type
    with caplog.at_level("WARNING", logger="hf_zero_offload"):
        resolve({"scheduler": {"type": block, "params": params}}, dataclasses.replace(ARGS, lr_scheduler_type=given))
    warned = [r.getMessage() for r in caplog.records if "not in its shape" in r.getMessage()]
    assert len(warned) == (1 if said else 0), warned
    for words in said:
        assert words in warned[0] and f"--lr_scheduler_type {given}" in warned[0]
