"""The README's promises, checked as a newcomer would meet them: the Python blocks of README.md and docs/*.md run as
written from outside the clone (tiny, offline, on the CPU when there is no GPU; docs/LOOPS.md's torchrun block on two
gloo processes) without a warning, and every repository path and benchmark module they name exists."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import run_together

ROOT = Path(__file__).resolve().parent.parent
# the README's details moved to docs/*.md: what the README promised is checked where it now stands
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ALL_DOCS = "\n".join(f.read_text(encoding="utf-8") for f in DOCS)


FRAGMENT = "<!-- fragment -->"  # on the line before a ```python block: compiled, not run
# a block whose first line is this command is saved under that name and run so: `# torchrun --nproc_per_node 2 loop.py`
TORCHRUN = re.compile(r"# torchrun --nproc_per_node[ =](\d+) (\w+\.py)\n")
# what a block may print that reads as a warning: advice for the CPU it runs on (the README's block says so too)
EXPECTED = re.compile(r"hf_zero_offload: --bf16 \(bf16=True\) on a CPU without AVX512-BF16 or AMX")


def python_blocks(text: str) -> list[tuple[str, bool]]:
    """(code, fragment) of each ```python block of a Markdown text."""
    found = re.findall(r"^(?:(" + re.escape(FRAGMENT) + r")[ \t]*\n\s*)?```python\n(.*?)^```", text, flags=re.S | re.M)
    return [(code, bool(mark)) for mark, code in found]


BLOCKS = {f"{f.relative_to(ROOT)}:{i}": block for f in DOCS
          for i, block in enumerate(python_blocks(f.read_text(encoding="utf-8")), start=1)}


def warnings_in(output: str) -> list[str]:
    """The lines of a run's output a user would read as a warning: Python's (``UserWarning: ...``), a logger's
    (``WARNING:name:`` under basicConfig; our logger's bare ``hf_zero_offload: ...`` before any configuration is
    logging's last-resort handler, WARNING and above), torch's C++ ones (``[W...]``, glog's ``W1205 ...``)."""
    return [ln for ln in output.splitlines()
            if (re.search(r"(?i)warn", ln) or ln.startswith("hf_zero_offload: ") or re.match(r"\[?[WE]\d{4} ", ln))
            and not EXPECTED.search(ln)]


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory) -> dict:
    """Every runnable block run as written, each in a fresh interpreter in a directory of its own outside the clone
    (no PYTHONPATH: the installed package), all side by side; a `# torchrun --nproc_per_node N x.py` block saved as
    x.py and run by torchrun (gloo on this CPU). {where: CompletedProcess}."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # (OMP_NUM_THREADS set: torchrun warns that it sets it to 1 otherwise)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    argvs, cwds = [], []
    runnable = {where: code for where, (code, fragment) in BLOCKS.items() if not fragment}
    for where, code in runnable.items():
        cwd = tmp_path_factory.mktemp("block")
        launch = TORCHRUN.match(code)
        script = cwd / (launch[2] if launch else "block.py")
        script.write_text(code, encoding="utf-8")
        argvs.append([sys.executable, *(("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={launch[1]}")
                                        if launch else ()), str(script)])
        cwds.append({"cwd": cwd})
    runs = run_together(argvs, jobs=len(argvs), per_child=cwds, env=env, timeout=600)
    return {where: (r, c["cwd"]) for where, r, c in zip(runnable, runs, cwds)}


@pytest.mark.parametrize("where", sorted(BLOCKS))
def test_python_blocks_run_as_written_outside_the_clone(where, block_runs):
    """Each ```python block of README.md and docs/*.md, as a newcomer pastes it: it runs (a fragment compiles) and
    says nothing a user would take for a warning (the loops' blocks also check their own resume, bit for bit)."""
    code, fragment = BLOCKS[where]
    if fragment:
        compile(code, where, "exec")
        return
    r, _ = block_runs[where]
    assert r.returncode == 0, f"{where}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    assert not warnings_in(r.stdout + r.stderr), f"{where} warns: {warnings_in(r.stdout + r.stderr)}"


def test_the_docs_blocks_are_read_as_written():
    """The README's Trainer block and docs/LOOPS.md's three loops are among them, its torchrun block launched so; a
    fragment is marked; a warning is found in each of its forms."""
    assert {"README.md:1", "docs/LOOPS.md:1", "docs/LOOPS.md:2", "docs/LOOPS.md:3"} <= set(BLOCKS)
    assert TORCHRUN.match(BLOCKS["docs/LOOPS.md:3"][0]) and not any(TORCHRUN.match(c) for c, _ in
                                                                    [BLOCKS["docs/LOOPS.md:1"], BLOCKS["README.md:1"]])
    md = "x\n\n```python\nrun()\n```\n<!-- fragment -->\n\n```python\nengine.step()\n```\n"
    assert python_blocks(md) == [("run()\n", False), ("engine.step()\n", True)]
    for line in ("a.py:3: UserWarning: x", "WARNING:hf_zero_offload:x", "hf_zero_offload: OffloadAdam.step() with no",
                 "[W1205 10:00:00.1 init.cpp:1] x", "W1205 10:00:00.1 123 run.py:1] x"):
        assert warnings_in(line) == [line], line
    assert not warnings_in("INFO:hf_zero_offload:hf_zero_offload: config=x\nstep 6: loss 0.27")


