"""Per-rank state files: exact round trips, slices, the device bounce path, and bad files."""
from __future__ import annotations

import json
import os
import struct
import zlib

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


def _lay_out(path, tensors, offsets=None, *, edit=None, first_format=False, no_sums=()):
    """A file whose header puts ``tensors`` at byte ``offsets`` of the data (default: one after the other, as
    ``write_state`` does), ``edit`` applied to its tensor entries, every checksum valid (except that ``no_sums``'s
    chunk lists are left out of the trailer): what another writer might produce."""
    nbytes = [t.numel() * t.element_size() for t in tensors.values()]
    offsets = offsets or [sum(nbytes[:i]) for i in range(len(nbytes))]
    entries = {k: {"dtype": str(t.dtype)[6:], "shape": list(t.shape), "offset": o, "nbytes": n}
               for (k, t), o, n in zip(tensors.items(), offsets, nbytes)}
    data = bytearray(max(o + n for o, n in zip(offsets, nbytes)))
    for t, o, n in zip(tensors.values(), offsets, nbytes):
        data[o:o + n] = t.view(-1).view(torch.uint8).numpy().tobytes()
    (edit or (lambda e: None))(entries)
    header = json.dumps({"meta": {"numel": 1000}, "tensors": entries}).encode()
    head = (b"HZOSTATE" if first_format else b"HZOSTAT2") + struct.pack("<Q", len(header)) + header
    with open(path, "wb") as f:
        f.write(head + bytes(data))
        if not first_format:
            step = checkpoint._CHUNK
            chunks = {k: [zlib.crc32(data[o + i:o + min(n, i + step)]) for i in range(0, n, step)]
                      for k, o, n in zip(tensors, offsets, nbytes) if k not in no_sums}
            trailer = json.dumps({"header": zlib.crc32(head), "chunks": chunks}).encode()
            f.write(trailer + struct.pack("<IQ", zlib.crc32(trailer), len(trailer)) + b"HZOCRC01")


def _splice(path, at, remove=0, insert=b""):
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[:at] + insert + raw[at + remove:])


def _inside_exp_avg(path):
    """A byte offset 100 bytes into exp_avg's data (the header and the trailer stay whole around it)."""
    _, entries, base = checkpoint.read_header(path)
    return base + entries["exp_avg"]["offset"] + 100


# Files whose header, trailer and checksums are whole but whose bytes do not add up to what their header declares:
# each passed read_header, so a load found them (cut: part way, after its first write) or never did (overlap, gap,
# a missing checksum list: loaded as they were).
LAYOUTS = {
    "cut in the middle": (lambda p: _splice(p, _inside_exp_avg(p), remove=400), r"400 bytes are missing"),
    "bytes inserted": (lambda p: _splice(p, _inside_exp_avg(p), insert=b"\x5a" * 7), r"it has 7 bytes too many"),
    "cut, first format": (lambda p: (_lay_out(p, _tensors(), first_format=True),
                                     _splice(p, _inside_exp_avg(p), remove=400)), r"400 bytes are missing"),
    "tensors overlap": (lambda p: _lay_out(p, _tensors(), [0, 3996, 7996]),
                        r"tensor 'exp_avg' starts at byte 3996 of the data, expected 4000 .* overlap"),
    "gap between tensors": (lambda p: _lay_out(p, _tensors(), [0, 4000, 8008]),
                            r"tensor 'half' starts at byte 8008 of the data, expected 8000 .* leave a gap"),
    "shape and nbytes disagree": (lambda p: _lay_out(p, _tensors(), edit=lambda e: e["half"].update(shape=[300])),
                                  r"tensor 'half' is .*, expected a dtype, a shape"),
    "unknown dtype": (lambda p: _lay_out(p, _tensors(), edit=lambda e: e["half"].update(dtype="Tensor")),
                      r"tensor 'half' is .*, expected a dtype"),
    "a checksum list missing": (lambda p: _lay_out(p, _tensors(), no_sums=("half",)),
                                r"the checksum trailer holds None for 'half', expected 1 checksums"),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_a_file_whose_bytes_do_not_add_up_is_refused_by_name_before_any_read(tmp_path, case):
    path = checkpoint.rank_file(str(tmp_path), 0, 1)
    for first_format in (False, True):  # the refusals are the layout's, not the helper's: as write_state lays them
        _lay_out(path, _tensors(), first_format=first_format)  # out, its files load
        assert all(torch.equal(checkpoint.read_tensor(path, k), t) for k, t in _tensors().items())
    checkpoint.write_state(path, {"numel": 1000}, _tensors())
    damage, match = LAYOUTS[case]
    damage(path)
    with pytest.raises(checkpoint.StateFileError, match=match) as e:
        checkpoint.read_header(path)
    assert str(e.value).startswith(f"optimizer state file {path}: ")
