"""``--help`` of the project's programs as a user runs it (a child in the repository root, without PYTHONPATH),
each one run once per test session.

    runs = help_runs([("-m", "benchmarks.kernel.adam_step"), ("examples/seq2seq/x.py",)])

Several test files read the same help (the benchmarks' entry points: test_benchmarks_args, test_benchmarks_layout,
test_docs_commands), and each child mostly imports torch, single-threaded (3-5 s on a 2-core VM): the first file to
ask runs what is not here yet side by side (tests/_procs.py), the others read it back. The whole CompletedProcess is
kept, a failed one too: every test that reads it sees the same status and stderr a child of its own would have given
(help does not depend on which test asks: the same interpreter, cwd and environment each time). ``runs_once`` does
the same for any such child (tests/_examples.py: finetune_trainer.py's help beside the GOMP spin probe).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _procs import run_together

ROOT = Path(__file__).resolve().parent.parent
_RUNS: dict[tuple, subprocess.CompletedProcess] = {}


def runs_once(children) -> list[subprocess.CompletedProcess]:
    """``python *args`` for each child ``(args, names of environment variables left out)``, in the order given,
    from ROOT: each run once a session, the ones not run yet side by side. For any child whose result does not
    depend on which test asks (a probe of the same files, in the same environment)."""
    children = [(tuple(a), tuple(sorted(drop))) for a, drop in children]
    missing = sorted(set(children) - set(_RUNS))
    if missing:
        envs = [{"env": {k: v for k, v in os.environ.items() if k not in drop}} for _, drop in missing]
        runs = run_together([[sys.executable, *a] for a, _ in missing], per_child=envs, cwd=ROOT, timeout=300)
        _RUNS.update(zip(missing, runs))
    return [_RUNS[c] for c in children]


def help_runs(argvs) -> list[subprocess.CompletedProcess]:
    """``python *argv --help`` for each argv (a tuple of the arguments before ``--help``), in the order given."""
    # PYTHONPATH dropped: a newcomer's shell has none; `-m benchmarks...` resolves from the cwd, as in the docs
    return runs_once([((*argv, "--help"), ("PYTHONPATH",)) for argv in argvs])


def help_run(*argv: str) -> subprocess.CompletedProcess:
    return help_runs([argv])[0]
