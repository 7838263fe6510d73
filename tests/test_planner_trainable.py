"""The planner for a trainable subset (--trainable, a PEFT adapter): its rows equal the engine's allocation
and count the frozen params, its activation prediction matches a real CPU step, a regex or adapter config that
selects nothing or is not there is named."""
from __future__ import annotations

import sys

import pytest
import torch

from _planner import T5_TINY, config_file, t5_params
from hf_zero_offload import planner
from hf_zero_offload.planner import measure, subset, trace
from hf_zero_offload.engine import OffloadAdam, OffloadOptions


# -- a trainable subset (--trainable) ----------------------------------------------------------------
def test_trainable_subset_rows_equal_the_engines_allocation_and_count_the_frozen_params():
    """Freezing the encoder (T5's tied embedding trains: decoder.embed_tokens is one of its names)."""
    opts = dict(bucket_numel=50_000, tile_numel=4096)
    p = planner.plan(T5_TINY, dtype="bf16", cuda=False, trainable=r"^decoder\.", configs=["baseline", "zero2_offload"],
                     **opts)
    model = trace.build_model(trace.load_config(T5_TINY), device="cpu")
    frozen = subset.freeze_except(model, r"^decoder\.", "t5-tiny")
    trainable = [q for q in model.parameters() if q.requires_grad]
    assert p.params == sum(q.numel() for q in trainable) and p.frozen == frozen > 0
    assert p.params + p.frozen == sum(q.numel() for q in model.parameters())
    assert p.to_json()["frozen_params"] == frozen and p.to_json()["inputs"]["trainable"] == r"^decoder\."
    assert model.shared.weight.requires_grad and not model.encoder.block[0].layer[0].SelfAttention.q.weight.requires_grad
    rows = {r.name: r for r in p.rows}
    assert rows["baseline"].device_states["frozen_params_fp32"] == 4 * frozen
    assert rows["zero2_offload"].device_states["frozen_params_16bit"] == 2 * frozen
    opt = OffloadAdam(trainable, param_dtype=torch.bfloat16, options=OffloadOptions(**opts))
    try:
        assert rows["zero2_offload"].host_bytes == opt.arena.nbytes
    finally:
        opt.close()
    assert f"trainable, {frozen:,} frozen (--trainable '^decoder\\\\.')" in planner.format_plan(p)


@pytest.mark.parametrize("regex, match", [("(", r"--trainable '\(' is not a regular expression"),
                                          ("a{99999999999}", r"--trainable 'a\{99999999999\}' is not a regular exp"),
                                          ("(" * 2000 + ")" * 2000, r"is not a regular expression Python can compile"),
                                          ("lora_", r"--trainable 'lora_' matches no trainable parameter of .*shared\.weight")])
def test_a_trainable_regex_that_selects_nothing_is_refused_by_name(regex, match):
    with pytest.raises(ValueError, match=match):
        planner.plan(T5_TINY, trainable=regex, configs=["baseline"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self VmHWM")
def test_trainable_subset_activation_prediction_matches_a_real_cpu_step(tmp_path):
    """As test_activation_prediction_matches_a_real_cpu_step, the encoder frozen: no weight gradients for it."""
    path = config_file("t5-tiny", T5_TINY, tmp_path)
    config = trace.load_config(path)
    jobs = [("fp32", 8, True), ("half", 8, False)]
    measured = measure.measure_cpu_steps(config, jobs, half_dtype=torch.bfloat16, trainable=r"^decoder\.")
    model = trace.build_model(config)
    subset.freeze_except(model, r"^decoder\.", "t5-tiny")
    profs = trace.profile_modes(config, ("fp32", "half"), half_dtype=torch.bfloat16, model=model)
    full = trace.profile_modes(config, ("fp32",), half_dtype=torch.bfloat16)
    assert profs["fp32"].grad_bytes < full["fp32"].grad_bytes
    for (mode, bs, keep), real in zip(jobs, measured):
        pred = profs[mode].peak(bs, keep)
        assert abs(pred - real) <= 0.10 * real, (mode, bs, keep, pred, real)


def _lora_config(tmp_path) -> str:
    """As a PeftModel's save_pretrained writes it (a run's checkpoint): inference_mode true, which froze every param
    of the planned model (an outside probe: estimate failed on every folder peft writes, blaming the lengths)."""
    peft = pytest.importorskip("peft")
    folder = tmp_path / "adapter"
    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], task_type="SEQ_2_SEQ_LM",
                    inference_mode=True).save_pretrained(folder)
    return str(folder)


def test_a_peft_adapter_is_planned_as_its_params_train(tmp_path):
    """LoRA on q and v: its A/B matrices train, every param of the model is frozen."""
    folder = _lora_config(tmp_path)
    p = planner.plan(T5_TINY, dtype="bf16", peft_config=folder, configs=["zero2_offload"])
    c = T5_TINY
    inner, layers = c["num_heads"] * c["d_kv"], c["num_layers"] + 2 * c["num_decoder_layers"]  # q, v per attention
    assert p.params == layers * 2 * 4 * (c["d_model"] + inner) and p.frozen == t5_params(T5_TINY)
    assert p.rows[0].device_states["frozen_params_16bit"] == 2 * p.frozen
    assert f"--peft-config {folder!r}" in planner.format_plan(p)


def test_trainable_narrows_a_peft_adapter_and_never_unfreezes(tmp_path):
    """--trainable with --peft-config replaced the adapter's choice: '^decoder' trained the base decoder's weights
    (and the decoder's LoRA matrices) instead of the decoder's LoRA matrices alone."""
    folder = _lora_config(tmp_path)
    whole = planner.plan(T5_TINY, dtype="bf16", peft_config=folder, configs=["zero2_offload"])
    p = planner.plan(T5_TINY, dtype="bf16", peft_config=folder, trainable=r"\.decoder\.", configs=["zero2_offload"])
    c = T5_TINY
    inner = c["num_heads"] * c["d_kv"]
    assert p.params == 2 * c["num_decoder_layers"] * 2 * 4 * (c["d_model"] + inner)  # self + cross attention q, v
    assert p.params + p.frozen == whole.params + whole.frozen and p.params < whole.params


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self VmHWM")
def test_a_peft_adapters_activation_prediction_matches_a_real_cpu_step(tmp_path):
    folder = _lora_config(tmp_path)
    config = trace.load_config(config_file("t5-tiny", T5_TINY, tmp_path))
    jobs = [("fp32", 8, True), ("half", 8, False)]
    measured = measure.measure_cpu_steps(config, jobs, half_dtype=torch.bfloat16, peft_config=folder)
    model = subset.with_adapter(trace.build_model(config), folder)
    profs = trace.profile_modes(config, ("fp32", "half"), half_dtype=torch.bfloat16, model=model)
    for (mode, bs, keep), real in zip(jobs, measured):
        pred = profs[mode].peak(bs, keep)
        assert abs(pred - real) <= 0.10 * real, (mode, bs, keep, pred, real)


def test_a_peft_config_that_is_not_there_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"--peft-config .*nowhere: (no adapter_config\.json there|planning a PEFT "
                                         r"adapter needs peft)"):
        planner.plan(T5_TINY, peft_config=str(tmp_path / "nowhere"), configs=["baseline"])
