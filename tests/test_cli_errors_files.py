"""The files ``hf-zero-offload`` names: the shipped configs (``--zero_offload NAME``, the repo's links to the
same files, the int8 preset), a name or path that does not exist, and ``consolidate``'s refusals (its input as
output, a run folder, a relative path from elsewhere, no param names, weights of another shape), each in one line."""
import os
from pathlib import Path

import pytest
import torch

from _cli_errors import ROOT, _checkpoint_of_a_linear, _one_line_error
from hf_zero_offload import cli, presets
from hf_zero_offload.config import ConfigError, load_config


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
