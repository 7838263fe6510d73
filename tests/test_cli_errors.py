"""A mistake costs one line: ``hf-zero-offload`` validates its numbers, names and paths before any model work,
prints ``hf-zero-offload CMD: error: ...`` and exits 2; ``--debug`` / ``HF_ZERO_OFFLOAD_DEBUG=1`` bring the
traceback back; Ctrl-C and a locale that cannot encode a path are one line too. The shipped configs and
``consolidate``'s refusals are in test_cli_errors_files.py, what the environment brings in
test_cli_errors_environment.py."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from _cli_errors import ROOT, TINY, _one_line_error

from hf_zero_offload import cli, usage
from hf_zero_offload.config import ConfigError


@pytest.mark.parametrize("extra,needle", [
    (["--gpu-mem-gib", "-1"], "--gpu-mem-gib"), (["--gpu-mem-gib", "0"], "--gpu-mem-gib"),
    (["--gpu-mem-gib", "nan"], "--gpu-mem-gib"), (["--gpu-mem-gib", "inf"], "--gpu-mem-gib"),
    (["--gpu-mem-gib", "0.4"], "safety margin"), (["--batch-size", "-3"], "--batch-size"),
    (["--batch-size", "0"], "--batch-size"), (["--seq-len", "0"], "--seq-len"), (["--tgt-len", "-1"], "--tgt-len"),
    (["--gpus", "0"], "--gpus"), (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps"),
    (["--configs", "nosuchrow"], "'nosuchrow'"), (["--bf16", "--configs", "zero2,fp16"], "'fp16'"),
    (["--configs", ""], "unknown row(s) ''"),  # it ran every row, while ",," was refused
])
def test_estimate_rejects_bad_numbers_and_names(capsys, extra, needle):
    line = _one_line_error(capsys, ["estimate", "--model", TINY, *extra], needle)
    if "--configs" in extra:
        assert "zero2_offload" in line  # the valid rows are listed


def test_estimate_bucket_numel_takes_what_a_ds_config_takes():
    """2e8 is a bucket size in a ds_config; --bucket-numel refused it."""
    from hf_zero_offload.planner.cli import _bucket
    assert _bucket("2e8") == 200_000_000 and _bucket("1000") == 1000 and _bucket("auto") == "auto"
    for bad in ("2.5", "x", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected a number of elements or auto, got '{bad}'"):
            _bucket(bad)


def test_estimate_takes_the_trainers_underscore_spellings_and_suggests_a_near_flag(capsys):
    parser = cli.build_parser()
    argv = ["estimate", "--model", TINY, "--seq_len", "64", "--tgt_len=32", "--state_dtype", "int8", "--json"]
    assert cli._dash_spellings(parser, argv) == ["estimate", "--model", TINY, "--seq-len", "64", "--tgt-len=32",
                                                 "--state-dtype", "int8", "--json"]
    assert cli._dash_spellings(parser, ["estimate", "--", "--seq_len"]) == ["estimate", "--", "--seq_len"]
    with pytest.raises(SystemExit) as e:  # argparse's own exit, as for any flag it does not know
        cli.main(["estimate", "--model", TINY, "--seq_lenx", "64"])
    assert e.value.code == 2 and "--seq_lenx (did you mean --seq-len?)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needles", [
    (["estimate", "--modle", TINY, "--gpus", "2"], ["--modle (did you mean --model?)", "required: --model"]),
    (["consolidate", "ckpt", "--with-optimiser"], ["--with-optimiser (did you mean --with-optimizer?)",
                                                   "required: output_dir"]),
    (["--verison"], ["unrecognized arguments: --verison", "required: COMMAND"]),
])
def test_a_misspelled_required_flag_is_named_not_only_the_missing_one(capsys, argv, needles):
    """argparse checks required arguments before it returns unknown ones: `--modle X` said only "the following
    arguments are required: --model", with no word of the typo on the same line."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.index(needles[0]) < err.index(needles[1]), err
    # an abbreviation argparse takes is not unknown
    assert cli.unknown_flags(cli.build_parser().subcommands["estimate"], ["--mod", "x", "--", "--zzz"]) == []


