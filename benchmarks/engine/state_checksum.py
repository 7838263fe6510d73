"""Save and load of one optimizer state file with and without the CRC-32 checksums.

    python -m benchmarks.engine.state_checksum [--gib 1.0] [--repeat 3] [--dir DIR] [--json PATH|-]

A state of ``--gib`` GiB (fp32 master, exp_avg, exp_avg_sq of equal size) is written with
``checkpoint.write_state`` (write, fsync, rename) and read back with ``checkpoint.read_into``; the
"without" rows run the same code with the CRC function replaced by a no-op, so the difference is
the checksum's cost. Loads read from the page cache (the file was just written): the worst case for
the checksum's share. Median of ``--repeat`` runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zlib

import torch

from benchmarks._common import (existing_dir, hardware, hardware_line, json_stdout, json_target, positive_float,
                               positive_int, provenance, write_json)
from hf_zero_offload.engine import checkpoint


def _time(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=positive_float, default=1.0, help="state size in GiB")
    ap.add_argument("--repeat", type=positive_int, default=3, help="runs per row (median reported)")
    ap.add_argument("--dir", type=existing_dir, default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", type=json_target, default=None, help="write the rows as JSON to PATH, or '-' for stdout")
    return ap


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    n = int(a.gib * 2**30) // 12
    src = {k: torch.randn(n) for k in ("master", "exp_avg", "exp_avg_sq")}
    dst = {k: torch.empty(n) for k in src}
    nbytes = 12 * n
    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = checkpoint.rank_file(d, 0, 1)
        real = zlib.crc32
        for label, crc in (("without", lambda data, value=0: 0), ("with CRC-32", real)):
            checkpoint.zlib.crc32 = crc
            try:
                save = _time(lambda: checkpoint.write_state(path, {"step": 1}, src), a.repeat)
                load = _time(lambda: checkpoint.read_into(path, dst), a.repeat)
            finally:
                checkpoint.zlib.crc32 = real
            rows.append({"checksum": label, "gib": nbytes / 2**30, "save_s": save, "load_s": load,
                         "save_gbps": nbytes / save / 1e9, "load_gbps": nbytes / load / 1e9})
        assert all(torch.equal(src[k], dst[k]) for k in src)
        crc_rate = nbytes / _time(lambda: [real(memoryview(t.numpy())) for t in src.values()], a.repeat) / 1e9
    info = hardware()
    print(hardware_line(info))
    print(f"state of {nbytes / 2**30:.2f} GiB in {os.path.abspath(a.dir or tempfile.gettempdir())}; "
          f"zlib.crc32 alone: {crc_rate:.2f} GB/s; threads={torch.get_num_threads()}")
    print(f"{'checksum':<12} {'save s':>8} {'load s':>8} {'save GB/s':>10} {'load GB/s':>10}")
    for r in rows:
        print(f"{r['checksum']:<12} {r['save_s']:8.2f} {r['load_s']:8.2f} {r['save_gbps']:10.2f} {r['load_gbps']:10.2f}")
    write_json(a.json, {**provenance("benchmarks.engine.state_checksum", argv, info), "crc32_gbps": crc_rate,
                        "rows": rows})


if __name__ == "__main__":
    with json_stdout():
        main()
