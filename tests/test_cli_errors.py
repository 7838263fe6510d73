"""A mistake costs one line: ``hf-zero-offload`` validates its numbers, names and paths before any model work,
prints ``hf-zero-offload CMD: error: ...`` and exits 2; ``--debug`` / ``HF_ZERO_OFFLOAD_DEBUG=1`` bring the
traceback back. Also: the shipped configs (``--zero_offload NAME``) and ``consolidate``'s refusals."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_zero_offload import cli, presets, usage
from hf_zero_offload.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "models" / "t5-tiny.json")


def _one_line_error(capsys, argv, *needles):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    # estimate's progress line ("tracing ...") comes before an error found by the trace: status, not the error
    lines = [ln for ln in captured.err.strip().splitlines() if not ln.startswith("hf-zero-offload estimate: tracing ")]
    assert len(lines) == 1 and lines[0].startswith(f"hf-zero-offload {argv[0]}: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


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


# -- shipped configs ------------------------------------------------------------------------------------------------
def test_shipped_configs_by_name_and_the_repo_links_are_the_same_files(capsys):
    for name, alias in (("zero2-offload", "ds_config_1gpu.json"), ("zero2-offload", "ds_config.json"),
                        ("zero2", "ds_config_zero2.json")):
        packaged = presets.preset_path(name)
        assert os.path.isfile(packaged) and Path(packaged).parent == Path(presets.__file__).parent / "configs"
        assert os.path.samefile(ROOT / "configs" / alias, packaged)  # one source of truth
        assert presets.preset_path(alias) == packaged
        assert load_config(name) == load_config(str(ROOT / "configs" / alias))
    assert cli.main(["configs"]) == 0
    out = capsys.readouterr().out
    assert "zero2-offload" in out and "zero2 " in out and "--zero_offload NAME" in out


def test_the_int8_preset_is_zero2_offload_with_8_bit_moments():
    from hf_zero_offload.config import ArgsView, resolve
    plain, int8 = load_config("zero2-offload"), load_config("zero2-offload-int8")
    assert int8["zero_optimization"]["offload_optimizer"].pop("state_dtype") == "int8"
    assert int8 == plain
    cfg = resolve("zero2-offload-int8", ArgsView(hidden_size=8))
    assert cfg.zero.offload and cfg.zero.state_dtype == "int8"


def test_a_name_or_path_that_does_not_exist(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # outside the clone: a bare blog file name is the shipped config, said (a user's own
    with caplog.at_level("WARNING", logger="hf_zero_offload"):  # file looked for in another folder was replaced silently)
        assert presets.resolve_config("ds_config.json") == presets.preset_path("zero2-offload")
        assert presets.resolve_config("zero2-offload") == presets.preset_path("zero2-offload")  # a name: nothing said
    assert [r.getMessage() for r in caplog.records] == [
        f"hf_zero_offload: no file ds_config.json in the current directory ({tmp_path}): the shipped config of that "
        f"name runs ({presets.preset_path('zero2-offload')}); give ./ds_config.json for a file of your own"]
    with pytest.raises(ConfigError, match="no shipped ds_config named 'zero3'.*zero2-offload"):
        load_config("zero3")
    with pytest.raises(ConfigError, match="no shipped ds_config named 'zero2-ofload'; did you mean zero2-offload\\?"):
        load_config("zero2-ofload")
    with pytest.raises(ConfigError, match="cannot read"):  # a path stays a path: no silent preset
        load_config(str(tmp_path / "zero2-offload"))
    # the clone's relative path run from elsewhere: where it was looked up, and the shipped name to use
    with pytest.raises(ConfigError, match=r"cannot read.*current directory, .*--zero_offload zero2-offload"):
        load_config("configs/ds_config_1gpu.json")
    (tmp_path / "zero2").write_text('{"zero_optimization": {"stage": 1}}')
    assert load_config("zero2")["zero_optimization"]["stage"] == 1  # an existing file wins over a name
    # a file name with a typo: a missing file (with the near one here), not an unknown shipped name
    (tmp_path / "ds_config_mine.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"ds_config_mie.json: no such file \(in .*\); did you mean ds_config_mine.json\?"):
        load_config("ds_config_mie.json")


# -- consolidate ----------------------------------------------------------------------------------------------------
def test_consolidate_refuses_its_input_as_output(tmp_path, capsys):
    ckpt = tmp_path / "checkpoint-3"
    (ckpt / "zero_offload").mkdir(parents=True)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(b"16-bit weights")
    before = sorted(p.name for p in ckpt.rglob("*"))
    _one_line_error(capsys, ["consolidate", str(ckpt), str(ckpt) + "/"], "is the checkpoint itself")
    assert weights.read_bytes() == b"16-bit weights" and sorted(p.name for p in ckpt.rglob("*")) == before
    # a folder inside it (its zero_offload/ took the model files beside the engine state): rotation deletes it too
    for inside in (ckpt / "zero_offload", ckpt / "zero_offload" / "x", ckpt / "merged"):
        _one_line_error(capsys, ["consolidate", str(ckpt), str(inside)], "is inside the checkpoint",
                        "save_total_limit")
        assert sorted(p.name for p in ckpt.rglob("*")) == before
    (tmp_path / "checkpoint-3-merged").mkdir()  # a sibling whose name starts with the checkpoint's is outside it
    assert cli.main(["consolidate", str(ckpt), str(tmp_path / "checkpoint-3-merged")]) == 2  # (no state in ckpt)
    assert "inside the checkpoint" not in capsys.readouterr().err


def test_consolidate_on_a_run_folder_points_at_its_checkpoints(tmp_path, capsys):
    for step in (10, 3, 200):
        (tmp_path / "run" / f"checkpoint-{step}" / "zero_offload").mkdir(parents=True)
    line = _one_line_error(capsys, ["consolidate", str(tmp_path / "run"), str(tmp_path / "out")], "run folder",
                           "checkpoint-3, checkpoint-10, checkpoint-200")
    assert line.split("e.g. ")[1].startswith(str(tmp_path / "run" / "checkpoint-200"))
    assert not (tmp_path / "out").exists()
    _one_line_error(capsys, ["consolidate", str(tmp_path / "nothing"), str(tmp_path / "out")], "no such checkpoint")


def test_consolidate_of_a_relative_path_from_another_directory_says_where_it_looked(tmp_path, capsys, monkeypatch):
    """The README's `consolidate output/checkpoint-500 output/fp32` typed from another directory said only
    "output/checkpoint-500: no such checkpoint folder"."""
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, ["consolidate", "output/checkpoint-500", "output/fp32"],
                    f"output/checkpoint-500: no such checkpoint folder (a relative path is read from the current "
                    f"directory, {tmp_path})")


def test_consolidate_without_param_names(tmp_path, capsys):
    state = tmp_path / "checkpoint-3" / "zero_offload"
    state.mkdir(parents=True)
    (state / "rank0_of_1.hzo").write_bytes(b"")
    _one_line_error(capsys, ["consolidate", str(tmp_path / "checkpoint-3"), str(tmp_path / "out")],
                    "param_names.json is missing")
    assert not (tmp_path / "out").exists()


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


def test_zero_offload_arguments_refuse_a_second_engine(tmp_path):
    pytest.importorskip("transformers")
    from hf_zero_offload import ZeroOffloadTrainingArguments

    with pytest.raises(ConfigError, match="--deepspeed and --zero_offload both given"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), deepspeed=str(ROOT / "configs" / "ds_config.json"),
                                     zero_offload="zero2-offload", use_cpu=True)
    with pytest.raises(ConfigError, match="--fsdp and --sharded_ddp both given"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", sharded_ddp=True, use_cpu=True)


@pytest.mark.parametrize("var,value,named", [("ACCELERATE_USE_DEEPSPEED", "true", "accelerate launch --use_deepspeed"),
                                              ("ACCELERATE_USE_DEEPSPEED", "1", "DEEPSPEED"),
                                              ("ACCELERATE_USE_FSDP", "True", "accelerate launch --use_fsdp")])
@pytest.mark.parametrize("ours", ["zero_offload", "sharded_ddp"])
def test_accelerates_own_engines_are_refused_before_transformers_builds_them(tmp_path, monkeypatch, var, value, named,
                                                                             ours):
    # accelerate's launcher sets these: both engines were built, then the run failed naming a create_optimizer
    # override nobody wrote (or, without the deepspeed package, a garbled "No package metadata")
    pytest.importorskip("transformers")
    from hf_zero_offload import ZeroOffloadTrainingArguments

    monkeypatch.setenv(var, value)
    kw = {"zero_offload": "zero2-offload"} if ours == "zero_offload" else {"sharded_ddp": True}
    with pytest.raises(ConfigError, match=rf"{var}={value} \(.*{named}.*\) and --{ours} both given: .*two engines"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kw)
    monkeypatch.setenv(var, "false")
    ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kw)


@pytest.mark.parametrize("mp,flags,expect", [("bf16", {}, "bf16"), ("fp16", {}, "fp16"), ("BF16", {}, "bf16"),
                                             ("no", {}, None), ("fp16", {"bf16": True}, "bf16")])
def test_accelerates_mixed_precision_is_taken_as_the_flag(tmp_path, monkeypatch, mp, flags, expect):
    # accelerate launch --mixed_precision bf16 was dropped: the run trained in fp32 without a word
    pytest.importorskip("transformers")
    from hf_zero_offload import ZeroOffloadTrainingArguments

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", mp)
    args = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, zero_offload="zero2-offload", **flags)
    assert (args.bf16, args.fp16) == (expect == "bf16", expect == "fp16")
    plain = ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True)  # the plain Trainer's business
    assert not plain.bf16 and not plain.fp16
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ConfigError, match=r"ACCELERATE_MIXED_PRECISION=fp8 .*with --zero_offload: .*fp32, bf16 or fp16"):
        ZeroOffloadTrainingArguments(output_dir=str(tmp_path), use_cpu=True, zero_offload="zero2-offload")


def _checkpoint_of_a_linear(tmp_path):
    from safetensors.torch import save_file

    from hf_zero_offload.saved_names import write_param_names
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    model = torch.nn.Linear(4, 3)
    engine = OffloadAdam(model.parameters(), lr=1e-2, options=OffloadOptions(num_threads=1))
    model(torch.randn(2, 4)).sum().backward()
    engine.step()
    ckpt = tmp_path / "checkpoint-1"
    engine.save_checkpoint(str(ckpt / "zero_offload"))
    write_param_names(str(ckpt / "zero_offload"), [["weight"], ["bias"]])
    engine.close()
    return ckpt, model, save_file


def test_consolidate_refuses_weights_of_another_shape_before_writing(tmp_path, capsys):
    """A key whose master has another shape used to be written with the master's shape, silently."""
    ckpt, model, save_file = _checkpoint_of_a_linear(tmp_path)
    save_file({"weight": torch.zeros(3, 4, dtype=torch.bfloat16), "bias": torch.zeros(3)}, str(ckpt / "a.safetensors"))
    save_file({"weight": torch.zeros(2, 2)}, str(ckpt / "b.safetensors"))  # sorted after a: checked before a's write
    _one_line_error(capsys, ["consolidate", str(ckpt), str(tmp_path / "out")],
                    "weight has shape [2, 2] but its master in the optimizer state has [3, 4]")
    assert not (tmp_path / "out").exists()
    (ckpt / "b.safetensors").unlink()
    from hf_zero_offload.cli import main as cli_main
    assert cli_main(["consolidate", str(ckpt), str(tmp_path / "out")]) == 0
    from safetensors.torch import load_file
    out = load_file(str(tmp_path / "out" / "a.safetensors"))
    assert torch.equal(out["weight"], model.weight.detach()) and out["weight"].dtype == torch.float32


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


