"""hf_zero_offload as outsiders install it: the core install without the [trainer] extra, the sdist's and the
wheel's contents, the build's message without a compiler, and the per-instruction-set objects of the build that
must not leak AVX code into what runs before CPUID is checked. Everything else in the suite runs from the checkout.
"""
from __future__ import annotations

import glob
import importlib.machinery
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import torch

import hf_zero_offload
from _tools import tool
from hf_zero_offload import extras

ROOT = Path(__file__).resolve().parent.parent
CORE = ["torch", "numpy", "psutil"]  # pyproject's dependencies: what a plain `pip install` brings


def _tracked(prefix: str = "") -> set[str]:
    """The checkout's files under ``prefix`` (git's list: a file left untracked is nobody's to ship)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z", "--", prefix or "."], cwd=ROOT, capture_output=True, timeout=60)
    return {f for f in out.stdout.decode().split("\0") if f and (ROOT / f).is_file()}


# -- without the [trainer] extra -------------------------------------------------------------------------------------
_NO_TRAINER_EXTRA = r"""
import os, sys, tempfile
for m in ("transformers", "accelerate", "safetensors"):  # an install without the [trainer] extra
    sys.modules[m] = None
import torch
import hf_zero_offload
from hf_zero_offload import CPUAdam, cli
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

