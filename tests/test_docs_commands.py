"""Every command the docs show (README.md, docs/*.md, examples/seq2seq/README*.md, benchmarks/**/README.md: code
blocks and inline code) is one a newcomer can type: the script or module exists where the command runs from, every
flag it passes is one the program knows, a ``--zero_offload`` value resolves from that directory, and
``finetune_trainer.py``'s command lines parse and resolve their ds_config against their own arguments. Running
them is test_readme.py's, test_examples*.py's and the benchmarks' own tests' job; this checks the spelling of all.
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from _help import help_run, help_runs

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples" / "seq2seq"
DOCS = sorted({ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *EX.glob("README*.md"),
               *(ROOT / "benchmarks").rglob("README.md")})
PROGRAMS = ("python", "python3", "torchrun", "hf-zero-offload", "make", ".venv/bin/python")


def _code(text: str) -> list[str]:
    """The text of fenced shell/diff blocks (a diff's removed lines dropped) and of inline code spans."""
    out = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if lang in ("", "bash", "sh", "console", "shell"):
            out.append(body)
        elif lang == "diff":
            out.append("\n".join(ln[1:] for ln in body.splitlines() if not ln.startswith("-")))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return out


def _commands(doc: Path) -> list[tuple[str, list[str]]]:
    found = []
    for block in _code(doc.read_text(encoding="utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s#\s.*$", "", line).strip()
            if line.startswith("$ "):
                line = line[2:]
            try:
                words = shlex.split(line)
            except ValueError:  # prose in backticks with an apostrophe: not a command
                continue
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the program
                words = words[1:]
            if words and words[0] in PROGRAMS and len(words) > 1:
                found.append((line, words))
    return found


COMMANDS = [(doc, line, words) for doc in DOCS for line, words in _commands(doc)]


def _flags(words: list[str]) -> set[str]:
    return {w.split("=", 1)[0] for w in words if re.fullmatch(r"--[A-Za-z][\w-]*(=.*)?", w)}


def _help(*argv: str) -> str:
    r = help_run(*argv)  # (tests/_help.py: each help runs once a session, without PYTHONPATH, from ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def _target(words: list[str]) -> tuple[str, list[str]] | None:
    """(``-m module`` / script path / ``hf-zero-offload SUB``, the arguments after it); None when not ours."""
    if words[0] == "torchrun":
        scripts = [i for i, w in enumerate(words) if w.endswith(".py")]
        return (words[scripts[0]], words[scripts[0] + 1:]) if scripts else None
    if words[0] == "hf-zero-offload":
        return f"hf-zero-offload {words[1]}", words[2:]
    if words[1] == "-m" and words[2].startswith(("benchmarks", "hf_zero_offload")):
        return f"-m {words[2]}", words[3:]
    if words[1].endswith(".py"):
        return words[1], words[2:]
    return None


def _help_argv(what: str) -> tuple[str, ...] | None:
    """The arguments before ``--help`` that describe ``what`` (a _target), None for finetune_trainer.py."""
    if what.startswith("hf-zero-offload"):
        return ("-m", "hf_zero_offload.cli", *what.split()[1:])
    if what.startswith("-m "):
        return ("-m", what[3:])
    if what.endswith("finetune_trainer.py"):
        return None
    return (str((ROOT if "/" in what else EX) / what),)


@pytest.fixture(scope="module", autouse=True)
def _helps_side_by_side():
    """Each distinct --help is a child that mostly imports torch, single-threaded: run them two at a time
    before the tests read them back (tests/_help.py keeps each, a failed one too, which its test reports)."""
    targets = [_target(words) for _, _, words in COMMANDS if words[0] != "make"]
    help_runs(sorted({_help_argv(t[0]) for t in targets if t is not None and "<" not in t[0]} - {None}))


def test_the_docs_show_commands():
    kinds = {words[0] for _, _, words in COMMANDS}
    assert {"python", "torchrun", "hf-zero-offload", "make"} <= kinds, kinds
    assert any("finetune_trainer.py" in line for _, line, _ in COMMANDS)


@pytest.mark.parametrize("doc, line, words", COMMANDS, ids=[f"{d.relative_to(ROOT)}: {ln[:60]}"
                                                           for d, ln, _ in COMMANDS])
def test_every_documented_command_names_what_exists(doc, line, words):
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert words[1] in targets, f"{doc.name}: make {words[1]}: no such target"
        return
    target = _target(words)
    if target is None or "<" in target[0]:  # pip, venv; a placeholder such as benchmarks.<topic>.<script>
        return
    what, args = target
    if what.startswith("-m "):
        module = what[3:]
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"{doc.name}: {module}: no such module"
    elif not what.startswith("hf-zero-offload"):
        cwd = ROOT if "/" in what else EX  # the blog's bare "python finetune_trainer.py" runs in examples/seq2seq
        assert (cwd / what).is_file(), f"{doc.name}: {line}: {what} not found from {cwd}"
    argv = _help_argv(what)
    if argv is None:  # finetune_trainer.py maps legacy flags --help does not list: parsed below
        return
    text = _help(*argv)
    unknown = sorted(f for f in _flags(args) if f not in text)
    assert not unknown, f"{doc.name}: {line}: {what} does not know {unknown}"


FINETUNE = [(doc, line, words) for doc, line, words in COMMANDS
            if (_target(words) or ("",))[0].endswith("finetune_trainer.py")]


@pytest.mark.parametrize("doc, line, words", FINETUNE, ids=[f"{d.relative_to(ROOT)}: {ln[:60]}"
                                                           for d, ln, _ in FINETUNE])
def test_finetune_command_lines_parse_and_their_config_resolves(doc, line, words, monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(EX))
    try:
        import seq2seq_args
    finally:
        sys.path.remove(str(EX))
    script, args = _target(words)
    monkeypatch.chdir(ROOT if "/" in script else EX)
    args = [a for a in args if a != "..."]
    # the GPU flags of a GPU command: parsing them on a CPU-only machine would fail for the wrong reason
    args = [a for a in args if a not in ("--fp16", "--bf16")] + ["--output_dir", str(tmp_path / "o")]
    model_args, data_args, targs = seq2seq_args.parse_args(args)
    if targs.zero_offload is not None:
        seq2seq_args.check_zero_config(targs, None)
