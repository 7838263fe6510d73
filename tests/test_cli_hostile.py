"""``hf-zero-offload`` as a hostile outsider and a brand-new user meet it: model configs of the wrong shape, type or
architecture, paths of the wrong kind, damaged checkpoint side files. Each mistake is one line naming the problem and
exit status 2, nothing is half-written, and what does run agrees with the engine's own plan.
(tests/test_cli_errors.py covers the numbers and names of ``estimate``; this file does not repeat them.)"""
import json
import sys
from pathlib import Path

import pytest
import torch

from hf_zero_offload import cli

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli_errors import _checkpoint_of_a_linear, _one_line_error  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "models" / "t5-tiny.json"
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 128, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0}
BART = {"model_type": "bart", "d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "vocab_size": 128,
        "max_position_embeddings": 64}
SMALL = ["--seq-len", "16", "--tgt-len", "16", "--configs", "zero2_offload"]  # keeps each trace well under a second


def _write(path: Path, obj) -> str:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return str(path)


def _t5(**changes) -> dict:
    cfg = json.loads(TINY.read_text())
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


# -- estimate: model configs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, needles", [
    (_t5(d_model="big"), ["d_model", "expected int"]),           # a value of the wrong type (was: a traceback)
    (_t5(d_model=-5), ["cannot build", "-5"]),                   # a negative size (was: RuntimeError traceback)
    (_t5(decoder_start_token_id=None), ["decoder_start_token_id"]),  # a key the model needs (was: AttributeError)
])
def test_estimate_a_config_the_model_cannot_be_built_from_is_one_line(tmp_path, capsys, cfg, needles):
    path = _write(tmp_path / "config.json", cfg)
    _one_line_error(capsys, ["estimate", "--model", path, *SMALL], path, *needles)


@pytest.mark.parametrize("flags, needle", [
    (["--gpu-mem-gib", "1e308"], "--gpu-mem-gib"),   # finite GiB, infinite bytes (was: OverflowError traceback)
    (["--seq-len", str(10 ** 12)], "--seq-len 1000000000000"),  # was: "is a key missing?" with no word of the length
])
def test_estimate_absurd_sizes(capsys, flags, needle):
    _one_line_error(capsys, ["estimate", "--model", str(TINY), "--configs", "zero2_offload", *flags], needle)


@pytest.mark.parametrize("text", ["", "not json{", "[1, 2]", "{}", '{"model_type": "nosuch"}'])
def test_estimate_not_a_model_config(tmp_path, capsys, text):
    path = _write(tmp_path / "m.json", text)
    _one_line_error(capsys, ["estimate", "--model", path], path)


def test_estimate_a_folder_without_config_json_says_so(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"x")  # was: "Should have a `model_type` key in its config.json"
    _one_line_error(capsys, ["estimate", "--model", str(tmp_path)], str(tmp_path), "no config.json")


@pytest.mark.parametrize("given", ["configs/models/t5-tiny.json", "t5-tiny"])
def test_estimate_a_relative_config_path_outside_the_clone_points_into_it(tmp_path, capsys, monkeypatch, given):
    """Run from another directory, the README's `--model configs/models/t5-3b.json` said only "no such config file"
    (the example script's --config_name names the clone's file); a Hub name gets the shipped config too."""
    monkeypatch.chdir(tmp_path)
    _one_line_error(capsys, ["estimate", "--model", given], given, f"current directory, {tmp_path}",
                    f"did you mean {TINY}?")


def test_estimate_a_device_file_given_as_the_model(capsys):
    """/dev/null was taken for a Hub id ("Repo id must be in the form 'repo_name' or 'namespace/repo_name'")."""
    _one_line_error(capsys, ["estimate", "--model", "/dev/null"], "/dev/null: not a regular file")


def test_estimate_auto_buckets_of_a_model_without_a_hidden_size(tmp_path, capsys):
    """--bucket-numel auto planned 500M-element buckets for a model the Trainer refuses ("auto" needs a hidden size)."""
    from transformers import BertConfig, EncoderDecoderConfig

    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    cfg = EncoderDecoderConfig.from_encoder_decoder_configs(BertConfig(**small), BertConfig(**small))
    cfg.decoder_start_token_id, cfg.pad_token_id = 0, 0
    cfg.save_pretrained(tmp_path)
    _one_line_error(capsys, ["estimate", "--model", str(tmp_path), *SMALL], "--bucket-numel auto", "no hidden size")


def test_estimate_a_ds_config_given_as_the_model(capsys):
    _one_line_error(capsys, ["estimate", "--model", str(ROOT / "configs" / "ds_config.json")], "model_type")