def test_the_readme_trainer_block_trains_with_the_engine(block_runs):
    r, cwd = block_runs["README.md:1"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "hf_zero_offload: config=" in r.stdout + r.stderr  # the engine ran, from the shipped config
    reserved = re.search(r"host_reserved=([\d.]+)([MG]iB)", r.stdout + r.stderr)
    assert reserved and float(reserved.group(1)) > 0, "the tiny model's host arena must not read as 0"
    assert (cwd / "out").is_dir()


def test_named_paths_and_modules_exist():
    text = ALL_DOCS
    for path in sorted(set(re.findall(r"(?<![\w/.])((?:configs|examples|benchmarks|tests|hf_zero_offload)/[\w./-]+"
                                      r"\.(?:py|json|sh|md))", text))):
        assert (ROOT / path).exists(), f"README.md or docs/ names {path}, which does not exist"
    for module in sorted(set(re.findall(r"python -m (benchmarks(?:\.\w+)+)", text))):
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), module


def test_architecture_names_every_module():
    """docs/ARCHITECTURE.md is the map a newcomer reads first: every module of the package is on it."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    missing = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "hf_zero_offload").rglob("*.py")
                     if not p.name.startswith("_") and f"{p.name} " not in text and f"{p.name}:" not in text
                     and f"{p.name})" not in text and f"{p.name}," not in text)
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}"


def test_what_the_readme_says_an_overflow_step_logs_and_sigterm_does():
    """The README promised `inf` for every skipped overflow step; a NaN gradient (a loss times a static scale
    that overflows) logs nan, as clip_grad_norm_ does. SIGTERM got no word while Ctrl-C's hint was documented."""
    from hf_zero_offload.engine.loss_scaler import LossScaler, decide_step

    flat = " ".join(ALL_DOCS.split())
    for sumsq, shown in ((float("inf"), "`inf` on a skipped overflow step"), (float("nan"), "or `nan` where a gradient "
                                                                                           "is NaN")):
        result, grad_scale = decide_step(LossScaler.from_fp16(enabled=True, loss_scale=128), sumsq, 1.0)
        assert result.skipped and grad_scale is None and str(result.grad_norm) == shown.split("`")[1] and shown in flat
    assert "ends it at once with exit 143 and no message" in flat


_RESOLVE = """
import importlib, sys
import hf_zero_offload
bad = []
for name in sys.argv[1:]:
    parts = name.split(".")
    try:
        obj = getattr(hf_zero_offload, parts[1])  # after `import hf_zero_offload` alone, as the docs' code uses it
        for i in range(2, len(parts)):
            try:
                obj = getattr(obj, parts[i])
            except AttributeError:  # a module of a subpackage, named for `python -m` or an import
                obj = importlib.import_module(".".join(parts[:i + 1]))
    except (AttributeError, ImportError) as e:
        bad.append(f"{name}: {e}")
print("\\n".join(bad))
"""


def test_every_dotted_name_the_docs_give_resolves():
    """The README's `hf_zero_offload.torch_state.torch_optimizer_state(DIR)` was an AttributeError after `import
    hf_zero_offload` (submodules were not attributes until imported), an outside probe; checked for every
    `hf_zero_offload.x.y` the docs name, in a fresh interpreter (this one has imported most modules)."""
    docs = [ROOT / "README.md", ROOT / "examples" / "seq2seq" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "benchmarks").glob("*.md"))]
    names = sorted({n for f in docs for n in re.findall(r"\bhf_zero_offload(?:\.[A-Za-z_]\w*)+",
                                                        f.read_text(encoding="utf-8"))})
    assert "hf_zero_offload.torch_state.torch_optimizer_state" in names
    r = subprocess.run([sys.executable, "-c", _RESOLVE, *names], capture_output=True, text=True, timeout=300,
                       cwd=str(ROOT / "tests"))
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr[-2000:]


def test_only_the_packages_own_modules_are_lazy_attributes():
    """Dotted or odd names raised ModuleNotFoundError (hasattr raised), "engine.core" returned the module and the
    configs folder imported as a namespace package (an outside probe)."""
    import hf_zero_offload

    for name in (".", "a..b", "py.typed", "engine.core", "configs", "nothing", "_C2"):
        assert not hasattr(hf_zero_offload, name), name
    assert hf_zero_offload.torch_state.__name__ == "hf_zero_offload.torch_state"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks, whose ``# comment`` lines are no headings."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_links_between_the_docs_resolve():
    """The README's details live in docs/*.md and point at each other by file and heading: a heading renamed or a
    file moved leaves a link to nothing, which no reader reports. Every Markdown file of the checkout (the
    benchmarks' and examples' READMEs point into docs/ too); a code block's comment line counted as a heading."""
    bad = []
    docs = {*DOCS, *(f for d in ("benchmarks", "examples", "configs", "hf_zero_offload")
                     for f in (ROOT / d).rglob("*.md"))}
    for doc in sorted(docs):
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(doc.read_text(encoding="utf-8"))):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                heads = {_anchor(h) for h in re.findall(r"^#+ (.*)$", _prose(dest.read_text(encoding="utf-8")),
                                                        flags=re.M)}
                if anchor not in heads:
                    bad.append(f"{doc.relative_to(ROOT)}: {target}: no such heading")
    assert not bad, bad