def test_a_source_tree_without_its_kernels_says_so(tmp_path):
    """From a clone's root, an unbuilt tree hides an installed hf_zero_offload: the error blamed a circular import
    ("cannot import name '_C' from partially initialized module")."""
    import shutil

    pkg = tmp_path / "hf_zero_offload"
    pkg.mkdir()
    shutil.copy(Path(__file__).resolve().parent.parent / "hf_zero_offload" / "__init__.py", pkg / "__init__.py")
    r = subprocess.run([sys.executable, "-S", "-c", "import hf_zero_offload"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert f"compiled kernels (_C) are not built in {pkg}" in r.stderr and "this source tree hides it" in r.stderr


def test_star_import_and_trainer_names_without_transformers():
    """Without the [trainer] extra, `from hf_zero_offload import *` failed on transformers, and a Trainer name gave
    the bare "No module named 'transformers'"."""
    code = """
import importlib.util, sys
class NoTransformers:  # an environment without transformers
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'transformers':
            raise ModuleNotFoundError("No module named 'transformers'", name='transformers')
sys.meta_path.insert(0, NoTransformers())
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == 'transformers' else find_spec(name, *a)
from hf_zero_offload import *
assert 'CPUAdam' in dir() and 'ZeroOffloadTrainer' not in dir()
import hf_zero_offload
try:
    hf_zero_offload.ZeroOffloadTrainer
except ModuleNotFoundError as e:
    print(e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "needs transformers, an optional dependency of hf_zero_offload; install it with the [trainer] extra" in r.stdout


@pytest.mark.parametrize("how", ["argument", "launcher"])
def test_accelerates_parallelism_config_is_refused_beside_ours(tmp_path, monkeypatch, how):
    pytest.importorskip("accelerate.parallelism_config", reason="accelerate >= 1.10 has a ParallelismConfig")
    """An outside probe: parallelism_config was refused by neither check; accelerate refuses it on CPU ranks for both
    Trainers alike, but on GPUs its mesh would shard the model beside our engine. Sizes of 1 change nothing."""
    pytest.importorskip("transformers")
    from accelerate.parallelism_config import ParallelismConfig
    from hf_zero_offload.other_engines import refuse_other_engines

    class Args:
        zero_offload, sharded_ddp, deepspeed, fsdp, parallelism_config = "zero2-offload", False, None, "", None

    args = Args()
    if how == "argument":
        args.parallelism_config = ParallelismConfig(dp_shard_size=2, tp_size=1)
    else:
        monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
        monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"parallelism_config \(dp_shard_size=2\) and --zero_offload both given"):
        refuse_other_engines(args)
    args.zero_offload = None
    refuse_other_engines(args)  # not ours: accelerate's business
    args.zero_offload = "zero2-offload"
    if how == "argument":
        args.parallelism_config = ParallelismConfig(dp_shard_size=1)
    else:
        monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1")
    refuse_other_engines(args)


def test_an_example_newer_than_the_installed_package_says_so_in_one_line():
    """An outside probe: a wheel installed, then `git pull`: the example failed with a ModuleNotFoundError traceback
    for a module the older package lacks (or an ImportError for a name it lacks). Both children side by side."""
    from _procs import run_together

    olders = {"module missing": "sys.modules['hf_zero_offload.run_lock'] = None",
              "name missing": "import hf_zero_offload.usage as u; del u.not_utf8_text"}
    script = str(ROOT / "examples" / "seq2seq" / "finetune_trainer.py")
    runs = run_together([[sys.executable, "-c", "import sys, runpy; %s; sys.argv = ['finetune_trainer.py', '--help']; "
                          "runpy.run_path(%r, run_name='__main__')" % (older, script)] for older in olders.values()],
                        timeout=120, env={**os.environ, "HF_ZERO_OFFLOAD_DEBUG": ""})
    for case, r in zip(olders, runs):
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (case, r.stderr)
        assert "lacks it: older than this script? Reinstall it" in r.stderr and "Traceback" not in r.stderr, case


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
