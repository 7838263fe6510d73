"""Fresh-interpreter children of a test that share one ``import torch``.

    runs = run_forked([code1, code2], envs=[env1, env2])   # [CompletedProcess, ...], in the order given

A test that needs its own interpreter per case (an environment variable read when hf_zero_offload is imported,
an import order) paid ~2-4 s per child on a 2-core machine, nearly all of it importing torch. Here one runner
process imports torch, checks that nothing of hf_zero_offload is loaded yet, and forks one child per code; each
child takes its own environment (os.environ replaced, as ``subprocess.run(env=...)`` gives it), runs its code as
``python -c`` runs it (``__main__``, the traceback and exit status 1 of an uncaught exception, SystemExit's status)
and writes its own stdout and stderr. So every child imports hf_zero_offload anew, in its environment, as a fresh
interpreter would; only torch is already loaded (as in tests/_dist.py's forked ranks), so what torch reads when it
loads (OMP_NUM_THREADS, GOMP_SPINCOUNT) is the runner's. A test that checks torch's own import or such a variable,
the interpreter's start-up or a command line keeps a real ``subprocess.run``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_RUNNER = r"""
import json, os, sys, traceback
import torch  # noqa: F401  the import every child shares
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "hf_zero_offload")
assert not loaded, f"the runner must not import hf_zero_offload before the fork: {loaded}"
jobs = json.load(open(sys.argv[1]))
sys.stdout.flush(); sys.stderr.flush()  # nothing buffered is written twice by the children
children = {}
for i, job in enumerate(jobs):
    pid = os.fork()
    if pid:
        children[pid] = i
        continue
    status = 1
    try:
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = ["-c", *job["args"]]
        try:
            exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            status = 0
        except SystemExit as e:  # as the interpreter ends on it
            if e.code is None or isinstance(e.code, int):
                status = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException as e:  # the traceback python -c prints: from the code's frame, not the runner's
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
codes = [None] * len(jobs)
for _ in jobs:
    pid, wait_status = os.wait()
    codes[children[pid]] = os.waitstatus_to_exitcode(wait_status)
print(json.dumps(codes))
"""


def runner_argv(codes, envs, folder, args=None) -> tuple[list[str], list[tuple[str, str]]]:
    """The runner's command line (for a caller that runs it beside other children, tests/_procs.py) and each
    child's (stdout, stderr) files; ``collect`` reads them back. ``args``: each child's sys.argv[1:]."""
    jobs, files = [], []
    for i, (code, env, rest) in enumerate(zip(codes, envs, args or [()] * len(codes))):
        out, err = os.path.join(folder, f"{i}.out"), os.path.join(folder, f"{i}.err")
        jobs.append({"code": code, "env": dict(env), "args": list(rest), "stdout": out, "stderr": err})
        files.append((out, err))
    spec = os.path.join(folder, "jobs.json")
    with open(spec, "w") as f:
        json.dump(jobs, f)
    return [sys.executable, "-c", _RUNNER, spec], files


def collect(runner: subprocess.CompletedProcess, codes, files) -> list[subprocess.CompletedProcess]:
    assert runner.returncode == 0, runner.stderr[-3000:]
    statuses = json.loads(runner.stdout.strip().splitlines()[-1])
    runs = []
    for code, status, (out, err) in zip(codes, statuses, files):
        with open(out) as o, open(err) as e:
            runs.append(subprocess.CompletedProcess([sys.executable, "-c", code], status, o.read(), e.read()))
    return runs


def run_forked(codes, envs=None, args=None, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    envs = envs or [os.environ] * len(codes)
    with tempfile.TemporaryDirectory(prefix="hzo-forked-") as folder:
        argv, files = runner_argv(codes, envs, folder, args)
        runner = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return collect(runner, codes, files)
