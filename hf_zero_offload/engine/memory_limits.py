"""Every limit on the host memory this process may still allocate, checked before the arena exists.

MemAvailable alone misses the limits that actually stop a process in a container or a batch job: the address
space limit (``ulimit -v``, RLIMIT_AS: counts virtual memory, so what is left is the limit minus the current
virtual size) and the memory cgroup (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, minus what the cgroup
already uses; the tightest of the process's cgroup and its ancestors). Past them the allocation fails inside
torch or the kernel OOM-kills the run, far from any explanation.
"""
from __future__ import annotations

import os
import resource

import psutil

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) or unreadable: no limit here


def _ancestors(root: str, rel: str) -> list[str]:
    """``root/rel`` and each parent directory up to ``root``."""
    parts = [p for p in rel.strip("/").split("/") if p]
    return [os.path.join(root, *parts[:i]) for i in range(len(parts), -1, -1)]


def _cgroup_limits(root: str, proc_cgroup: str) -> list[tuple[str, int]]:
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            lines = [ln.strip().split(":", 2) for ln in f if ln.strip()]
    except OSError:
        return []
    found = []
    for fields in lines:
        if len(fields) != 3:
            continue
        _, controllers, rel = fields
        if controllers == "":  # v2 unified hierarchy: "0::/path" (under unified/ on a hybrid v1+v2 host)
            hybrid = not os.path.exists(os.path.join(root, "cgroup.controllers"))
            files, base = ("memory.max", "memory.current"), os.path.join(root, "unified") if hybrid else root
        elif "memory" in controllers.split(","):
            files, base = ("memory.limit_in_bytes", "memory.usage_in_bytes"), os.path.join(root, "memory")
        else:
            continue
        for d in _ancestors(base, rel):
            limit = _read_int(os.path.join(d, files[0]))
            if limit is None or limit >= 1 << 60:  # v1 reports "no limit" as a huge page-rounded number
                continue
            used = _read_int(os.path.join(d, files[1])) or 0
            found.append((f"cgroup memory limit {os.path.join(d, files[0])} ({limit / 2**30:.2f} GiB, "
                          f"{used / 2**30:.2f} GiB in use)", max(0, limit - used)))
    return found


def host_memory_limits(*, cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> list[tuple[str, int]]:
    """(what, bytes still allocatable under it) for every limit that applies, MemAvailable first."""
    limits = [("MemAvailable", psutil.virtual_memory().available)]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        vms = psutil.Process().memory_info().vms
        limits.append((f"address-space limit RLIMIT_AS / ulimit -v ({soft / 2**30:.2f} GiB, "
                       f"{vms / 2**30:.2f} GiB of address space in use)", max(0, soft - vms)))
    return limits + _cgroup_limits(cgroup_root, proc_cgroup)


def address_space_headroom() -> int:
    """What a run needs under RLIMIT_AS beyond the arena: every thread reserves address space (its stack; glibc a
    64 MiB malloc arena per thread) and the first steps allocate their temporaries. An arena that fit with a few MB
    to spare died in libgomp's thread creation, with no message (an outside probe, 710 MB left for 0.69 GiB)."""
    import torch  # (the thread count the step runs with)
    return 256 * 2**20 + 72 * 2**20 * max(1, torch.get_num_threads())


def check_host_ram(nbytes: int, freed: int = 0, **where) -> None:
    """Raise MemoryError when ``nbytes`` exceeds any limit (with the address-space headroom under RLIMIT_AS), with the
    numbers and the ways out. ``freed``: resident bytes the build frees (weights that leave for the device)."""
    room = address_space_headroom()
    short = [(what, left + freed) for what, left in host_memory_limits(**where)
             if nbytes + (room if what.startswith("address-space") else 0) > left + freed]
    if not short:
        return
    what, left = min(short, key=lambda s: s[1])
    raise MemoryError(
        f"hf_zero_offload needs {nbytes / 2**30:.2f} GiB of host RAM for the offloaded optimizer (fp32 master + "
        f"Adam moments + gradient store + staging) but only {left / 2**30:.2f} GiB is left under the {what}"
        + (f" (counting {freed / 2**30:.2f} GiB of weights it moves to the device)" if freed else "")
        + (f" (and threads and the first steps need {room / 2**30:.2f} GiB of address space "
           "beside it)" if what.startswith("address-space") else "") + ". "
        "Ways out: a smaller model; the delayed parameter update off (it doubles the gradient store and the "
        "parameter staging); fewer ranks (GPUs) per node, or --sharded_ddp so each rank holds only its shard; "
        "or raise the limit (free memory, ulimit -v, the container's memory limit)")
