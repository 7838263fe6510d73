"""Shared helpers for the benchmarks: hardware line, timing, plain-text tables, JSON output."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence


def cpu_model() -> str:
    """The model name, with the x86 family/model numbers: a VM often shows only "AMD EPYC", and two
    generations of one name (Zen 3, family 25; Zen 5, family 26) differ in vector width and speed."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def hardware() -> dict[str, Any]:
    """The facts a reader needs to compare two runs, as a dict (also stored in the JSON)."""
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["ram_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:  # psutil is optional here
        pass
    try:
        from hf_zero_offload import ops

        info["simd"] = ops.simd_level()
        info["simd_available"] = ops.available_simd_levels()
    except Exception as exc:  # the package may not be built yet
        info["simd"] = f"unavailable ({type(exc).__name__})"
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    from importlib import metadata  # the Trainer stack's versions (a GPU image brings its own: not recorded once)
    for name in ("transformers", "accelerate"):
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    return info


def hardware_line(info: Mapping[str, Any] | None = None) -> str:
    info = dict(info or hardware())
    cores = f"{info.get('logical_cores')} logical cores"
    if info.get("physical_cores"):
        cores += f" ({info['physical_cores']} physical)"
    parts = [
        f"CPU: {info['cpu']}",
        cores,
        f"torch {info['torch']} ({info['torch_threads']} threads)",
        f"SIMD: {info.get('simd')}",
        f"GPU: {info['gpu'] or 'none'}",
    ]
    if info.get("ram_gib"):
        parts.insert(2, f"{info['ram_gib']} GiB RAM")
    return " | ".join(parts)


# the kernels' and engines' switches as the process started (a benchmark may set one itself later, from a flag)
_START_ENV = {k: v for k, v in os.environ.items() if k.startswith("HF_ZERO_OFFLOAD_")}


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run: ``python -m module args``, after the HF_ZERO_OFFLOAD_* variables it
    started with (HF_ZERO_OFFLOAD_SIMD chose the kernels); ``argv`` when ``main(argv)`` was called in-process."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return shlex.join([f"{k}={v}" for k, v in sorted(_START_ENV.items())] + ["python", "-m", module, *argv])


def provenance(module: str, argv: Sequence[str] | None = None, info: Mapping[str, Any] | None = None) -> dict:
    """The fields every benchmark's JSON starts with: which benchmark, the command, when (UTC), torch's version and
    the hardware (``info``: a ``hardware()`` already taken, so the line and the dict agree)."""
    import datetime

    import torch

    info = dict(info or hardware())
    return {"benchmark": module.removeprefix("benchmarks."), "command": command_line(module, argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "hardware_line": hardware_line(info), "hardware": info}


def time_calls(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> list[float]:
    """Seconds per call of ``fn``, ``repeat`` times after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def backward_and_step(loss, opt, scaler=None) -> None:
    """One training step's second half, the way each peer is meant to be driven: our engines scale the
    loss themselves, torch's fp16 recipe goes through its GradScaler, the rest is plain."""
    if hasattr(opt, "scale_loss"):
        opt.scale_loss(loss).backward()
        opt.step()
    elif scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


Column = str | tuple  # "key" or (key, header) or (key, header, format spec)


def _norm_col(col: Column) -> tuple[str, str, str]:
    if isinstance(col, str):
        return col, col, ""
    key = col[0]
    header = col[1] if len(col) > 1 else key
    fmt = col[2] if len(col) > 2 else ""
    return key, header, fmt


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A plain-text table; numbers right-aligned, missing values shown as '-'."""
    cols = [_norm_col(c) for c in columns]
    cells = []
    for row in rows:
        line = []
        for key, _, fmt in cols:
            v = row.get(key)
            if v is None:
                line.append("-")
            elif fmt and isinstance(v, (int, float)):
                line.append(format(v, fmt))
            else:
                line.append(str(v))
        cells.append(line)
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, (_, h, _) in enumerate(cols)]
    numeric = [all(isinstance(row.get(k), (int, float)) or row.get(k) is None for row in rows) for k, _, _ in cols]

    def fmt_line(vals):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    out = [fmt_line([h for _, h, _ in cols]), fmt_line(["-" * w for w in widths])]
    out += [fmt_line(r) for r in cells]
    return "\n".join(out)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], file=None) -> None:
    print(format_table(rows, columns), file=file or sys.stdout)


_JSON_OUT = None  # the real stdout while ``json_stdout`` sends everything else to stderr


@contextlib.contextmanager
def json_stdout(argv: Sequence[str] | None = None):
    """With ``--json -`` stdout carries the JSON alone, so a program can parse it: the hardware line, the table and
    the progress lines go to stderr (three benchmarks printed their table before the JSON)."""
    global _JSON_OUT
    argv = sys.argv[1:] if argv is None else list(argv)
    wanted = "--json=-" in argv or any(a == "--json" and argv[i + 1:i + 2] == ["-"] for i, a in enumerate(argv))
    if not wanted:
        yield
        return
    _JSON_OUT = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _JSON_OUT = None


def write_json(path_or_stdout: str | os.PathLike | None, payload: Any) -> None:
    """Write ``payload`` as JSON to a file (parent folders created) or to stdout when given '-'."""
    if path_or_stdout is None:
        return
    text = json.dumps(payload, indent=2, default=str)
    if str(path_or_stdout) == "-":
        print(text, file=_JSON_OUT or sys.stdout)
        return
    path = os.fspath(path_or_stdout)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _proc_stat_busy() -> float | None:
    """Seconds of CPU time all processes have used (from /proc/stat), or None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        vals = [int(x) for x in fields]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ForeignLoad:
    """Measures how many cores *other* processes kept busy while the block ran (a shared machine
    makes memory-bound timings meaningless when that is not ~0):

        with ForeignLoad() as load: ...
        load.cores  # average number of cores used by other processes, or None
    """

    def __enter__(self):
        self._busy0 = _proc_stat_busy()
        t = os.times()
        self._self0 = t.user + t.system
        self._wall0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy1 = _proc_stat_busy()
        t = os.times()
        wall = time.perf_counter() - self._wall0
        if self._busy0 is None or busy1 is None or wall <= 0:
            self.cores = None
        else:
            own = t.user + t.system - self._self0
            self.cores = max(0.0, (busy1 - self._busy0 - own) / wall)
        return False


# -- targets: every benchmark states each of its targets with one of three verdicts -----------------------------
MET, NOT_MET, NOT_HERE = "met", "NOT MET", "not meaningful here"


def phases_text(phases: Mapping[str, float]) -> str:
    """An offload row's step phases (``engine/rows.PhaseClock``, median ms) as one line's tail."""
    return " | ".join(f"{k} {v:.1f}" for k, v in phases.items())


def target_line(label: str, value: str, verdict: str, why: str = "") -> str:
    """``[met] label: value`` / ``[NOT MET] ...`` / ``[not meaningful here] ... (why)``: a reader of ``make bench``
    sees at once whether something is wrong, and why a target says nothing on this machine."""
    assert verdict in (MET, NOT_MET, NOT_HERE), verdict
    return f"[{verdict}] {label}: {value}" + (f" ({why})" if why else "")


def beside(value: float, target: float, digits: int = 2) -> str:
    """``value`` to ``digits`` decimals, or to as many more as it takes to differ from ``target``: a missed
    target must not print as equal to it (a tiny model's 18.004 B/param read "18.00, target <= 18" next to
    NOT MET)."""
    for d in range(digits, digits + 5):
        if value == target or f"{value:.{d}f}" != f"{target:.{d}f}":
            return f"{value:.{d}f}"
    return repr(value)


def verdict(ok: bool) -> str:
    return MET if ok else NOT_MET


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example(name: str):
    """A module of examples/seq2seq/ (e.g. ``synthetic_data``) loaded from its file: the examples are scripts,
    not a package, and loading by path keeps ``sys.path`` untouched."""
    import importlib.util

    path = os.path.join(ROOT, "examples", "seq2seq", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"hzo_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODELS = os.path.join(ROOT, "configs", "models")


def model_config(name: str) -> str:
    """``--model`` of the benchmarks: a name of configs/models/ (``t5-small``) or a path to a config JSON; an
    argparse ``type``, so a wrong one is a usage error listing the names, before any work."""
    import argparse

    path = name if name.endswith(".json") or os.sep in name else os.path.join(MODELS, f"{name}.json")
    if not os.path.isfile(path):
        names = ", ".join(sorted(f[:-5] for f in os.listdir(MODELS) if f.endswith(".json")))
        raise argparse.ArgumentTypeError(f"no {path}; names: {names}, or a path to a config JSON")
    return path


def model_list(text: str) -> list[str]:
    """``--models t5-tiny,t5-small``: comma-separated ``model_config`` names or paths, none twice, at least one (``,``
    ran nothing and said nothing; a name given twice ran twice), as the list of names given."""
    items = items_of(text, "one or more model names or config paths expected")
    refuse_repeats(items)
    for x in items:
        model_config(x)
    return items


# the argparse types, where the benchmarks import them from
from benchmarks._args import (existing_dir, int_at_least, int_list, items_of, json_target,  # noqa: E402,F401
                              name_list, nonnegative_float, nonnegative_int, output_dir, output_file, positive_float,
                              positive_int, refuse_repeats, torch_device)
