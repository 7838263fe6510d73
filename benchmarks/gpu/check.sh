#!/usr/bin/env bash
# The ONE prepared GPU check for hf_zero_offload. Run it, from the repository root, on a machine with a
# CUDA GPU (written for one H200 with a 15-minute device budget; this script stays under 9 minutes):
#
#     bash benchmarks/gpu/check.sh            # results go to $OUT (the device tool copies $OUT back)
#
# What it does, in order; every step has its own `timeout`, a failing step never stops the next one,
# and a summary of all steps is printed at the end (also written to $OUT/summary.txt):
#   1. install       pip install --no-build-isolation --no-deps --no-index -e .  (compiles the C++ kernels;
#                    the image already has torch, pybind11, scikit-build-core, cmake; nothing is downloaded)
#   2. hardware      the hardware line (CPU, cores, RAM, torch, SIMD level of the build, GPU) -> $OUT/hardware.json
#   3. cuda tests    (a cuda_device step first: it fails where no CUDA device is usable, as on a CPU with SMALL=1,
#                    since the tests would all skip and pytest say ok) pytest -m cuda on every test file with a
#                    cuda-marked test or conftest's `mode` fixture (every cuda-marked test; GPU parity with torch
#                    AdamW, gradient accumulation, clipping, fp16 overflow, DPU, resume, the stream-race
#                    test, gradient memory bounded by the buckets, pinned arena; close/replacement giving back the
#                    device buffers and the pinning, adapt_accelerator on CUDA, a model moved after the build).
#                    An image without pytest
#                    (session 29's H200 had it) installs it from wheels carried in .gpu_wheels/ (`make gpu-wheels` here, then
#                    carry ".gpu_wheels")                                         -> $OUT/cuda_tests.log
#   4. offload step  benchmarks/engine/offload_step.py, CUDA memory capped at 24 GiB
#                    (torch.cuda.set_per_process_memory_fraction), two sizes:
#                      500M params bf16: every row fits, so the step-time ratios vs no offload are meaningful
#                      1B params bf16:   no-offload may run out of memory under the cap (that is the point)
#                      1B again, rows b,c with --blocking_waits (host waits sleep: an A/B of the spinning default)
#                      2M params bf16:   the offload path's fixed cost per step (no cap needed)
#                    each offload row also says where its step time goes (rows.PhaseClock)
#                                                                                  -> $OUT/offload_step_gpu_*.json
#   5. adam step     benchmarks/kernel/adam_step.py: the host CPU Adam of the GPU machine  -> $OUT/adam_step_gpu_host.json
#   6. demo          examples/seq2seq/run_demo.py (make demo's job) on the GPU       -> $OUT/demo_results.json
#   7. t5-3b         benchmarks/t5/table.py --t5_3b_recipe, ZeRO-2 + offload at batch 9 under 24 GiB, on
#                    a synthetic corpus of full-length lines (the planner's largest batch)  -> $OUT/t5/
#   8. planner       benchmarks/t5/planner_validate.py --gpu: planned vs measured device peak of t5-3b with ZeRO-2
#                    + offload at batch 4 and 8, SDPA as torch picks it and forced to math: the per-sample slope
#                    against the trace's, as planned and with CUDA's kernels  -> $OUT/planner_validate_gpu.json
#
# Knobs (environment): OUT (default ./gpu_out), PY (default python3 if it has torch, else python),
# SKIP_INSTALL=1 (package already built), SMALL=1 (tiny sizes: a smoke test of this script on any machine),
# BUDGET_S (default 515: steps are cut short so the whole script ends inside it), TAR=FILE (all of $OUT in one
# archive). Session 29's H200 run took 116 s for steps 1-5 (the demo 80 s and a t5-3b row 89 s by hand after it):
#     TAR=$OUT/gpu_out.tgz OUT=/tmp/g bash benchmarks/gpu_check.sh     (TAR in the device tool's own $OUT)

set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PY:-$(command -v python3 >/dev/null && python3 -c 'import torch' 2>/dev/null && echo python3 || echo python)}"
BUDGET_S="${BUDGET_S:-515}"
START=$(date +%s)
SUMMARY=()
export PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

