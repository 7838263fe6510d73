"""Every benchmark entry point (``python -m benchmarks.X.Y``), read through its ``build_parser()``: numbers and paths are
checked by argparse before any work (a 0 or a negative count ran a meaningless row, hung a peer rank or failed with a
traceback), ``--help`` is whole and quick, and the JSON carries the same provenance (the command, the hardware, the
torch version, the date)."""
import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import _common

ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINTS = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "benchmarks").rglob("*.py")
                      if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8"))
# a plain int/float is allowed only where any value of it is meaningful
PLAIN_NUMBER_OK = {("benchmarks.t5.table", "--seed"): "a seed may be any integer"}
# options naming a file or folder: each needs a type that checks it before the run
PATH_DESTS = {"json", "png", "out_dir", "data_dir", "dir", "model"}
# text options without a checking type: each checked in main() before any work, or any text is meaningful
FREE_TEXT_OK = {
    ("benchmarks.kernel.adam_step", "--also-level"): "the levels come from the compiled module, imported after the "
                                                     "parse (torch must not start before --threads is set)",
}


def _parsers(module: str):
    """(label, parser) of the module and of each of its subcommands."""
    parser = importlib.import_module(module).build_parser()
    out = [(module, parser)]
    for action in parser._actions:
        if action.choices and isinstance(action.choices, dict):  # subparsers
            out += [(f"{module} {name}", sub) for name, sub in action.choices.items()]
    return out


def _options():
    for module in ENTRY_POINTS:
        for label, parser in _parsers(module):
            for action in parser._actions:
                if action.option_strings or action.dest not in ("help",):
                    yield module, label, parser, action


def _flag(action) -> str:
    return "/".join(action.option_strings) or action.metavar or action.dest


def test_the_entry_points_are_found_and_each_has_build_parser():
    assert {"benchmarks.kernel.adam_step", "benchmarks.engine.compact_quality", "benchmarks.t5.table",
            "benchmarks.gpu.check", "benchmarks.sharding.sharded_step"} <= set(ENTRY_POINTS), ENTRY_POINTS
    for module in ENTRY_POINTS:
        assert callable(getattr(importlib.import_module(module), "build_parser", None)), module


def test_every_number_and_path_option_has_a_checked_type():
    plain, unchecked_paths = [], []
    for module, label, _, action in _options():
        numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
        untyped_number = action.type is None and numeric_default and action.nargs != 0 and action.const is None
        if (action.type in (int, float) or untyped_number) and action.choices is None:
            if (module, _flag(action)) not in PLAIN_NUMBER_OK:
                plain.append(f"{label} {_flag(action)}")
        if action.dest in PATH_DESTS and action.type is None:
            unchecked_paths.append(f"{label} {_flag(action)}")
    assert not plain, f"plain int/float options (use benchmarks._common's checked types): {plain}"
    assert not unchecked_paths, f"path options without a checking type: {unchecked_paths}"


def test_every_text_option_is_checked_or_said_free():
    """A list of rows or dtypes, a device: a typo failed after the model was built (a KeyError), or the rest of the
    run went on without it; checked by name_list / torch_device, or listed in FREE_TEXT_OK with the reason."""
    free = []
    for module, label, _, action in _options():
        text = (action.type is None and action.choices is None and action.nargs != 0 and action.const is None
                and action.option_strings and not isinstance(action.default, (bool, int, float)))
        if text and (module, _flag(action).split("/")[0]) not in FREE_TEXT_OK:
            free.append(f"{label} {_flag(action)}")
    assert not free, f"text options without a checking type (benchmarks._args: name_list, torch_device): {free}"


_NUMBER_TYPE = re.compile(r"an integer >= (\d+)|a positive number|a number >= 0|comma-separated integers >= (\d+)")


def _bad_values(action) -> list[str]:
    """Values the option must refuse: below its least (0 for the positive ones, -1 for all), a path it cannot use."""
    name = getattr(action.type, "__name__", "")
    m = _NUMBER_TYPE.fullmatch(name)
    if m:
        least = int(m.group(1) or m.group(2) or 0) if "integer" in name else (1 if "positive" in name else 0)
        values = sorted({"-1", str(least - 1) if least > 0 else "-1"})
        if "integer" not in name:
            values.append("inf")  # (--params inf: an OverflowError traceback at int())
        return [f"1,{v}" for v in values] if name.startswith("comma") else values
    if action.type in (_common.json_target, _common.output_file, _common.output_dir):
        return ["/proc/hzo_no/x.json"]
    if action.type is _common.existing_dir:
        return [str(ROOT / "no_such_folder_hzo")]
    if action.type is _common.model_list:
        return ["t5-tinny", "t5-tiny,t5-tiny", ","]
    if action.type is _common.model_config or name == "_model_path":
        return ["t5-tinny"]
    allowed = getattr(action.type, "allowed", None)
    if allowed:  # a name outside the list, one given twice, none at all
        return ["nosuchname", f"{allowed[0]},{allowed[0]}", ","]
    if action.type is _common.torch_device:
        return ["tpu", "cuda:99"]
    return []


