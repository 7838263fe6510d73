"""One training run per output directory: a lock file holding the owner's pid, host and start time.

Two runs writing the same ``output_dir`` at once both finish, and a checkpoint can end up with one run's model
and the other's optimizer state. The lock makes the second run an error before it does any work. It belongs to
the job, not to a process: the caller lets rank 0 take it and tells the other ranks the outcome (the ranks of one
torchrun job share the directory). A lock whose process is gone (same host; a pid reused by another process
shows a different start time) is stale and taken over with a warning. A lock from another host cannot be
checked: it is an error that says which file to delete if that run is dead. Nothing here imports transformers.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import time

import psutil
import torch.distributed as dist

try:
    import fcntl
except ImportError:  # not POSIX: no takeover guard (torch.distributed runs here on Linux)
    fcntl = None

from .config import ConfigError
from .engine.checkpoint import atomic_open

LOCK_NAME = "hzo-run.lock"
logger = logging.getLogger("hf_zero_offload")


class RunLockError(ConfigError):
    """Another live run holds the output directory."""


def _me() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "process_start": psutil.Process(pid).create_time(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _alive(owner: dict) -> bool:
    """Whether the owner process still runs (only meaningful on the owner's host)."""
    try:
        proc = psutil.Process(int(owner["pid"]))
        # a recycled pid belongs to a process started later than the owner
        return abs(proc.create_time() - float(owner.get("process_start", proc.create_time()))) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def _same_process(a: dict, b: dict) -> bool:
    return a.get("host") == b["host"] and a.get("pid") == b["pid"]


class RunLock:
    """``acquire()`` returns a warning to log (a stale lock taken over) or None; ``release()`` is idempotent."""

    def __init__(self, directory: str):
        # absolute: a relative output_dir and a chdir before release() would unlink (or miss) another file
        self.path = os.path.join(os.path.abspath(directory), LOCK_NAME)
        self.held = False
        self.owned = False  # this object created (or took over) the file; False: another lock of this process did

    def _read(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                owner = json.load(f)
            return owner if isinstance(owner, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # a torn or foreign file: no owner we could check

    def _create(self, me: dict) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:  # a read-only or foreign folder: said as the output_dir's, before any model work
            raise OSError(e.errno, f"output_dir {os.path.dirname(self.path)} is not writable (the run lock "
                                   f"{LOCK_NAME} cannot be created there: {e.strerror or e}); checkpoints and results "
                                   "go there: give a writable --output_dir") from None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as e:  # a full disk: an empty lock left behind (taken over later as stale) and no path said
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise OSError(e.errno, f"cannot write the run lock {self.path}: {e.strerror or e}") from e
        return True

    @contextlib.contextmanager
    def _takeover_guard(self):
        """Judging the owner gone and replacing it must be one step for the processes of this host: two takers
        that both judged a stale lock before either replaced it would each replace it, and the first to check
        its ownership afterwards would run beside the second. An exclusive flock on the directory (released by
        the kernel if the holder dies; no extra file left behind) makes the takers take turns."""
        fd = None
        if fcntl is not None:
            try:
                fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:  # a file system without flock (some NFS or FUSE mounts): unguarded, as before
                logger.debug("hf_zero_offload: no flock on %s (%s); run-lock takeover unguarded", self.path, e)
                if fd is not None:
                    os.close(fd)
                fd = None
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # drops the flock

    def acquire(self) -> str | None:
        directory = os.path.dirname(os.path.abspath(self.path))
        if os.path.lexists(directory) and not os.path.isdir(directory):  # makedirs: only "[Errno 17] File exists"
            raise RunLockError(f"output_dir {directory} is a file, not a directory")
        os.makedirs(directory, exist_ok=True)
        me = _me()
        warning = None
        mine = False
        for _ in range(3):  # a racing taker may remove the file between our reads
            if self._create(me):
                mine = True
                break
            with self._takeover_guard():
                owner = self._read()
                if owner is None:
                    continue
                if _same_process(owner, me):
                    break  # this process already holds it (another Trainer of the same script)
                if owner.get("host") not in (None, me["host"]):
                    raise RunLockError(
                        f"{self.path}: output_dir is in use by pid {owner.get('pid')} on host {owner.get('host')} "
                        f"(started {owner.get('started')}); use another --output_dir, or delete the lock file if "
                        "that run is dead")
                if owner and _alive(owner):
                    raise RunLockError(
                        f"{self.path}: another run (pid {owner.get('pid')}, started {owner.get('started')}) is "
                        "training in this output_dir; wait for it, stop it, or use another --output_dir")
                warning = (f"hf_zero_offload: took over the stale run lock {self.path} (pid {owner.get('pid')} on "
                           f"{owner.get('host')}, started {owner.get('started')}, is gone)")
                # replace, not delete + create: a process creating the lock anew (O_EXCL) sees a file throughout
                with atomic_open(self.path, "w") as f:
                    json.dump(me, f)
                mine = True
        else:
            raise RunLockError(f"{self.path}: could not take the run lock (it keeps changing owner)")
        if not _same_process(self._read() or {}, me):
            raise RunLockError(f"{self.path}: another run took the output_dir at the same moment")
        if not self.held:
            self.held, self.owned = True, mine
            atexit.register(self.release)
        return warning

    def confirm(self) -> str | None:
        """Before each save, while held: the file is still this run's. Deleted by hand (or by a cleanup) mid-run,
        a second run could start in the output_dir and the two wrote over each other's checkpoints. Missing: taken
        again, and a warning returned; a stale owner's: taken over; a live run's: a RunLockError before any write."""
        if not self.held or _same_process(self._read() or {}, _me()):
            return None
        try:
            warning = self.acquire()
        except RunLockError as e:
            raise RunLockError(f"{e}. This run's lock was deleted while it trained and that run started since: this "
                               "run stops before its save would write over that run's files") from None
        self.owned = True
        return warning or (f"hf_zero_offload: the run lock {self.path} was deleted while this run trained; taken again "
                           "(a run started in this output_dir meanwhile would have been let in)")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        atexit.unregister(self.release)
        owner = self._read()
        if self.owned and owner is not None and _same_process(owner, _me()):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:  # (a file system gone read-only): the error that ended the run must stay the one said
                logger.warning("hf_zero_offload: could not remove the run lock %s (%s); the next run takes it over "
                               "as stale", self.path, e)


def take_job_lock(lock: RunLock, rank: int, world_size: int) -> RunLock:
    """Rank 0 takes ``lock`` for the whole job; every rank learns the outcome, so that all of them stop together
    before any work (a collective: every rank calls it)."""
    _on_rank0(lock.acquire, rank, world_size)
    return lock


def confirm_job_lock(lock: RunLock, rank: int, world_size: int) -> None:
    """Rank 0 checks that the job still holds ``lock`` (``RunLock.confirm``) before a save; every rank learns the
    outcome, so that all of them stop before writing (a collective: every rank calls it)."""
    _on_rank0(lock.confirm, rank, world_size)


def _on_rank0(action, rank: int, world_size: int) -> None:
    error = warning = raised = None
    if rank == 0:
        try:
            warning = action()
        except (RunLockError, OSError) as e:  # (a lock re-created on a full disk: the others waited, then died)
            error, raised = str(e), e
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if raised is not None:  # rank 0 raises its own error, type and errno kept; the others its words
        raise raised
    if error is not None:
        raise RunLockError(f"rank 0: {error}")
    if warning:
        logger.warning(warning)
