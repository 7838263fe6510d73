"""Peak host RSS of a real Trainer run with fp32 vs compact Adam moments (offload_optimizer.state_dtype).

    python -m benchmarks.engine.compact_rss [--model configs/models/t5-large.json] [--dtypes fp32,int8]
        [--steps 3] [--min-free-gib 18] [--json PATH|-]

(run from the repository root). Each state dtype is one process, one after the other (never two at
once: the machine may be shared): examples/seq2seq/finetune_trainer.py with a random-init model
from ``--model``, ``--zero_offload`` = configs/ds_config_1gpu.json with the state dtype set, on the
CPU in bf16, batch 2, 32 source / 16 target tokens, ``--steps`` steps, on the synthetic corpus. The
peak is the run's own ``train_peak_host_rss_bytes`` (ru_maxrss: model, optimizer arena,
activations, Python/torch/transformers). A run starts only when ``--min-free-gib`` GiB are available.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (hardware, hardware_line, json_stdout, json_target, load_example,  # noqa: E402
                               model_config, name_list, nonnegative_float, positive_int, print_table, provenance,
                               write_json)

SCRIPT = os.path.join(ROOT, "examples", "seq2seq", "finetune_trainer.py")


def ds_config(path: str, state_dtype: str) -> str:
    with open(os.path.join(ROOT, "configs", "ds_config_1gpu.json")) as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["offload_optimizer"]["state_dtype"] = state_dtype
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def run_one(state_dtype: str, args, work: str) -> dict:
    import psutil

    free = psutil.virtual_memory().available / 2**30
    if free < args.min_free_gib:
        return {"state_dtype": state_dtype, "skipped": f"only {free:.1f} GiB available (< {args.min_free_gib})"}
    out = os.path.join(work, f"out_{state_dtype}")
    cmd = [sys.executable, SCRIPT, "--config_name", args.model, "--data_dir", os.path.join(work, "data"),
           "--task", "translation_en_to_ro", "--output_dir", out, "--overwrite_output_dir", "--do_train",
           "--zero_offload", ds_config(os.path.join(work, f"ds_{state_dtype}.json"), state_dtype),
           "--n_train", "64", "--max_source_length", "32", "--max_target_length", "16",
           "--per_device_train_batch_size", "2", "--max_steps", str(args.steps), "--learning_rate", "1e-4",
           "--use_cpu", "--bf16", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
           "--logging_steps", "1", "--seed", "42"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"state_dtype": state_dtype, "error": proc.stderr[-2000:]}
    with open(os.path.join(out, "all_results.json")) as f:
        res = json.load(f)
    return {"state_dtype": state_dtype, "peak_rss_GB": res["train_peak_host_rss_bytes"] / 1e9,
            "train_loss": res.get("train_loss"), "train_runtime_s": res.get("train_runtime")}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=model_config, default=model_config("t5-large"),
                    help="a name of configs/models/ or a config JSON")
    ap.add_argument("--dtypes", type=name_list(("fp32", "bf16", "int8"), "state dtype"), default="fp32,int8",
                    help="state dtypes, one Trainer run each")
    ap.add_argument("--steps", type=positive_int, default=3, help="optimizer steps per run")
    ap.add_argument("--min-free-gib", type=nonnegative_float, default=18.0,
                    help="start a run only with this many GiB available (0: always)")
    ap.add_argument("--json", type=json_target, default=None, help="write the results as JSON to PATH (- for stdout)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    info = hardware()
    print(hardware_line(info), flush=True)
    with tempfile.TemporaryDirectory(prefix="hzo_rss_") as work:
        load_example("synthetic_data").write_corpus(os.path.join(work, "data"), 64, 8, 8, seed=0)
        rows = []
        for sd in args.dtypes:
            rows.append(run_one(sd, args, work))
            print(rows[-1], flush=True)
    ok = {r["state_dtype"]: r["peak_rss_GB"] for r in rows if "peak_rss_GB" in r}
    for r in rows:
        if "peak_rss_GB" in r and "fp32" in ok:
            r["vs_fp32"] = r["peak_rss_GB"] / ok["fp32"]
    print(f"{os.path.basename(args.model)}, Trainer on CPU, bf16, batch 2, 32/16 tokens, {args.steps} steps:")
    print_table([r for r in rows if "peak_rss_GB" in r],
                [("state_dtype", "state_dtype", "s"), ("peak_rss_GB", "peak RSS GB", ".2f"),
                 ("vs_fp32", "vs fp32", ".3f"), ("train_loss", "train loss", ".4f"),
                 ("train_runtime_s", "train s", ".0f")])
    write_json(args.json, {**provenance("benchmarks.engine.compact_rss", argv, info), "args": vars(args),
                           "runs": rows})
    return 0


if __name__ == "__main__":
    with json_stdout():
        code = main()
    sys.exit(code)
