"""Per-rank state files: exact round trips, slices, the device bounce path, and bad files."""
from __future__ import annotations

import os

import pytest
import torch

from hf_zero_offload.engine import checkpoint


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"master": torch.randn(1000, generator=g), "exp_avg": torch.randn(1000, generator=g),
            "half": torch.randn(333, generator=g).to(torch.bfloat16)}


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "bounce"])
def test_round_trip_in_small_chunks(tmp_path, monkeypatch, device_path):
    """``bounce``: the path device-resident state takes (ZeRO without offload on a GPU), run here by
    treating the CPU tensors as device tensors; tiny chunks so every tensor spans several."""
    monkeypatch.setattr(checkpoint, "_CHUNK", 64)
    if device_path:
        monkeypatch.setattr(checkpoint, "_is_host", lambda t: False)
    src = _tensors()
    path = checkpoint.rank_file(str(tmp_path), 0, 1)
    checkpoint.write_state(path, {"step": 3}, src)
    assert os.listdir(tmp_path) == ["rank0_of_1.hzo"]
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    assert checkpoint.read_into(path, dst) == {"step": 3}
    assert all(torch.equal(dst[k], src[k]) for k in src)
    part = torch.zeros(100)
    checkpoint.read_into(path, {"exp_avg": part}, start={"exp_avg": 450})
    assert torch.equal(part, src["exp_avg"][450:550])


def test_bad_inputs_name_the_problem(tmp_path):
    path = checkpoint.rank_file(str(tmp_path), 0, 1)
    with pytest.raises(ValueError, match="'master' must be contiguous"):
        checkpoint.write_state(path, {}, {"master": torch.zeros(4, 4).t()})
    assert not os.listdir(tmp_path)  # nothing half-written
    checkpoint.write_state(path, {}, _tensors())
    with pytest.raises(ValueError, match="expected float32"):
        checkpoint.read_into(path, {"half": torch.zeros(333)})
    with pytest.raises(ValueError, match="asked for"):
        checkpoint.read_into(path, {"master": torch.zeros(10)}, start={"master": 995})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(ValueError, match="truncated"):
        checkpoint.read_into(path, {"half": torch.zeros(333, dtype=torch.bfloat16)})
    with pytest.raises(FileNotFoundError, match="not found"):
        checkpoint.read_header(str(tmp_path / "nope.hzo"))


def test_a_full_disk_names_the_file_and_leaves_the_previous_one(tmp_path, monkeypatch):
    """ENOSPC from a write names no file; the error now does (the temporary is gone, the previous
    checkpoint file intact). The tmpfs-full case was checked by hand (needs root to mount)."""
    import errno

    path = str(tmp_path / "rank0_of_1.hzo")
    checkpoint.write_state(path, {"numel": 3}, {"master": torch.ones(3)})
    before = open(path, "rb").read()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_byte_chunks", full)
    with pytest.raises(OSError, match=r"No space left on device: '.*rank0_of_1.hzo'"):
        checkpoint.write_state(path, {"numel": 3}, {"master": torch.zeros(3)})
    assert os.listdir(tmp_path) == ["rank0_of_1.hzo"] and open(path, "rb").read() == before
