"""A TCPStore served by a child process that a test stops (SIGSTOP) to play a store host that stopped answering.

    with store_server() as (port, pid):
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=...)
        stop(pid)

The child forks from tests/_dist.py's server, which has imported torch once: a fresh ``python -c "import
torch.distributed ..."`` per test spent 1.5-2 s importing on 2 cores before it served anything. The store is the
child's own, its pid the one to stop, so a stopped server holds what a stopped rank 0 holds (its connections open,
no answer).
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

from _dist import _context


def _serve(conn) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    conn.close()
    time.sleep(120)


def stop(pid: int) -> None:
    """SIGSTOP, returning once the process is stopped: the signal takes effect when the kernel next runs it, and a
    request sent at once was answered now and then on a loaded machine (1 full run in 3)."""
    os.kill(pid, signal.SIGSTOP)
    give_up = time.monotonic() + 10
    while time.monotonic() < give_up:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "T":
                return
        time.sleep(0.005)
    raise RuntimeError(f"process {pid} not stopped 10 s after SIGSTOP")


@contextlib.contextmanager
def store_server():
    ctx = _context()
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(theirs,), daemon=True)
    server.start()
    try:
        if not ours.poll(60):
            raise RuntimeError("the store's child did not give its port within 60 s")
        yield ours.recv(), server.pid
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.join()
