"""examples/seq2seq/finetune_trainer.py and the small example scripts: every other mistake a first-hour user makes
said in one line (data files, missing packages, Ctrl-C, a flag mistake), and the OpenMP spin the script shortens
(legacy flags: test_examples_args_legacy.py; refusals before any model work: test_examples_args_early.py; the runs
themselves: test_examples.py)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from _examples import EX, ROOT, TINY
from _procs import run_together

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytest.importorskip("sacrebleu")

import finetune_trainer  # noqa: E402


def test_data_files_that_are_not_utf8_are_named_and_a_bom_is_dropped(tmp_path):
    import seq2seq_data as sd

    (tmp_path / "train.source").write_bytes(b"\xef\xbb\xbfone\ntwo\n")
    (tmp_path / "train.target").write_bytes(b"unu\ndoi cu \xe2\x80\n")  # cut inside a character
    with pytest.raises(ValueError, match=r"train.target: not a UTF-8 text file \(line 2: byte 11 is 0xe2\)"):
        sd.read_split(str(tmp_path), "train")
    (tmp_path / "train.target").write_bytes(b"a\rb\r\xe9\r")  # lines end at \r too, as the reader ends them
    with pytest.raises(ValueError, match=r"train.target: not a UTF-8 text file \(line 3: byte 4 is 0xe9\)"):
        sd.read_split(str(tmp_path), "train")
    (tmp_path / "train.target").write_bytes("unu\ndoi \u0219i\n".encode())
    assert sd.read_split(str(tmp_path), "train") == (["one", "two"], ["unu", "doi \u0219i"])


def test_blank_and_empty_data_files_are_refused_by_name(tmp_path):
    """A blank line trained a pair with an empty side, without a word (v4.2's dataset asserted "empty tgt line for
    index N"); empty files failed later, in the sampler, naming neither."""
    import seq2seq_data as sd

    (tmp_path / "train.source").write_text("one\ntwo\nthree\n\n", encoding="utf-8")
    (tmp_path / "train.target").write_text("unu\n  \ntrei\npatru\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"train.source: 1 blank or missing text\(s\) among the 4 used \(line 4\)"):
        sd.read_split(str(tmp_path), "train")
    with pytest.raises(ValueError, match=r"train.target: 1 blank or missing text\(s\) among the 2 used \(line 2\)"):
        sd.read_split(str(tmp_path), "train", n_obs=2)
    assert sd.read_split(str(tmp_path), "train", n_obs=1) == (["one"], ["unu"])  # the lines used are checked
    for name in ("train.source", "train.target"):
        (tmp_path / name).write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"train.source and .*train.target hold no lines"):
        sd.read_split(str(tmp_path), "train")


@pytest.mark.parametrize("rows, match", [
    ({"translation": [{"en": "a", "ro": "b"}, {"en": "c", "ro": " "}]},
     r"wmt16 split 'train' column translation\['ro'\]: 1 blank or missing text\(s\) among the 2 used \(index 1\)"),
    ({"translation": [{"en": "a", "ro": "b"}, {"ro": "d"}]}, r"column translation\['en'\]: .*\(index 1\)"),
    ({"document": ["x", None, ""], "summary": ["y", "z", "w"]}, r"column 'document': 2 blank or missing .*index 1, 2"),
])
def test_blank_texts_of_a_hub_dataset_are_refused_by_name(monkeypatch, rows, match):
    """--dataset_name took the same blank texts (and a pair missing a language: a KeyError) as --data_dir did."""
    import sys
    import types

    import seq2seq_data as sd

    class Split:
        column_names = list(rows)

        def select(self, idx):
            return self

        def __getitem__(self, col):
            return rows[col]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: Split()))
    with pytest.raises(ValueError, match=match):
        sd.load_hf_dataset_split("wmt16", "ro-en", "train", "en_XX", "ro_RO", None)
    rows = {k: v[:1] for k, v in rows.items()}  # the first pair alone is whole
    got = sd.load_hf_dataset_split("wmt16", "ro-en", "train", "en_XX", "ro_RO", None)
    assert got == ((["a"], ["b"]) if "translation" in rows else (["x"], ["y"]))


