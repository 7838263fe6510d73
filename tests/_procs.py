"""Independent child processes of one test, run side by side.

    first, second = run_together([argv1, argv2], env=env, timeout=300)

Each child of these tests spends most of its time importing torch and transformers, single-threaded
(3-10 s each on a 2-core VM), so two children at once take little more than one: on 2 cores this is
what keeps the suite inside CI's time. Same keyword arguments as ``subprocess.run`` (``capture_output``
and ``text`` default to True), the same arguments for every child; ``per_child`` gives one child its
own (``{"env": ...}``); results come back in the order given. Children are independent processes
whatever their order, so the tests' assertions do not change; a test that checks timing or a shared
file must not use this.
"""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor


def run_together(argvs, *, jobs: int | None = None, per_child=None, **kwargs) -> list[subprocess.CompletedProcess]:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    per_child = per_child or [{}] * len(argvs)
    jobs = jobs or max(1, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # threads only wait: the work is in the children
        futures = [pool.submit(subprocess.run, argv, **{**kwargs, **own}) for argv, own in zip(argvs, per_child)]
        return [f.result() for f in futures]
