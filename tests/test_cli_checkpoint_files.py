"""``hf-zero-offload consolidate`` against a checkpoint whose files were damaged, cut short, replaced by folders or
joined by strays (an outside probe of the command line and of checkpoint loading): each is one line naming the file
and what is wrong with it, exit status 2, and no output written. (tests/test_cli_hostile.py covers the side files,
param_names.json and the output folder; tests/test_consolidate_whole.py the completion marker's own checks.)"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli_hostile import ckpt_model  # noqa: E402,F401 (the fixture)
from test_cli_errors import _one_line_error  # noqa: E402


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
