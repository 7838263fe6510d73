"""Per-rank optimizer state files, written atomically, checksummed, read back in place.

One file per rank, ``rank{r}_of_{n}.hzo``::

    b"HZOSTAT2" | u64 header length | JSON header | raw tensor bytes | trailer

The header is ``{"meta": state_meta(), "tensors": {name: dtype, shape, byte offset, nbytes}}``. The
trailer holds CRC-32s: one of the magic, length and header, and one per 64 MiB chunk of every tensor
(``{"header": crc, "chunks": {name: [crc, ...]}}`` as JSON, its own CRC, its u64 length, and
b"HZOCRC01" last). Per-chunk sums let a rank that reads only a slice of a tensor (re-partitioning)
verify just the chunks it touches. zlib's CRC-32 runs at several GB/s and drops the GIL, so a save
stays bound by the disk (``benchmarks/engine/state_checksum.py``). Files of the first format (b"HZOSTATE",
no checksum) still load.

Tensors are streamed straight from the host arena to disk and read straight back into it: no second
copy of the optimizer state in RAM (device-resident state, ZeRO without offload, goes through a
64 MiB host bounce buffer). Writes go to ``<file>.hzo-tmp.<host>.<pid>``, are fsynced, then renamed (the
directory fsynced too): a crash leaves the previous checkpoint intact, never half a file; the next
save removes temporaries whose writer is dead.
"""
from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import reprlib
import socket
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

_MAGIC_V1, _MAGIC = b"HZOSTATE", b"HZOSTAT2"
_TRAILER_MAGIC = b"HZOCRC01"
_CHUNK = 64 << 20
_MAX_HEADER = 1 << 30  # a header is a few MB even for huge models; more means a damaged length
_FALLBACK = "the file is damaged: resume from an earlier checkpoint"


class StateFileError(ValueError):
    """A state file that cannot be trusted (damaged, truncated, not ours); names the file."""


def rank_file(directory: str, rank: int, world_size: int) -> str:
    return os.path.join(directory, f"rank{rank}_of_{world_size}.hzo")


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


TMP_TAG = ".hzo-tmp."  # ours alone: the cleanup below must never match a user's own "x.tmp.3"


def tmp_name(path: str) -> str:
    # The host is in the name: ranks on other nodes may write into the same (shared) directory, and
    # only a writer on this host can be known dead.
    return f"{path}{TMP_TAG}{socket.gethostname()}.{os.getpid()}"


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporaries in ``directory`` whose writer on this host is dead (killed mid-save); a live
    writer's temporary stays, and so does another host's. Returns what was removed.

    Only names this module writes are candidates: ``<file>.hzo-tmp.<host>.<pid>``, and the earlier
    ``<file>.tmp.<host>.<pid>`` with this host's name. Not the first format's ``<file>.tmp.<pid>``: the run
    walks its whole output_dir, and that pattern also fits files of the user's own (``data.tmp.3``), which
    a cleanup must not delete."""
    removed, host = [], socket.gethostname()
    paths = {p for pattern in (f"*{TMP_TAG}*", "*.tmp.*")
             for p in glob.glob(os.path.join(glob.escape(directory), pattern))}
    for path in sorted(paths):
        name = os.path.basename(path)
        tag = TMP_TAG if TMP_TAG in name else ".tmp."
        who, _, pid = name.rsplit(tag, 1)[1].rpartition(".")
        if who != host or not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError:  # a read-only checkpoint (a mounted snapshot): the cleanup is best effort, the run goes on
            continue
    return removed


def fsync_dir(directory: str) -> None:
    """Make the names in ``directory`` durable: a rename is in the page cache until its directory is fsynced, so
    after a power cut the completion marker could exist while a file renamed before it did not."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # a platform or file system that cannot open a directory: nothing more can be done
    try:
        with contextlib.suppress(OSError):  # some file systems (FUSE) refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str) -> None:
    """Every file and directory under ``directory`` on disk: the Trainer's own files (model, trainer state) are
    written without fsync, and the completion marker must not reach the disk before them."""
    for root, dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(FileNotFoundError), open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


