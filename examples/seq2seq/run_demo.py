#!/usr/bin/env python
"""``make demo``: train a small randomly initialised T5 on a SYNTHETIC toy translation corpus, offline, on CPU or GPU.

1. Writes the synthetic corpus (examples/seq2seq/synthetic_data.py) to output/demo_data, unless it is there.
2. Runs examples/seq2seq/finetune_trainer.py with configs/models/t5-demo.json (random init, a SentencePiece tokenizer
   trained on the fly), ``--zero_offload configs/ds_config_1gpu.json``, training + generate-eval (BLEU).
   Validation BLEU is also measured every 300 steps (3 times), for the curve.
3. Prints the metrics, checks that output/demo/all_results.json exists and draws output/demo/curves.png (training
   loss, validation loss and BLEU per step; plot_curves.py), named in the last line.

Progress: a tqdm bar on a terminal; otherwise (a pipe, CI) one line per logging step with the step count and the
time left (finetune_trainer.py's StepProgressCallback).

``--smoke`` runs the same steps at toy sizes (a few training steps) for the test suite. The corpus is synthetic: the
BLEU it reports says that the pipeline learns, nothing about real translation quality.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import example_cli  # noqa: E402
import plot_curves  # noqa: E402
import synthetic_data  # noqa: E402

# what the demo's two steps import: finetune_trainer.py (run by this same Python) and the plot at the end, which
# came after minutes of training when matplotlib was missing
NEEDS = ("torch", "transformers", "accelerate", "safetensors", "sentencepiece", "sacrebleu", "hf_zero_offload",
         "matplotlib")

# Full demo: sized so that it finishes in well under 5 minutes on a 2-core CPU and BLEU rises clearly from ~0.
# (Measured: the legacy --sortish_sampler slows convergence on this toy task a lot, 38 vs 62 BLEU, so it is off;
# the DeepSpeed-style WarmupLR of ds_config_1gpu.json keeps the lr constant after warm-up: 1e-3 beat 3e-3.)
FULL = dict(n_train=5000, n_val=200, n_test=200, epochs=6, train_bs=32, eval_bs=100, lr=1e-3, warmup=100,
            max_steps=None, eval_steps=300, logging_steps=25)
# Smoke: the same pipeline in seconds (one evaluation during training, so the curve has a BLEU point to draw).
SMOKE = dict(n_train=64, n_val=16, n_test=16, epochs=1, train_bs=8, eval_bs=16, lr=3e-3, warmup=0, max_steps=6,
             eval_steps=3, logging_steps=2)
# What `make demo` costs, measured (docs/RESULTS.md, "Demo"); printed at the start so a slow machine is not mistaken for a hang.
EXPECTED = ("about 2 min on an idle 2-core CPU; 25 min measured with other jobs keeping the 2 cores busy (load "
            "average 7); 80 s on one H200 with 16 cores")


def build_command(data_dir: str, output_dir: str, sizes: dict, model_config: str, use_gpu: bool) -> list:
    cmd = [
        sys.executable, os.path.join(HERE, "finetune_trainer.py"),
        "--config_name", model_config,
        "--data_dir", data_dir,
        "--task", "translation_en_to_ro",
        "--output_dir", output_dir,
        "--overwrite_output_dir",
        "--do_train", "--do_eval",
        "--predict_with_generate",
        "--zero_offload", os.path.join(ROOT, "configs", "ds_config_1gpu.json"),
        "--n_train", str(sizes["n_train"]), "--n_val", str(sizes["n_val"]),
        "--max_source_length", "64", "--max_target_length", "64",
        "--val_max_target_length", "64", "--test_max_target_length", "64",
        "--per_device_train_batch_size", str(sizes["train_bs"]),
        "--per_device_eval_batch_size", str(sizes["eval_bs"]),
        "--learning_rate", str(sizes["lr"]),
        "--warmup_steps", str(sizes["warmup"]),
        "--num_train_epochs", str(sizes["epochs"]),
        "--eval_beams", "1",
        "--logging_steps", str(sizes["logging_steps"]),
        "--save_strategy", "no",
        "--report_to", "none",
        "--seed", "42",
    ]
    # a bar on a terminal; in a log, step/ETA lines (a bar redrawn with carriage returns is unreadable there)
    cmd += ["--disable_tqdm", "false" if sys.stdout.isatty() else "true"]
    cmd += ["--eval_strategy", "steps", "--eval_steps", str(sizes["eval_steps"])]  # BLEU points for the curve
    if sizes.get("max_steps"):
        cmd += ["--max_steps", str(sizes["max_steps"])]
    if use_gpu:
        cmd += ["--fp16"]
    else:
        cmd += ["--use_cpu"]
        from hf_zero_offload.launch_checks import cpu_has_native_bf16  # the library's rule (imports torch)

        if cpu_has_native_bf16():  # True only where known (None: unknown, stay in fp32)
            cmd += ["--bf16"]  # ~1.2x faster than fp32 for t5-demo on a 2-core Zen 5 (no gain on an Intel model 167)
    return cmd


def interrupted(data_dir: str | None = None) -> None:
    """Ctrl-C: one line and 130, as finetune_trainer.py says its own (run_demo.py died in a KeyboardInterrupt
    traceback under the child's line). The demo saves no checkpoint: `make demo` starts again, its data kept."""
    kept = f" (its data in {data_dir} is kept)" if data_dir and os.path.isdir(data_dir) else ""
    sys.stderr.write(f"[demo] interrupted: make demo starts again from the first step{kept}\n")
    raise SystemExit(130)


def run_child(cmd: list, env: dict, data_dir: str) -> int:
    """finetune_trainer.py's exit status. A Ctrl-C reaches the child too (one process group): wait for it to say
    its line and end, then say ours (a second Ctrl-C stops it at once)."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait()
        except KeyboardInterrupt:
            proc.kill()
            proc.wait()
        interrupted(data_dir)


def main(argv=None) -> dict:
    p = example_cli.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="toy sizes and 6 training steps (for tests)")
    p.add_argument("--output_root", default=os.path.join(ROOT, "output"),
                   help="where demo_data/ and demo/ go (demo_smoke_data/ and demo_smoke/ with --smoke; "
                        "default: ./output)")
    p.add_argument("--model_config", default=os.path.join(ROOT, "configs", "models", "t5-demo.json"))
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when CUDA is available")
    a = p.parse_args(argv)
    example_cli.require("run_demo.py", NEEDS)  # before any data is written

    t0 = time.time()
    if not a.smoke:
        print(f"[demo] expected time: {EXPECTED}", flush=True)
    sizes = SMOKE if a.smoke else FULL
    tag = "demo_smoke" if a.smoke else "demo"
    data_dir = os.path.join(a.output_root, f"{tag}_data")
    output_dir = os.path.join(a.output_root, tag)
    if all(os.path.isfile(os.path.join(data_dir, f"{s}.{e}")) for s in ("train", "val", "test")
           for e in ("source", "target")):
        print(f"[demo] synthetic data already in {data_dir}")
    else:
        synthetic_data.write_corpus(data_dir, sizes["n_train"], sizes["n_val"], sizes["n_test"], seed=0)
        print(f"[demo] wrote synthetic data to {data_dir}")

    use_gpu = False
    if not a.cpu:
        try:
            import torch

            use_gpu = torch.cuda.is_available()
        except ImportError:
            pass
    cmd = build_command(data_dir, output_dir, sizes, a.model_config, use_gpu)
    print("[demo] " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd), flush=True)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    rc = run_child(cmd, env, data_dir)
    if rc:
        raise SystemExit(f"[demo] FAILED: finetune_trainer.py exited with {rc} (its message is above)")

    results_path = os.path.join(output_dir, "all_results.json")
    if not os.path.isfile(results_path):
        raise SystemExit(f"[demo] FAILED: {results_path} was not written")
    with open(results_path) as f:
        metrics = json.load(f)
    print(f"[demo] {results_path}:")
    for key in ("train_loss", "train_runtime", "train_samples_per_second", "val_loss", "val_bleu", "val_gen_len",
                "val_runtime", "train_peak_host_rss_bytes", "train_peak_device_mem_bytes"):
        print(f"[demo]   {key:28s} {metrics.get(key)}")
    png = plot_curves.plot(output_dir)
    print(f"[demo] done in {time.time() - t0:.1f} s (synthetic data: BLEU shows the pipeline learns, nothing more)")
    print(f"[demo] loss and BLEU curves: {os.path.relpath(png, ROOT) if png.startswith(ROOT + os.sep) else png}")
    return metrics


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # (while writing the data or drawing the curves)
        interrupted()