# run NAME LIMIT_S CMD...: runs CMD under `timeout`, never longer than what is left of the budget; its output
# goes to $OUT/NAME.log and to the console; the outcome goes into the summary.
run() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) - 5 ))
  if (( left < 15 )); then
    SUMMARY+=("$(printf '%-22s SKIPPED (time budget spent)' "$name")")
    return
  fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit}s): $*"
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  local what="ok"
  (( rc == 124 || rc == 137 )) && what="TIMED OUT"
  (( rc != 0 && rc != 124 && rc != 137 )) && what="FAILED"
  SUMMARY+=("$(printf '%-22s %-9s rc=%-3s %4ss' "$name" "$what" "$rc" "$dt")")
}

WORK=$(mktemp -d)  # the demo's and the t5 run's models and data: never in $OUT (the device tool returns 8 files)
if [[ "${SMALL:-0}" == 1 ]]; then
  SIZE_A=(--params 4e6 --tokens 64 --steps 3); SIZE_B=(--params 8e6 --tokens 64 --steps 3); ADAM=(--numel 2000000 --rounds 3)
  SIZE_C=(--params 5e5 --tokens 64 --steps 3)
  DEMO=(--smoke); T5=(--smoke --rows zero2_offload --max_steps 2)
else
  SIZE_A=(--params 5e8 --tokens 4096 --steps 6); SIZE_B=(--params 1e9 --tokens 2048 --steps 5); ADAM=(--numel 50000000 --rounds 8)
  SIZE_C=(--params 2e6 --tokens 2048 --steps 20)
  DEMO=(); T5=(--t5_3b_recipe --rows zero2_offload --no-find_max_bs --batch_size 9 --max_steps 3
               --no_predict_with_generate --n_train 40 --n_val 8)
fi


# 1. build + install the package in place (no downloads: --no-index; build deps come from the image)
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  run install 170 "$PY" -m pip install --no-build-isolation --no-deps --no-index -e .
fi
# 2. hardware, after the build (its SIMD level reads the compiled module; nvidia-smi needs no Python package)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv > "$OUT/nvidia_smi.csv" 2>&1
run hardware 30 "$PY" -m benchmarks.gpu.check hardware --json "$OUT/hardware.json"
run import 30 "$PY" -c "import hf_zero_offload, hf_zero_offload._C as c; from hf_zero_offload import ops; print('simd', ops.simd_level(), ops.available_simd_levels())"

# 3. the CUDA tests (pytest's -m overrides the default "not slow and not cuda" from pyproject.toml); without a
# usable CUDA device they would all skip and pytest would say "ok": a step of its own fails then
run cuda_device 60 "$PY" -c "import sys, torch; ok = torch.cuda.is_available(); print('cuda', ok, torch.version.cuda, \
torch.cuda.get_device_name(0) if ok else ''); sys.exit(0 if ok else 1)"
if ! "$PY" -c "import pytest" 2>/dev/null; then
  run install_pytest 60 "$PY" -m pip install --no-index --find-links .gpu_wheels pytest pytest-timeout
fi
# every file with a cuda-marked test or a test taking conftest's `mode` (whose cuda case is marked): a list written
# out by hand missed the files split off later (session 40: test_engine_dpu*.py's cuda cases had not run)
CUDA_FILES=$(grep -lzP 'mark\.cuda|def test_\w+\([^)]*\bmode\b' tests/test_*.py | tr '\0\n' '  ')
run cuda_tests 170 "$PY" -m pytest -m cuda -q -rsx -p no:cacheprovider $CUDA_FILES

# 4. one training step with and without offload (JSON per size); 24 GiB CUDA cap
run offload_step_500m 120 "$PY" -m benchmarks.engine.offload_step "${SIZE_A[@]}" --dtype bf16 --gpu_mem_gib 24 --rows a,b,c,d \
  --json "$OUT/offload_step_gpu_500m.json"
run offload_step_1b 150 "$PY" -m benchmarks.engine.offload_step "${SIZE_B[@]}" --dtype bf16 --gpu_mem_gib 24 --rows a,b,c,d \
  --json "$OUT/offload_step_gpu_1b.json"
# the same rows with host waits that sleep instead of spinning (a spinning wait holds a core the CPU Adam runs on)
run offload_step_1b_blocking 120 "$PY" -m benchmarks.engine.offload_step "${SIZE_B[@]}" --dtype bf16 --gpu_mem_gib 24 \
  --rows b,c --blocking_waits --json "$OUT/offload_step_gpu_1b_blocking.json"