@contextlib.contextmanager
def atomic_path(path: str):
    """Yield a temporary name beside ``path``; once the caller has written it, fsync it and rename it
    over ``path``. A crash or an exception leaves the previous file (or none), never half a file: the
    one-file case of :func:`atomic_files`."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    try:
        with atomic_files(directory) as stage:
            yield stage(path)
    except OSError as e:
        if e.filename is None:  # a failed write (a full disk) names no file: say which one
            raise OSError(e.errno, e.strerror, path) from e
        raise


@contextlib.contextmanager
def atomic_files(directory: str):
    """Several files of ``directory`` made visible together, or none: yields ``stage(path)``, which gives the
    temporary to write ``path``'s whole content to. When the block ends every temporary is fsynced, then all are
    renamed in the order staged (so the file staged last appears last) and the directory fsynced; a failure or a
    stop before that (Ctrl-C, a full disk) removes the temporaries and renames nothing. A set of files (weights
    beside their config) is thus never half replaced; :func:`atomic_path` is the one-file case."""
    staged: list[tuple[str, str]] = []  # (temporary, target)

    def stage(path: str) -> str:
        staged.append((tmp_name(path), path))
        return staged[-1][0]

    remove_stale_temporaries(directory)
    try:
        yield stage
        for tmp, _ in staged:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        for tmp, path in staged:
            os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException:
        for tmp, _ in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise


def remove_durably(directory: str, names) -> None:
    """Unlink the files ``names`` of ``directory`` (those present) and make their removal durable before anything
    is written after it (an old completion record must not survive a crash beside new files)."""
    gone = False
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            gone = True
    if gone:
        fsync_dir(directory)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "wb"):
    """``open(path, mode)`` for writing, made atomic with :func:`atomic_path`."""
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f


def _is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _byte_chunks(t: torch.Tensor):
    """The bytes of contiguous ``t`` in chunks of ``_CHUNK`` (the last may be shorter): views of host
    memory, or host copies of one chunk at a time for a device tensor."""
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
    head = _MAGIC + struct.pack("<Q", len(header)) + header
    sums = {"header": zlib.crc32(head), "chunks": {}}
    with atomic_open(path, "wb") as f:
        f.write(head)
        for name, t in tensors.items():
            crcs = sums["chunks"][name] = []
            for raw in _byte_chunks(t):
                view = memoryview(raw)
                crcs.append(zlib.crc32(view))
                f.write(view)
        trailer = json.dumps(sums).encode()
        f.write(trailer + struct.pack("<IQ", zlib.crc32(trailer), len(trailer)) + _TRAILER_MAGIC)


def _bad(path: str, what: str) -> StateFileError:
    return StateFileError(f"optimizer state file {path}: {what}; {_FALLBACK}")


def _read_trailer(f, path: str, size: int) -> dict:
    tail = 12 + len(_TRAILER_MAGIC)
    if size < tail:
        raise _bad(path, "truncated (no checksum trailer)")
    f.seek(size - tail)
    raw = f.read(tail)
    crc, n = struct.unpack("<IQ", raw[:12])
    if raw[12:] != _TRAILER_MAGIC or n > size - tail:
        raise _bad(path, "truncated or damaged checksum trailer")
    f.seek(size - tail - n)
    trailer = f.read(n)
    if zlib.crc32(trailer) != crc:
        raise _bad(path, "checksum trailer does not match its checksum")
    try:
        sums = json.loads(trailer)
        ok = isinstance(sums, dict) and isinstance(sums.get("header"), int) and isinstance(sums.get("chunks"), dict)
    except ValueError:
        ok = False
    if not ok:
        raise _bad(path, 'checksum trailer is not {"header": crc, "chunks": {name: [crc, ...]}}')
    return {**sums, "length": tail + n}


def read_header(path: str, *, with_sums: bool = False):
    """(meta, tensor entries, byte offset where the tensor data starts[, checksums or None for the
    first format]). Verifies the header's checksum; every problem names the file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"optimizer state file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(len(_MAGIC))
        if magic not in (_MAGIC, _MAGIC_V1):
            raise StateFileError(f"{path} is not an hf_zero_offload state file")
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise _bad(path, "truncated header")
        (n,) = struct.unpack("<Q", raw_len)
        if n > min(_MAX_HEADER, size - 16):
            raise _bad(path, f"header length {n} exceeds the file ({size} bytes)")
        raw = f.read(n)
        sums = None
        if magic == _MAGIC:
            sums = _read_trailer(f, path, size)
            if zlib.crc32(magic + raw_len + raw) != sums["header"]:
                raise _bad(path, "header checksum mismatch")
    try:
        header = json.loads(raw)
        meta, entries = header["meta"], header["tensors"]
    except (ValueError, KeyError, TypeError) as e:
        raise _bad(path, f"unreadable header ({type(e).__name__}: {e})") from None
    base = len(_MAGIC) + 8 + n
    _check_layout(path, entries, size, base, sums)
    out = (meta, entries, base)
    return (*out, sums) if with_sums else out