@pytest.mark.parametrize("cfg, flags, needle", [
    (GPT2, ["--seq-len", "100"], "--seq-len 100"),               # was: a plan for sequences the model cannot take
    (BART, ["--seq-len", "16", "--tgt-len", "65"], "--tgt-len 65"),
])
def test_estimate_sequences_longer_than_the_models_positions(tmp_path, capsys, cfg, flags, needle):
    path = _write(tmp_path / "config.json", cfg)
    _one_line_error(capsys, ["estimate", "--model", path, "--configs", "zero2_offload", *flags], needle, "64")


@pytest.mark.parametrize("cfg", [GPT2, BART], ids=["gpt2", "bart"])
def test_estimate_other_architectures_count_like_the_real_model(tmp_path, capsys, cfg):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from hf_zero_offload.planner.plan import EngineSettings, _engine_defaults, _engine_plan

    path = _write(tmp_path / "config.json", cfg)
    assert cli.main(["estimate", "--model", path, "--json", *SMALL]) == 0
    data = json.loads(capsys.readouterr().out)
    c = AutoConfig.for_model(**cfg)
    real = (AutoModelForSeq2SeqLM if c.is_encoder_decoder else AutoModelForCausalLM).from_config(c)
    n = sum(p.numel() for p in real.parameters())
    assert data["params"] == n
    row = data["configs"][0]
    from hf_zero_offload.args_view import hidden_size_of

    d = _engine_defaults()  # the buckets of a ds_config's "auto" reduce_bucket_size, estimate's default
    engine = _engine_plan(n, EngineSettings(hidden_size_of(real) ** 2, d["tile_numel"],
                                            max_param_numel=max(p.numel() for p in real.parameters())), dpu=False)
    assert row["host_bytes"] == engine.host_bytes and row["max_batch_size"] >= 1


def test_estimate_a_folder_with_spaces_and_unicode(tmp_path, capsys):
    d = tmp_path / "my models é"
    d.mkdir()
    _write(d / "config.json", TINY.read_text())
    assert cli.main(["estimate", "--model", str(d), *SMALL]) == 0
    assert "params: 230,400" in capsys.readouterr().out


def test_estimate_an_absurd_batch_size_does_not_fit(capsys):
    assert cli.main(["estimate", "--model", str(TINY), "--batch-size", str(10 ** 12), "--json", *SMALL]) == 0
    row = json.loads(capsys.readouterr().out)["configs"][0]
    assert row["fits"] is False and row["max_batch_size"] < 10 ** 12


