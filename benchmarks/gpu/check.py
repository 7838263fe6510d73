"""Helpers for benchmarks/gpu/check.sh (the one prepared script for a session with a GPU).

    python -m benchmarks.gpu.check hardware            the hardware line + CUDA facts (also as JSON with --json)
    python -m benchmarks.gpu.check summary DIR         the target lines of every offload_step*.json in DIR
    python -m benchmarks.gpu.check long_corpus DIR     a synthetic corpus whose every line fills 128 tokens

pytest comes from the device image where it has one (the H200 image of session 29 did), else from wheels carried
to the machine (``make gpu-wheels`` downloads them into ``.gpu_wheels/``; the machine has no network).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


# -- hardware --------------------------------------------------------------------------------------
def cmd_hardware(args: argparse.Namespace) -> int:
    import torch

    from benchmarks._common import hardware, hardware_line, provenance

    info = hardware()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu_mem_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    capability=f"{p.major}.{p.minor}", gpu_count=torch.cuda.device_count())
    print(hardware_line(info))
    print(json.dumps(info, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(provenance("benchmarks.gpu.check", args.argv, info), f, indent=2, default=str)
    return 0


# -- summary ---------------------------------------------------------------------------------------
def cmd_summary(args: argparse.Namespace) -> int:
    from benchmarks._common import phases_text

    out = args.dir
    for path in sorted(glob.glob(os.path.join(out, "offload_step*.json"))):
        try:
            with open(path) as f:
                d = json.load(f)
        except Exception as exc:
            print(f"{os.path.basename(path)}: unreadable ({exc})")
            continue
        c = d.get("config", {})
        print(f"{os.path.basename(path)}: {c.get('params_target', 0) / 1e6:.0f}M params, {c.get('dtype')}, "
              f"batch {c.get('tokens')} x {c.get('width')}")
        for r in d.get("rows", []):
            ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else "-"
            peak = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else "-"
            print(f"  {r['row']:<36} {r['ms']:9.1f} ms  {ratio:>6}  peak {peak}")
        for r in d.get("rows", []):
            if r.get("phases_ms"):
                print(f"  phases of {r['row'][:3]} (median ms): " + phases_text(r["phases_ms"]))
        for name, why in d.get("skipped", {}).items():
            print(f"  skipped {name}: {why}")
        for line in d.get("target_lines", []):
            print(f"  {line}")
    return 0


# -- a corpus at full length -----------------------------------------------------------------------
def cmd_long_corpus(args: argparse.Namespace, n: int = 200, join: int = 16) -> int:
    """The synthetic corpus with ``join`` sentences per line (source and target alike): every line is longer than
    the recipe's 128 tokens, so every batch is truncated to full length and the activations are the planner's. The
    first GPU run's short sentences (batches padded to their longest, a few tokens) measured only the weights."""
    import runpy

    write_corpus = runpy.run_path(str(ROOT / "examples" / "seq2seq" / "synthetic_data.py"))["write_corpus"]
    out = args.dir
    write_corpus(out, n_train=n * join, n_val=8 * join, n_test=8 * join, seed=0)
    for split in ("train", "val", "test"):
        for side in ("source", "target"):
            path = os.path.join(out, f"{split}.{side}")
            with open(path) as f:
                lines = f.read().splitlines()
            with open(path, "w") as f:
                f.writelines(" ".join(lines[i:i + join]) + "\n" for i in range(0, len(lines), join))
    print(f"wrote {out}: {n} training lines of {join} sentences each")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from benchmarks._common import existing_dir, json_target, output_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{hardware,summary,long_corpus}")
    hw = sub.add_parser("hardware", help="the hardware line + CUDA facts")
    hw.add_argument("--json", type=json_target, default=None, help="also write them as JSON to PATH")
    hw.set_defaults(fn=cmd_hardware)
    sm = sub.add_parser("summary", help="the target lines of every offload_step*.json in DIR")
    sm.add_argument("dir", type=existing_dir, nargs="?", default=".", metavar="DIR")
    sm.set_defaults(fn=cmd_summary)
    lc = sub.add_parser("long_corpus", help="a synthetic corpus whose every line fills 128 tokens, into DIR")
    lc.add_argument("dir", type=output_dir, metavar="DIR")
    lc.set_defaults(fn=cmd_long_corpus)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