def _check_layout(path: str, entries, size: int, base: int, sums: dict | None) -> None:
    """The file is exactly what ``write_state`` writes for this header: each tensor's bytes right after the one
    before it (no overlap, no gap), the data ending where the trailer starts, one checksum per chunk. The header and
    trailer checksums cannot tell a file whose data lost or gained bytes (a copy cut short in the middle, a block
    inserted): without this it passed every check made before a load and failed only part way through, after the
    optimizer's state had been overwritten. Costs one ``stat`` and a loop over the few tensors."""
    if not isinstance(entries, dict):
        raise _bad(path, f"the header's tensors must be an object, got {type(entries).__name__}")
    end = 0
    for name, e in entries.items():
        if not _entry_ok(e):
            raise _bad(path, f"tensor {name!r} is {reprlib.repr(e)}, expected a dtype, a shape, a byte offset and "
                             "the nbytes that dtype and shape make")
        if e["offset"] != end:
            raise _bad(path, f"tensor {name!r} starts at byte {e['offset']} of the data, expected {end} (where the "
                             "tensor before it ends): its bytes overlap another tensor's or leave a gap")
        end += e["nbytes"]
        chunks, want = sums and sums["chunks"].get(name), -(-e["nbytes"] // _CHUNK)
        if sums is not None and not (isinstance(chunks, list) and len(chunks) == want):
            raise _bad(path, f"the checksum trailer holds {reprlib.repr(chunks)} for {name!r}, expected {want} "
                             f"checksums (one per {_CHUNK} bytes)")
    declared = base + end + (0 if sums is None else sums["length"])
    if size != declared:
        off = (f"{declared - size} bytes are missing (a copy cut short, or bytes lost in the middle)"
               if size < declared else f"it has {size - declared} bytes too many (bytes added to its data)")
        raise _bad(path, f"the file is {size} bytes, but its header declares {declared} ({base} of header, {end} of "
                         f"tensors, {declared - base - end} of checksum trailer): {off}")


def _entry_ok(e) -> bool:
    if not (isinstance(e, dict) and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)):
        return False
    dtype = getattr(torch, e["dtype"], None)
    return (isinstance(dtype, torch.dtype) and all(map(_count, e["shape"])) and _count(e.get("offset"))
            and _count(e.get("nbytes")) and e["nbytes"] == math.prod(e["shape"]) * dtype.itemsize)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_into(path: str, tensors: dict[str, torch.Tensor], *, start: dict[str, int] | None = None) -> dict:
    """Fill ``tensors`` (contiguous; host, or device through a bounce buffer) from ``path`` in place;
    ``start`` gives an element offset into the stored tensor per name (re-partitioning reads a
    slice). Every 64 MiB chunk touched is verified against its checksum. Returns the meta."""
    meta, entries, base, sums = read_header(path, with_sums=True)
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
            out = dst.view(-1).view(torch.uint8)
            crcs = None if sums is None else sums["chunks"].get(name)
            _read_range(f, path, base + e["offset"], first, e["nbytes"], out, crcs)
    return meta


def _read_range(f, path: str, at: int, first: int, total: int, out: torch.Tensor, crcs: list | None) -> None:
    """Bytes [first, first + len(out)) of the tensor stored at file offset ``at`` into ``out``, chunk
    by chunk: a whole chunk landing in host memory is read in place and its checksum computed on a
    helper thread while the next chunk is read (zlib drops the GIL); an edge chunk (or any chunk for
    a device tensor) goes through a bounce buffer, read and checked whole before the bounce is reused."""
    n = out.numel()
    bounce, pending = None, []
    with ThreadPoolExecutor(max_workers=1) as pool:
        for c0 in range(first // _CHUNK * _CHUNK, first + n, _CHUNK):
            c1 = min(c0 + _CHUNK, total)
            lo, hi = max(c0, first), min(c1, first + n)
            f.seek(at + c0)
            if _is_host(out) and lo == c0 and hi == c1:
                view = memoryview(out[lo - first:hi - first].numpy())
                _read_exact(f, view, path)
                if crcs is not None:
                    pending.append((c0, c1, pool.submit(zlib.crc32, view)))
                continue
            if bounce is None:
                bounce = torch.empty(min(_CHUNK, total), dtype=torch.uint8)
            view = memoryview(bounce[:c1 - c0].numpy())
            _read_exact(f, view, path)
            if crcs is not None:
                pending.append((c0, c1, zlib.crc32(view)))
            out[lo - first:hi - first].copy_(bounce[lo - c0:hi - c0])  # synchronous: the bounce is reused
    for c0, c1, crc in pending:
        if (crc if isinstance(crc, int) else crc.result()) != crcs[c0 // _CHUNK]:
            raise _bad(path, f"checksum mismatch in bytes [{at + c0}, {at + c1})")


def _read_exact(f, view: memoryview, path: str) -> None:
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            raise _bad(path, "truncated")
        got += k


def read_tensor(path: str, name: str) -> torch.Tensor:
    """One stored tensor as a new CPU tensor (consolidation, tests)."""
    _, entries, _ = read_header(path)
    if name not in entries:
        raise KeyError(f"{path} holds no tensor {name!r}")
    e = entries[name]
    out = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
    read_into(path, {name: out})
    return out
