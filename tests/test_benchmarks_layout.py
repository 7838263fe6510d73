"""benchmarks/ as a newcomer meets it: topic folders with a README each, runnable as ``python -m benchmarks.X.Y``
(no sys.path edits, no private ``_C``), and target lines that say met / NOT MET / not meaningful here."""
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def test_topic_folders_and_no_path_hacks():
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["__init__.py", "_args.py", "_common.py"]
    topics = [d for d in BENCH.iterdir() if d.is_dir() and d.name not in ("results", "__pycache__")]
    assert {d.name for d in topics} >= {"kernel", "engine", "sharding", "t5", "gpu"}
    for d in topics:
        assert (d / "README.md").is_file() and (d / "__init__.py").is_file(), d
    for path in BENCH.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "sys.path.insert" not in text and "sys.path.append" not in text, path
        assert not re.search(r"import _C\b|from hf_zero_offload import .*\b_C\b|hf_zero_offload\._C", text), path


BIG = 20_000_000  # params: the offload benchmark's CPU default


def test_offload_targets_each_have_a_verdict():
    from benchmarks._common import MET, NOT_HERE, NOT_MET
    from benchmarks.engine.offload_step import _fmt_targets

    rows = [{"row": "(a) torch", "ms": 10.0, "ratio": 1.0},
            {"row": "(b) ours", "ms": 12.0, "ratio": 1.2, "opt_bpp": 17.5, "dev_state_bpp": 2.1, "buckets_bpp": 0.1,
             "pcie_bpp": 4.0},
            {"row": "(c) ours + DPU", "ms": 12.5, "ratio": 1.25, "opt_bpp": 18.0}]
    for cuda, dtype in ((False, torch.float32), (True, torch.bfloat16), (True, torch.float32)):
        lines = [ln for ln in _fmt_targets(rows, types.SimpleNamespace(cuda=cuda, dtype=dtype, n_target=BIG))
                 if not ln.startswith("  (")]
        assert lines and all(ln.startswith(tuple(f"[{v}]" for v in (MET, NOT_MET, NOT_HERE))) for ln in lines), lines
        here = [ln for ln in lines if ln.startswith(f"[{NOT_HERE}]")]
        assert all(ln.endswith(")") for ln in here)  # with the reason
        if not cuda:
            assert len(here) == len(lines) - 1  # only the host bytes are meaningful on a CPU
    gpu = _fmt_targets(rows, types.SimpleNamespace(cuda=True, dtype=torch.bfloat16, n_target=BIG))
    assert f"[{NOT_MET}] offload + DPU step" in "\n".join(gpu) and f"[{MET}] offload step" in "\n".join(gpu)


def test_a_small_model_s_host_bytes_are_not_judged():
    """Under 20M params the engine's ~30 MB of fixed buffers weigh per param (24 B/param at 2M, a NOT MET that said
    nothing of the engine's plan)."""
    from benchmarks._common import NOT_HERE
    from benchmarks.engine.offload_step import _fmt_targets

    rows = [{"row": "(b) ours", "ms": 1.0, "ratio": 1.0, "opt_bpp": 24.0}]
    line = next(ln for ln in _fmt_targets(rows, types.SimpleNamespace(cuda=False, dtype=torch.float32, n_target=2e6))
                if "host optimizer memory" in ln)
    assert line.startswith(f"[{NOT_HERE}]") and "24.00 B/param" in line and "under 20M params" in line, line


def test_offload_step_trains_in_fp32_on_a_cpu_without_bf16(monkeypatch):
    """--dtype auto: torch emulates bf16 on a CPU without AVX512-BF16/AMX (~6 s a step at 20M params)."""
    from benchmarks.engine import offload_step
    from hf_zero_offload import launch_checks

    for native, cpu in ((False, "fp32"), (True, "bf16"), (None, "bf16")):
        monkeypatch.setattr(launch_checks, "cpu_has_native_bf16", lambda native=native: native)
        assert offload_step._auto_dtype("cpu") == cpu
        assert offload_step._auto_dtype("cuda") == "bf16"
    assert offload_step.build_parser().parse_args([]).dtype == "auto"


def test_a_missed_byte_target_shows_the_excess():
    """A tiny model's 18.004 B/param printed as "18.00 B/param, target <= 18" beside NOT MET."""
    from benchmarks._common import NOT_MET
    from benchmarks.engine.offload_step import _fmt_targets

    rows = [{"row": "(b) ours", "ms": 1.0, "ratio": 1.0, "opt_bpp": 18.004}]
    line = next(ln for ln in _fmt_targets(rows, types.SimpleNamespace(cuda=False, dtype=torch.float32, n_target=BIG))
                if "host optimizer memory" in ln)
    assert line.startswith(f"[{NOT_MET}]") and "18.004 B/param" in line, line
    from benchmarks._common import beside  # the kernel benchmark's target lines print through it too
    assert (beside(1.0004, 1.0, 3), beside(0.8499, 0.85), beside(0.85, 0.85), beside(14.2857, 18)) == (
        "1.0004", "0.8499", "0.85", "14.29")


