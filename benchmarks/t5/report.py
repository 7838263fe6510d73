"""The t5 table's outputs: one table row from the runs of a configuration (``combine``), the markdown table with
the blog's numbers below it, and the matplotlib chart.
"""
from __future__ import annotations

import os
import statistics
from typing import Any, Dict, List, Optional

from benchmarks.t5.runs import RowSpec

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


def row_summary(spec: RowSpec, res: Dict[str, Any], bs_source: str) -> Dict[str, Any]:
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


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def _time_cell(r: Dict[str, Any], key: str) -> str:
    rng = r.get(key + "_range")
    return fmt(r[key]) + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng and r.get("repeats", 1) > 1 else "")


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
        f"Model `{s['model']}` ({fmt(payload.get('params_m'), '.2f')}M params, random init), data: {s['data']}, "
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
        mem = (f"{fmt(r['peak_device_mem_gib'])} | {fmt(None if host is None else host / 1024)}" if cuda
               else fmt(host, ".1f"))
        status = "" if r["status"] == "ok" else f" **{r['status']}**"
        lines.append(f"| {r['configuration']}{status} | {r['nproc']} | {fmt(r['batch_size'], 'd')} | "
                     f"{_time_cell(r, 'train_runtime')} | {_time_cell(r, 'val_runtime')} | {mem} "
                     f"| {fmt(r['train_loss'], '.3f')} | {fmt(r['foreign_cores'])} |")
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


def params_m(model_path: str) -> Optional[float]:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForSeq2SeqLM

        cfg = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            m = AutoModelForSeq2SeqLM.from_config(cfg)
        return sum(p.numel() for p in m.parameters()) / 1e6  # tied weights counted once
    except Exception:  # noqa: BLE001
        return None


def combine(spec: RowSpec, runs: List[Dict[str, Any]], source: str) -> Dict[str, Any]:
    """One table row from the repeats of a configuration: medians of the times, max of the peaks."""
    ok = [r for r in runs if r["status"] == "ok"]
    row = row_summary(spec, ok[0] if ok else runs[-1], source)
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