torch.manual_seed(0)
p, q = torch.nn.Parameter(torch.randn(33)), None
q = torch.nn.Parameter(p.detach().clone())
ours, ref = CPUAdam([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2, weight_decay=0.0, foreach=False)
for _ in range(2):
    g = torch.randn(33)
    p.grad, q.grad = g.clone(), g.clone()
    ours.step(); ref.step()
assert torch.equal(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"])
assert torch.equal(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
model = torch.nn.Linear(4, 2)
engine = OffloadAdam(model.named_parameters(), lr=1e-2, options=OffloadOptions())
model(torch.randn(3, 4)).sum().backward(); engine.step(); engine.close()
assert cli.main(["configs"]) == 0
import hf_zero_offload.torch_state, hf_zero_offload.planner.heads  # no transformers at import
print("CORE-OK")

def said(what, run):
    try:
        run()
    except ModuleNotFoundError as e:
        print("SAID", what, "|", e)
    else:
        print("RAN", what)

said("trainer", lambda: __import__("hf_zero_offload.trainer"))
said("consolidate", lambda: __import__("hf_zero_offload.consolidate"))
said("attr-consolidate", lambda: hf_zero_offload.consolidate)
said("attr-trainer", lambda: hf_zero_offload.ZeroOffloadSeq2SeqTrainer)
said("planner", lambda: hf_zero_offload.planner.plan({"model_type": "t5"}))
said("planner-heads", lambda: hf_zero_offload.planner.heads.model_class(None))
for argv in (["estimate", "--model", os.path.join(tempfile.mkdtemp(), "c.json")], ["consolidate", "a", "b"]):
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    print("EXIT", argv[0], code, file=sys.stderr)
"""


def test_without_the_trainer_extra_the_core_works_and_the_rest_names_the_extra(tmp_path):
    """From a wheel with no extra: `import hf_zero_offload.trainer` and `hf_zero_offload.consolidate` said only "No
    module named 'transformers'/'safetensors'", and the CLI's line named "'<the checkout>[trainer]'" and the
    checkout's .venv, which a wheel's user has not got."""
    r = subprocess.run([sys.executable, "-c", _NO_TRAINER_EXTRA], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "CORE-OK" in r.stdout, r.stderr[-3000:]
    command = extras.install_command("trainer")
    said = dict(ln.split(" ", 2)[1:] for ln in r.stdout.splitlines() if ln.startswith("SAID "))
    assert set(said) == {"trainer", "consolidate", "attr-consolidate", "attr-trainer", "planner", "planner-heads"}, \
        r.stdout
    for what, message in said.items():
        assert "[trainer] extra" in message and command in message and "\n" not in message, (what, message)
        assert re.search(r"needs (transformers|safetensors)", message), (what, message)
    errors = [ln for ln in r.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 2 and all(f"[trainer] extra ({command})" in ln for ln in errors), r.stderr[-3000:]
    assert "EXIT estimate 2" in r.stderr and "EXIT consolidate 2" in r.stderr and "checkout" not in r.stderr


def test_one_package_of_the_extra_missing_is_named_whichever_imports_it(tmp_path):
    """transformers and accelerate there, safetensors not (installed on their own, or uninstalled): accelerate's own
    import of safetensors failed inside ``require``, whose message was only "No module named 'safetensors'"."""
    code = ("import sys; sys.modules['safetensors'] = None\n"
            "try:\n    import hf_zero_offload.trainer\nexcept ModuleNotFoundError as e:\n    print(e)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.stdout.startswith("hf_zero_offload.trainer needs safetensors, an optional dependency"), r.stdout + r.stderr


def test_the_install_command_names_the_installed_package_or_else_the_source_tree(monkeypatch):
    try:
        metadata.distribution("hf_zero_offload")
    except metadata.PackageNotFoundError:
        pytest.skip("hf_zero_offload is not installed here")
    # installed (here: the editable install of make install): pip adds the extra's packages and keeps ours
    assert extras.install_command("trainer") == "pip install 'hf_zero_offload[trainer]'"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    # a source tree on PYTHONPATH: the name is on no index (another project's, at worst): the tree is named
    monkeypatch.setattr(extras.metadata, "distribution", not_installed)
    assert extras.install_command("examples") == f"pip install '{ROOT}[examples]'"


def test_the_version_is_the_same_in_the_package_and_its_metadata():
    declared = re.search(r'(?m)^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert hf_zero_offload.__version__ == declared
    try:
        assert metadata.version("hf_zero_offload") == declared
    except metadata.PackageNotFoundError:
        pass


# -- what the sdist and the wheel hold -------------------------------------------------------------------------------
def _needed_to_build_and_use() -> set[str]:
    """What a build from the sdist and a user of it need: every tracked file of the package (modules, the shipped
    configs, py.typed), the C++ sources and the build's files."""
    needed = _tracked("hf_zero_offload") | _tracked("csrc")
    needed |= {"CMakeLists.txt", "pyproject.toml", "LICENSE", "README.md"}
    assert {f"hf_zero_offload/configs/{n}.json" for n in ("zero2", "zero2-offload")} <= needed
    assert "hf_zero_offload/py.typed" in needed and any(f.endswith(".h") for f in needed)
    return needed


_NEVER_SHIPPED = re.compile(r"(^|/)(build|\.venv|output|dist|out|__pycache__|\.pytest_cache|\.git)/|\.(so|pyc|o)$")


def test_the_sdist_holds_what_the_build_needs_and_nothing_built(tmp_path):
    """scikit-build-core picks the sdist's files by .gitignore and pyproject's sdist.include/exclude; this checkout,
    after make install, holds build/, .venv and caches beside the sources, none of which may ship."""
    pytest.importorskip("scikit_build_core")
    code = f"import scikit_build_core.build as b; print(b.build_sdist({str(tmp_path)!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    sdist = tmp_path / r.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as tar:
        top = f"hf_zero_offload-{hf_zero_offload.__version__}/"
        names = {m.name[len(top):] for m in tar.getmembers() if m.isfile()}
    missing = _needed_to_build_and_use() - names
    assert not missing, f"the sdist lacks {sorted(missing)}"
    assert not [n for n in names if _NEVER_SHIPPED.search(n)], sorted(n for n in names if _NEVER_SHIPPED.search(n))
    assert "PKG-INFO" in names


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_runs_outside_the_checkout(tmp_path):
    """Builds the wheel (about a minute on 2 cores) as `pip wheel .` does, then imports it from a folder that is not
    the checkout: every tracked file of the package, the compiled module, nothing else."""
    pytest.importorskip("scikit_build_core")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist")], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel, = glob.glob(str(tmp_path / "dist" / "*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {n for n in names if n.startswith("hf_zero_offload/")}
    compiled = {n for n in package if re.fullmatch(r"hf_zero_offload/_C\..*\.so", n)}
    assert len(compiled) == 1 and package - compiled == _tracked("hf_zero_offload"), sorted(package ^ _tracked(
        "hf_zero_offload"))
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "t"),
                        wheel], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    code = ("import hf_zero_offload, torch; from hf_zero_offload import CPUAdam; print(hf_zero_offload.__file__)\n"
            "p = torch.nn.Parameter(torch.randn(99)); q = torch.nn.Parameter(p.detach().clone())\n"
            "a, b = CPUAdam([p], lr=0.1), torch.optim.AdamW([q], lr=0.1, weight_decay=0.0, foreach=False)\n"
            "for _ in range(3):\n"
            "    p.grad = torch.randn(99); q.grad = p.grad.clone(); a.step(); b.step()\n"
            "print(all(torch.equal(a.state[p][k], b.state[q][k]) for k in ('exp_avg', 'exp_avg_sq')), "
            "bool((p - q).abs().max() < 1e-6))")
    # -S: no .pth files, so not this venv's editable install (its finder comes before PYTHONPATH); torch from the
    # venv's site-packages, after the wheel's folder
    site = os.path.dirname(os.path.dirname(torch.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "t"), site]))
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [str(tmp_path / "t" / "hf_zero_offload" / "__init__.py"), "True", "True"], r.stdout


