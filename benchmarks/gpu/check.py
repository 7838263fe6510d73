"""Helpers for benchmarks/gpu/check.sh (the one prepared script for a session with a GPU).

    python -m benchmarks.gpu.check hardware            the hardware line + CUDA facts (also as JSON with --json)
    python -m benchmarks.gpu.check summary DIR         the target lines of every offload_step*.json in DIR
    python -m benchmarks.gpu.check long_corpus DIR     a synthetic corpus whose every line fills 128 tokens

pytest comes from the device image where it has one (the H200 image of session 29 did), else from wheels carried
to the machine (``make gpu-wheels`` downloads them into ``.gpu_wheels/``; the machine has no network).
"""
from __future__ import annotations

import glob
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


# -- hardware --------------------------------------------------------------------------------------
def cmd_hardware(args: list[str]) -> int:
    import torch
    from benchmarks._common import hardware, hardware_line

    info = hardware()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu_mem_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    capability=f"{p.major}.{p.minor}", gpu_count=torch.cuda.device_count())
    print(hardware_line(info))
    print(json.dumps(info, default=str))
    if "--json" in args:
        path = args[args.index("--json") + 1]
        with open(path, "w") as f:
            json.dump({"hardware": info, "hardware_line": hardware_line(info)}, f, indent=2, default=str)
    return 0


# -- summary ---------------------------------------------------------------------------------------
def cmd_summary(args: list[str]) -> int:
    from benchmarks._common import phases_text

    out = args[0] if args else "."
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
def cmd_long_corpus(args: list[str], n: int = 200, join: int = 16) -> int:
    """The synthetic corpus with ``join`` sentences per line (source and target alike): every line is longer than
    the recipe's 128 tokens, so every batch is truncated to full length and the activations are the planner's. The
    first GPU run's short sentences (batches padded to their longest, a few tokens) measured only the weights."""
    import runpy

    write_corpus = runpy.run_path(str(ROOT / "examples" / "seq2seq" / "synthetic_data.py"))["write_corpus"]
    out = args[0]
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


def main() -> int:
    cmds = {"hardware": cmd_hardware, "summary": cmd_summary, "long_corpus": cmd_long_corpus}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        print(__doc__)
        return 2
    return cmds[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