def test_an_unknown_flag_after_a_subcommand_names_the_subcommand(capsys):
    with pytest.raises(SystemExit) as e:  # was: the top-level usage and "hf-zero-offload: error"
        cli.main(["estimate", "--model", str(TINY), "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "hf-zero-offload estimate: error: unrecognized arguments: --bogus" in err, err
    with pytest.raises(SystemExit):
        cli.main(["consolidate", "a", "b", "c"])
    assert "hf-zero-offload consolidate: error: unrecognized arguments: c" in capsys.readouterr().err


@pytest.mark.parametrize("sub, flags", [("estimate", ["--model", "--gpus", "--gpu-mem-gib", "--state-dtype", "--json",
                                                       "--gradient-checkpointing", "--seq-len", "--tgt-len"]),
                                        ("consolidate", ["checkpoint_dir", "output_dir"]), ("configs", [])])
def test_help_of_each_subcommand(capsys, sub, flags):
    with pytest.raises(SystemExit) as e:
        cli.main([sub, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(f in out for f in flags), out


def test_the_example_script_help_runs():
    from _examples import finetune_children  # (its run beside test_examples_args' spin probe, once a session)

    r = finetune_children()["help"]  # from ROOT, without PYTHONPATH
    assert r.returncode == 0 and "--zero_offload" in r.stdout, r.stderr[-2000:]


# -- consolidate --------------------------------------------------------------------------------------------------------
@pytest.fixture
def ckpt_model(tmp_path):
    ckpt, model, save_file = _checkpoint_of_a_linear(tmp_path)
    save_file({"weight": torch.zeros(3, 4, dtype=torch.bfloat16), "bias": torch.zeros(3, dtype=torch.bfloat16)},
              str(ckpt / "model.safetensors"))
    _write(ckpt / "config.json", {"model_type": "linear", "torch_dtype": "bfloat16"})
    return ckpt, model


def test_consolidate_a_file_instead_of_a_checkpoint_folder(ckpt_model, tmp_path, capsys):
    ckpt, model = ckpt_model
    _one_line_error(capsys, ["consolidate", str(ckpt / "model.safetensors"), str(tmp_path / "out")],
                    "is a file, not a checkpoint folder")  # was: "no such checkpoint folder"


def test_consolidate_into_a_file(ckpt_model, tmp_path, capsys):
    ckpt, model = ckpt_model
    _write(tmp_path / "out", "x")  # was: "[Errno 17] File exists"
    _one_line_error(capsys, ["consolidate", str(ckpt), str(tmp_path / "out")], "is a file, not a folder")
    assert (tmp_path / "out").read_text() == "x"


@pytest.mark.parametrize("names, needle", [
    ("garbage", "param_names.json"),                      # was: "Expecting value: line 1 column 1 (char 0)"
    ('["weight", "bias"]', "param_names.json"),           # was: written without the masters (16-bit zeros upcast)
    ('{"weight": 1, "bias": 2}', "param_names.json"),     # the same
    ('[["weight"], ["nosuch"]]', "nosuch"),               # was: bias silently left at its 16-bit value
])
def test_consolidate_damaged_param_names_write_nothing(ckpt_model, tmp_path, capsys, names, needle):
    ckpt, model = ckpt_model
    _write(ckpt / "zero_offload" / "param_names.json", names)
    _one_line_error(capsys, ["consolidate", str(ckpt), str(tmp_path / "out")], needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["{broken", "[1]"])
def test_consolidate_a_damaged_config_json_writes_nothing(ckpt_model, tmp_path, capsys, text):
    ckpt, model = ckpt_model
    _write(ckpt / "config.json", text)  # was: the weights written, then an unnamed JSON error or a TypeError traceback
    _one_line_error(capsys, ["consolidate", str(ckpt), str(tmp_path / "out")], "config.json")
    assert not (tmp_path / "out").exists()


def test_consolidate_into_a_new_nested_folder_and_over_its_own_output(ckpt_model, tmp_path, capsys):
    ckpt, model = ckpt_model
    from safetensors.torch import load_file

    out = tmp_path / "a b" / "é" / "fp32"
    for _ in range(2):  # the second run replaces the first one's files, leaving no temporaries
        assert cli.main(["consolidate", str(ckpt), str(out)]) == 0
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    w = load_file(str(out / "model.safetensors"))
    assert torch.equal(w["weight"], model.weight.detach()) and torch.equal(w["bias"], model.bias.detach())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def test_consolidate_writes_both_names_of_a_tied_weight_held_twice_in_one_file(ckpt_model, tmp_path, capsys):
    """A weight file may hold a tied weight under two names (saved as two copies, e.g. by a model that does not
    declare the tie); both get the master. They used to be handed to safetensors as one shared tensor, which it
    refuses ("Some tensors share memory"), so consolidate failed after reading everything."""
    ckpt, model = ckpt_model
    from safetensors.torch import load_file, save_file

    from hf_zero_offload.saved_names import write_param_names
    write_param_names(str(ckpt / "zero_offload"), [["weight", "proj.weight"], ["bias"]])
    save_file({"weight": torch.zeros(3, 4, dtype=torch.bfloat16), "proj.weight": torch.zeros(3, 4, dtype=torch.bfloat16),
               "bias": torch.zeros(3, dtype=torch.bfloat16)}, str(ckpt / "model.safetensors"))
    out = tmp_path / "out"
    assert cli.main(["consolidate", str(ckpt), str(out)]) == 0, capsys.readouterr().err
    w = load_file(str(out / "model.safetensors"))
    assert sorted(w) == ["bias", "proj.weight", "weight"]
    assert torch.equal(w["weight"], model.weight.detach()) and torch.equal(w["proj.weight"], model.weight.detach())
    assert torch.equal(w["bias"], model.bias.detach())


def test_consolidate_writes_no_completion_marker(ckpt_model, tmp_path, capsys):
    """The checkpoint's hzo_complete.json was copied with the config files: the fp32 folder claimed to be a
    complete training checkpoint."""
    ckpt, model = ckpt_model
    _write(ckpt / "hzo_complete.json", {"complete": True, "step": 1})
    assert cli.main(["consolidate", str(ckpt), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("stale", ["model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                   "hzo_complete.json", "trainer_state.json", "zero_offload"])
def test_consolidate_into_a_folder_with_other_weights_or_a_checkpoint_writes_nothing(ckpt_model, tmp_path, capsys,
                                                                                    stale):
    """An existing output was written over file by file: a previous sharded output's index and shards stayed
    beside the new single file (from_pretrained would read the stale shards), and a training checkpoint given
    as the output lost its weights."""
    ckpt, model = ckpt_model
    out = tmp_path / "out"
    out.mkdir()
    (out / stale).mkdir() if stale == "zero_offload" else _write(out / stale, "{}")
    (out / "model.safetensors").write_bytes(b"old")
    _one_line_error(capsys, ["consolidate", str(ckpt), str(out)], stale)
    assert (out / "model.safetensors").read_bytes() == b"old"
