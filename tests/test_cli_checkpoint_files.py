"""``hf-zero-offload consolidate`` against a checkpoint whose files were damaged, cut short, replaced by folders or
joined by strays (an outside probe of the command line and of checkpoint loading): each is one line naming the file
and what is wrong with it, exit status 2, and no output written. (tests/test_cli_hostile.py covers the side files,
param_names.json and the output folder; tests/test_consolidate_whole.py the completion marker's own checks.)"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli_hostile import ckpt_model  # noqa: E402,F401 (the fixture)
from _cli_errors import _one_line_error  # noqa: E402


def _cut(path: Path, at: int) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:at if at >= 0 else len(raw) + at])


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x5F
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, said", [
    (lambda p: _cut(p, 0), "header too small"),
    (lambda p: _cut(p, 5), "header too small"),
    (lambda p: _cut(p, 40), "invalid header length"),
    (lambda p: _cut(p, -1), "file not fully covered"),
    (lambda p: _flip(p, 3), "header too large"),
    (lambda p: _flip(p, 8), "invalid JSON in header"),
    (lambda p: (p.unlink(), p.mkdir()), "is a folder, not a safetensors weight file"),
], ids=["empty", "cut-in-length", "cut-in-header", "cut-at-end", "length-flipped", "header-flipped", "a-folder"])
def test_a_damaged_weight_file_is_one_line_naming_it(ckpt_model, tmp_path, capsys, damage, said):
    """safetensors' SafetensorError is no ValueError or OSError: a cut or damaged model.safetensors (a checkpoint
    without a completion marker, or a weight file too large for the marker to hash) was a traceback from inside
    safetensors naming no file; a folder of that name said only "No such device (os error 19)"."""
    ckpt, _ = ckpt_model
    damage(ckpt / "model.safetensors")
    line = _one_line_error(capsys, ["consolidate", str(ckpt), str(tmp_path / "out")],
                           str(ckpt / "model.safetensors"), said)
    assert "consolidate an earlier checkpoint" in line
    assert not (tmp_path / "out").exists()


def test_a_stray_weight_file_beside_the_weights_is_named(ckpt_model, tmp_path, capsys):
    """A file added to a checkpoint is not held against it (its marker lists what its save wrote); one that is no
    safetensors was a traceback."""
    ckpt, _ = ckpt_model
    (ckpt / "notes.safetensors").write_text("not weights")
    _one_line_error(capsys, ["consolidate", str(ckpt), str(tmp_path / "out")], str(ckpt / "notes.safetensors"),
                    "cannot be read as safetensors model weights")
    assert not (tmp_path / "out").exists()


def _checkpoint_of_two_same_shaped_layers(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    engine = OffloadAdam(model.parameters(), lr=1e-2, options=OffloadOptions(num_threads=1))
    model(torch.randn(2, 4)).sum().backward()
    engine.step()
    ckpt = tmp_path / "checkpoint-1"
    engine.save_checkpoint(str(ckpt / "zero_offload"))
    engine.close()
    save_file({"0.weight": torch.zeros(4, 4, dtype=torch.bfloat16), "1.weight": torch.zeros(4, 4, dtype=torch.bfloat16)},
              str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "two", "torch_dtype": "bfloat16"}))
    return ckpt, model


@pytest.mark.parametrize("names", [[["0.weight"], ["0.weight"]], [["0.weight", "1.weight"], ["1.weight"]]],
                         ids=["one-name-twice", "an-alias-of-another-slot"])
def test_param_names_naming_one_param_in_two_slots_is_refused(tmp_path, capsys, names):
    """The later slot's master was written under the name and the earlier one's dropped: 0.weight took 1.weight's
    master and 1.weight kept its 16-bit zeros, and consolidate said it wrote the fp32 weights."""
    from safetensors.torch import load_file

    from hf_zero_offload import cli
    from hf_zero_offload.saved_names import write_param_names

    ckpt, model = _checkpoint_of_two_same_shaped_layers(tmp_path)
    write_param_names(str(ckpt / "zero_offload"), names)
    _one_line_error(capsys, ["consolidate", str(ckpt), str(tmp_path / "out")],
                    str(ckpt / "zero_offload" / "param_names.json"), "names optimizer slots 0 and 1")
    assert not (tmp_path / "out").exists()
    write_param_names(str(ckpt / "zero_offload"), [["0.weight"], ["1.weight"]])  # as the save wrote it: consolidated
    assert cli.main(["consolidate", str(ckpt), str(tmp_path / "out")]) == 0
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(out[f"{i}.weight"].equal(model[i].weight.detach()) for i in (0, 1))
