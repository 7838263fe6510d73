"""ds_config.json files as users pass them to DeepSpeed with the HF Trainer, and hostile variants of them.

tests/data/configs/wild/ holds configs written after the key structure of transformers' DeepSpeed guide and its
tests/deepspeed configs, DeepSpeed's config-json reference, DeepSpeedExamples and accelerate's templates (and
hf_auto_zero2_cosine.json: the "auto" style of transformers' guide with DeepSpeed's WarmupCosineLR parameters). Each is
accepted with DeepSpeed's meaning or refused with one line naming the file, the key and why. The variants are
generated from the schema's own tables, so a key added there is covered here too.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from hf_zero_offload.config import ArgsView, ConfigError, OptimizerConfig, SchedulerConfig, resolve, schema

WILD = Path(__file__).parent / "data" / "configs" / "wild"
ARGS = ArgsView(per_device_train_batch_size=4, gradient_accumulation_steps=2, world_size=2, max_grad_norm=0.5,
                learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6, weight_decay=0.01,
                warmup_steps=3, max_steps=20, fp16=True, hidden_size=16)


def error(cfg, args=None, source="<dict>") -> str:
    with pytest.raises(ConfigError) as e:
        resolve(cfg, args)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{source}: "), msg  # one line, the file first
    return msg


def wild(name: str) -> dict:
    return json.loads((WILD / name).read_text())


# ---------------------------------------------------------------- the configs from the wild


@pytest.mark.parametrize("name, stage, offload", [
    ("hf_docs_zero2_offload.json", 2, True), ("hf_tests_zero2_bf16_auto.json", 2, True),
    ("accelerate_stage2_offload.json", 2, True), ("accelerate_stage1_decay.json", 1, False),
    ("hf_auto_zero2_cosine.json", 2, True),
])
def test_hf_style_auto_configs_take_every_value_from_the_arguments(name, stage, offload):
    args = dataclasses.replace(ARGS, gradient_accumulation_steps=1)  # accelerate's files say 1
    cfg = resolve(WILD / name, args)
    assert (cfg.zero.stage, cfg.zero.offload) == (stage, offload)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 1, 8)
    assert cfg.gradient_clipping == 0.5 and cfg.fp16.enabled and not cfg.bf16
    # accelerate's files leave betas and eps out: missing keys follow the arguments too
    assert cfg.optimizer == OptimizerConfig("AdamW", 2e-4, (0.8, 0.99), 1e-6, 0.01, True)
    sched = wild(name)["scheduler"]["type"]
    if sched == "WarmupCosineLR":  # its peak is the optimizer's lr (2e-4 above): no LR of its own
        assert cfg.scheduler == SchedulerConfig(sched, warmup_num_steps=3, warmup_type="linear", total_num_steps=20,
                                                warmup_min_ratio=0.0, cos_min_ratio=0.1)
    else:
        assert cfg.scheduler == SchedulerConfig(sched, 0.0, 2e-4, 3, "log", 20 if sched == "WarmupDecayLR" else None)
    if name.startswith("hf_"):
        assert cfg.zero.reduce_bucket_size == 200_000_000
    else:
        assert cfg.zero.reduce_bucket_size == 16 * 16  # "auto": hidden_size squared


def test_bf16_auto_follows_the_command_line():
    path = WILD / "hf_tests_zero2_bf16_auto.json"
    cfg = resolve(path, dataclasses.replace(ARGS, fp16=False, bf16=True))
    assert cfg.bf16 and not cfg.fp16.enabled
    cfg = resolve(path, dataclasses.replace(ARGS, fp16=False, bf16=False))
    assert not cfg.bf16 and not cfg.fp16.enabled
    assert "fp16.enabled" in error(path, source=str(path)) and "bf16.enabled" in error(path, source=str(path))


@pytest.mark.parametrize("name", ["deepspeed_docs_many_keys.json", "deepspeed_examples_cifar.json"])
def test_explicit_deepspeed_configs_keep_their_numbers(name):
    raw = wild(name)
    cfg = resolve(WILD / name)
    p = raw["optimizer"]["params"]
    assert cfg.optimizer == OptimizerConfig("Adam", p["lr"], tuple(p["betas"]), p["eps"], p["weight_decay"], True)
    s = raw["scheduler"]["params"]
    assert (cfg.scheduler.warmup_max_lr, cfg.scheduler.warmup_num_steps) == (s["warmup_max_lr"], s["warmup_num_steps"])
    assert cfg.scheduler.warmup_type == s.get("warmup_type", "log")
    assert cfg.fp16.enabled and cfg.gradient_clipping == raw["gradient_clipping"]
    assert cfg.train_batch_size == raw["train_batch_size"]
    assert cfg.zero.stage == raw["zero_optimization"]["stage"]
    assert cfg.fp16.initial_scale_power == raw["fp16"]["initial_scale_power"]


@pytest.mark.parametrize("name, key, why", [
    ("hf_tests_zero3_offload.json", "zero_optimization.stage", "stage 3"),
    ("hf_docs_nvme_offload.json", "zero_optimization.offload_optimizer.device", "NVMe"),
    ("deepspeed_examples_onebit.json", "optimizer.type", "only Adam/AdamW"),
    ("hf_docs_amp_auto.json", "amp", "Apex"),
])
def test_unsupported_configs_are_refused_naming_the_key(name, key, why):
    path = WILD / name
    for args in (None, ARGS):
        msg = error(path, args, source=str(path))
        assert msg.startswith(f"{path}: {key}: ") and "not supported by hf_zero_offload" in msg and why in msg


# ---------------------------------------------------------------- every key of the tables


def _keys(table=schema.TOP, prefix=""):
    for key, spec in table.items():
        if spec.children is not None:
            yield from _keys(spec.children, f"{prefix}{key}.")
        elif spec.kind == "use":
            yield f"{prefix}{key}", spec


def _with(path: str, value) -> dict:
    raw = wild("hf_docs_zero2_offload.json")
    node = raw
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return raw


USE_KEYS = [k for k, _ in _keys() if not k.startswith("bfloat16.")]


@pytest.mark.parametrize("path", USE_KEYS)
def test_auto_is_accepted_exactly_where_documented(path):
    spec = dict(_keys())[path]
    raw = _with(path, "auto")
    if path == "scheduler.params.total_num_steps":
        raw["scheduler"]["type"] = "WarmupDecayLR"
    if spec.auto:
        resolve(raw, ARGS)
    else:
        assert f"<dict>: {path}: \"auto\" is not accepted" in error(raw, ARGS)


@pytest.mark.parametrize("value", ["1e-4", "true", None, [1], {"a": 1}, "Auto"])
@pytest.mark.parametrize("path", USE_KEYS)
def test_wrong_types_name_the_key(path, value):
    spec = dict(_keys())[path]
    if (isinstance(value, str) or value is None) and spec.check is not None:
        try:  # strings a choice accepts ("linear", "cpu"...), a null a key takes as not set, are not wrong types
            spec.check(value)
            return
        except Exception:
            pass
    msg = error(_with(path, value), ARGS)
    assert msg.startswith(f"<dict>: {path}: ") and ("expected" in msg or "not supported" in msg), msg


def _leaves(table=schema.TOP, prefix=""):
    for key, spec in table.items():
        if spec.children is not None:
            yield from _leaves(spec.children, f"{prefix}{key}.")
        yield f"{prefix}{key}"  # a section too: an integer where an object belongs


@pytest.mark.parametrize("value", [10**400, -10**400], ids=["huge", "-huge"])
@pytest.mark.parametrize("path", list(_leaves()) + ["zero_optimization.stage3_prefetch_bucket_size"])
def test_integers_beyond_a_float_name_the_key(path, value):
    # JSON allows any integer literal: one beyond a float's range raised OverflowError (a traceback) in every
    # numeric key's check, ignored ones included
    msg = error(_with(path, value), ARGS)
    assert msg.startswith(f"<dict>: {path}: ") and "integer of 401 digits" in msg, msg


def test_an_integer_longer_than_python_prints_names_the_file_and_key(tmp_path):
    # past 4300 digits json.loads itself raised, with no key, suggesting sys.set_int_max_str_digits()
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2, "reduce_bucket_size": -1' + "0" * 5000 + "}}")
    msg = error(path, source=str(path))
    assert msg == (f"{path}: zero_optimization.reduce_bucket_size: expected a positive integer, got a negative "
                   "integer of 5001 digits")
    path.write_text('{"checkpoint": {"tag": 1' + "0" * 5000 + "}}")  # a free-form object's value is never read
    assert resolve(path).zero.stage == 0


@pytest.mark.parametrize("fp16, path, says", [
    # 1/1e-300 is inf in the kernel's fp32: NaN weights after one step; at 1e-10 every fp16 gradient underflowed
    ({"loss_scale": 1e-300}, "fp16.loss_scale", "expected 0 (dynamic) or a static scale in [1, 2**126]"),
    ({"loss_scale": 1e-10}, "fp16.loss_scale", "below 1 a scale only pushes fp16 gradients into underflow"),
    ({"loss_scale": 0.5}, "fp16.loss_scale", "got 0.5"),
    ({"loss_scale": 2.0 ** 127}, "fp16.loss_scale", "[1, 2**126]"),
    ({"min_loss_scale": 1e-300}, "fp16.min_loss_scale", "expected a number in [2**-126, 2**126]"),
    # the first overflow set the scale to max(scale / 2, minimum) = the minimum: every later step skipped
    ({"initial_scale_power": 16, "min_loss_scale": 1e30, "hysteresis": 1}, "fp16.min_loss_scale",
     "1e+30 is above the initial dynamic scale 65536 = 2**fp16.initial_scale_power (2**16)"),
    ({"min_loss_scale": 1e5}, "fp16.min_loss_scale", "above the initial dynamic scale 65536"),  # 2**16: the default
    ({"initial_scale_power": 0, "min_loss_scale": 2}, "fp16.min_loss_scale", "(2**0)"),
    ({"loss_scale_window": 0}, "fp16.loss_scale_window", "an integer >= 1"),
    ({"hysteresis": -1}, "fp16.hysteresis", "an integer >= 1"),
])
def test_loss_scales_outside_what_fp32_unscales_are_refused(fp16, path, says):
    msg = error({"fp16": {"enabled": True, **fp16}})
    assert msg.startswith(f"<dict>: {path}: ") and says in msg, msg


def test_loss_scales_at_the_limits_are_accepted():
    for fp16 in ({"loss_scale": 1}, {"loss_scale": 2.0 ** 126}, {"initial_scale_power": 0},
                 {"initial_scale_power": 126, "min_loss_scale": 2.0 ** 126}, {"min_loss_scale": 2.0 ** -126},
                 {"loss_scale": 128, "min_loss_scale": 1e30}):  # a static scale never reaches its minimum
        resolve({"fp16": {"enabled": True, **fp16}})


@pytest.mark.parametrize("raw, shown, near", [
    ({"fp16 ": {"enabled": True}}, "'fp16 '", "'fp16'"),
    ({"fp16\x00": {}}, "'fp16\\x00'", "'fp16'"),
    ({"zero_optimization": {"reduce_bucket_size\u200b": 5}}, "zero_optimization.'reduce_bucket_size\\u200b'",
     "'reduce_bucket_size'"),
])
def test_an_unknown_key_with_invisible_characters_shows_them(raw, shown, near):
    # printed bare, "fp16 : unknown key at top level (did you mean 'fp16'?)" read as nonsense
    msg = error(raw)
    assert msg.startswith(f"<dict>: {shown}: unknown key ") and f"differs from {near} only by spaces or invisible " \
        "characters" in msg and "\x00" not in msg and "\u200b" not in msg, msg


def test_a_boolean_is_no_harmless_number_of_an_unsupported_key():
    # true == 1 in Python: "gradient_predivide_factor": true must not pass as the harmless 1 (zero_hpz_partition_size,
    # where this was found, is a ZeRO-3 setting now accepted at stages 1-2 whatever its value, as DeepSpeed does)
    assert "not supported by hf_zero_offload" in error(_with("gradient_predivide_factor", True), ARGS)
    resolve(_with("gradient_predivide_factor", 1), ARGS)


def test_dicts_built_in_python():
    raw = {"zero_optimization": {"stage": np.int64(2), "offload_optimizer": {"device": "cpu"},
                                 "reduce_bucket_size": np.float64(2e8)},
           "optimizer": {"type": "AdamW", "params": {"lr": np.float32(0.25), "betas": (0.9, 0.99)}}}
    cfg = resolve(raw)
    assert cfg.zero.stage == 2 and cfg.zero.reduce_bucket_size == 200_000_000
    assert cfg.optimizer.lr == 0.25 and cfg.optimizer.betas == (0.9, 0.99)
    assert "train_micro_batch_size_per_gpu: expected a positive integer" in error(
        {"train_micro_batch_size_per_gpu": np.float32(2.5)})  # not truncated to 2
    assert "optimizer.params.betas: expected a JSON value" in error(
        {"optimizer": {"type": "Adam", "params": {"betas": np.array([0.9, 0.99])}}})
    assert "<dict>: 3: keys must be strings, got int" in error({3: {"stage": 2}})
    assert "<dict>: zero_optimization.1: keys must be strings" in error({"zero_optimization": {1: 2}})
    before = copy.deepcopy(raw)
    resolve(raw, ArgsView(learning_rate=0.25, adam_beta2=0.99))
    assert raw.keys() == before.keys() and raw["optimizer"] == before["optimizer"]  # the caller's dict is untouched


def test_null_is_not_set_for_sections_and_switched_off_features():
    raw = wild("hf_docs_zero2_offload.json")
    base = resolve(raw, ARGS)
    for key in ("optimizer", "scheduler"):
        nulled = {**raw, key: None}
        missing = {k: v for k, v in raw.items() if k != key}
        assert resolve(nulled, ARGS) == resolve(missing, ARGS)
    z = {**raw["zero_optimization"], "offload_param": None, "stage3_max_live_parameters": None}
    assert resolve({**raw, "zero_optimization": z}, ARGS) == base
    assert not resolve({"zero_optimization": {"stage": 2, "offload_optimizer": None}}).zero.offload
    for path in ("optimizer.params.lr", "fp16.enabled", "zero_optimization.stage", "gradient_clipping"):
        assert f"{path}: expected" in error(_with(path, None), ARGS)


# ---------------------------------------------------------------- values that contradict the command line


def test_both_16_bit_formats():
    assert "bf16.enabled: fp16 and bf16 cannot both be enabled" in error({"fp16": {"enabled": True},
                                                                          "bf16": {"enabled": True}})
    msg = error({"fp16": {"enabled": "auto"}, "bf16": {"enabled": True}}, ARGS)
    assert "bf16.enabled=True vs --bf16 False" in msg
    assert "cannot both be true" in error({"bf16": {"enabled": "auto"}}, dataclasses.replace(ARGS, bf16=True))


def test_scheduler_block_against_the_trainer_schedule():
    raw = wild("hf_docs_zero2_offload.json")
    for kind in ("linear", "constant_with_warmup"):  # linear: the default, and transformers' WarmupLR twin
        assert resolve(raw, dataclasses.replace(ARGS, lr_scheduler_type=kind)).scheduler.type == "WarmupLR"
    for kind in ("cosine", "polynomial", "constant", "cosine_with_min_lr"):
        msg = error(raw, dataclasses.replace(ARGS, lr_scheduler_type=kind))
        assert f"scheduler.type='WarmupLR' vs --lr_scheduler_type {kind}" in msg
    decay = {**raw, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20}}}
    assert "--lr_scheduler_type constant_with_warmup" in error(
        decay, dataclasses.replace(ARGS, lr_scheduler_type="constant_with_warmup"))
    explicit = {**raw, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 7, "total_num_steps": 50}}}
    msg = error(explicit, ARGS)
    for item in ("scheduler.params.warmup_max_lr=0.001 vs --learning_rate 0.0002",
                 "scheduler.params.warmup_num_steps=7 vs --warmup_steps 3",
                 "scheduler.params.total_num_steps=50 vs the number of training steps 20"):
        assert item in msg.split("values): ")[1].split("; ")
    for name in ("OneCycle", "LRRangeTest", "StepLR", "CosineAnnealingLR"):
        msg = error({"scheduler": {"type": name, "params": {"total_num_steps": 10}}})
        assert "scheduler.type" in msg and "--lr_scheduler_type" in msg and "not supported" in msg


def test_gradient_clipping_and_batch_size_against_the_arguments():
    raw = wild("hf_docs_zero2_offload.json")
    assert "gradient_clipping=1.0 vs --max_grad_norm 0.5" in error({**raw, "gradient_clipping": 1.0}, ARGS)
    assert resolve({**raw, "gradient_clipping": 0.5}, ARGS).gradient_clipping == 0.5
    msg = error({**raw, "train_batch_size": 12}, ARGS)  # 2 ranks * 4 * 2 = 16
    assert "train_batch_size=12 vs world_size*per_device_train_batch_size*gradient_accumulation_steps 16" in msg
    assert "not a multiple" in error({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 5})


@pytest.mark.parametrize("name", ["Adamax", "SGD", "RMSprop", "NAdam", "RAdam", "Lion", "OneBitLamb", "adafactor"])
def test_optimizers_other_than_adam(name):
    msg = error({"optimizer": {"type": name, "params": {"lr": 1e-3}}})
    assert msg.startswith(f"<dict>: optimizer.type: \"{name}\" is not supported") and "only Adam/AdamW" in msg


# ---------------------------------------------------------------- files that are not what they should be


@pytest.mark.parametrize("content, where, says", [
    (b'{"zero_optimization": {"stage": 2,},\n}', ":1:35", "trailing comma before '}'"),
    (b'{"betas": [0.9, 0.999,]}', ":1:23", "trailing comma before ']'"),
    (b'// ZeRO-2\n{"zero_optimization": {"stage": 2}}', ":1:1", "JSON has no comments"),
    (b'{"zero_optimization": {"stage": 2} /* offload */}', ":1:36", "JSON has no comments"),
    (b'{"zero_optimization": {"stage": 2}, # offload\n}', ":1:37", "JSON has no comments"),
    (b"", ":1:1", "the file is empty"),
    # the README's extension block pasted as the file: "invalid JSON: Extra data", no more
    (b'"zero_optimization": {"stage": 2,\n  "offload_optimizer": {"device": "cpu"}}\n', ":1:20",
     '"key": value outside any object (a fragment pasted as the whole file?): a ds_config is one JSON object, so '
     "wrap the file's content in { }"),
    (b"  \n\n", ":3:1", "the file is empty"),
    ('{"zero_optimization": {"stage": 2}, "r\xe9sum\xe9": 1}'.encode("latin-1"), "",
     "not a UTF-8 text file (byte 38 is 0xe9)"),
    ('{"zero_optimization": {"stage": 2}}'.encode("utf-16"), "", "not a UTF-8 text file (byte 0 is 0xff)"),
    (b'\xef\xbb\xbf' + '{"zero_optimization": {"stage": 2}, "r\xe9sum\xe9": 1}'.encode("latin-1"), "",
     "not a UTF-8 text file (byte 41 is 0xe9)"),  # counted in the file, its byte-order mark included
    (b"[" * 100_000, "", "nested too deeply"),
    (b"null", "", "the top level must be a JSON object ({...}), got null"),
    (b'["zero2"]', "", "the top level must be a JSON object ({...}), got an array"),
])
def test_unreadable_files_are_one_line_naming_the_file(tmp_path, content, where, says):
    path = tmp_path / "ds_config.json"
    path.write_bytes(content)
    msg = error(path, source=f"{path}{where}")
    assert says in msg


def test_a_byte_order_mark_changes_nothing(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_bytes(b"\xef\xbb\xbf" + (WILD / "hf_docs_zero2_offload.json").read_bytes())
    assert resolve(path, ARGS) == dataclasses.replace(resolve(WILD / "hf_docs_zero2_offload.json", ARGS),
                                                      source=str(path))


def test_a_directory_or_something_else_instead_of_a_file(tmp_path):
    (tmp_path / "cfg.json").mkdir()
    assert "cannot read the ds_config file: Is a directory" in error(tmp_path / "cfg.json",
                                                                     source=str(tmp_path / "cfg.json"))
    for thing in (None, 3, b"zero2", ["zero2"]):
        with pytest.raises(ConfigError, match="expected a ds_config path, a shipped config.s name, JSON text or a "
                                              "dict"):
            resolve(thing)


def test_json_text_is_read_as_deepspeed_reads_it(tmp_path):
    """transformers turns a --deepspeed string starting with "{" into a dict; --zero_offload took it for a shipped
    config's name ("no shipped ds_config named '{...}'", an outside probe porting transformers' DeepSpeed tests)."""
    from transformers import HfArgumentParser

    from hf_zero_offload import ZeroOffloadTrainingArguments

    text = (WILD / "hf_docs_zero2_offload.json").read_text()
    assert resolve("  " + text, ARGS) == dataclasses.replace(resolve(WILD / "hf_docs_zero2_offload.json", ARGS),
                                                              source="<inline JSON>")
    (args,) = HfArgumentParser(ZeroOffloadTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--zero_offload", '{"zero_optimization": {"stage": 2}}'])
    assert args.zero_offload == {"zero_optimization": {"stage": 2}}
    assert json.loads(args.to_json_string())["zero_offload"] == args.zero_offload
    for bad, says in (('{"zero_optimization": {"stage": 2,}}', "<inline JSON>:1:35: invalid JSON: a trailing comma"),
                      ('{"train_batch_size": 8, "train_batch_size": 8}', "<inline JSON>: invalid JSON: duplicate key")):
        with pytest.raises(ConfigError, match=re.escape(says)):  # at the arguments, before any model work
            ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, zero_offload=bad)
    with pytest.raises(ConfigError, match="<inline JSON>: zero_optimisation: unknown key"):
        resolve('{"zero_optimisation": {}}', ARGS)
    with pytest.raises(ConfigError, match=r"<inline JSON>: a ds_config is a JSON object \(\{...\}\), got a JSON list"):
        resolve('[{"zero_optimization": {"stage": 2}}]', ARGS)  # (was: "no shipped ds_config named '[...'")
    assert resolve("\ufeff" + text, ARGS).source == "<inline JSON>"
    with pytest.raises(ConfigError, match=r"<inline JSON>: zero_optimization.bogus: unknown key"):  # (was <dict>)
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                     zero_offload='{"zero_optimization": {"stage": 2, "bogus": 1}}')
    odd = tmp_path / "{run}.json"  # a file whose name starts so is a file (a review)
    odd.write_text(text)
    assert resolve(str(odd), ARGS).source == str(odd)


def test_json_text_keeps_its_name_after_the_arguments(tmp_path):
    """--zero_offload '{...}' is a dict from the arguments on: a value contradicting the command line, found when the
    Trainer resolves it, was named "<dict>" (and so was the start line's config=), a name the user never wrote."""
    import torch

    from hf_zero_offload import ZeroOffloadTrainer, ZeroOffloadTrainingArguments

    for given, name in (('{"zero_optimization": {"stage": 0}}', "<inline JSON>"),
                        ({"zero_optimization": {"stage": 0}}, "<dict>")):
        args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, sharded_ddp=True,
                                            report_to="none", zero_offload=given)
        with pytest.raises(ConfigError, match=rf"^{name}: ds_config values contradict TrainingArguments"):
            ZeroOffloadTrainer(model=torch.nn.Linear(2, 2), args=args)
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                        zero_offload='{"zero_optimization": {"stage": 2}}')
    args.zero_offload = {"zero_optimization": {"stage": 0}}  # a dict set in its place since: a dict again
    assert ZeroOffloadTrainer(model=torch.nn.Linear(2, 2), args=args)._zo_raw.source == "<dict>"


