"""The host-RAM check sees every limit that applies: MemAvailable, RLIMIT_AS, the cgroup v1/v2 memory limit."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hf_zero_offload.engine import memory_limits
from hf_zero_offload.engine.memory_limits import check_host_ram, host_memory_limits

GiB = 2**30


def _cgroup(tmp_path, proc_line, files):
    (tmp_path / "proc_cgroup").write_text(proc_line + "\n")
    for rel, value in files.items():
        p = tmp_path / "root" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"{value}\n")
    return dict(cgroup_root=str(tmp_path / "root"), proc_cgroup=str(tmp_path / "proc_cgroup"))


def test_cgroup_v2_limit_minus_usage_of_the_tightest_ancestor(tmp_path):
    where = _cgroup(tmp_path, "0::/job/step", {
        "cgroup.controllers": "memory", "job/memory.max": 3 * GiB, "job/memory.current": GiB,
        "job/step/memory.max": "max", "job/step/memory.current": GiB // 2})
    limits = host_memory_limits(**where)
    cg = [left for what, left in limits if "cgroup" in what]
    assert cg == [2 * GiB]
    with pytest.raises(MemoryError, match=r"needs 2\.50 GiB.*only 2\.00 GiB is left under the cgroup memory limit "
                                          r".*job/memory.max.*delayed parameter update off.*fewer ranks"):
        check_host_ram(int(2.5 * GiB), **where)
    check_host_ram(GiB, **where)


def test_cgroup_v1_and_hybrid_hosts(tmp_path):
    where = _cgroup(tmp_path, "4:memory,foo:/batch/42\n0::/", {
        "memory/batch/42/memory.limit_in_bytes": GiB, "memory/batch/42/memory.usage_in_bytes": GiB // 4,
        "memory/memory.limit_in_bytes": 9223372036854771712})  # v1's "unlimited"
    assert [left for what, left in host_memory_limits(**where) if "cgroup" in what] == [3 * GiB // 4]
    with pytest.raises(MemoryError, match="memory.limit_in_bytes"):
        check_host_ram(GiB, **where)


def test_no_cgroup_file_means_no_cgroup_limit(tmp_path):
    limits = host_memory_limits(cgroup_root=str(tmp_path), proc_cgroup=str(tmp_path / "missing"))
    assert [w for w, _ in limits if "cgroup" in w] == []


def test_mem_available_still_counts(monkeypatch):
    class VM:
        available = GiB
    monkeypatch.setattr(memory_limits.psutil, "virtual_memory", lambda: VM)
    with pytest.raises(MemoryError, match="under the MemAvailable"):
        check_host_ram(2 * GiB, cgroup_root="/nonexistent", proc_cgroup="/nonexistent")


def test_real_address_space_limit_stops_the_arena_before_torch_allocates():
    """ulimit -v below the arena: the engine's arena refuses with the numbers, instead of torch failing inside
    its allocator (MemAvailable alone passes here)."""
    code = textwrap.dedent("""
        import resource, psutil, torch
        from hf_zero_offload.engine.buffers import HostArena, plan_host_memory
        vms = psutil.Process().memory_info().vms
        resource.setrlimit(resource.RLIMIT_AS, (vms + (256 << 20), resource.RLIM_INFINITY))
        plan = plan_host_memory(64 << 20, param_dtype=torch.float32, bucket_numel=1 << 20, tile_numel=1 << 20)
        try:
            HostArena(plan, pin=False)
        except MemoryError as e:
            print("REFUSED:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED:" in out.stdout, out.stdout + out.stderr
    assert "address-space limit RLIMIT_AS / ulimit -v" in out.stdout and "Ways out" in out.stdout


def test_a_cpu_runs_gradient_buckets_count_in_the_host_ram_check(monkeypatch):
    """On a CPU run the gradient buckets are host RAM beside the arena: left out of the check, a limit between the
    two failed in torch's allocator ("can't allocate memory: you tried to allocate 134348800 bytes")."""
    import torch

    from _models import TinyNet
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

    model = TinyNet()
    opts = OffloadOptions(num_threads=1, bucket_numel=1 << 16)
    for build in (lambda: OffloadAdam(model.parameters(), lr=1e-2, options=opts),
                  lambda: ShardedAdam(model.parameters(), lr=1e-2, stage=2, offload=True, options=opts)):
        ref = build()
        arena = ref.arena.nbytes
        beside = sum(n * dt.itemsize for n, dt, where in ref.plan.regions.values() if where == "device")
        assert beside > 0
        ref.close()
        monkeypatch.setattr(memory_limits, "host_memory_limits", lambda **kw: [("test limit", arena + beside - 1)])
        with pytest.raises(MemoryError, match=rf"needs {(arena + beside) / GiB:.2f} GiB of host RAM.*test limit"):
            build()
        monkeypatch.setattr(memory_limits, "host_memory_limits", lambda **kw: [("test limit", arena + beside)])
        build().close()
        monkeypatch.undo()
    assert torch.get_default_dtype() == torch.float32


def test_a_build_that_fails_for_memory_after_replacing_an_engine_says_so_and_keeps_nothing(monkeypatch):
    """A new engine releases the one it replaces before allocating (peak host memory: one arena, lifetime.py), so
    an allocation that fails past the host-RAM check leaves that engine done. The error says so (a note), the live
    engine's refusal names the failed build, the params are left as they were (not cast), the failed engine keeps
    no memory (a notebook's sys.last_traceback holds it) and no hook: backward leaves .grad to torch."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from _models import TinyNet, batches, loss_fn
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions, buffers, offload

    torch.manual_seed(0)
    model = TinyNet()
    live = OffloadAdam(model.parameters(), lr=1e-2, options=OffloadOptions(num_threads=1))
    live_arena = StorageWeakRef(live.master.untyped_storage())
    real_empty, arenas = torch.empty, []

    def empty(*args, **kwargs):  # the gradient buckets (2, bucket) fail, as past a limit the check missed
        if len(args) == 2 and args[0] == 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_empty(*args, **kwargs)

    class Arena(buffers.HostArena):  # the failed build's arena, to see it freed
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            arenas.append(StorageWeakRef(self._buf.untyped_storage()))

    monkeypatch.setattr(offload.torch, "empty", empty)
    monkeypatch.setattr(offload, "HostArena", Arena)
    with pytest.raises(RuntimeError, match="can't allocate memory") as failed:
        OffloadAdam(model.parameters(), lr=1e-2, param_dtype=torch.bfloat16, options=OffloadOptions(num_threads=1))
    monkeypatch.undo()
    assert any("the OffloadAdam that held these parameters was replaced (its memory released) before this "
               "OffloadAdam failed to build: it can no longer train them" in n for n in failed.value.__notes__)
    assert live_arena.expired() and len(arenas) == 1 and arenas[0].expired()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # not cast
    ids, labels, use_branch = batches(1)[0]
    loss_fn(model, ids, labels, use_branch).backward()
    assert model.body[0].weight.grad is not None  # no engine took it
    with pytest.raises(RuntimeError, match=r"OffloadAdam was replaced by a new OffloadAdam built on the same parameters "
                                           r".*; that new OffloadAdam then failed to build \(RuntimeError\)"):
        live.step()
    live.close()


def test_an_address_space_limit_needs_room_for_threads_beside_the_arena(monkeypatch):
    """An arena that fit under RLIMIT_AS with a few MB to spare passed the check, then the run died in libgomp's thread
    creation with no message (outside probe F): the threads' headroom counts."""
    from hf_zero_offload.engine import memory_limits
    arena = 700 << 20
    for spare, refused in ((10 << 20, True), (memory_limits.address_space_headroom() + (1 << 20), False)):
        monkeypatch.setattr(memory_limits, "host_memory_limits", lambda **_: [
            ("address-space limit RLIMIT_AS / ulimit -v (x GiB, y GiB of address space in use)", arena + spare)])
        if refused:
            with pytest.raises(MemoryError, match=r"threads and the first steps need \d+\.\d\d GiB of address space"):
                memory_limits.check_host_ram(arena)
        else:
            memory_limits.check_host_ram(arena)