def test_bad_numbers_and_paths_are_one_usage_line_naming_the_flag(capsys):
    """Every checked option of every benchmark, fed a value under its least (0, -1) or an unusable path: argparse
    exits with status 2 and one error line naming the flag and what it expects, before any work."""
    tried = []
    for module, label, parser, action in _options():
        for value in _bad_values(action):
            argv = [f"{action.option_strings[0]}={value}"] if action.option_strings else [value]
            with pytest.raises(SystemExit) as e:
                parser.parse_args(argv)
            err = capsys.readouterr().err.strip().splitlines()
            errors = [ln for ln in err if "error:" in ln]
            assert e.value.code == 2 and len(errors) == 1 and errors == err[-1:], (label, argv, err)
            shown = value.split("/")[-1].split(",")[0]  # (a list's error names the bad item)
            named = f"argument {_flag(action)}: " in errors[0] and shown in errors[0]
            assert named and "Traceback" not in "\n".join(err), errors
            tried.append(f"{label} {argv[0]}")
    assert len(tried) >= 40 and any("--repeat=0" in t for t in tried), tried  # the walk reached the options


@pytest.mark.parametrize("argv, says", [
    (["engine.compact_rss", "--steps", "0"], "argument --steps: 0: an integer >= 1 expected"),
    (["t5.table", "--repeat", "-1"], "argument --repeat: -1: an integer >= 1 expected"),
    (["engine.many_tensors", "--tensors", "10,0"], "argument --tensors: '10,0': comma-separated integers >= 1"),
    (["engine.offload_step", "--warmup", "2"], "argument --warmup: 2: an integer >= 3 expected"),
    (["engine.compact_quality", "--lr", "0"], "argument --lr: 0: a positive number expected"),
    (["t5.table", "--bs_rel_tol", "nan"], "argument --bs_rel_tol: nan: a number >= 0 expected"),
    (["engine.offload_step", "--rows", "a,x"], "argument --rows: x: not a row; rows are a,b,c,d,e"),
    (["engine.compact_rss", "--dtypes", "fp32,fp16"], "argument --dtypes: fp16: not a state dtype; state dtypes are "
                                                      "fp32,bf16,int8"),
    (["engine.compact_quality", "--dtypes", "fp32,int8,int8"], "argument --dtypes: int8: given twice"),
    (["t5.table", "--rows", "zero2-offload"], "argument --rows: zero2-offload: not a row; rows are baseline,"),
    (["t5.planner_validate", "--gpu-rows", ""], "argument --gpu-rows: '': one or more GPU tier rows expected"),
    (["engine.offload_step", "--device", "cuda:99"], "argument --device: cuda:99: " +
     ("no CUDA device here" if not torch.cuda.is_available() else "this machine has")),
])
def test_sample_flags(argv, says, capsys):
    parser = importlib.import_module(f"benchmarks.{argv[0]}").build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv[1:])
    assert e.value.code == 2 and says in capsys.readouterr().err.splitlines()[-1]


def test_help_of_every_entry_point_is_whole():
    """``--help`` of each, as a user runs it: status 0, the description not cut to its first line (compact_quality's
    stopped mid-sentence), every option listed."""
    from _help import help_runs  # each help runs once a session (test_docs_commands reads them too)

    runs = help_runs([("-m", m) for m in ENTRY_POINTS])
    for module, r in zip(ENTRY_POINTS, runs):
        assert r.returncode == 0 and r.stdout.startswith("usage:") and "Traceback" not in r.stderr, (module, r.stderr)
        doc = importlib.import_module(module).__doc__.strip().splitlines()
        assert doc[-1].strip() in r.stdout, module  # the docstring's last line: the whole description
        for label, parser in _parsers(module):
            if label != module:
                assert label.split()[-1] in r.stdout, (module, label)  # a subcommand is named, its options in its help
                continue
            for action in parser._actions:
                for opt in action.option_strings:
                    assert opt in r.stdout, (module, opt)


def test_every_json_is_built_on_the_provenance_helper():
    """Each entry point that writes JSON starts it with benchmarks._common.provenance (some had no command, some no
    hardware, none the date); state_checksum's is checked end to end below."""
    for module in ENTRY_POINTS:
        text = (ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")
        if "write_json(" in text or "json.dump(" in text:
            assert f'provenance("{module}"' in text, f"{module} writes JSON without benchmarks._common.provenance"


def test_state_checksum_json_end_to_end(tmp_path):
    """At a toy size, in-process: the JSON's provenance, the command being the one that reproduces it."""
    import torch

    from benchmarks.engine import state_checksum

    out = tmp_path / "sub" / "state.json"
    argv = ["--gib", "0.0005", "--repeat", "1", "--dir", str(tmp_path), "--json", str(out)]
    state_checksum.main(argv)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "engine.state_checksum" and len(data["rows"]) == 2
    assert data["command"] == "python -m benchmarks.engine.state_checksum " + " ".join(argv)
    assert data["torch"] == torch.__version__ and data["hardware"]["cpu"] and data["hardware_line"].startswith("CPU: ")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", data["date"]), data["date"]


def test_the_command_names_the_switches_the_run_started_with(monkeypatch):
    monkeypatch.setattr(_common, "_START_ENV", {"HF_ZERO_OFFLOAD_SIMD": "avx2"})
    assert _common.command_line("benchmarks.x.y", ["--json", "a b.json"]) == (
        "HF_ZERO_OFFLOAD_SIMD=avx2 python -m benchmarks.x.y --json 'a b.json'")
    monkeypatch.setattr(sys, "argv", ["/x/y.py", "--rounds", "2"])
    monkeypatch.setattr(_common, "_START_ENV", {})
    assert _common.command_line("benchmarks.x.y") == "python -m benchmarks.x.y --rounds 2"