def test_freeze_embeds_and_encoder():
    from transformers import AutoConfig, AutoModelForSeq2SeqLM
    import seq2seq_utils as su

    model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(TINY))
    su.freeze_embeds(model)
    assert not model.shared.weight.requires_grad
    assert not model.encoder.embed_tokens.weight.requires_grad and not model.decoder.embed_tokens.weight.requires_grad
    assert model.encoder.block[0].layer[0].SelfAttention.q.weight.requires_grad
    su.freeze_encoder(model)
    assert not any(p.requires_grad for p in model.encoder.parameters())
    assert model.decoder.block[0].layer[0].SelfAttention.q.weight.requires_grad


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="config_name"):
        finetune_trainer.main(["--data_dir", "x", "--output_dir", str(tmp_path / "o"), "--use_cpu"])
    with pytest.raises(ValueError, match="data_dir"):
        finetune_trainer.main(["--config_name", TINY, "--output_dir", str(tmp_path / "o"), "--use_cpu"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="overwrite_output_dir"):
        finetune_trainer.main(["--config_name", TINY, "--data_dir", str(tmp_path), "--output_dir", str(tmp_path / "full"),
                               "--do_train", "--use_cpu"])


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="--deepspeed is then DeepSpeed's")
def test_deepspeed_flag_without_the_package_points_at_zero_offload(tmp_path):
    with pytest.raises(ValueError, match="--zero_offload ds_config.json takes the same file"):
        finetune_trainer.main(["--config_name", TINY, "--data_dir", "x", "--output_dir", str(tmp_path / "o"),
                               "--deepspeed", "ds_config.json"])


def test_deepspeed_together_with_zero_offload_names_the_pair(tmp_path):
    from hf_zero_offload.config import ConfigError

    base = ["--config_name", TINY, "--data_dir", "x", "--output_dir", str(tmp_path / "o"), "--use_cpu"]
    with pytest.raises(ConfigError, match="--deepspeed and --zero_offload both given"):
        finetune_trainer.main(base + ["--deepspeed", "ds_config.json", "--zero_offload", "zero2-offload"])
    with pytest.raises(ConfigError, match="--fsdp and --sharded_ddp both given"):
        finetune_trainer.main(base + ["--sharded_ddp", "--fsdp", "full_shard"])


