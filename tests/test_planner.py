"""The memory planner (hf_zero_offload.planner): parameter counts, the engine's real allocations,
activation predictions against a real CPU step, the t5-3b estimate's cost (the CLI and API surface:
test_planner_cli.py; a trainable subset or PEFT adapter: test_planner_trainable.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from _planner import MODELS, ROOT, T5_3B, T5_SMALL, T5_TINY, config_file, t5_params
from hf_zero_offload import planner
from hf_zero_offload.planner import measure, trace
from hf_zero_offload.engine import OffloadAdam, OffloadOptions


# -- parameter counts --------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [T5_TINY, T5_SMALL], ids=["tiny", "small"])
def test_param_counts_equal_the_real_model(cfg):
    config = trace.load_config(cfg)
    n, largest = trace.count_params(trace.build_model(config))  # meta: no memory
    torch.manual_seed(0)
    real = trace.build_model(config, device="cpu")
    assert real.shared.weight is real.lm_head.weight  # tied, so counted once below
    assert n == sum(p.numel() for p in real.parameters()) == t5_params(cfg)
    assert largest == cfg["vocab_size"] * cfg["d_model"]


def test_param_counts_of_repo_configs():
    for name, inline in [("t5-tiny", T5_TINY), ("t5-small", T5_SMALL), ("t5-3b", T5_3B)]:
        path = MODELS / f"{name}.json"
        want = t5_params(inline)
        assert trace.count_params(trace.build_model(trace.load_config(inline)))[0] == want
        if path.exists():
            assert trace.count_params(trace.build_model(trace.load_config(path)))[0] == want, name
    assert t5_params(T5_3B) == 2_851_598_336


# -- model states equal the engine's real allocations ------------------------------------------------
@pytest.mark.parametrize("gas,state_dtype", [(1, "fp32"), (2, "fp32"), (1, "bf16"), (1, "int8"), (2, "int8")])
def test_offload_rows_equal_the_engines_allocation(gas, state_dtype):
    opts = dict(bucket_numel=50_000, tile_numel=4096, gradient_accumulation_steps=gas, state_dtype=state_dtype)
    p = planner.plan(T5_TINY, dtype="bf16", cuda=False, bucket_numel=opts["bucket_numel"],
                     tile_numel=opts["tile_numel"], gradient_accumulation_steps=gas, state_dtype=state_dtype,
                     configs=["zero2_offload", "zero2_offload_dpu"]
                     + ([f"zero2_offload_state_{state_dtype}"] if state_dtype != "fp32" else []))
    rows = {r.name: r for r in p.rows}
    if state_dtype != "fp32":  # the compact-state row of the default table is the same plan
        assert rows[f"zero2_offload_state_{state_dtype}"].host_bytes == rows["zero2_offload"].host_bytes
        # and the legend under the table says so for the offload rows too
        assert f"  zero2_offload_dpu: ZeRO-2 + CPU offload + delayed param update, bf16, {state_dtype} moments" \
            in planner.format_plan(p).splitlines()
    for name, dpu in [("zero2_offload", False), ("zero2_offload_dpu", True)]:
        torch.manual_seed(0)
        model = trace.build_model(trace.load_config(T5_TINY), device="cpu")
        opt = OffloadAdam(model.parameters(), param_dtype=torch.bfloat16, options=OffloadOptions(dpu=dpu, **opts))
        try:
            row = rows[name]
            assert opt.numel == p.params
            assert row.host_bytes == opt.arena.nbytes == opt.plan.host_bytes
            assert row.device_states["grad_buckets"] == opt.plan.device_bytes
            assert row.device_states["params_16bit"] == sum(q.numel() * q.element_size() for q in model.parameters())
        finally:
            opt.arena.close()
            if opt._worker is not None:
                opt._worker.shutdown()


SHARDED_ROWS = {"zero2_offload": dict(stage=2, offload=True), "zero2": dict(stage=2, offload=False),
                "sharded_stage1_bf16": dict(stage=1, offload=False),
                "zero2_offload_state_int8": dict(stage=2, offload=True, state_dtype="int8")}


def _sharded_allocation_job(rank, world, config: dict, bucket: int):
    """What ShardedAdam really allocates per rank for t5-tiny (one param group, model order)."""
    from hf_zero_offload.engine import ShardedAdam

    out = {}
    for name, cfg in SHARDED_ROWS.items():
        torch.manual_seed(0)
        model = trace.build_model(trace.load_config(config), device="cpu")
        cfg = dict(cfg)
        opt = ShardedAdam([p for p in model.parameters() if p.requires_grad], param_dtype=torch.bfloat16,
                          options=OffloadOptions(bucket_numel=bucket, state_dtype=cfg.pop("state_dtype", "fp32")),
                          **cfg)
        out[name] = {"host": opt.arena.nbytes if opt.arena is not None else 0,
                     "device": {k: t.numel() * t.element_size() for k, t in opt.regions.items()
                                if opt.plan.regions[k][2] == "device" and t.numel()}}
        opt.close()
    return out


def test_sharded_rows_are_what_the_engine_allocates():
    """Planner rows for 2 GPUs against ShardedAdam on 2 gloo ranks (cuda=False on both sides: the CPU
    engine's layout), region by region; params and full .grads are the model's, not the engine's."""
    from _dist import run_distributed

    with ThreadPoolExecutor(1) as pool:  # the ranks start and allocate while the plan is made here
        ranks = pool.submit(run_distributed, _sharded_allocation_job, T5_TINY, 10_000)
        p = planner.plan(T5_TINY, gpus=2, dtype="bf16", cuda=False, bucket_numel=10_000, configs=list(SHARDED_ROWS))
        r0, r1 = ranks.result()
    assert r0 == r1
    for row in p.rows:
        real = r0[row.name]
        planned = {k: v for k, v in row.device_states.items() if not k.startswith(("params_", "grads_"))}
        assert planned == real["device"], row.name
        assert row.host_bytes == real["host"], row.name
    by = {r.name: r for r in p.rows}
    assert by["zero2_offload"].host_bytes > 0 and "master" not in by["zero2_offload"].device_states
    assert by["zero2"].host_bytes == 0 and by["zero2"].device_states["master"] == 4 * -(-p.params // 2)


# -- activations: the meta trace against a real CPU step ---------------------------------------------
def test_event_lines_are_exact_beyond_the_traced_batches():
    config = trace.load_config(T5_TINY)
    prof = trace.profile_activations(config, "fp32", seq_len=32, tgt_len=16)
    assert prof.aligned
    model = trace.build_model(config)
    t8 = trace.trace_step(model, trace.dummy_batch(config, 8, 32, 16))
    assert prof.peak(8, keep=False) == t8.peak and prof.peak(8, keep=True) == t8.peak_keep


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self VmHWM")
def test_activation_prediction_matches_a_real_cpu_step(tmp_path):
    """A real forward + backward of t5-tiny on the CPU, peak measured by the kernel (VmHWM with every
    tensor its own mmap), against the meta-trace prediction: within 10 % (measured: < 1 %)."""
    path = config_file("t5-tiny", T5_TINY, tmp_path)
    config = trace.load_config(path)
    jobs = [("fp32", 8, True), ("half", 8, False), ("amp", 8, True)]
    with ThreadPoolExecutor(1) as pool:  # the real steps' child process and the trace here, side by side
        measured = pool.submit(measure.measure_cpu_steps, config, jobs, half_dtype=torch.bfloat16)
        profs = trace.profile_modes(config, half_dtype=torch.bfloat16)
        measured = measured.result()
    for (mode, bs, keep), real in zip(jobs, measured):
        pred = profs[mode].peak(bs, keep)
        assert abs(pred - real) <= 0.10 * real, (mode, bs, keep, pred, real)


def test_t5_without_dropout_is_traced(tmp_path):
    """T5 passes its learned position bias as the attention mask; without dropout the trace sent it through the
    CPU flash kernel, which takes no mask that needs a gradient: `estimate` failed ("not differentiable with
    respect to argument 'attn_mask'"), blaming the config. (Against a real step: the slow test below.)"""
    path = config_file("t5-tiny-no-dropout", {**T5_TINY, "dropout_rate": 0.0}, tmp_path)
    profs = trace.profile_modes(trace.load_config(path), ("fp32",), half_dtype=torch.bfloat16)
    assert profs["fp32"].peak(8, True) > 0


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self VmHWM")
def test_t5_without_dropout_is_traced_as_its_real_step_runs(tmp_path):
    """T5 passes its learned position bias as the attention mask; without dropout the trace sent it through the
    CPU flash kernel, which takes no mask that needs a gradient: `estimate` failed ("not differentiable with
    respect to argument 'attn_mask'"), blaming the config. A real step runs the math path there, as the trace now.
    Within 15%, on the safe side (measured: the trace 10% above the real step, 43.5 vs 39.5 MB)."""
    path = config_file("t5-tiny-no-dropout", {**T5_TINY, "dropout_rate": 0.0}, tmp_path)
    config = trace.load_config(path)
    jobs = [("fp32", 8, True)]
    with ThreadPoolExecutor(1) as pool:
        measured = pool.submit(measure.measure_cpu_steps, config, jobs, half_dtype=torch.bfloat16)
        profs = trace.profile_modes(config, ("fp32",), half_dtype=torch.bfloat16)
        measured = measured.result()
    pred = profs["fp32"].peak(8, True)
    assert measured[0] <= pred <= 1.15 * measured[0], (pred, measured[0])


@pytest.mark.slow  # (23 s: make test-all) the default tier keeps t5's real-step check
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self VmHWM")
@pytest.mark.parametrize("model_type", ["llama", "mistral"], ids=["llama", "mistral-sliding-window"])
def test_sdpa_attention_is_traced_as_the_fused_kernel_runs(model_type):
    """On meta, scaled_dot_product_attention took its math path and created the seq x seq scores that the real
    step's fused kernel never holds: a Llama-shaped model at seq 2048 traced 8.5x its real CPU step. The trace plans
    for batches with padding (on meta transformers cannot tell, and builds the attention mask a batch without
    padding skips), so the real step here has one padding position.)"""
    # mistral's sliding window always brings a bool mask, which the kernel keeps in the query's dtype (0.67x with
    # the mask passed as bool)
    kv_heads = 4
    window = {"sliding_window": 256} if model_type == "mistral" else {}
    config = trace.load_config({"model_type": model_type, **window, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
                                "vocab_size": 256, "max_position_embeddings": 1024, "bos_token_id": 0,
                                "eos_token_id": 0, "pad_token_id": 0})
    jobs = [("fp32", 2, True), ("half", 2, False)]
    with ThreadPoolExecutor(1) as pool:  # the real steps' child process and the trace here, side by side
        # a batch with padding, as most are: its attention mask exists in the real step as in the trace
        measured = pool.submit(measure.measure_cpu_steps, config, jobs, half_dtype=torch.bfloat16, seq_len=1024,
                               padded=True)
        profs = trace.profile_modes(config, ("fp32", "half"), half_dtype=torch.bfloat16, seq_len=1024)
        measured = measured.result()
    for (mode, bs, keep), real in zip(jobs, measured):
        pred = profs[mode].peak(bs, keep)
        assert abs(pred - real) <= 0.15 * real, (mode, pred, real)


@pytest.mark.slow  # (17 s: make test-all) the default tier traces checkpointing in test_examples' offload runs
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self VmHWM")
def test_gradient_checkpointing_prediction_matches_a_real_cpu_step(tmp_path):
    """--gradient-checkpointing traces the checkpointed step (the backward recomputes each block):
    against a real checkpointed step within 10 %, and far below the plain step per sample."""
    path = config_file("t5-tiny", T5_TINY, tmp_path)
    config = trace.load_config(path)
    jobs = [("fp32", 16, False), ("half", 16, False)]
    with ThreadPoolExecutor(1) as pool:  # as above
        measured = pool.submit(measure.measure_cpu_steps, config, jobs, half_dtype=torch.bfloat16,
                               gradient_checkpointing=True)
        ckpt = trace.profile_modes(config, ("fp32", "half"), half_dtype=torch.bfloat16,
                                   model=trace.build_model(config, gradient_checkpointing=True))
        plain = trace.profile_modes(config, ("fp32", "half"), half_dtype=torch.bfloat16)
        measured = measured.result()
    for (mode, bs, keep), real in zip(jobs, measured):
        pred = ckpt[mode].peak(bs, keep)
        assert abs(pred - real) <= 0.10 * real, (mode, bs, pred, real)
        assert ckpt[mode].asymptote(keep)[1] < 0.7 * plain[mode].asymptote(keep)[1], mode
    p = planner.plan(T5_TINY, configs=["zero2_offload"], gradient_checkpointing=True)
    assert p.gradient_checkpointing and set(p.to_json()) == {"inputs", "params", "frozen_params", "configs"}
    assert p.to_json()["inputs"]["gradient_checkpointing"] is True
    assert "gradient checkpointing" in planner.format_plan(p)


# -- the t5-3b estimate: cost and sanity, through the CLI's --json -----------------------------------
REQUIRED = {"name": str, "device_bytes_model_states": int, "host_bytes": int, "activation_bytes_per_sample": int,
            "max_batch_size": int}


@pytest.fixture(scope="module", autouse=True)
def t5_3b_cli(request, tmp_path_factory):
    """Starts ``python -m hf_zero_offload.cli estimate`` for t5-3b when the module starts (only if its
    test was collected), so it runs on the second core while the other tests run here."""
    if not any(item.name == "test_t5_3b_estimate_is_fast_small_and_sane" for item in request.session.items):
        yield None
        return
    tmp = tmp_path_factory.mktemp("t5_3b")
    path = config_file("t5-3b", T5_3B, tmp)
    cmd = [sys.executable, "-m", "hf_zero_offload.cli", "estimate", "--model", str(path), "--gpus", "1", "--json"]
    out, err = open(tmp / "stdout", "w+"), open(tmp / "stderr", "w+")
    run = {"t0": time.perf_counter(), "proc": subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True),
           "out": out, "err": err}
    yield run
    if run["proc"].returncode is None:
        run["proc"].kill()
        run["proc"].wait()
    out.close()
    err.close()


def test_t5_3b_estimate_is_fast_small_and_sane(t5_3b_cli):
    proc = t5_3b_cli["proc"]
    _, status, ru = os.wait4(proc.pid, 0)  # this child's own rusage
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t5_3b_cli["t0"]
    t5_3b_cli["err"].seek(0)
    assert proc.returncode == 0, t5_3b_cli["err"].read()[-3000:]
    t5_3b_cli["out"].seek(0)
    out = t5_3b_cli["out"].read()
    cpu = ru.ru_utime + ru.ru_stime
    maxrss = ru.ru_maxrss * 1024  # Linux: KiB
    print(f"t5-3b estimate: wall {wall:.1f} s (sharing the cores with the other tests), cpu {cpu:.1f} s, "
          f"max RSS {maxrss / 2**20:.0f} MiB")
    assert cpu < 60, cpu
    # wall time is not asserted: it measures the machine's other load (148 s at load average 9); CPU time does not
    assert maxrss < 2 * 2**30, maxrss

    data = json.loads(out)
    assert set(data) == {"inputs", "params", "frozen_params", "gradient_bucket_numel", "configs"}  # what it was asked
    assert data["inputs"]["model"].endswith("t5-3b.json") and data["inputs"]["gpus"] == 1 and data["inputs"]["gpu_mem_gib"] == 24
    n = data["params"]
    assert isinstance(n, int) and n == t5_params(T5_3B)
    names = [c["name"] for c in data["configs"]]
    assert names == ["baseline", "fp16", "sharded_stage1_fp32", "sharded_stage1_fp16", "zero2", "zero2_offload",
                     "zero2_offload_dpu", "zero2_offload_state_bf16", "zero2_offload_state_int8"]
    for c in data["configs"]:
        for key, typ in REQUIRED.items():
            assert isinstance(c[key], typ) and not isinstance(c[key], bool), (c["name"], key)
        assert (c["host_bytes"] > 0) == ("offload" in c["name"])
    rows = {c["name"]: c for c in data["configs"]}
    off = rows["zero2_offload"]
    # estimate's default: "auto" buckets, hidden_size**2 (the shipped configs'), at least the largest param (the
    # shared embedding)
    buckets = 2 * max(T5_3B["d_model"] ** 2, T5_3B["vocab_size"] * T5_3B["d_model"]) * 2
    assert data["inputs"]["bucket_numel"] == T5_3B["d_model"] ** 2
    assert off["device_bytes_model_states"] == 2 * n + buckets       # 2 B/param + the two fp16 buckets
    assert 12 * n < off["host_bytes"] <= 18 * n                      # masters + moments + grad store + staging
    assert rows["zero2_offload_dpu"]["host_bytes"] > off["host_bytes"]
    # compact moments (issue 14): int8 <= 8.5 B/param, t5-3b <= 24 GiB of host memory; bf16 <= 10.5
    assert rows["zero2_offload_state_int8"]["host_bytes"] <= min(8.5 * n, 24 * 2**30)
    assert rows["zero2_offload_state_bf16"]["host_bytes"] <= 10.5 * n
    # the anchors: plain --fp16 does not fit t5-3b on a 24 GB card at batch 1; ZeRO-2 + offload does
    assert rows["fp16"]["max_batch_size"] == 0
    assert off["max_batch_size"] >= 1
    assert rows["zero2"]["device_bytes_model_states"] > 16 * n  # one rank holds every shard