# DPU with one core left to the thread that launches the device's work (session 40's H100: with all 16 cores in the
# CPU Adam the delayed row's forward+backward took 99 ms instead of 56)
run offload_step_1b_dpu_threads 90 "$PY" -m benchmarks.engine.offload_step "${SIZE_B[@]}" --dtype bf16 --gpu_mem_gib 24 \
  --rows b,c --threads $(( $(nproc) > 1 ? $(nproc) - 1 : 1 )) --json "$OUT/offload_step_gpu_1b_dpu_threads.json"
# a tiny model: the offload path's fixed cost per step (the demo's 1.2M-param T5 took ~45 ms a step on the H200)
run offload_step_2m 60 "$PY" -m benchmarks.engine.offload_step "${SIZE_C[@]}" --dtype bf16 --rows a,b,c \
  --json "$OUT/offload_step_gpu_2m.json"

# 5. the host-side CPU Adam of this machine (no GPU involved)
if [[ -f benchmarks/kernel/adam_step.py ]]; then
  run adam_step 60 "$PY" -m benchmarks.kernel.adam_step "${ADAM[@]}" --json "$OUT/adam_step_gpu_host.json"
elif [[ -f benchmarks/adam_step.py ]]; then  # before its move into benchmarks/kernel/
  run adam_step 60 "$PY" benchmarks/adam_step.py "${ADAM[@]}" --json "$OUT/adam_step_gpu_host.json"
else
  SUMMARY+=("$(printf '%-22s SKIPPED (benchmarks/kernel/adam_step.py missing)' adam_step)")
fi

# 6. make demo's job on the GPU (its metrics and curves only; the model stays in $WORK)
run demo 150 "$PY" examples/seq2seq/run_demo.py "${DEMO[@]}" --output_root "$WORK/demo"
cp "$WORK"/demo/demo*/all_results.json "$OUT/demo_results.json" 2>/dev/null
cp "$WORK"/demo/demo*/curves.png "$OUT/demo_curves.png" 2>/dev/null

# 7. t5-3b, the blog's single-GPU recipe at the planner's largest batch (9 at 128/128 tokens under 24 GiB), on a
# corpus whose every line fills the 128 tokens (the first GPU run's short sentences measured only the weights)
run t5_corpus 60 "$PY" -m benchmarks.gpu.check long_corpus "$WORK/long"
run t5_3b 240 "$PY" -m benchmarks.t5.table "${T5[@]}" --data_dir "$WORK/long" --gpu_mem_gib 24 --keep_logs \
  --out_dir "$OUT/t5"

# 8. the planner against real CUDA steps (its GPU tier had never run): session 40's t5-3b recipe rows measured 1.42
# GiB of activations per sample where the planner plans 1.81, so its largest batch (9) was 12 measured
run planner_gpu 200 "$PY" -m benchmarks.t5.planner_validate --models t5-tiny --batches 2 --gpu \
  --gpu-models t5-3b --gpu-rows zero2_offload --gpu-attention default,math --gpu-batch 4,8 \
  --json "$OUT/planner_validate_gpu.json"

# summary: every step's outcome, then the measured targets
{
  echo
  echo "=== gpu_check summary ($(( $(date +%s) - START ))s of ${BUDGET_S}s budget) ==="
  [[ -f "$OUT/hardware.log" ]] && head -n 1 "$OUT/hardware.log"
  [[ -f "$OUT/nvidia_smi.csv" ]] && tail -n +2 "$OUT/nvidia_smi.csv"
  printf '%s\n' "${SUMMARY[@]}"
  [[ -f "$OUT/cuda_tests.log" ]] && grep -E "passed|failed|skipped|error|FAILED|XFAIL|XPASS" "$OUT/cuda_tests.log" | tail -n 25
  "$PY" -m benchmarks.gpu.check summary "$OUT" 2>&1
  [[ -f "$OUT/t5_3b.log" ]] && grep -E "^\| " "$OUT/t5_3b.log"
  echo "files in $OUT:"; ls -1 "$OUT"
} 2>&1 | tee "$OUT/summary.txt"
rm -rf "$WORK"
# TAR=FILE: everything in $OUT as one archive (the device tool brings back at most 8 files from its $OUT)
[[ -n "${TAR:-}" ]] && tar czf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")"
