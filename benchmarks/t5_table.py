#!/usr/bin/env python
"""The HF blog's t5 table ("Fit More and Train Faster With ZeRO via DeepSpeed and FairScale", Jan 2021), rerun.

    python benchmarks/t5_table.py                     # CPU: t5-demo, 2 gloo processes, scaled-down arguments
    python benchmarks/t5_table.py --model configs/models/t5-large.json --data_dir wmt_en_ro   # GPU: the blog's run
    python benchmarks/t5_table.py --t5_3b_recipe      # GPU: t5-3b on one 24 GiB-capped GPU (ZeRO-2 + offload)
    python benchmarks/t5_table.py --smoke --out_dir /tmp/x   # 3 one-process rows on t5-tiny, seconds (tests)

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
    zero2_offload_1p   (only when N > 1) the same on ONE process: the reference for the next row
    zero2_offload_dpu  ds_config_1gpu.json + "delayed_param_update": {"enabled": true, "warmup_steps": W}, ONE
                       process (ShardedAdam, the multi-process engine, has no DPU: it raises ValueError)

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
import copy
import json
import math
import os
import resource
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _common import hardware, hardware_line, write_json  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "seq2seq", "finetune_trainer.py")
SYNTH = os.path.join(ROOT, "examples", "seq2seq", "synthetic_data.py")
CONFIGS = os.path.join(ROOT, "configs")
GiB, MiB = 2 ** 30, 2 ** 20

# The blog's table (t5-large, 2x Titan RTX 24 GB, n_train 2000, n_val 500, max lengths 128, 1 epoch, beams 4).
BLOG_T5_LARGE = [
    {"configuration": "baseline DDP (fp32)", "bs": 16, "train_s": 30.95, "eval_s": 56.33},
    {"configuration": "--fp16", "bs": 20, "train_s": 21.49, "eval_s": 53.47},
    {"configuration": "--sharded_ddp", "bs": 30, "train_s": 25.91, "eval_s": 47.56},
    {"configuration": "--sharded_ddp --fp16", "bs": 30, "train_s": 17.38, "eval_s": 45.66},
    {"configuration": "DeepSpeed ZeRO-2, no offload (fp16)", "bs": 40, "train_s": 10.40, "eval_s": 34.93},
    {"configuration": "DeepSpeed ZeRO-2 + CPU offload (fp16)", "bs": 50, "train_s": 20.97, "eval_s": 32.14},
]
BLOG_T5_3B = ("t5-3b on one 24 GB RTX-3090: plain --fp16 OOM at BS 1; ZeRO-2 + CPU offload BS 20 (30 OOM), "
              "train_runtime 8.8511 s for 60 samples, val_runtime 3.5329 s for 10, ~71 GB host RAM")

# What a failed run prints when memory ran out (CUDA caching allocator, CPU allocator, Python, RLIMIT_AS).
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED", "can't allocate memory",
               "std::bad_alloc", "MemoryError", "Cannot allocate memory", "out of memory")

LAUNCHER = '''\
# Generated by benchmarks/t5_table.py: apply the memory caps, then run finetune_trainer.py as __main__.
import os, runpy, sys
_gib = os.environ.get("HZO_GPU_MEM_GIB")
if _gib:
    import torch
    if torch.cuda.is_available():
        _dev = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        _total = torch.cuda.get_device_properties(_dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(_gib) * 2**30 / _total), _dev)
_host = os.environ.get("HZO_HOST_MEM_GIB")
if _host:
    import resource
    _b = int(float(_host) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (_b, _b))
_script = os.environ["HZO_SCRIPT"]
sys.argv[0] = _script
runpy.run_path(_script, run_name="__main__")
'''


# ----------------------------------------------------------------------------------------------------------------------
# rows


@dataclass
class RowSpec:
    name: str
    label: str
    flags: List[str]
    nproc: int
    note: str = ""


def _dpu_config(tmp: str, warmup_steps: int) -> str:
    with open(os.path.join(CONFIGS, "ds_config_1gpu.json")) as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["delayed_param_update"] = {"enabled": True, "warmup_steps": int(warmup_steps)}
    path = os.path.join(tmp, "ds_config_1gpu_dpu.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def _sharded_flags(tmp: str, stage: int) -> List[str]:
    if stage == 2:  # hf_zero_offload's own default for a bare --sharded_ddp: {"zero_optimization": {"stage": 2}}
        return ["--sharded_ddp"]
    path = os.path.join(tmp, f"sharded_stage{stage}.json")
    with open(path, "w") as f:
        json.dump({"zero_optimization": {"stage": stage}}, f)
    return ["--sharded_ddp", "--zero_offload", path]


def build_rows(args, tmp: str, cuda: bool) -> List[RowSpec]:
    half = "--fp16" if cuda else "--bf16"
    n = args.nproc
    dp = "DDP " if n > 1 else ""
    off_cfg = os.path.join(CONFIGS, "ds_config.json" if n > 1 else "ds_config_1gpu.json")
    sharded = _sharded_flags(tmp, args.sharded_stage)
    rows = [
        RowSpec("baseline", f"baseline {dp}(fp32)", [], n),
        RowSpec("half", half, [half], n),
        RowSpec("sharded_ddp", f"--sharded_ddp (ZeRO-{args.sharded_stage}, fp32)", sharded, n),
        RowSpec("sharded_ddp_half", f"--sharded_ddp {half} (ZeRO-{args.sharded_stage})", sharded + [half], n),
        RowSpec("zero2", f"ZeRO-2, no offload ({half[2:]})",
                ["--zero_offload", os.path.join(CONFIGS, "ds_config_zero2.json"), half], n),
        RowSpec("zero2_offload", f"ZeRO-2 + CPU offload ({half[2:]})", ["--zero_offload", off_cfg, half], n),
    ]
    dpu_flags = ["--zero_offload", _dpu_config(tmp, args.dpu_warmup_steps), half]
    if n > 1:
        rows.append(RowSpec("zero2_offload_1p", f"ZeRO-2 + CPU offload ({half[2:]}), 1 process",
                            ["--zero_offload", os.path.join(CONFIGS, "ds_config_1gpu.json"), half], 1,
                            "reference for the DPU row"))
    rows.append(RowSpec("zero2_offload_dpu", f"ZeRO-2 + CPU offload + DPU ({half[2:]}), 1 process", dpu_flags, 1,
                        f"DPU after {args.dpu_warmup_steps} steps; one process: ShardedAdam has no DPU"))
    if args.rows:
        wanted = args.rows.split(",")
        unknown = set(wanted) - {r.name for r in rows}
        if unknown:
            raise SystemExit(f"unknown --rows {sorted(unknown)}; known: {[r.name for r in rows]}")
        rows = [r for r in rows if r.name in wanted]
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# running one configuration


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_stat_busy() -> Optional[float]:
    """CPU seconds all processes on the machine have used (from /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return (sum(vals[:8]) - vals[3] - (vals[4] if len(vals) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Runner:
    """Builds the finetune_trainer.py command line for a row and batch size, runs it, reads all_results.json."""

    def __init__(self, args, tmp: str, data_dir: str, cuda: bool, log_dir: str):
        self.args, self.tmp, self.data_dir, self.cuda, self.log_dir = args, tmp, data_dir, cuda, log_dir
        self.launcher = None
        caps = (cuda and args.gpu_mem_gib) or (not cuda and args.host_mem_gib)
        if caps:
            self.launcher = os.path.join(tmp, "hzo_capped_launch.py")
            with open(self.launcher, "w") as f:
                f.write(LAUNCHER)
        self.count = 0

    def command(self, row: RowSpec, bs: int, out_dir: str, probe: bool) -> List[str]:
        a = self.args
        script = self.launcher or SCRIPT
        if row.nproc > 1:
            launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
                      str(row.nproc), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), script]
        else:
            launch = [sys.executable, script]
        cmd = launch + [
            "--config_name", a.model, "--data_dir", self.data_dir, "--task", "translation_en_to_ro",
            "--output_dir", out_dir, "--overwrite_output_dir", "--do_train",
            "--n_train", str(a.n_train), "--n_val", str(a.n_val),
            "--max_source_length", str(a.max_source_length), "--max_target_length", str(a.max_target_length),
            "--val_max_target_length", str(a.val_max_target_length),
            "--per_device_train_batch_size", str(bs), "--per_device_eval_batch_size", str(a.eval_batch_size or bs),
            "--learning_rate", str(a.learning_rate), "--adam_eps", "1e-6", "--warmup_steps", str(a.warmup_steps),
            "--label_smoothing", "0.1", "--sortish_sampler", "--seed", str(a.seed),
            "--logging_first_step", "--logging_steps", "1000", "--eval_strategy", "no",
            "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
        ]
        if a.freeze_embeds:
            cmd.append("--freeze_embeds")
        if probe:
            cmd += ["--max_steps", str(a.probe_steps)]
        else:
            cmd += ["--do_eval", "--eval_beams", str(a.eval_beams)]
            if a.predict_with_generate:
                cmd.append("--predict_with_generate")
            cmd += ["--max_steps", str(a.max_steps)] if a.max_steps else ["--num_train_epochs", str(a.num_train_epochs)]
        if not self.cuda:
            cmd += ["--use_cpu"] + (["--ddp_backend", "gloo"] if row.nproc > 1 else [])
        return cmd + row.flags + list(a.extra_args or [])

    def env(self, row: RowSpec) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        # CPU default 1 thread per process: on a shared 2-core machine a 2-thread OpenMP process whose second core
        # is taken by another job waits at every parallel region (measured 5-20x slower, erratic).
        threads = self.args.threads or (max(1, (os.cpu_count() or 1) // row.nproc) if self.cuda else 1)
        env["OMP_NUM_THREADS"] = str(threads)
        if self.launcher:
            env["HZO_SCRIPT"] = SCRIPT
            if self.cuda and self.args.gpu_mem_gib:
                env["HZO_GPU_MEM_GIB"] = str(self.args.gpu_mem_gib)
            if not self.cuda and self.args.host_mem_gib:
                env["HZO_HOST_MEM_GIB"] = str(self.args.host_mem_gib)
        return env

    def run(self, row: RowSpec, bs: int, probe: bool = False) -> Dict[str, Any]:
        self.count += 1
        tag = f"{self.count:03d}_{row.name}_bs{bs}{'_probe' if probe else ''}"
        out_dir = os.path.join(self.tmp, "runs", tag)
        log_path = os.path.join(self.log_dir, tag + ".log")
        cmd = self.command(row, bs, out_dir, probe)
        env = self.env(row)
        busy0, cpu0, t0 = _proc_stat_busy(), _children_cpu(), time.perf_counter()
        with open(log_path, "w") as log:
            log.write("$ " + shlex.join(cmd) + "\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    timeout=self.args.run_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = time.perf_counter() - t0
        busy1, cpu1 = _proc_stat_busy(), _children_cpu()
        with open(log_path, errors="replace") as f:
            text = f.read()
        res: Dict[str, Any] = {"batch_size": bs, "rc": rc, "wall_s": round(wall, 2),
                               "cpu_s": round(cpu1 - cpu0, 2), "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                               "cmd": shlex.join(cmd), "log": log_path}
        if busy0 is not None and busy1 is not None and wall > 0:
            # cores kept busy by processes other than this row's (the machine may be shared)
            res["foreign_cores"] = round(max(0.0, (busy1 - busy0 - (cpu1 - cpu0)) / wall), 2)
        results = os.path.join(out_dir, "all_results.json")
        if rc == 0 and os.path.exists(results):
            with open(results) as f:
                res["results"] = json.load(f)
            res["status"] = "ok"
        else:
            res["status"] = "oom" if any(m in text for m in OOM_MARKERS) or rc in (-9, 137) else "error"
            res["log_tail"] = text[-4000:]
        if not self.args.keep_run_dirs:
            shutil.rmtree(out_dir, ignore_errors=True)
        return res


# ----------------------------------------------------------------------------------------------------------------------
# largest batch size


def _round_bs(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def find_max_bs(probe: Callable[[int], str], start: int, multiple: int = 1, max_bs: int = 4096,
                log: Callable[[str], None] = print, rel_tol: float = 0.0) -> tuple:
    """Largest multiple of ``multiple`` (<= max_bs) for which ``probe(bs)`` returns "ok"; 0 when even ``multiple``
    fails. ``probe`` returns "ok", "oom" or "error" (an error that is not out-of-memory stops the search). Gallops
    by 1.5x from ``start`` to bracket the answer, then bisects until the failing size is within
    max(multiple, rel_tol * passing size) of the passing one. Returns (bs, {bs: status}, error_or_None)."""
    seen: Dict[int, str] = {}

    def ok(bs: int) -> Optional[bool]:
        if bs not in seen:
            seen[bs] = probe(bs)
            log(f"    probe bs={bs}: {seen[bs]}")
        return None if seen[bs] == "error" else seen[bs] == "ok"

    bs = min(_round_bs(start, multiple), max_bs)
    first = ok(bs)
    if first is None:
        return 0, seen, f"probe at bs={bs} failed (not out-of-memory)"
    if first:
        lo, hi = bs, None
        while hi is None and lo < max_bs:
            nxt = min(max_bs, max(lo + multiple, _round_bs(lo * 1.5, multiple)))
            r = ok(nxt)
            if r is None:
                return lo, seen, f"probe at bs={nxt} failed (not out-of-memory)"
            lo, hi = (nxt, None) if r else (lo, nxt)
        if hi is None:
            return lo, seen, None  # max_bs fits
    else:
        hi, lo = bs, None
        while lo is None:
            if hi <= multiple:
                return 0, seen, None
            nxt = max(multiple, min(hi - multiple, _round_bs(hi / 1.5, multiple)))
            r = ok(nxt)
            if r is None:
                return 0, seen, f"probe at bs={nxt} failed (not out-of-memory)"
            hi, lo = (hi, nxt) if r else (nxt, None)
    while hi - lo > max(multiple, rel_tol * lo):
        mid = _round_bs((lo + hi) / 2, multiple)
        if mid <= lo or mid >= hi:
            mid = lo + multiple
        r = ok(mid)
        if r is None:
            return lo, seen, f"probe at bs={mid} failed (not out-of-memory)"
        lo, hi = (mid, hi) if r else (lo, mid)
    return lo, seen, None


_PLANNER_ROW = {"baseline": "baseline", "half": None, "sharded_ddp": "sharded_stage1_fp32",
                "sharded_ddp_half": "sharded_stage1_{dtype}", "zero2": "zero2", "zero2_offload": "zero2_offload",
                "zero2_offload_1p": "zero2_offload", "zero2_offload_dpu": "zero2_offload_dpu"}


def planner_guesses(args, rows: List[RowSpec], dtype: str) -> Dict[str, int]:
    """hf_zero_offload.planner's largest batch per row (the search's starting point); {} when it fails."""
    out: Dict[str, int] = {}
    try:
        from hf_zero_offload.planner import plan
    except Exception as e:  # noqa: BLE001
        print(f"planner unavailable ({e}); the search starts at --batch_size")
        return out
    for nproc in sorted({r.nproc for r in rows}):
        try:
            p = plan(args.model, gpus=nproc, gpu_mem_gib=args.gpu_mem_gib or 24.0, dtype=dtype,
                     seq_len=args.max_source_length, tgt_len=args.max_target_length)
        except Exception as e:  # noqa: BLE001
            print(f"planner failed for {nproc} process(es) ({type(e).__name__}: {e}); the search starts at "
                  "--batch_size")
            continue
        by_name = {r.name: r.max_batch_size for r in p.rows}
        for r in rows:
            key = _PLANNER_ROW.get(r.name)
            key = dtype if key is None else key.format(dtype=dtype)
            if r.name.startswith("sharded") and args.sharded_stage != 1:
                continue  # the planner's sharded rows are ZeRO-1
            if r.nproc == nproc and key in by_name:
                out[r.name] = by_name[key]
    return out


# ----------------------------------------------------------------------------------------------------------------------
# outputs


def _row_summary(spec: RowSpec, res: Dict[str, Any], bs_source: str) -> Dict[str, Any]:
    r = res.get("results") or {}
    dev = r.get("train_peak_device_mem_bytes")
    host = r.get("train_peak_host_rss_bytes")
    return {
        "name": spec.name, "configuration": spec.label, "nproc": spec.nproc, "flags": spec.flags, "note": spec.note,
        "batch_size": res.get("batch_size"), "batch_size_source": bs_source, "status": res.get("status"),
        "train_runtime": r.get("train_runtime"), "val_runtime": r.get("val_runtime"),
        "train_samples_per_second": r.get("train_samples_per_second"), "train_loss": r.get("train_loss"),
        "val_loss": r.get("val_loss"), "val_bleu": r.get("val_bleu"), "val_gen_len": r.get("val_gen_len"),
        "peak_device_mem_gib": None if dev is None else round(dev / GiB, 3),
        "peak_host_rss_mib": None if host is None else round(host / MiB, 1),
        "wall_s": res.get("wall_s"), "cpu_s": res.get("cpu_s"), "foreign_cores": res.get("foreign_cores"),
        "loadavg_after": res.get("loadavg_after"), "cmd": res.get("cmd"),
        **({"log_tail": res["log_tail"]} if "log_tail" in res else {}),
    }


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def _time_cell(r: Dict[str, Any], key: str) -> str:
    rng = r.get(key + "_range")
    return _fmt(r[key]) + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng and r.get("repeats", 1) > 1 else "")


def markdown(payload: Dict[str, Any]) -> str:
    cuda = payload["mode"] == "gpu"
    s = payload["settings"]
    mem_head = "peak GPU mem GiB (rank 0) | peak host RSS GiB (rank 0)" if cuda else "peak host RSS MiB (rank 0)"
    bs_head = "max BS/proc" if s["find_max_bs"] else "BS/proc (fixed)"
    lines = [
        f"# {payload['title']}",
        "",
        f"Hardware: {payload['hardware_line']}",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Model `{s['model']}` ({_fmt(payload.get('params_m'), '.2f')}M params, random init), data: {s['data']}, "
        f"n_train {s['n_train']}, n_val {s['n_val']}, max_source_length {s['max_source_length']}, "
        f"max_target_length {s['max_target_length']}, val_max_target_length {s['val_max_target_length']}, "
        f"{'max_steps ' + str(s['max_steps']) if s['max_steps'] else str(s['num_train_epochs']) + ' epoch(s)'}, "
        f"eval beams {s['eval_beams']}{' with --predict_with_generate' if s['predict_with_generate'] else ''}, "
        f"OMP_NUM_THREADS={s['threads_per_process']} per process. "
        + (f"Times: median of {s['repeat']} runs per row, run in round-robin rounds (min-max in brackets). "
           if s["repeat"] > 1 else "Times: one run per row. ") +
        f"Load average before/after: {payload['loadavg_before']} / {payload['loadavg_after']}.",
        "",
        f"| configuration | procs | {bs_head} | train s | eval s | {mem_head} | train loss | other cores busy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if cuda else ""),
    ]
    for r in payload["rows"]:
        host = r["peak_host_rss_mib"]
        mem = (f"{_fmt(r['peak_device_mem_gib'])} | {_fmt(None if host is None else host / 1024)}" if cuda
               else _fmt(host, ".1f"))
        status = "" if r["status"] == "ok" else f" **{r['status']}**"
        lines.append(f"| {r['configuration']}{status} | {r['nproc']} | {_fmt(r['batch_size'], 'd')} | "
                     f"{_time_cell(r, 'train_runtime')} | {_time_cell(r, 'val_runtime')} | {mem} "
                     f"| {_fmt(r['train_loss'], '.3f')} | {_fmt(r['foreign_cores'])} |")
    lines += ["", *[f"- {n}" for n in payload["notes"]], ""]
    if payload.get("recipe"):
        return "\n".join(lines + [f"The blog: {BLOG_T5_3B}."]) + "\n"
    lines += ["The blog's table for comparison (t5-large, 2x Titan RTX 24 GB, PyTorch 1.7.1, fairscale/DeepSpeed):",
              "", "| configuration | max BS/GPU | train s | eval s |", "|---|---:|---:|---:|"]
    lines += [f"| {b['configuration']} | {b['bs']} | {b['train_s']:.2f} | {b['eval_s']:.2f} |" for b in BLOG_T5_LARGE]
    return "\n".join(lines) + "\n"


def chart(payload: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    cuda = payload["mode"] == "gpu"
    names = [r["configuration"] for r in rows]
    y = list(range(len(rows)))
    search = payload["settings"]["find_max_bs"]
    fig, axes = plt.subplots(1, 3 if search else 2, figsize=(15 if search else 11, 0.55 * len(rows) + 2.2),
                             sharey=True)
    train = [r["train_runtime"] or 0 for r in rows]
    val = [r["val_runtime"] or 0 for r in rows]
    def err(key, mid):
        rngs = [r.get(key + "_range") or [m, m] for r, m in zip(rows, mid)]
        return [[m - lo for m, (lo, hi) in zip(mid, rngs)], [hi - m for m, (lo, hi) in zip(mid, rngs)]]

    axes[0].barh([i - 0.2 for i in y], train, height=0.4, label="train_runtime", color="tab:blue",
                 xerr=err("train_runtime", train), capsize=3)
    axes[0].barh([i + 0.2 for i in y], val, height=0.4, label="val_runtime", color="tab:orange",
                 xerr=err("val_runtime", val), capsize=3)
    axes[0].set_xlabel("seconds")
    axes[0].legend(loc="lower right", fontsize=8)
    mem = [(r["peak_device_mem_gib"] if cuda else r["peak_host_rss_mib"]) or 0 for r in rows]
    axes[1].barh(y, mem, color="tab:green")
    axes[1].set_xlabel("peak GPU memory, GiB (rank 0)" if cuda else "peak host RSS, MiB (rank 0)")
    if search:
        axes[2].barh(y, [r["batch_size"] or 0 for r in rows], color="tab:purple")
        axes[2].set_xlabel("max batch size / process")
    else:
        axes[1].set_title(f"batch size {rows[0]['batch_size'] if rows else '-'} per process, all rows", fontsize=9)
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
    for i, r in enumerate(rows):
        if r["status"] != "ok":
            axes[0].text(0, i, f"  {r['status']}", va="center", color="red")
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(names, fontsize=8)
    axes[0].invert_yaxis()
    s = payload["settings"]
    fig.suptitle(f"{payload['title']}\n{payload['hardware_line'][:150]}\n{os.path.basename(s['model'])}, "
                 f"n_train {s['n_train']}, n_val {s['n_val']}, OMP_NUM_THREADS={s['threads_per_process']} per process",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _params_m(model_path: str) -> Optional[float]:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForSeq2SeqLM

        cfg = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            m = AutoModelForSeq2SeqLM.from_config(cfg)
        return sum(p.numel() for p in m.parameters()) / 1e6  # tied weights counted once
    except Exception:  # noqa: BLE001
        return None


# ----------------------------------------------------------------------------------------------------------------------
# main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="config JSON (random init). Default: configs/models/t5-large.json "
                                                  "on GPU, t5-demo.json on CPU, t5-tiny.json with --smoke")
    ap.add_argument("--data_dir", default=None, help="legacy layout (train|val.source/.target); default: a "
                                                     "SYNTHETIC corpus from synthetic_data.py in a temp dir")
    ap.add_argument("--out_dir", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--nproc", type=int, default=None,
                    help="processes for the multi-process rows (default: min(2, GPUs) on GPU, 2 on CPU)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS per process (default: cores / procs with a GPU, 1 on CPU)")
    ap.add_argument("--rows", default=None, help="comma-separated subset of row names")
    ap.add_argument("--n_train", type=int, default=None)
    ap.add_argument("--n_val", type=int, default=None)
    ap.add_argument("--max_source_length", type=int, default=None)
    ap.add_argument("--max_target_length", type=int, default=None)
    ap.add_argument("--val_max_target_length", type=int, default=None)
    ap.add_argument("--num_train_epochs", type=float, default=1.0)
    ap.add_argument("--max_steps", type=int, default=None, help="instead of --num_train_epochs")
    ap.add_argument("--eval_beams", type=int, default=None, help="default 4 (the blog's t5 setting); 2 with --smoke")
    ap.add_argument("--no_predict_with_generate", dest="predict_with_generate", action="store_false",
                    help="evaluate the loss only (default: generate with beam search, as the blog)")
    ap.add_argument("--no_freeze_embeds", dest="freeze_embeds", action="store_false")
    ap.add_argument("--learning_rate", type=float, default=3e-5)
    ap.add_argument("--warmup_steps", type=int, default=None, help="default 500 on GPU (the blog), 4 on CPU")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--batch_size", type=int, default=None,
                    help="per-process batch size when not searching (default 16 on CPU, the blog's baseline 16 on "
                         "GPU); the search's start when the planner has no guess")
    ap.add_argument("--eval_batch_size", type=int, default=None, help="default: the train batch size")
    ap.add_argument("--sharded_stage", type=int, choices=(1, 2), default=1,
                    help="ZeRO stage of the --sharded_ddp rows (1 = optimizer states only, as the planner's rows)")
    ap.add_argument("--dpu_warmup_steps", type=int, default=None,
                    help="steps before DPU starts (default: 40 on GPU as the paper, 10 on CPU)")
    ap.add_argument("--find_max_bs", action=argparse.BooleanOptionalAction, default=None,
                    help="search the largest batch per row (default on with a GPU, off on CPU)")
    ap.add_argument("--gpu_mem_gib", type=float, default=24.0, help="per-process GPU memory cap (0: none)")
    ap.add_argument("--host_mem_gib", type=float, default=None, help="CPU search: RLIMIT_AS per process")
    ap.add_argument("--bs_multiple", type=int, default=1, help="probe batch sizes in multiples of this")
    ap.add_argument("--max_bs", type=int, default=1024)
    ap.add_argument("--bs_rel_tol", type=float, default=0.05,
                    help="stop bisecting when the failing size is within this fraction of the passing one")
    ap.add_argument("--final_oom_retries", type=int, default=2,
                    help="when the full run at the size found runs out of memory, retry this often 10 %% lower")
    ap.add_argument("--probe_steps", type=int, default=3, help="optimizer steps of a train-only probe run")
    ap.add_argument("--run_timeout", type=float, default=3600.0, help="seconds before a run is killed")
    ap.add_argument("--repeat", type=int, default=1,
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
    a = ap.parse_args(argv)
    if a.extra_args and a.extra_args[0] == "--":
        a.extra_args = a.extra_args[1:]
    return a


def _defaults(a: argparse.Namespace, cuda: bool) -> None:
    if a.smoke:
        d = dict(model="configs/models/t5-tiny.json", n_train=32, n_val=8, max_source_length=32, max_target_length=32,
                 val_max_target_length=8, warmup_steps=1, batch_size=8, dpu_warmup_steps=1, nproc=1, eval_beams=2)
        a.max_steps = a.max_steps or 3
        a.rows = a.rows or "baseline,zero2_offload,zero2_offload_dpu"
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


def _combine(spec: RowSpec, runs: List[Dict[str, Any]], source: str) -> Dict[str, Any]:
    """One table row from the repeats of a configuration: medians of the times, max of the peaks."""
    ok = [r for r in runs if r["status"] == "ok"]
    row = _row_summary(spec, ok[0] if ok else runs[-1], source)
    if len(runs) > 1:
        row["status"] = "ok" if len(ok) == len(runs) else (runs[-1]["status"] if not ok else "partly failed")
        for key in ("train_runtime", "val_runtime", "train_samples_per_second"):
            vals = [r["results"][key] for r in ok if r["results"].get(key) is not None]
            if vals:
                row[key] = round(statistics.median(vals), 4)
                row[key + "_range"] = [min(vals), max(vals)]
        for key, src, scale in (("peak_device_mem_gib", "train_peak_device_mem_bytes", GiB),
                                ("peak_host_rss_mib", "train_peak_host_rss_bytes", MiB)):
            vals = [r["results"][src] for r in ok if r["results"].get(src) is not None]
            row[key] = round(max(vals) / scale, 3 if scale == GiB else 1) if vals else None
        fc = [r["foreign_cores"] for r in runs if r.get("foreign_cores") is not None]
        row["foreign_cores"] = round(statistics.mean(fc), 2) if fc else None
        row["wall_s"] = round(sum(r["wall_s"] for r in runs), 2)
        row["runs"] = [{k: r.get(k) for k in ("status", "wall_s", "cpu_s", "foreign_cores", "loadavg_after")}
                       | {k: (r.get("results") or {}).get(k) for k in ("train_runtime", "val_runtime", "train_loss")}
                       for r in runs]
    return row


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
                bs = entry["bs"] = max(1, min(bs - a.bs_multiple, _round_bs(bs * 0.9, a.bs_multiple)))
                res = runner.run(spec, bs)
            entry["runs"].append(res)
            r = res.get("results") or {}
            print(f"   {res['status']}: train {_fmt(r.get('train_runtime'))} s, eval {_fmt(r.get('val_runtime'))} s, "
                  f"wall {res['wall_s']} s, other cores busy {_fmt(res.get('foreign_cores'))}", flush=True)
            if res["status"] != "ok":
                print(f"   command: {res['cmd']}\n   log tail:\n{res.get('log_tail', '')[-2000:]}", flush=True)
    out = []
    for entry in plan:
        row = _combine(entry["spec"], entry["runs"], entry["source"])
        row["repeats"] = len([r for r in entry["runs"] if "cmd" in r])
        if entry["search"]:
            row["search"] = entry["search"]
        out.append(row)
    return out


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
            sys.path.insert(0, os.path.dirname(SYNTH))
            import synthetic_data

            data_dir = synthetic_data.write_corpus(os.path.join(tmp, "data"), a.n_train, a.n_val, 1, seed=0)
            data_desc = "SYNTHETIC toy en->ro corpus (examples/seq2seq/synthetic_data.py, seed 0)"
        runner = Runner(a, tmp, data_dir, cuda, log_dir)
        if a.t5_3b_recipe:
            half = "--fp16" if cuda else "--bf16"
            rows = [RowSpec("half", f"plain {half}", [half], 1),
                    RowSpec("zero2_offload", f"ZeRO-2 + CPU offload ({half[2:]}), ds_config_1gpu.json",
                            ["--zero_offload", os.path.join(CONFIGS, "ds_config_1gpu.json"), half], 1)]
            if a.rows:
                rows = [r for r in rows if r.name in a.rows.split(",")]
        else:
            rows = build_rows(a, tmp, cuda)
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
                     f"rows use {min(a.nproc * threads, os.cpu_count() or 1)} core(s), the 1-process rows {threads}; "
                     "compare the 1-process rows with each other. (2 threads per process on this shared machine "
                     "ran 5-20x slower and erratically: OpenMP waits for a thread whose core another job holds)")
    notes.append(f"sharded_ddp rows: hf_zero_offload's --sharded_ddp at ZeRO stage {a.sharded_stage} without offload "
                 "(fairscale is gone from transformers)")
    notes.append("DPU row: one process, because the multi-process engine (ShardedAdam) has no delayed parameter "
                 f"update; compare it with the 1-process offload row. DPU starts after {a.dpu_warmup_steps} steps")
    notes.append("train loss (same seed and data order per process count): the --zero_offload rows use the ds_config's "
                 "WarmupLR scheduler (constant after warmup), the others the Trainer's linear decay, so their losses "
                 "differ; the 1-process rows take twice the optimizer steps of the 2-process rows")
    notes.append("train s / eval s: finetune_trainer.py's train_runtime / val_runtime (rank 0); 'other cores busy': "
                 "cores that processes outside the run kept busy on average (from /proc/stat), a noise indicator")
    if not a.data_dir:
        notes.append("data: SYNTHETIC (made-up toy language): BLEU/loss say nothing about translation quality; "
                     "short sentences, so max_source_length rarely truncates")
    payload = {
        "title": ("t5-3b single-GPU recipe" if a.t5_3b_recipe else
                  f"t5 table ({mode}): the HF blog's ZeRO rows rerun with hf_zero_offload"),
        "mode": mode if not a.smoke else "cpu" if not cuda else "gpu",
        "smoke": bool(a.smoke),
        "recipe": bool(a.t5_3b_recipe),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(
            [sys.executable, os.path.relpath(__file__, ROOT), *argv]),
        "hardware": hardware(),
        "hardware_line": hardware_line(),
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "total_wall_s": round(time.perf_counter() - t_start, 1),
        "params_m": _params_m(a.model),
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
