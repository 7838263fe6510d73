"""Per-rank optimizer state files, written atomically, read back in place.

One file per rank: ``rank{r}_of_{n}.hzo`` = an 8-byte little-endian header length, a JSON header
(the engine's ``state_meta()`` plus each tensor's dtype, shape and byte offset), then the raw
tensor bytes. Tensors are streamed straight from the host arena to disk and read straight back
into it: no second copy of the optimizer state in RAM (device-resident state, ZeRO without offload,
goes through a 64 MiB host bounce buffer) (a ``torch.save`` of an arena view would
write the whole arena and unpickling would allocate another copy). Writes go to a temporary name,
are fsynced, then renamed: a crash leaves the previous checkpoint intact, never half a file.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct

import torch

_MAGIC = b"HZOSTATE"
_CHUNK = 64 << 20


def rank_file(directory: str, rank: int, world_size: int) -> str:
    return os.path.join(directory, f"rank{rank}_of_{world_size}.hzo")


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


@contextlib.contextmanager
def atomic_path(path: str):
    """Yield a temporary name beside ``path``; once the caller has written it, fsync it and rename it
    over ``path``. A crash or an exception leaves the previous file (or none), never half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb"):
    """``open(path, mode)`` for writing, made atomic with :func:`atomic_path`."""
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f


def _is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _byte_chunks(t: torch.Tensor):
    """The bytes of contiguous ``t`` in chunks of at most ``_CHUNK``: views of host memory, or host
    copies of one chunk at a time for a device tensor."""
    flat = t.detach().view(-1)
    step = max(1, _CHUNK // t.element_size())
    for i in range(0, flat.numel(), step):
        piece = flat[i:i + step]
        yield (piece if _is_host(piece) else piece.cpu()).view(torch.uint8).numpy()


def write_state(path: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    entries, offset = {}, 0
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"state tensor {name!r} must be contiguous")
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": nbytes}
        offset += nbytes
    header = json.dumps({"meta": meta, "tensors": entries}).encode()
    with atomic_open(path, "wb") as f:
        f.write(_MAGIC + struct.pack("<Q", len(header)) + header)
        for t in tensors.values():
            for raw in _byte_chunks(t):
                f.write(memoryview(raw))


def read_header(path: str) -> tuple[dict, dict, int]:
    """(meta, tensor entries, byte offset where the tensor data starts)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"optimizer state file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(len(_MAGIC))
        if magic != _MAGIC:
            raise ValueError(f"{path} is not an hf_zero_offload state file")
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header["meta"], header["tensors"], len(_MAGIC) + 8 + n


def read_into(path: str, tensors: dict[str, torch.Tensor], *, start: dict[str, int] | None = None) -> dict:
    """Fill ``tensors`` (contiguous; host, or device through a bounce buffer) from ``path`` in place;
    ``start`` gives an element offset into the stored tensor per name (re-partitioning reads a
    slice). Returns the meta."""
    meta, entries, base = read_header(path)
    with open(path, "rb") as f:
        for name, dst in tensors.items():
            if name not in entries:
                raise KeyError(f"{path} holds no tensor {name!r}")
            e = entries[name]
            if e["dtype"] != _dtype_name(dst.dtype):
                raise ValueError(f"{path}: {name} is {e['dtype']}, expected {_dtype_name(dst.dtype)}")
            first = (start or {}).get(name, 0) * dst.element_size()
            nbytes = dst.numel() * dst.element_size()
            if first + nbytes > e["nbytes"]:
                raise ValueError(f"{path}: {name} holds {e['nbytes']} bytes, asked for {first + nbytes}")
            if not dst.is_contiguous():
                raise ValueError(f"cannot read {name!r} into a non-contiguous tensor")
            f.seek(base + e["offset"] + first)
            if _is_host(dst):
                _read_exact(f, memoryview(dst.view(-1).view(torch.uint8).numpy()), path)
                continue
            flat, step = dst.view(-1), max(1, _CHUNK // dst.element_size())
            bounce = torch.empty(min(step, flat.numel()), dtype=dst.dtype)
            for i in range(0, flat.numel(), step):
                piece = bounce[:min(step, flat.numel() - i)]
                _read_exact(f, memoryview(piece.view(torch.uint8).numpy()), path)
                flat[i:i + piece.numel()].copy_(piece)  # synchronous: the bounce is reused next
    return meta


def _read_exact(f, view: memoryview, path: str) -> None:
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            raise ValueError(f"{path} is truncated")
        got += k


def read_tensor(path: str, name: str) -> torch.Tensor:
    """One stored tensor as a new CPU tensor (consolidation, tests)."""
    _, entries, _ = read_header(path)
    e = entries[name]
    out = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
    read_into(path, {name: out})
    return out