def _import_error_beside(tmp_path: Path, name: str, data: bytes) -> str:
    """stderr of `import hf_zero_offload` from a copy of its __init__.py with ``data`` as the file ``name``."""
    pkg = tmp_path / "hf_zero_offload"
    pkg.mkdir(parents=True)
    shutil.copy(ROOT / "hf_zero_offload" / "__init__.py", pkg / "__init__.py")
    (pkg / name).write_bytes(data)
    r = subprocess.run([sys.executable, "-S", "-c", "import hf_zero_offload"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "not built" not in r.stderr, r.stderr[-2000:]
    return r.stderr.strip().splitlines()[-1]


def test_kernels_built_on_a_newer_system_say_so_and_what_to_do(tmp_path):
    """A wheel built here (glibc 2.36, GCC 12) on an older system: the loader's "version `GLIBCXX_3.4.30' not found";
    the error said the kernels were "not built" and to run make install in a checkout."""
    from hf_zero_offload import _C

    data = Path(_C.__file__).read_bytes()
    if b"GLIBCXX_3.4" not in data:
        pytest.skip("this build needs no versioned libstdc++ symbol")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    line = _import_error_beside(tmp_path, "_C" + suffix, data.replace(b"GLIBCXX_3.4", b"GLIBCXX_9.4"))  # (too new)
    assert f"kernels ({tmp_path / 'hf_zero_offload' / ('_C' + suffix)}) do not load on this machine" in line, line
    assert "newer C/C++ runtime" in line and "GLIBCXX_9.4" in line and "from its sdist" in line, line


def test_kernels_of_another_python_or_unloadable_say_which(tmp_path):
    line = _import_error_beside(tmp_path / "a", "_C.cpython-39-x86_64-linux-gnu.so", b"x")
    assert "(_C.cpython-39-x86_64-linux-gnu.so) were built for another Python" in line, line
    line = _import_error_beside(tmp_path / "b", "_C" + importlib.machinery.EXTENSION_SUFFIXES[0], b"not an ELF")
    assert "do not load on this machine [ImportError: " in line and "newer" not in line, line


def test_an_editable_installs_unloadable_kernels_are_not_called_unbuilt(tmp_path):
    """An editable install (make install) keeps _C in site-packages, found by scikit-build-core's import hook, not
    beside __init__.py: kernels there that did not load (a newer system's build) were called "not built" in the
    source tree, with make install to run."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    built = tmp_path / "site" / ("_C" + suffix)
    built.parent.mkdir()
    built.write_bytes(b"not an ELF")
    hook = (f"import importlib.util, sys\n"
            f"class Redirect:\n"
            f"    def find_spec(self, name, path=None, target=None):\n"
            f"        if name == 'hf_zero_offload._C':\n"
            f"            return importlib.util.spec_from_file_location(name, {str(built)!r})\n"
            f"sys.meta_path.insert(0, Redirect())\n")
    pkg = tmp_path / "src" / "hf_zero_offload"
    pkg.mkdir(parents=True)
    shutil.copy(ROOT / "hf_zero_offload" / "__init__.py", pkg / "__init__.py")
    r = subprocess.run([sys.executable, "-S", "-c", hook + "import hf_zero_offload"], cwd=pkg.parent,
                       capture_output=True, text=True, timeout=120)
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and "not built" not in line, line
    assert f"kernels ({built}) do not load on this machine [ImportError: " in line, line


# -- the build on other machines -------------------------------------------------------------------------------------
def test_a_build_without_a_cxx_compiler_says_what_to_install(tmp_path):
    """CMake's own error was "Could not find compiler set in environment variable CXX: g++." on a machine where
    nobody had set CXX (scikit-build-core sets it)."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"))
    r = subprocess.run([tool("cmake"), "-S", str(ROOT), "-B", str(tmp_path / "b")], env=env, capture_output=True,
                       text=True, timeout=120)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode != 0 and "hf_zero_offload: no working C++ compiler found" in out, out[-3000:]
    assert f"CXX='{tmp_path / 'no-such-compiler'}'" in out and "apt install g++" in out