def test_estimate_unknown_model_names_the_repo_config(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    _one_line_error(capsys, ["estimate", "--model", "t5-3b"], "t5-3b", "configs/models/t5-3b.json")


def test_debug_flag_and_env_bring_the_traceback_back(monkeypatch):
    with pytest.raises(ValueError, match="--seq-len"):
        cli.main(["--debug", "estimate", "--model", TINY, "--seq-len", "0"])
    monkeypatch.setenv("HF_ZERO_OFFLOAD_DEBUG", "1")
    with pytest.raises(ValueError, match="--seq-len"):
        cli.main(["estimate", "--model", TINY, "--seq-len", "0"])


@pytest.mark.parametrize("value, debug", [("off", False), ("disable", False), ("n", False), ("on", True),
                                          ("maybe", True)])
def test_the_debug_switch_reads_off_words_as_off(monkeypatch, capsys, value, debug):
    """"off", "n" and "disable" turned the tracebacks on; a word that is neither is said, and taken as on (it only
    adds tracebacks, and is read before errors are reported)."""
    monkeypatch.setenv("HF_ZERO_OFFLOAD_DEBUG", value)
    assert usage.take_debug_flag(["estimate"]) == (debug, ["estimate"])
    said = capsys.readouterr().err
    assert ("HF_ZERO_OFFLOAD_DEBUG='maybe' is not an on/off value" in said) is (value == "maybe")


def test_help_names_the_debug_flag_and_a_closed_pipe_is_not_an_error(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "--debug" in capsys.readouterr().out
    monkeypatch.setattr(sys.stdout, "fileno", lambda: os.open(os.devnull, os.O_WRONLY))  # pytest's capture has none

    def reader_left():
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(SystemExit) as e:
        usage.run_reporting("hf-zero-offload estimate", reader_left, debug=False)
    assert e.value.code == 1 and "error" not in capsys.readouterr().err


@pytest.mark.parametrize("error", [
    OSError("We couldn't connect to the Hub.\nCheck your internet connection."),  # transformers' offline error
    ValueError("\n  first\n\n  second  "), ConfigError("a.json: ds_config values contradict: x\n- y"),
])
def test_a_library_message_over_several_lines_is_printed_on_one(capsys, error):
    def fail():
        raise error

    with pytest.raises(SystemExit) as e:
        usage.run_reporting("finetune_trainer.py", fail, debug=False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("finetune_trainer.py: error: ") and all(w in err for w in str(error).split())


@pytest.mark.parametrize("module, extra", [("transformers", "trainer"), ("sentencepiece", "examples"),
                                           ("transformers.models.t5", "trainer"), ("numpy_not_ours", None)])
def test_a_missing_optional_package_names_the_extra_that_installs_it(capsys, module, extra):
    """`pip install <checkout>` without an extra, then `hf-zero-offload estimate`: it printed only "error: No module
    named 'transformers'"."""
    def fail():
        raise ModuleNotFoundError(f"No module named '{module}'", name=module)

    with pytest.raises(SystemExit):
        usage.run_reporting("hf-zero-offload", fail, debug=False)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"No module named '{module}'" in err
    # the installed package's name (this .venv's editable install), not a checkout a wheel's user has not got
    assert (f"install it with the [{extra}] extra (pip install 'hf_zero_offload[{extra}]')" in err) == bool(extra), err


def test_installed_command_exits_2_without_traceback():
    cmd = [sys.executable, "-m", "hf_zero_offload.cli", "estimate", "--model", TINY, "--gpu-mem-gib", "nan"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- the plan printed at start ----------------------------------------------------------------------------------------
def test_plan_header_says_cpu_and_the_runs_dtype_and_explains_columns():
    from hf_zero_offload import planner

    p = planner.plan(TINY, cuda=False, run_dtype="fp32", dtype="bf16", seq_len=16, tgt_len=16, batch_size=2,
                     configs=["zero2_offload"])
    text = planner.format_plan(p)
    assert "on the CPU" in text and "GPU(s)" not in text and "this run trains in fp32" in text
    for explained in ("zero2_offload: ZeRO-2 + CPU offload", "act const", "@max|1", "device GiB @2, fits"):
        assert explained in text.split("-----")[-1], explained  # below the table
    js = p.to_json()
    assert js["inputs"]["cuda"] is False and js["inputs"]["run_dtype"] == "fp32" and js["inputs"]["batch_size"] == 2
    assert json.loads(json.dumps(js))  # serialisable


def test_estimate_says_it_is_tracing_on_stderr_and_keeps_json_clean(capsys):
    """A first user saw minutes of silence on a loaded machine after the README's '16 s'."""
    import json

    assert cli.main(["estimate", "--model", TINY, "--configs", "zero2_offload", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("hf-zero-offload estimate: tracing ") and "t5-tiny" in captured.err
    plan = json.loads(captured.out)
    # the size asked for ("auto": hidden_size**2) and the one planned (at least the largest param), as the table says
    assert (plan["inputs"]["bucket_numel"], plan["gradient_bucket_numel"]) == (64 ** 2, 65536)


@pytest.mark.parametrize("local_rank, printed", [(None, True), ("0", True), ("1", False), ("3", False)])
def test_ctrl_c_under_torchrun_is_one_line_per_node(capsys, monkeypatch, local_rank, printed):
    """torchrun passes SIGINT to every rank: the interrupted line came once per rank, the same line N times."""
    from hf_zero_offload.usage import EXIT_INTERRUPTED, run_reporting

    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)

    def work():
        raise KeyboardInterrupt

    import signal

    from hf_zero_offload import usage

    installed = {}
    monkeypatch.setattr(usage.signal, "signal", lambda sig, handler: installed.setdefault(sig, handler))
    with pytest.raises(SystemExit) as e:
        run_reporting("prog", work, debug=False, interrupted=lambda: "go on from X")
    assert e.value.code == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert (err == "prog: interrupted; go on from X\n") if printed else err == "", err
    # a second Ctrl-C during the shutdown exits at once (it printed a traceback from torch's exit hook)
    assert installed == {signal.SIGINT: usage._exit_at_once}


def test_a_path_the_locale_cannot_encode_names_the_locale(capsys, monkeypatch):
    """An outside probe: LANG=C and a non-ASCII --output_dir: "'utf-8' codec can't encode characters in position 0-1:
    surrogates not allowed", naming neither the path nor the locale (transformers' save_pretrained)."""
    monkeypatch.setenv("LC_ALL", "C")

    def fail():
        "\udcc3\udcb6ut".encode("utf-8")

    with pytest.raises(SystemExit):
        usage.run_reporting("finetune_trainer.py", fail, debug=False)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "non-UTF-8 locale (LC_ALL/LANG=C)" in err and "PYTHONUTF8=1" in err


def test_ctrl_c_ends_an_open_progress_bar_before_its_line(capsys):
    """The interrupted line was printed on the end of a save's unfinished "Writing model shards" bar (an outside
    probe; test_examples' Ctrl-C test then failed now and then), and a bar closed at exit came after it."""
    from tqdm import tqdm

    from hf_zero_offload.usage import run_reporting

    bars = []  # held, as the save's frame holds its bar while the interrupt unwinds it

    def interrupted_in_a_save():
        bars.append(tqdm(total=10, desc="Writing model shards"))  # (stderr, as transformers' bars)
        bars[0].update(0)
        raise KeyboardInterrupt

    import signal
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as e:
            run_reporting("prog", interrupted_in_a_save, debug=False, interrupted=lambda: "go on from X")
    finally:  # (it sets an exit-at-once handler for a second Ctrl-C: a later test's SIGINT ended the suite with it)
        signal.signal(signal.SIGINT, handler)
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.endswith("\nprog: interrupted; go on from X\n"), repr(err[-200:])


@pytest.mark.parametrize("argv, says", [
    (["estimate", "--model", TINY, "--gpu-mem-gib", "24GB"], "argument --gpu-mem-gib: invalid float value: '24GB'"),
    (["estimate", "--model", TINY, "--gpus", "2.5"], "argument --gpus: invalid int value: '2.5'"),
    (["estimate", "--model", TINY, "--fp16", "--bf16"], "argument --bf16: not allowed with argument --fp16"),
    (["estimate"], "the following arguments are required: --model"),
    (["consolidate", "only_one"], "the following arguments are required: output_dir"),
    ([], "the following arguments are required: COMMAND"),
])
def test_argparse_errors_are_one_line_too(capsys, argv, says):
    """A value of the wrong type printed argparse's usage block (10 lines for estimate) above the line naming it,
    where the README promises one line (an outside probe)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err, err
    assert err.rstrip().endswith("--help)")
