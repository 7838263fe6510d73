"""Planner validation: predicted vs measured memory.

CPU tier (default; Linux, any machine):
  * parameter counts: planner (meta model) vs a real CPU model from the same config;
  * offload host bytes: planner row vs ``OffloadAdam(...).arena.nbytes`` with the same options;
  * activation peaks of one real forward + backward on the CPU (kernel-measured: VmHWM with every
    tensor its own mmap, see ``planner.measure.measure_cpu_steps``) vs the meta-trace prediction in the
    row's dtype, and vs the alternative "trace fp32 and halve the activations".

GPU tier (``--gpu``; needs CUDA; ``benchmarks/t5/gpu_tier.py``, not yet run): for t5-large / t5-3b real training
steps (baseline fp32 + torch AdamW, torch AMP fp16 + GradScaler, ZeRO-2 + CPU offload with ``OffloadAdam``) at each
batch size, under each SDPA backend asked for, compare ``torch.cuda.max_memory_allocated()`` over steps 2-3
(optimizer state exists) with the planner's ``device_bytes_at_batch_size``; the measured per-sample slope is set
beside the trace's, as planned and traced with CUDA's kernel choices.

    python -m benchmarks.t5.planner_validate                        # CPU tier (--json PATH to keep the rows)
    python -m benchmarks.t5.planner_validate --gpu --gpu-models t5-large,t5-3b --gpu-batch 4,8
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch  # noqa: E402

from hf_zero_offload import planner  # noqa: E402
from hf_zero_offload.planner import measure, trace  # noqa: E402

from benchmarks._common import (hardware, hardware_line, int_list, json_stdout, json_target, model_config,  # noqa: E402
                               model_list, name_list, positive_int, print_table, provenance, write_json)
from benchmarks.t5.gpu_tier import (ATTENTION, GPU_ROWS, TRACES, gpu_measure, pct_error, per_sample,  # noqa: E402
                                    traced_per_sample)

MiB = 2 ** 20
KEEP = {"fp32": True, "half": False, "amp": True}  # the gradient policy of the rows that train in each mode


def cpu_params(name: str) -> dict:
    config = trace.load_config(model_config(name))
    n_meta, _ = trace.count_params(trace.build_model(config))
    real = trace.build_model(config, device="cpu")
    n_real = sum(p.numel() for p in real.parameters())
    return {"model": name, "planner": n_meta, "real_model": n_real, "equal": n_meta == n_real}


def cpu_engine(name: str) -> list[dict]:
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    out = []
    config = trace.load_config(model_config(name))
    opts = dict(bucket_numel=1 << 20, tile_numel=1 << 16)
    p = planner.plan(config, cuda=False, dtype="bf16", configs=["zero2_offload", "zero2_offload_dpu"], seq_len=16,
                     tgt_len=16, **opts)
    for row, dpu in zip(p.rows, (False, True)):
        model = trace.build_model(config, device="cpu")
        opt = OffloadAdam(model.parameters(), param_dtype=torch.bfloat16, options=OffloadOptions(dpu=dpu, **opts))
        out.append({"model": name, "row": row.name, "planner_host_bytes": row.host_bytes,
                    "engine_arena_nbytes": opt.arena.nbytes, "equal": row.host_bytes == opt.arena.nbytes})
        opt.close()
    return out


def cpu_activations(name: str, batches, seq_len: int, tgt_len: int) -> list[dict]:
    config = trace.load_config(model_config(name))
    half = torch.bfloat16  # the CPU's 16-bit type for real runs (fp16 has the same sizes)
    profs = trace.profile_modes(config, half_dtype=half, seq_len=seq_len, tgt_len=tgt_len)
    jobs = [(mode, bs, KEEP[mode]) for mode in ("fp32", "half", "amp") for bs in batches]
    t0 = time.perf_counter()
    measured = measure.measure_cpu_steps(config, jobs, half_dtype=half, seq_len=seq_len, tgt_len=tgt_len)
    print(f"  {name}: {len(jobs)} real CPU steps measured in {time.perf_counter() - t0:.1f} s")
    f32 = profs["fp32"]
    rows = []
    for (mode, bs, keep), real in zip(jobs, measured):
        pred = profs[mode].peak(bs, keep)
        if mode == "fp32":
            halved = None
        elif mode == "half":  # fp32 trace, everything halved (drop-gradient policy like the ZeRO-2 rows)
            halved = f32.peak(bs, False) // 2
        else:  # amp: fp32 activations halved, fp32 gradients kept, plus the autocast weight copies
            halved = (f32.peak(bs, True) - f32.grad_bytes) // 2 + f32.grad_bytes + profs["amp"].param_cast_bytes
        rows.append({"model": name, "mode": mode, "batch": bs, "grads": "kept" if keep else "freed",
                     "measured_MiB": round(real / MiB, 1), "traced_MiB": round(pred / MiB, 1),
                     "traced_err_%": pct_error(pred, real),
                     "fp32_halved_MiB": None if halved is None else round(halved / MiB, 1),
                     "fp32_halved_err_%": None if halved is None else pct_error(halved, real)})
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=model_list, default="t5-tiny,t5-small",
                    help="CPU tier models: names of configs/models/NAME.json or paths to config JSON files")
    ap.add_argument("--batches", type=int_list(1), default=[2, 8], help="CPU tier batch sizes, comma-separated")
    ap.add_argument("--seq-len", type=positive_int, default=128, help="source tokens")
    ap.add_argument("--tgt-len", type=positive_int, default=128, help="target tokens")
    ap.add_argument("--gpu", action="store_true", help="run the GPU tier (needs CUDA; untested so far)")
    ap.add_argument("--gpu-models", type=model_list, default="t5-large,t5-3b", help="GPU tier models, as --models")
    ap.add_argument("--gpu-rows", type=name_list(GPU_ROWS, "GPU tier row"), default=",".join(GPU_ROWS),
                    help="GPU tier rows, comma-separated (gpu_measure trains these three)")
    ap.add_argument("--gpu-batch", type=int_list(1), default=[4, 8],
                    help="GPU tier batch sizes, comma-separated (two or more: the per-sample slope)")
    ap.add_argument("--gpu-attention", type=name_list(ATTENTION, "SDPA backend"), default=list(ATTENTION),
                    help="the SDPA backends each GPU step runs under (default: what torch picks, math, efficient)")
    ap.add_argument("--json", "--out", dest="json", type=json_target, default=None,
                    help="write the results as JSON to PATH, or '-' for stdout (the published run: "
                         "benchmarks/results/planner_validate.json)")
    return ap


def _gpu_row(name: str, row: str, bs: int, args, attention: str) -> dict:
    try:
        return gpu_measure(name, row, bs, args.seq_len, args.tgt_len, attention)
    except (torch.OutOfMemoryError, RuntimeError) as exc:  # (RuntimeError: no kernel of the forced backend fits)
        torch.cuda.empty_cache()
        return {"model": name, "row": row, "attention": attention, "batch": bs,
                "error": f"{type(exc).__name__}: {exc}"[:200]}


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    info = hardware()
    print(hardware_line(info))
    models = args.models  # (each checked by model_list, before any work)
    batches = args.batches
    result = {**provenance("benchmarks.t5.planner_validate", argv, info), "seq_len": args.seq_len,
              "tgt_len": args.tgt_len}

    params = [cpu_params(m) for m in models]
    print("\nparameter counts (tied weights once)")
    print_table(params, ["model", "planner", "real_model", "equal"])
    engine = [r for m in models for r in cpu_engine(m)]
    print("\noffload host bytes: planner vs OffloadAdam arena (CPU, bf16, bucket 1M, tile 64K)")
    print_table(engine, ["model", "row", "planner_host_bytes", "engine_arena_nbytes", "equal"])
    print(f"\nactivation peak of one forward + backward (seq {args.seq_len}, tgt {args.tgt_len}), "
          "real CPU step vs prediction")
    acts = [r for m in models for r in cpu_activations(m, batches, args.seq_len, args.tgt_len)]
    print_table(acts, ["model", "mode", "batch", "grads", "measured_MiB", "traced_MiB", "traced_err_%",
                       "fp32_halved_MiB", "fp32_halved_err_%"])
    result.update(params=params, engine=engine, activations=acts)

    if args.gpu:
        if not torch.cuda.is_available():
            print("--gpu: no CUDA device; GPU tier skipped", file=sys.stderr)
        else:
            gpu = []
            for m in args.gpu_models:
                for row in args.gpu_rows:
                    for attention in args.gpu_attention:
                        for bs in args.gpu_batch:
                            gpu.append(_gpu_row(m, row, bs, args, attention))
            print("\nGPU: torch.cuda.max_memory_allocated vs planner device bytes at the batch size")
            print_table(gpu, ["model", "row", "attention", "batch", "measured_GiB", "planned_GiB", "err_%", "error"])
            slopes = per_sample(gpu)
            traced = {m: traced_per_sample(trace.load_config(model_config(m)), args.seq_len, args.tgt_len)
                      for m in {r["model"] for r in slopes}}  # (once per model: rows and backends share its trace)
            for r in slopes:
                r.update(traced[r["model"]])
            print("\nGPU: GiB of activations per sample, measured (slope) vs traced (as planned; CUDA's kernels)")
            print_table(slopes, ["model", "row", "attention", "measured_GiB_per_sample", *TRACES])
            result["gpu_per_sample"] = slopes
            result["gpu"] = gpu
    write_json(args.json, result)
    if args.json not in (None, "-"):
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    with json_stdout():
        code = main()
    sys.exit(code)
