"""Helpers for benchmarks/gpu_check.sh (the one prepared script for a session with a GPU).

    python benchmarks/gpu_check.py hardware            the hardware line + CUDA facts (also as JSON with --json)
    python benchmarks/gpu_check.py tests [FILE...]     run CUDA test files WITHOUT pytest (fallback for an image
                                                       that lacks it): a tiny stand-in for the few pytest features
                                                       those files use (marks, parametrize, fixtures, approx)
    python benchmarks/gpu_check.py summary DIR         the target lines of every offload_step*.json in DIR

The fallback runner is deliberately small: module-level ``pytestmark``, ``@pytest.mark.parametrize``
(with ``ids``), ``@pytest.mark.xfail``, ``@pytest.mark.skipif``, ``@pytest.fixture`` generator fixtures
defined in the test module, the built-in ``tmp_path`` fixture, ``pytest.approx`` and ``pytest.raises``.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import inspect
import itertools
import json
import math
import os
import pathlib
import sys
import tempfile
import time
import traceback
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- hardware --------------------------------------------------------------------------------------
def cmd_hardware(args: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from _common import hardware, hardware_line

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


# -- a minimal pytest stand-in ---------------------------------------------------------------------
class _Mark:
    def __init__(self, name, args=(), kwargs=None):
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs and not self.args:
            fn = args[0]
            fn.__dict__.setdefault("_marks", []).append(self)
            return fn
        mark = _Mark(self.name, args, kwargs)

        def deco(fn):
            fn.__dict__.setdefault("_marks", []).append(mark)
            return fn
        mark.decorate = deco
        return _Applied(mark)


class _Applied:
    """``pytest.mark.x(args)``: usable as a decorator and as a value in ``pytestmark``."""

    def __init__(self, mark):
        self.mark = mark

    def __call__(self, fn):
        return self.mark.decorate(fn)


class _MarkNamespace:
    def __getattr__(self, name):
        return _Mark(name)


class _Approx:
    def __init__(self, expected, rel=None, abs=None):
        self.expected, self.rel, self.abs = expected, rel, abs

    def __eq__(self, other):
        rel = 1e-6 if self.rel is None and self.abs is None else (self.rel or 0.0)
        return math.isclose(other, self.expected, rel_tol=rel, abs_tol=self.abs or 1e-12)

    def __repr__(self):
        return f"approx({self.expected})"


class _XFailed(Exception):
    pass


class _Skipped(Exception):
    pass


def _make_stub() -> types.ModuleType:
    stub = types.ModuleType("pytest")
    stub.mark = _MarkNamespace()
    stub.approx = lambda expected, rel=None, abs=None: _Approx(expected, rel, abs)

    def fixture(fn=None, **_):
        if fn is None:
            return lambda f: setattr(f, "_fixture", True) or f
        fn._fixture = True
        return fn
    stub.fixture = fixture

    @contextlib.contextmanager
    def raises(exc, match=None):
        import re
        try:
            yield
        except exc as e:  # noqa: B030
            if match and not re.search(match, str(e)):
                raise AssertionError(f"{exc.__name__} raised but {match!r} not in {e}") from e
        else:
            raise AssertionError(f"DID NOT RAISE {exc.__name__}")
    stub.raises = raises
    stub.skip = lambda reason="": (_ for _ in ()).throw(_Skipped(reason))
    return stub


def _marks_of(obj) -> list:
    out = []
    for m in getattr(obj, "_marks", []):
        out.append(m)
    return out


def _module_marks(mod) -> list:
    out = []
    for m in getattr(mod, "pytestmark", []):
        out.append(m.mark if isinstance(m, _Applied) else m)
    return out


def _cases(fn):
    """(id, kwargs) for every parametrize combination."""
    axes = []
    for m in reversed(_marks_of(fn)):
        if m.name != "parametrize":
            continue
        names, values = m.args[0], m.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        ids = m.kwargs.get("ids") or [str(v) for v in values]
        axis = []
        for i, v in zip(ids, values):
            axis.append((i, dict(zip(names, v if len(names) > 1 else [v]))))
        axes.append(axis)
    if not axes:
        return [("", {})]
    out = []
    for combo in itertools.product(*axes):
        out.append(("-".join(i for i, _ in combo), {k: v for _, kw in combo for k, v in kw.items()}))
    return out


def _run_file(path: str, only: str | None) -> tuple[int, int, int, int]:
    sys.path.insert(0, str(pathlib.Path(path).resolve().parent))
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod_marks = _module_marks(mod)
    passed = failed = xfailed = skipped = 0
    for name, fn in list(vars(mod).items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        marks = mod_marks + _marks_of(fn)
        skip = next((m for m in marks if m.name == "skipif" and m.args and m.args[0]), None)
        xfail = next((m for m in marks if m.name == "xfail"), None)
        for case_id, kwargs in _cases(fn):
            label = f"{path}::{name}" + (f"[{case_id}]" if case_id else "")
            if only and only not in label:
                continue
            if skip is not None:
                print(f"SKIPPED {label}: {skip.kwargs.get('reason', '')}")
                skipped += 1
                continue
            gens, t0 = [], time.perf_counter()
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    for param in inspect.signature(fn).parameters:
                        if param in kwargs:
                            continue
                        if param == "tmp_path":
                            kwargs[param] = pathlib.Path(tmp)
                        elif getattr(getattr(mod, param, None), "_fixture", False):
                            gen = getattr(mod, param)()
                            if inspect.isgenerator(gen):
                                kwargs[param] = next(gen)
                                gens.append(gen)
                            else:
                                kwargs[param] = gen
                        else:
                            raise RuntimeError(f"fixture {param!r} is not supported by the fallback runner")
                    try:
                        fn(**kwargs)
                    finally:
                        for gen in reversed(gens):
                            with contextlib.suppress(StopIteration):
                                next(gen)
                dt = time.perf_counter() - t0
                if xfail is not None:
                    print(f"XPASS   {label} ({dt:.1f} s): {xfail.kwargs.get('reason', '')[:100]}")
                    passed += 1
                    if xfail.kwargs.get("strict"):
                        failed += 1
                else:
                    print(f"PASSED  {label} ({dt:.1f} s)")
                    passed += 1
            except _Skipped as exc:
                print(f"SKIPPED {label}: {exc}")
                skipped += 1
            except Exception:
                dt = time.perf_counter() - t0
                if xfail is not None:
                    print(f"XFAIL   {label} ({dt:.1f} s)")
                    xfailed += 1
                else:
                    print(f"FAILED  {label} ({dt:.1f} s)")
                    traceback.print_exc(limit=6)
                    failed += 1
            sys.stdout.flush()
    return passed, failed, xfailed, skipped


def cmd_tests(args: list[str]) -> int:
    only = None
    if "-k" in args:
        i = args.index("-k")
        only = args[i + 1]
        args = args[:i] + args[i + 2:]
    files = args or [str(ROOT / "tests" / "test_engine_cuda.py")]
    try:
        import pytest  # noqa: F401
        print("note: real pytest is importable; the fallback runner is used anyway (as asked)")
    except ImportError:
        pass
    sys.modules["pytest"] = _make_stub()
    totals = [0, 0, 0, 0]
    for f in files:
        for i, v in enumerate(_run_file(f, only)):
            totals[i] += v
    p, fl, xf, sk = totals
    print(f"== fallback runner: {p} passed, {fl} failed, {xf} xfailed, {sk} skipped ==")
    return 1 if fl else 0


# -- summary ---------------------------------------------------------------------------------------
def cmd_summary(args: list[str]) -> int:
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
        for name, why in d.get("skipped", {}).items():
            print(f"  skipped {name}: {why}")
        for line in d.get("target_lines", []):
            print(f"  {line}")
    return 0


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in {"hardware", "tests", "summary"}:
        print(__doc__)
        return 2
    return {"hardware": cmd_hardware, "tests": cmd_tests, "summary": cmd_summary}[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
