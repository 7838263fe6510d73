"""Run a function on N local processes joined in a torch.distributed group (gloo by default).

    results = run_distributed(fn, arg1, arg2, world_size=2)

``fn(rank, world_size, *args)`` must be importable by name (a module-level function of a test module
or helper): each rank is a process forked from a server that has imported torch and the Trainer once. The process group is initialised before ``fn``
runs and destroyed after. Return values are pickled back (tensors included, as copies), in rank
order. If any rank raises, ``run_distributed`` raises ``DistributedError`` with every failing rank's
traceback; a rank that hangs (e.g. a collective its peer never joins) is killed after ``timeout``.
"""
from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_KEPT = []  # see _entry


class DistributedError(RuntimeError):
    pass


# Ranks fork from a server that has imported these once, instead of each importing them anew: torch and
# transformers' Trainer take 3-10 s per process on a 2-core machine, most of a Trainer test's time.
# Nothing runs in the server but the imports (no threads, no OpenMP pool, no process group), so a
# forked rank starts from a state a fresh interpreter would reach; each rank still gets the test's
# sys.path and cwd (multiprocessing's preparation data) and, below, its environment.
PRELOAD = ["torch", "torch.distributed", "hf_zero_offload", "hf_zero_offload.trainer"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts: the first run's ranks
    return ctx


def _entry(rank, world_size, port, backend, threads, collective_timeout, fn, args, results, environ):
    # the server's environment is the one it started with; a rank runs in the caller's, as a spawned one did
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)  # ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=collective_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout))
        try:
            out = fn(rank, world_size, *args)
        finally:
            # torch < 2.8 deallocates a ProcessGroup holding the GIL while it joins gloo's worker threads, and a
            # worker still dropping the last collective's tensors needs the GIL: a deadlock (pytorch#154976).
            # Kept referenced, the group is only unregistered here; the rank ends in os._exit, no destructor runs.
            _KEPT.append(dist.group.WORLD)
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn, *args, world_size: int = 2, backend: str = "gloo", threads: int = 1,
                    timeout: float = 120.0, collective_timeout: float = 60.0) -> list:
    ctx = _context()
    results = ctx.Queue()
    # The rendezvous store lives here, bound to a port the OS picks and held until every rank is done:
    # a free port picked, released and bound again by rank 0 could be taken in between.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=collective_timeout))
    port = store.port
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, threads, collective_timeout, fn, args,
                                              results, dict(os.environ)), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    got, errors = {}, {}
    grace = None
    deadline = time.monotonic() + timeout
    try:
        while len(got) + len(errors) < world_size:
            if errors and grace is None:
                # a peer of a failed rank may wait in a collective forever: give it a moment to report
                grace = time.monotonic() + 3.0
            left = min(deadline, grace or deadline) - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        for p in dead:
                            errors.setdefault(procs.index(p), f"process exited with code {p.exitcode}")
                continue
            if ok:
                got[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(got) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    missing = [r for r in range(world_size) if r not in got and r not in errors]
    if errors or missing:
        parts = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            parts.append(f"ranks {missing} gave no result within {timeout:.0f} s (killed)")
        raise DistributedError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(parts))
    return [got[r] for r in range(world_size)]