def test_a_hub_id_offline_points_at_the_clone_config(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(finetune_trainer.AutoConfig, "from_pretrained", offline)
    with pytest.raises(OSError, match=r"couldn't connect.*--config_name .*configs/models/t5-3b.json builds a "
                                      r"randomly initialised t5-3b"):
        finetune_trainer.main(["--model_name_or_path", "t5-3b", "--data_dir", str(tmp_path), "--output_dir",
                               str(tmp_path / "o"), "--use_cpu"])


def test_plot_curves_cli(tmp_path, capsys):
    import plot_curves

    with pytest.raises(SystemExit) as e:
        plot_curves.main(["--help"])
    assert e.value.code == 0 and "output_dir" in capsys.readouterr().out
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 3, "train_loss": 7.0}]}))
    for folder, needle in ((tmp_path / "missing", "is not a directory"), (tmp_path, "holds no trainer_state.json"),
                           (tmp_path / "run", "--logging_steps")):
        with pytest.raises(SystemExit) as e:
            plot_curves.main([str(folder)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith("plot_curves.py: error: ") and needle in err, err


@pytest.mark.parametrize("script, blocked, args", [
    ("run_demo.py", "torch", ["--smoke", "--cpu"]),
    ("run_demo.py", "matplotlib", ["--smoke", "--cpu"]),  # the plot came last, after the whole training
    ("plot_curves.py", "matplotlib", []),
    ("plot_curves.py", "hf_zero_offload", []),
])
def test_an_example_run_by_a_python_without_its_dependencies_says_so_in_one_line(tmp_path, script, blocked, args):
    """The system's python3 instead of the .venv's (the README's `source .venv/bin/activate` forgotten): run_demo.py
    wrote its data, then died in a traceback; plot_curves.py died in one at its first import."""
    path = os.path.join(EX, script)
    argv = [path, *args, *(["--output_root", str(tmp_path)] if script == "run_demo.py" else [str(tmp_path)])]
    code = (f"import runpy, sys; sys.modules[{blocked!r}] = None; sys.argv = {argv!r}; "
            f"runpy.run_path({path!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    err = r.stderr.strip()
    assert r.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"{script}: error: this Python ({sys.executable}) has no module named ") and \
        repr(blocked) in err and ".venv/bin/python" in err, err
    assert os.listdir(tmp_path) == []  # nothing written


@pytest.mark.parametrize("argv, says", [
    (["synthetic_data.py", "--n-train=5"], "unrecognized arguments: --n-train=5 (did you mean --n_train?); the "
                                           "following arguments are required: out_dir"),
    (["synthetic_data.py", "OUT", "--n_trian", "5"], "unrecognized arguments: --n_trian (did you mean --n_train?)"),
    (["synthetic_data.py", "OUT", "--n_train", "x"], "argument --n_train: invalid int value: 'x'"),
    (["run_demo.py", "--cpuu"], "unrecognized arguments: --cpuu (did you mean --cpu?)"),
    (["plot_curves.py"], "the following arguments are required: output_dir"),
])
def test_the_small_example_scripts_say_a_command_line_mistake_in_one_line(tmp_path, argv, says):
    """argparse printed its usage block above the error, and a misspelled flag beside a missing positional was
    reported as the missing positional alone (`synthetic_data.py --n-train=5`: "required: out_dir")."""
    r = subprocess.run([sys.executable, os.path.join(EX, argv[0]), *argv[1:]], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert err == f"{argv[0]}: error: {says} (usage: {argv[0]} --help)", err
    assert os.listdir(tmp_path) == []


def test_a_ctrl_c_during_the_demo_waits_for_finetune_trainer_and_says_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C in `make demo` reaches run_demo.py and its finetune_trainer.py child alike: the child said its line,
    then run_demo.py died in a KeyboardInterrupt traceback (and could exit before the child had finished)."""
    import run_demo

    waits = []

    class Child:  # the child as a Ctrl-C finds it: the parent's wait interrupted, the child ends on its own (130)
        def __init__(self, cmd, **kwargs):
            assert cmd[1].endswith("finetune_trainer.py")

        def wait(self):
            waits.append(1)
            if len(waits) == 1:
                raise KeyboardInterrupt
            return 130

        def kill(self):
            raise AssertionError("the child was killed instead of awaited")

    monkeypatch.setattr(run_demo.subprocess, "Popen", Child)
    with pytest.raises(SystemExit) as e:
        run_demo.main(["--smoke", "--cpu", "--output_root", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 130 and len(waits) == 2, (e.value.code, waits)
    assert err.strip().splitlines() == [f"[demo] interrupted: make demo starts again from the first step (its data "
                                        f"in {tmp_path / 'demo_smoke_data'} is kept)"], err


def test_script_errors_are_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 2, "ofload_optimizer": {"device": "cpu"}}}')
    argv = [sys.executable, os.path.join(EX, "finetune_trainer.py"), "--config_name", TINY, "--data_dir", str(tmp_path),
            "--output_dir", str(tmp_path / "o"), "--use_cpu", "--do_train", "--zero_offload", str(bad)]
    env = {**os.environ, "HF_ZERO_OFFLOAD_DEBUG": "0"}
    r, debug = run_together([argv, argv + ["--debug", "--output_dir", str(tmp_path / "o2")]], timeout=300, cwd=ROOT, env=env)
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("finetune_trainer.py: error: ") and "ofload_optimizer" in errors[0]
    r = debug
    assert r.returncode == 1 and "Traceback" in r.stderr and "ConfigError" in r.stderr


def test_dataset_name_without_datasets_is_a_clear_error(tmp_path):
    try:
        import datasets  # noqa: F401
        pytest.skip("datasets is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="--data_dir"):
        finetune_trainer.main(["--config_name", TINY, "--dataset_name", "wmt16", "--dataset_config_name", "ro-en",
                               "--src_lang", "en", "--tgt_lang", "ro", "--output_dir", str(tmp_path / "o"),
                               "--do_train", "--use_cpu", "--report_to", "none"])


@pytest.mark.parametrize("env,want", [({}, "10000"), ({"GOMP_SPINCOUNT": "500"}, "500"),
                                      ({"OMP_WAIT_POLICY": "active"}, None)])
def test_the_script_shortens_the_openmp_spin_unless_the_user_chose(env, want):
    """torch's OpenMP workers spin for milliseconds after each parallel op on the cores the CPU step needs
    next; the script sets a shorter spin (README, Limitations; docs/LIMITATIONS.md) and keeps a GOMP_SPINCOUNT or
    OMP_WAIT_POLICY the user gave."""
    environ = dict(env)
    finetune_trainer.shorten_openmp_spin(environ)
    assert environ.get("GOMP_SPINCOUNT") == want


def test_the_spin_is_set_before_torch_loads_openmp():
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: the script must set it before `import torch`."""
    from _examples import finetune_children  # (the probe runs beside test_cli_hostile's help child, once a session)

    out = finetune_children()["spin"]  # _examples.SPIN_PROBE, without GOMP_SPINCOUNT and OMP_WAIT_POLICY
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True 10000"


@pytest.mark.parametrize("argv, match", [
    (["--per_device_train_batch_size", "abc"], r"--per_device_train_batch_size.*invalid int value: 'abc'"),
    (["--zero_offload"], r"--zero_offload.*expected one argument"),
    (["--zero_ofload", "zero2-offload"], r"unknown arguments: --zero_ofload \(did you mean --zero_offload\?\)"),
], ids=["bad-value", "missing-value", "misspelled-flag"])
def test_a_flag_mistake_is_one_error_without_the_usage_text(argv, match, capsys):
    """argparse printed its 140-line usage before a bad or missing value's message."""
    with pytest.raises(ValueError, match=match):
        finetune_trainer.parse_args(["--output_dir", "o", *argv])
    assert "usage:" not in capsys.readouterr().err