def test_compact_quality_targets_judge_only_above_the_noise_floor():
    from benchmarks._common import MET, NOT_HERE, NOT_MET
    from benchmarks.engine.compact_quality import target_lines

    def row(sd, lo, hi):
        return {"state_dtype": sd, "seeds": 2, "mean_vs_fp32": (lo + hi) / 2, "min_vs_fp32": lo, "max_vs_fp32": hi}

    quiet = target_lines([row("fp32-ulp", 0.999, 1.001), row("bf16", 0.998, 1.007), row("int8", 0.995, 1.004)])
    assert [ln.split("]")[0] for ln in quiet] == [f"[{MET}", f"[{NOT_MET}"]  # int8 first, then bf16 (0.7% > 0.5%)
    noisy = target_lines([row("fp32-ulp", 0.97, 1.04), row("int8", 1.0, 1.002)])
    assert noisy[0].startswith(f"[{NOT_HERE}]") and "noise floor 4.00%" in noisy[0] and noisy[0].endswith(")")
    bare = target_lines([row("int8", 0.98, 1.0)])  # no floor measured: judged as it is, and said so
    assert bare[0].startswith(f"[{NOT_MET}]") and "fp32-ulp" in bare[0]


def test_state_checksum_refuses_a_missing_dir_before_any_work(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "benchmarks.engine.state_checksum", "--gib", "0.001", "--dir",
                        str(tmp_path / "missing")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--dir" in r.stderr.splitlines()[-1], r.stderr


def test_benchmark_models_by_name_or_path_and_results_only_when_asked(capsys):
    import pytest

    from benchmarks._common import model_config
    from benchmarks.engine import compact_quality
    from benchmarks.t5 import planner_validate as pv

    tiny = ROOT / "configs" / "models" / "t5-tiny.json"
    assert os.path.samefile(model_config("t5-tiny"), tiny) and model_config(str(tiny)) == str(tiny)  # was doubled
    for main, argv in ((pv.main, ["--models", "t5-tinny"]), (compact_quality.main, ["--model", "t5-tinny"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "t5-tinny" in err and "t5-tiny," in err.splitlines()[-1], err
    with pytest.raises(SystemExit):  # the published results are not the default output any more
        pv.main(["--help"])
    assert "--json" in capsys.readouterr().out


def test_gpu_check_passes_only_flags_its_benchmarks_know():
    """benchmarks/gpu/check.sh runs once, on a borrowed GPU: a flag a module does not know costs that run."""
    from _help import help_runs  # each help runs once a session (test_benchmarks_args reads them all)

    script = (BENCH / "gpu" / "check.sh").read_text(encoding="utf-8").replace("\\\n", " ")
    arrays = {}
    for name, body in re.findall(r"(\w+)=\(([^)]*)\)", script):
        arrays.setdefault(name, []).extend(re.findall(r"--[\w-]+", body))
    calls = sorted(set(re.findall(r"-m (benchmarks\.\w+\.\w+) ([^\n]*)", script)))
    for (module, rest), run in zip(calls, help_runs([("-m", module) for module, _ in calls])):
        flags = set(re.findall(r"(?<![\w-])--[\w-]+", rest))
        for name in re.findall(r"\$\{(\w+)\[@\]\}", rest):
            flags |= set(arrays[name])
        help_text = run.stdout
        unknown = sorted(f for f in flags if f not in help_text)
        assert not unknown, f"check.sh passes {unknown} to {module}"


def test_kernel_benchmark_runs_and_its_json_names_the_simd_override():
    """The kernel benchmark end to end at a toy size, with and without HF_ZERO_OFFLOAD_SIMD (the JSON's command
    must reproduce the run, so an override of the kernels' instruction set is part of it)."""
    import json
    import sys

    from _procs import run_together
    from hf_zero_offload import ops

    levels = ("", "scalar")
    env = {k: v for k, v in os.environ.items() if k != "HF_ZERO_OFFLOAD_SIMD"}
    argv = [sys.executable, "-m", "benchmarks.kernel.adam_step", "--numel", "70000", "--rounds", "1", "--pause", "0",
            "--skip", "deepspeed", "torchao", "--json", "-"]
    runs = run_together([argv] * len(levels), cwd=ROOT, timeout=300,
                        per_child=[{"env": {**env, **({"HF_ZERO_OFFLOAD_SIMD": lv} if lv else {})}} for lv in levels])
    for level, r in zip(levels, runs):
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout)
        assert out["command"].startswith(f"HF_ZERO_OFFLOAD_SIMD={level} " if level else "python"), out["command"]
        assert out["hardware"]["simd"] == (level or ops.available_simd_levels()[-1])  # unset: the best level
        assert {row["name"] for row in out["rows"]} >= {"ours fp32", "ours mixed", "ours int8-state", "stream bound"}
        # every round's time is kept, so a run's spread (the host's drift) can be read back later
        assert all(len(row["times_ms"]) == 1 and row["times_ms"][0] > 0 for row in out["rows"])


def test_json_on_stdout_is_the_json_alone(capsys):
    """`--json -` ("or '-' for stdout"): three benchmarks printed their table before the JSON, so stdout did not
    parse. Every benchmark that takes --json runs its main under json_stdout."""
    import json

    from benchmarks._common import json_stdout, write_json

    with json_stdout(["--rounds", "1", "--json", "-"]):
        print("row  ms/step")
        write_json("-", {"rows": [1]})
    out, err = capsys.readouterr()
    assert json.loads(out) == {"rows": [1]} and "ms/step" in err
    with json_stdout(["--json", "out.json"]):
        print("table")
    assert capsys.readouterr().out == "table\n"
    for path in ROOT.glob("benchmarks/**/*.py"):
        text = path.read_text()
        if '"--json"' in text and "for stdout" in text:
            assert "json_stdout(" in text or "sys.stderr if" in text, path


def test_offload_rows_say_where_their_step_time_goes():
    """rows.PhaseClock: each phase of the engine's step timed (the first GPU run left 75-160 ms a step unexplained)."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "benchmarks.engine.offload_step", "--params", "2e5", "--tokens", "8",
                        "--steps", "2", "--rows", "b,c", "--json", "-"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["rows"]
    assert [row["row"][:3] for row in rows] == ["(b)", "(c)"]
    for row in rows:
        phases = row["phases_ms"]
        assert list(phases) == ["fwd+bwd", "wait grads", "norm", "adam", "step", "end sync"]
        assert phases["adam"] > 0 and phases["step"] > 0 and all(v >= 0 for v in phases.values()), phases


@pytest.mark.parametrize("argv, says", [
    (["kernel.adam_step", "--rounds", "0"], "argument --rounds: 0: an integer >= 1 expected"),
    (["sharding.sharded_step", "--repeat", "0"], "argument --repeat: 0: an integer >= 1 expected"),  # (a rank hung)
    (["engine.state_checksum", "--gib", "-1"], "argument --gib: -1: a positive number expected"),
    (["kernel.adam_step", "--json", "/proc/x.json"], "argument --json: /proc/x.json: cannot write a JSON file there"),
])
def test_benchmark_arguments_are_checked_before_any_work(argv, says):
    """0 rounds, a negative size or an unwritable --json failed with a traceback deep in a run (an unwritable path
    after the whole run; a 0-round sharded run left its peer rank waiting), an outside probe."""
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{argv[0]}", *argv[1:]], capture_output=True, text=True,
                       timeout=120, cwd=str(ROOT))
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def _brace_expand(pattern: str) -> list[str]:
    """``run{1..3}``, ``{json,png}``, ``engine_many_tensors{,_int8}``: the shorthands the READMEs name files by."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    body = m.group(1)
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    alternatives = [str(i) for i in range(int(r.group(1)), int(r.group(2)) + 1)] if r else body.split(",")
    return [p for alt in alternatives for p in _brace_expand(pattern[:m.start()] + alt + pattern[m.end():])]


def test_every_result_file_is_referenced_by_a_readme():
    """A measured file nobody points at is a figure no reader can find (adam_step_cpu.json, of a script since
    replaced, sat there unreferenced): each file of benchmarks/results/ is named, or matched by a brace or glob
    pattern (``gpu_h200_*``, ``run{1..9}``), in README.md, a benchmarks README or docs/."""
    import fnmatch

    docs = [ROOT / "README.md", *BENCH.glob("**/README.md"), *(ROOT / "docs").glob("*.md")]
    patterns = {p for doc in docs for token in re.findall(r"[\w{},.*\-]+", doc.read_text(encoding="utf-8"))
                for p in _brace_expand(token) if len(p.split("*")[0]) >= 4}  # no bare "*" matching everything
    orphans = [f.name for f in sorted((BENCH / "results").iterdir())
               if not any(fnmatch.fnmatchcase(f.name, p) for p in patterns)]
    assert not orphans, f"benchmarks/results/ files no README names: {orphans}"
