#!/usr/bin/env python
"""The HF blog's t5 table ("Fit More and Train Faster With ZeRO via DeepSpeed and FairScale", Jan 2021), rerun.

    python -m benchmarks.t5.table                     # CPU: t5-demo, 2 gloo processes, scaled-down arguments
    python -m benchmarks.t5.table --model configs/models/t5-large.json --data_dir wmt_en_ro   # GPU: the blog's run
    python -m benchmarks.t5.table --t5_3b_recipe      # GPU: t5-3b on one 24 GiB-capped GPU (ZeRO-2 + offload)
    python -m benchmarks.t5.table --smoke --out_dir /tmp/x   # 3 one-process rows on t5-tiny, seconds (tests)

Each row is one run of ``examples/seq2seq/finetune_trainer.py`` in a subprocess (``python -m
torch.distributed.run --nproc_per_node N`` for the multi-process rows; ``--use_cpu --ddp_backend gloo`` on CPU) with
the blog's arguments, scaled by the flags below. ``train_runtime`` / ``val_runtime`` and the peak memory come from
the run's ``all_results.json`` (rank 0's numbers): ``torch.cuda.max_memory_allocated`` on a GPU, the peak RSS of the
rank-0 process on CPU.

Rows (the blog's six, plus the paper's delayed parameter update):

    baseline           plain fp32 (torch AdamW; DDP when N > 1)
    half               --fp16 (--bf16 on CPU): torch autocast, fp32 model
    sharded_ddp        --sharded_ddp, ZeRO stage --sharded_stage (default 1: optimizer states sharded, the planner's
                       "sharded_stage1" rows), no offload, fp32
    sharded_ddp_half   the same with --fp16 (--bf16): the engine's 16-bit model with fp32 master shards
    zero2              --zero_offload configs/ds_config_zero2.json --fp16 (ZeRO-2, no offload)
    zero2_offload      --zero_offload configs/ds_config.json (N > 1) / ds_config_1gpu.json (N = 1) --fp16
    zero2_offload_dpu  the zero2_offload config + "delayed_param_update": {"enabled": true, "warmup_steps": W}

Largest batch size: on a GPU (default there, ``--find_max_bs``) every row is probed with short train-only runs
(``--probe_steps`` optimizer steps; ``--sortish_sampler`` puts the longest batch first, so the probe sees the worst
padding) under ``--gpu_mem_gib`` (default 24) enforced in the training process by
``torch.cuda.set_per_process_memory_fraction`` (a generated launcher script reads HZO_GPU_MEM_GIB, then runs
finetune_trainer.py); a probe that fails with CUDA out-of-memory means "does not fit". The search starts at
hf_zero_offload.planner's predicted largest batch, gallops up/down by 1.5x and bisects until the first failing size is
within ``--bs_rel_tol`` (5 %) of the last passing one (``--bs_multiple`` rounds the probed sizes). The table row is then
one full run at the batch size found (10 % lower, up to ``--final_oom_retries`` times, if that full run runs out of
memory). On CPU the search is off by default and
every row uses ``--batch_size``; ``--find_max_bs --host_mem_gib G`` caps each process's address space with
RLIMIT_AS instead (virtual, not resident memory: a coarse cap).

Outputs in ``--out_dir`` (default benchmarks/results/): ``t5_table_{cpu|gpu}.json`` (rows, settings, hardware line,
command, load averages), ``.md`` (the table, with the blog's numbers below it) and ``.png`` (matplotlib, Agg);
``--smoke`` writes ``t5_table_smoke.*``; ``--t5_3b_recipe`` writes ``t5_3b_recipe_gpu.*``. Per-run logs go to a
temporary folder (``--keep_logs`` keeps them under the output folder); a failing row keeps its command and the tail
of its log in the JSON, the other rows still run, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import os
import runpy
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List


# The parts, one module each: rows and running one (runs), the batch-size search (bs_search), the outputs
# (report). The names tests/test_t5_table.py uses stay importable from here.
from benchmarks._common import (existing_dir, model_config, name_list, nonnegative_float, nonnegative_int,  # noqa: E402
                               output_dir, positive_float, positive_int, provenance, write_json)
from benchmarks.t5.bs_search import find_max_bs, planner_guesses, round_bs  # noqa: E402
from benchmarks.t5.report import BLOG_T5_3B, BLOG_T5_LARGE, chart, combine, fmt, markdown, params_m  # noqa: E402
from benchmarks.t5.runs import CONFIGS, ROOT, ROW_NAMES, SCRIPT, RowSpec, Runner, build_rows  # noqa: E402,F401  (SCRIPT: tests)

SYNTH = os.path.join(ROOT, "examples", "seq2seq", "synthetic_data.py")


# ----------------------------------------------------------------------------------------------------------------------
# main


def _model_path(name: str) -> str:
    """--model: a name of configs/models/ or a config JSON (checked before any run), made absolute."""
    return os.path.abspath(model_config(name))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=_model_path, default=None,
                    help="a name of configs/models/ or a config JSON (random init). Default: t5-large on GPU, "
                         "t5-demo on CPU, t5-tiny with --smoke")
    ap.add_argument("--data_dir", type=existing_dir, default=None,
                    help="legacy layout (train|val.source/.target); default: a SYNTHETIC corpus from "
                         "synthetic_data.py in a temp dir")
    ap.add_argument("--out_dir", type=output_dir, default=os.path.join(ROOT, "benchmarks", "results"),
                    help="where the JSON, markdown and PNG go (created)")
    ap.add_argument("--nproc", type=positive_int, default=None,
                    help="processes for the multi-process rows (default: min(2, GPUs) on GPU, 2 on CPU)")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="OMP_NUM_THREADS per process (default: cores / procs with a GPU, 1 on CPU)")
    ap.add_argument("--rows", type=name_list(ROW_NAMES, "row"), default=None,
                    help=f"comma-separated subset of the rows: {','.join(ROW_NAMES)}")
    for flag, what in (("--n_train", "training examples"), ("--n_val", "validation examples"),
                       ("--max_source_length", "source tokens"), ("--max_target_length", "target tokens"),
                       ("--val_max_target_length", "target tokens in evaluation")):
        ap.add_argument(flag, type=positive_int, default=None, help=f"{what} (default: the mode's)")
    ap.add_argument("--num_train_epochs", type=positive_float, default=1.0)
    ap.add_argument("--max_steps", type=positive_int, default=None, help="instead of --num_train_epochs")
    ap.add_argument("--eval_beams", type=positive_int, default=None,
                    help="default 4 (the blog's t5 setting); 2 with --smoke")
    ap.add_argument("--no_predict_with_generate", dest="predict_with_generate", action="store_false",
                    help="evaluate the loss only (default: generate with beam search, as the blog)")
    ap.add_argument("--no_freeze_embeds", dest="freeze_embeds", action="store_false")
    ap.add_argument("--learning_rate", type=positive_float, default=3e-5)
    ap.add_argument("--warmup_steps", type=nonnegative_int, default=None,
                    help="default 500 on GPU (the blog), 4 on CPU")
    ap.add_argument("--seed", type=int, default=42, help="any integer")
    ap.add_argument("--batch_size", type=positive_int, default=None,
                    help="per-process batch size when not searching (default 16 on CPU, the blog's baseline 16 on "
                         "GPU); the search's start when the planner has no guess")
    ap.add_argument("--eval_batch_size", type=positive_int, default=None, help="default: the train batch size")
    ap.add_argument("--sharded_stage", type=int, choices=(1, 2), default=1,
                    help="ZeRO stage of the --sharded_ddp rows (1 = optimizer states only, as the planner's rows)")
    ap.add_argument("--dpu_warmup_steps", type=nonnegative_int, default=None,
                    help="steps before DPU starts (default: 40 on GPU as the paper, 10 on CPU)")
    ap.add_argument("--find_max_bs", action=argparse.BooleanOptionalAction, default=None,
                    help="search the largest batch per row (default on with a GPU, off on CPU)")
    ap.add_argument("--gpu_mem_gib", type=nonnegative_float, default=24.0, help="per-process GPU memory cap (0: none)")
    ap.add_argument("--host_mem_gib", type=positive_float, default=None, help="CPU search: RLIMIT_AS per process")
    ap.add_argument("--bs_multiple", type=positive_int, default=1, help="probe batch sizes in multiples of this")
    ap.add_argument("--max_bs", type=positive_int, default=1024)
    ap.add_argument("--bs_rel_tol", type=nonnegative_float, default=0.05,
                    help="stop bisecting when the failing size is within this fraction of the passing one")
    ap.add_argument("--final_oom_retries", type=nonnegative_int, default=2,
                    help="when the full run at the size found runs out of memory, retry this often 10 %% lower")
    ap.add_argument("--probe_steps", type=positive_int, default=3, help="optimizer steps of a train-only probe run")
    ap.add_argument("--run_timeout", type=positive_float, default=3600.0, help="seconds before a run is killed")
    ap.add_argument("--repeat", type=positive_int, default=1,
                    help="full runs per row, in round-robin rounds; the table shows the median (ranges in the JSON)")
    ap.add_argument("--t5_3b_recipe", action="store_true",
                    help="the blog's single-GPU t5-3b run (GPU only) instead of the table")
    ap.add_argument("--force", action="store_true", help="run --t5_3b_recipe without a GPU anyway")
    ap.add_argument("--smoke", action="store_true", help="t5-tiny, 3 steps, 3 one-process rows (tests)")
    ap.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is present")
    ap.add_argument("--keep_logs", action="store_true", help="copy the per-run logs to OUT_DIR/t5_table_logs/")
    ap.add_argument("--keep_run_dirs", action="store_true", help="keep each run's output_dir (models) in the temp dir")
    ap.add_argument("extra_args", nargs=argparse.REMAINDER,
                    help="after --: passed to every finetune_trainer.py run")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    if a.extra_args and a.extra_args[0] == "--":
        a.extra_args = a.extra_args[1:]
    return a


def _defaults(a: argparse.Namespace, cuda: bool) -> None:
    if a.smoke:
        d = dict(model="configs/models/t5-tiny.json", n_train=32, n_val=8, max_source_length=32, max_target_length=32,
                 val_max_target_length=8, warmup_steps=1, batch_size=8, dpu_warmup_steps=1, nproc=1, eval_beams=2)
        a.max_steps = a.max_steps or 3
        a.rows = a.rows or ["baseline", "zero2_offload", "zero2_offload_dpu"]
    elif a.t5_3b_recipe:
        d = dict(model="configs/models/t5-3b.json", n_train=60, n_val=10, max_source_length=128, max_target_length=128,
                 val_max_target_length=128, warmup_steps=500, batch_size=20, dpu_warmup_steps=40, nproc=1, eval_beams=4)
    elif cuda:
        d = dict(model="configs/models/t5-large.json", n_train=2000, n_val=500, max_source_length=128,
                 max_target_length=128, val_max_target_length=128, warmup_steps=500, batch_size=16,
                 dpu_warmup_steps=40, nproc=max(1, min(2, _gpu_count())), eval_beams=4)
    else:
        d = dict(model="configs/models/t5-demo.json", n_train=2000, n_val=100, max_source_length=128,
                 max_target_length=128, val_max_target_length=64, warmup_steps=4, batch_size=16, dpu_warmup_steps=10,
                 nproc=2, eval_beams=4)
    for k, v in d.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if not os.path.isabs(a.model):
        a.model = os.path.join(ROOT, a.model)
    if a.find_max_bs is None:
        a.find_max_bs = cuda and not a.smoke
    if a.find_max_bs and not cuda and not a.host_mem_gib:
        raise SystemExit("--find_max_bs on CPU needs --host_mem_gib (the RLIMIT_AS cap per process)")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def run_rows(a, rows: List[RowSpec], runner: Runner, cuda: bool, dtype: str) -> List[Dict[str, Any]]:
    """Phase 1: the batch size of each row (fixed, or searched). Phase 2: --repeat rounds over all rows
    (round-robin, so that a change in the machine's load hits every row alike)."""
    guesses = planner_guesses(a, rows, dtype) if a.find_max_bs and cuda else {}
    plan: List[Dict[str, Any]] = []
    for spec in rows:
        entry = {"spec": spec, "bs": a.batch_size, "source": "fixed", "search": None, "runs": []}
        plan.append(entry)
        if not a.find_max_bs:
            continue
        print(f"== search {spec.name}: {spec.label} ({spec.nproc} process{'es' if spec.nproc > 1 else ''})",
              flush=True)
        guess = guesses.get(spec.name)
        start = max(1, guess) if guess is not None else a.batch_size  # planner: 0 = nothing fits, probe 1
        found, seen, err = find_max_bs(lambda b, spec=spec: runner.run(spec, b, probe=True)["status"], start,
                                       a.bs_multiple, a.max_bs, log=lambda m: print(m, flush=True),
                                       rel_tol=a.bs_rel_tol)
        entry["search"] = {"start": start, "planner_max_bs": guess, "probes": seen, "error": err,
                           "cap": f"{a.gpu_mem_gib} GiB GPU" if cuda else f"{a.host_mem_gib} GiB RLIMIT_AS",
                           "final_oom_retries": []}
        entry["bs"], entry["source"] = found, "search"
        if found == 0:
            print(f"   nothing fits ({err or 'out of memory at the smallest batch'})", flush=True)
            entry["runs"].append({"batch_size": 0, "status": "oom" if err is None else "error"})

    for rep in range(a.repeat):
        for entry in plan:
            spec, bs = entry["spec"], entry["bs"]
            if bs == 0 or (entry["runs"] and entry["runs"][-1]["status"] not in ("ok",)):
                continue  # nothing fits, or an earlier round failed: do not repeat a failure
            print(f"== {spec.name} (round {rep + 1}/{a.repeat}): {spec.label}, {spec.nproc} "
                  f"process{'es' if spec.nproc > 1 else ''}, bs {bs}", flush=True)
            res = runner.run(spec, bs)
            retries = entry["search"]["final_oom_retries"] if entry["search"] else []
            while (res["status"] == "oom" and entry["source"] == "search" and rep == 0
                   and len(retries) < a.final_oom_retries and bs > 1):
                # the full run (whole epoch, eval, save) can need more than the short probe: 10 % lower, rerun
                retries.append({"batch_size": bs, "status": "oom", "log_tail": res.get("log_tail", "")[-1500:]})
                print(f"   full run at bs {bs} ran out of memory; retrying lower", flush=True)
                bs = entry["bs"] = max(1, min(bs - a.bs_multiple, round_bs(bs * 0.9, a.bs_multiple)))
                res = runner.run(spec, bs)
            entry["runs"].append(res)
            r = res.get("results") or {}
            print(f"   {res['status']}: train {fmt(r.get('train_runtime'))} s, eval {fmt(r.get('val_runtime'))} s, "
                  f"wall {res['wall_s']} s, other cores busy {fmt(res.get('foreign_cores'))}", flush=True)
            if res["status"] != "ok":
                print(f"   command: {res['cmd']}\n   log tail:\n{res.get('log_tail', '')[-2000:]}", flush=True)
    out = []
    for entry in plan:
        row = combine(entry["spec"], entry["runs"], entry["source"])
        row["repeats"] = len([r for r in entry["runs"] if "cmd" in r])
        if entry["search"]:
            row["search"] = entry["search"]
        out.append(row)
    return out


def recipe_rows(a: argparse.Namespace, cuda: bool) -> List[RowSpec]:
    """The blog's t5-3b recipe: plain 16-bit and ZeRO-2 + CPU offload; ``--rows`` (a list, checked against every
    row name) picks among them, and a name of the table's other rows is refused here, not run as no row at all."""
    half = "--fp16" if cuda else "--bf16"
    rows = [RowSpec("half", f"plain {half}", [half], 1),
            RowSpec("zero2_offload", f"ZeRO-2 + CPU offload ({half[2:]}), ds_config_1gpu.json",
                    ["--zero_offload", os.path.join(CONFIGS, "ds_config_1gpu.json"), half], 1)]
    if not a.rows:
        return rows
    other = [name for name in a.rows if name not in {r.name for r in rows}]
    if other:
        raise SystemExit(f"--rows {','.join(other)}: not a row of --t5_3b_recipe; its rows are "
                         f"{','.join(r.name for r in rows)}")
    return [r for r in rows if r.name in a.rows]


def main(argv=None) -> int:
    a = parse_args(argv)
    cuda = _gpu_count() > 0 and not a.cpu
    if a.t5_3b_recipe and not cuda and not a.force:
        print("--t5_3b_recipe needs a GPU (t5-3b under a 24 GiB cap); none here: nothing run (--force runs anyway)")
        return 0
    _defaults(a, cuda)
    mode = "smoke" if a.smoke else ("gpu" if cuda else "cpu")
    stem = "t5_3b_recipe_" + ("gpu" if cuda else "cpu") if a.t5_3b_recipe else f"t5_table_{mode}"
    dtype = "fp16" if cuda else "bf16"
    os.makedirs(a.out_dir, exist_ok=True)
    t_start = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="t5_table_") as tmp:
        log_dir = os.path.join(tmp, "logs")
        os.makedirs(log_dir)
        if a.data_dir:
            data_dir, data_desc = os.path.abspath(a.data_dir), a.data_dir
        else:
            write_corpus = runpy.run_path(SYNTH)["write_corpus"]  # the example's own generator, by file
            data_dir = write_corpus(os.path.join(tmp, "data"), a.n_train, a.n_val, 1, seed=0)
            data_desc = "SYNTHETIC toy en->ro corpus (examples/seq2seq/synthetic_data.py, seed 0)"
        runner = Runner(a, tmp, data_dir, cuda, log_dir)
        rows = recipe_rows(a, cuda) if a.t5_3b_recipe else build_rows(a, tmp, cuda)
        results = run_rows(a, rows, runner, cuda, dtype)
        if a.keep_logs:
            shutil.copytree(log_dir, os.path.join(a.out_dir, f"{stem}_logs"), dirs_exist_ok=True)

    notes = []
    if a.find_max_bs:
        cap = (f"{a.gpu_mem_gib} GiB per GPU via torch.cuda.set_per_process_memory_fraction" if cuda else
               f"RLIMIT_AS {a.host_mem_gib} GiB per process")
        notes.append(f"max BS: largest per-process batch whose {a.probe_steps}-step train-only probe ran under the cap "
                     f"({cap}), to within {a.bs_rel_tol:.0%} (the next size probed failed); see each row's 'search'")
    else:
        notes.append(f"no batch-size search (off on CPU by default): every row trains at the fixed per-process batch "
                     f"size {a.batch_size}, so the BS column is not a 'max BS'")
    if not cuda:
        notes.append("CPU: --use_cpu --ddp_backend gloo, bf16 instead of fp16; 'peak host RSS' is rank 0's peak RSS "
                     "(ru_maxrss), which includes the model, optimizer, activations, Python/torch/transformers "
                     "(~0.4-0.5 GiB on its own); on a CPU-only machine offload moves state between two places in the "
                     "same RAM, so it cannot lower this number")
        threads = a.threads or 1
        notes.append(f"threads: OMP_NUM_THREADS={threads} per process ({os.cpu_count()} cores): the {a.nproc}-process "
                     f"rows use {min(a.nproc * threads, os.cpu_count() or 1)} core(s). (2 threads per process on this "
                     "shared machine ran 5-20x slower and erratically: OpenMP waits for a thread whose core another "
                     "job holds)")
    notes.append(f"sharded_ddp rows: hf_zero_offload's --sharded_ddp at ZeRO stage {a.sharded_stage} without offload "
                 "(fairscale is gone from transformers)")
    notes.append(f"DPU row: the offload row's config with the delayed parameter update after {a.dpu_warmup_steps} "
                 "steps, on as many processes (ShardedAdam's DPU when N > 1)")
    notes.append("train loss (same seed and data order per process count): the --zero_offload rows use the ds_config's "
                 "WarmupLR scheduler (constant after warmup), the others the Trainer's linear decay, so their losses "
                 "differ; the DPU row's parameters lag one step after the warm-up, so its loss differs slightly")
    notes.append("train loss does not depend on --predict_with_generate: evaluation runs after training "
                 "(--eval_strategy no); checked equal to all digits with and without it, also with eval every 15 "
                 "steps, DPU on/off. It does move with the step count (n_train, batch size, max_steps/epochs): the "
                 "mean over the first 37 steps is 7.63, over 58 steps 7.30 (a 1-process offload run)")
    notes.append("train s / eval s: finetune_trainer.py's train_runtime / val_runtime (rank 0); 'other cores busy': "
                 "cores that processes outside the run kept busy on average (from /proc/stat), a noise indicator")
    if not a.data_dir:
        notes.append("data: SYNTHETIC (made-up toy language): BLEU/loss say nothing about translation quality; "
                     "short sentences, so max_source_length rarely truncates")
    payload = {
        **provenance("benchmarks.t5.table", argv),
        "title": ("t5-3b single-GPU recipe" if a.t5_3b_recipe else
                  f"t5 table ({mode}): the HF blog's ZeRO rows rerun with hf_zero_offload"),
        "mode": mode if not a.smoke else "cpu" if not cuda else "gpu",
        "smoke": bool(a.smoke),
        "recipe": bool(a.t5_3b_recipe),
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "total_wall_s": round(time.perf_counter() - t_start, 1),
        "params_m": params_m(a.model),
        "settings": {
            "model": os.path.relpath(a.model, ROOT), "data": data_desc, "nproc": a.nproc, "n_train": a.n_train,
            "n_val": a.n_val, "max_source_length": a.max_source_length, "max_target_length": a.max_target_length,
            "val_max_target_length": a.val_max_target_length, "num_train_epochs": a.num_train_epochs,
            "max_steps": a.max_steps, "eval_beams": a.eval_beams, "predict_with_generate": a.predict_with_generate,
            "learning_rate": a.learning_rate, "warmup_steps": a.warmup_steps, "freeze_embeds": a.freeze_embeds,
            "batch_size": a.batch_size, "find_max_bs": a.find_max_bs, "gpu_mem_gib": a.gpu_mem_gib if cuda else None,
            "host_mem_gib": a.host_mem_gib, "sharded_stage": a.sharded_stage, "dpu_warmup_steps": a.dpu_warmup_steps,
            "repeat": a.repeat, "threads_per_process": a.threads or ("cores / procs" if cuda else 1), "label_smoothing": 0.1, "adam_eps": 1e-6, "sortish_sampler": True, "seed": a.seed,
            "extra_args": a.extra_args,
        },
        "notes": notes,
        "rows": results,
        "blog_reference": {"t5_large": BLOG_T5_LARGE, "t5_3b": BLOG_T5_3B},
    }
    if a.t5_3b_recipe:
        payload["title"] += f" (blog: {BLOG_T5_3B})"
    write_json(os.path.join(a.out_dir, stem + ".json"), payload)
    md = markdown(payload)
    with open(os.path.join(a.out_dir, stem + ".md"), "w") as f:
        f.write(md)
    try:
        chart(payload, os.path.join(a.out_dir, stem + ".png"))
    except Exception as e:  # noqa: BLE001  (matplotlib missing: the JSON/markdown still stand)
        print(f"chart failed: {type(e).__name__}: {e}")
    print()
    print(md)
    print(f"wrote {os.path.join(a.out_dir, stem)}.json/.md/.png in {payload['total_wall_s']} s")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