def test_llamafactory_and_openrlhf_configs_load_as_under_deepspeed():
    """Refused before: LLaMA-Factory's comms_config and monitor_config (keys DeepSpeed itself does not read), OpenRLHF's
    sub_group_size "auto", its zero_hpz_partition_size 8 at stage 2 (a ZeRO-3 setting) and tensor_parallel.autotp_size 1
    (no TP); a "_comment" key was 'unknown (did you mean comet?)'."""
    lf = resolve(WILD / "llamafactory_z2_offload.json", dataclasses.replace(ARGS, fp16=False, bf16=True))
    assert (lf.zero.stage, lf.zero.offload, lf.bf16, lf.gradient_clipping) == (2, True, True, 0.5)
    rlhf = resolve(WILD / "openrlhf_train_offload.json", dataclasses.replace(ARGS, fp16=False, bf16=True,
                                                                             max_grad_norm=1.0))
    assert (rlhf.zero.stage, rlhf.zero.offload, rlhf.bf16, rlhf.gradient_clipping) == (2, True, True, 1.0)
    for key, value, said in [
        ("tensor_parallel", {"autotp_size": 2}, r'tensor_parallel: \{"autotp_size": 2\} is not supported by '
                                               r"hf_zero_offload: tensor parallelism \(AutoTP\) is not implemented"),
        ("fp16", {"enabled": True, "auto_cast": True}, r"fp16.auto_cast: true is not supported by hf_zero_offload: "
                                                      r"the engine casts the model to fp16 and runs no autocast"),
    ]:
        assert re.search(said, error({key: value})), error({key: value})


def test_an_explicit_stage_0_with_sharded_ddp_is_a_contradiction():
    """It ran ZeRO-2 without a word (the flag asks for partitioning); left out, the stage is 2 with the flag."""
    msg = error({"zero_optimization": {"stage": 0}}, dataclasses.replace(ARGS, sharded_ddp=True))
    assert "zero_optimization.stage=0 (no partitioning) vs --sharded_ddp" in msg
    assert resolve({"zero_optimization": {"stage": 1}}, dataclasses.replace(ARGS, sharded_ddp=True)).zero.stage == 1