def test_a_cxx_of_a_wrapper_and_its_compiler_builds_with_both(tmp_path):
    """CXX="ccache g++" (a wrapper, then the compiler; here `env g++`, the same shape): the compiler check cached the
    wrapper's path alone, and CMake then took /usr/bin/env for the compiler ("identification is unknown")."""
    if shutil.which("g++") is None or shutil.which("env") is None:
        pytest.skip("needs g++ and env")
    env = dict(os.environ, CXX="env g++")
    r = subprocess.run([tool("cmake"), "-S", str(ROOT), "-B", str(tmp_path / "b")], env=env, capture_output=True,
                       text=True, timeout=120)
    out = r.stdout + r.stderr
    assert "The CXX compiler identification is GNU" in out, out[-3000:]


def _isa_objects() -> list[Path]:
    found = sorted(ROOT.glob("build/cp*/CMakeFiles/hzo_*.dir/csrc/*.o"))  # make install's build (build/{wheel_tag})
    if not found:
        pytest.skip("no build directory of make install here")
    return found


def test_the_per_isa_objects_share_no_code_with_the_rest():
    """Each instruction set's unit is compiled with its own -m flags; an inline function or template it shares with
    the generic code (a weak, COMDAT symbol) could be linked from that unit's AVX copy into code that runs on any
    x86-64 (SIGILL on a CPU without AVX). Each unit may define its kernel table alone, and call nothing."""
    nm = tool("nm")
    for obj in _isa_objects():
        isa = obj.parent.parent.name[len("hzo_"):-len(".dir")]
        r = subprocess.run([nm, "-C", str(obj)], capture_output=True, text=True, timeout=60, check=True)
        symbols = [ln.split(maxsplit=2)[-2:] for ln in r.stdout.splitlines()]
        shared = [s for s in symbols if s[0] not in "tdbrn"]  # anything but the unit's own (local) code and data
        if isa == "scalar":  # built without -m flags: the reference path of every x86-64 (and other) CPU
            assert not [s for s in shared if s[0] in "WVuv"], (obj, shared)
            dis = subprocess.run([tool("objdump"), "-d", str(obj)], capture_output=True, text=True, timeout=60).stdout
            assert not re.search(r"%[yz]mm|vfmadd", dis), obj
        else:
            assert shared == [["T", f"hzo::{isa}_kernels()"]], (obj, shared)
