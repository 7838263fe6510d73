"""``--help`` of the project's programs as a user runs it (a child in the repository root, without PYTHONPATH),
each one run once per test session.

    runs = help_runs([("-m", "benchmarks.kernel.adam_step"), ("examples/seq2seq/x.py",)])

Several test files read the same help (the benchmarks' entry points: test_benchmarks_args, test_benchmarks_layout,
test_docs_commands), and each child mostly imports torch, single-threaded (3-5 s on a 2-core VM): the first file to
ask runs what is not here yet side by side (tests/_procs.py), the others read it back. The whole CompletedProcess is
kept, a failed one too: every test that reads it sees the same status and stderr a child of its own would have given
(help does not depend on which test asks: the same interpreter, cwd and environment each time).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _procs import run_together

ROOT = Path(__file__).resolve().parent.parent
_RUNS: dict[tuple[str, ...], subprocess.CompletedProcess] = {}


def help_runs(argvs) -> list[subprocess.CompletedProcess]:
    """``python *argv --help`` for each argv (a tuple of the arguments before ``--help``), in the order given."""
    argvs = [tuple(a) for a in argvs]
    missing = sorted(set(argvs) - set(_RUNS))
    if missing:
        # PYTHONPATH dropped: a newcomer's shell has none; `-m benchmarks...` resolves from the cwd, as in the docs
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        runs = run_together([[sys.executable, *argv, "--help"] for argv in missing], cwd=ROOT, env=env, timeout=300)
        _RUNS.update(zip(missing, runs))
    return [_RUNS[a] for a in argvs]


def help_run(*argv: str) -> subprocess.CompletedProcess:
    return help_runs([argv])[0]
