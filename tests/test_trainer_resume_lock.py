"""The output_dir's run lock: a second live run is refused before any work, the lock is held only while
train() runs and checked at each save, a stale lock is taken over, a foreign host's is an error, an unwritable
output_dir is named."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from _t5 import ToyDataset, tiny_t5
from _resume import COMMON, OFFLOAD, _same
from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments
from hf_zero_offload import resume
from hf_zero_offload.run_lock import LOCK_NAME, RunLock, RunLockError

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the run lock

def _foreign_lock(directory, proc, host=None):
    import psutil
    os.makedirs(directory, exist_ok=True)
    owner = {"pid": proc.pid, "host": host or __import__("socket").gethostname(),
             "process_start": psutil.Process(proc.pid).create_time(), "started": "earlier"}
    (directory / LOCK_NAME).write_text(json.dumps(owner))


def test_a_second_live_run_is_an_error_before_any_work(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _foreign_lock(tmp_path / "busy", other)
        model = tiny_t5()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RunLockError, match=rf"another run \(pid {other.pid}.*is training in this output_dir"):
            ZeroOffloadSeq2SeqTrainer(model=model, args=ZeroOffloadSeq2SeqTrainingArguments(
                output_dir=str(tmp_path / "busy"), **{**COMMON, "zero_offload": OFFLOAD}), train_dataset=ToyDataset())
        assert _same(model, before) and os.listdir(tmp_path / "busy") == [LOCK_NAME]
    finally:
        other.kill()
        other.wait()


def test_the_lock_is_held_while_train_runs_only(tmp_path, monkeypatch):
    """It was taken in __init__ and released at the end of train() or at exit: a Trainer built for evaluate(), dropped,
    or whose __init__ failed kept any other process off its output_dir until the notebook's kernel exited; and with a
    relative output_dir and a chdir before train() the lock stayed in the first directory."""
    from transformers import TrainerCallback

    def build(out, **kw):
        return ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(), args=(
            ZeroOffloadSeq2SeqTrainingArguments(output_dir=out, **{**COMMON, "zero_offload": OFFLOAD, **kw})))

    seen = []

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(os.path.exists(os.path.join(os.path.abspath(args.output_dir), LOCK_NAME)))

    monkeypatch.chdir(tmp_path)
    trainer = build("run", max_steps=1)
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # built: nothing held
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the outputs go to elsewhere/run now, and so does the lock
    trainer.add_callback(Look())
    trainer.train()
    assert seen == [True] and not (tmp_path / "elsewhere" / "run" / LOCK_NAME).exists()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(ToyDataset())

    with pytest.raises(ValueError):  # refused in transformers' __init__, after ours took the lock
        ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=Stream(), args=(
            ZeroOffloadSeq2SeqTrainingArguments(output_dir="failed", **{**COMMON, "zero_offload": OFFLOAD,
                                                                      "max_steps": -1})))
    assert not (tmp_path / "elsewhere" / "failed" / LOCK_NAME).exists()


@pytest.mark.parametrize("meanwhile", ["deleted", "another run started"])
def test_a_lock_deleted_mid_run_is_checked_at_each_save(tmp_path, caplog, meanwhile):
    """An outside probe deleted the lock of a running job: a second run then started in the output_dir and each saved
    over the other's checkpoints. Each save checks the lock first: taken again when missing; another live run's is
    an error before this save writes anything."""
    from transformers import TrainerCallback
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    out = tmp_path / "run"

    class Meddle(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                os.unlink(out / LOCK_NAME)
                if meanwhile != "deleted":
                    _foreign_lock(out, other)

    trainer = ZeroOffloadSeq2SeqTrainer(model=tiny_t5(), train_dataset=ToyDataset(), callbacks=[Meddle()], args=(
        ZeroOffloadSeq2SeqTrainingArguments(output_dir=str(out), **{**COMMON, "zero_offload": OFFLOAD})))
    try:
        with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
            if meanwhile == "deleted":
                trainer.train()
                assert any("was deleted while this run trained; taken again" in r.getMessage() for r in caplog.records)
                assert resume.status(str(out / "checkpoint-4")) == "complete"
                assert not (out / LOCK_NAME).exists()  # released at the end, as the lock taken at the start
            else:
                with pytest.raises(RunLockError, match=rf"another run \(pid {other.pid}.*is training in this "
                                                       r"output_dir.*stops before its save would write over"):
                    trainer.train()
                assert not (out / "checkpoint-4").exists()
                assert json.loads((out / LOCK_NAME).read_text())["pid"] == other.pid  # the other run's, kept
    finally:
        other.kill()
        other.wait()


def test_an_unwritable_output_dir_is_named_as_such(tmp_path, monkeypatch):
    """A read-only output_dir gave "[Errno 30] Read-only file system: '.../hzo-run.lock'" (an outside probe)."""
    import errno

    real = os.open

    def read_only(path, *args, **kw):
        if str(path).endswith(LOCK_NAME):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path, *args, **kw)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OSError, match=r"output_dir .* is not writable \(the run lock hzo-run.lock cannot be created "
                                      r"there: Read-only file system\); .* give a writable --output_dir"):
        RunLock(str(tmp_path)).acquire()


def test_a_second_lock_of_the_same_process_leaves_the_first_ones_file(tmp_path):
    first, second = RunLock(str(tmp_path)), RunLock(str(tmp_path))
    first.acquire()
    second.acquire()  # re-entrant: another Trainer of the same script
    second.release()
    assert (tmp_path / LOCK_NAME).exists()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_stale_lock_is_taken_over_and_foreign_host_is_an_error(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    _foreign_lock(tmp_path / "stale", dead)
    dead.wait()
    lock = RunLock(str(tmp_path / "stale"))
    assert "took over the stale run lock" in lock.acquire()
    assert json.loads((tmp_path / "stale" / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert RunLock(str(tmp_path / "stale")).acquire() is None  # same process: re-entrant
    lock.release()
    assert not (tmp_path / "stale" / LOCK_NAME).exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _foreign_lock(tmp_path / "far", alive, host="another-host")
        with pytest.raises(RunLockError, match="on host another-host.*delete the lock file if that run is dead"):
            RunLock(str(tmp_path / "far")).acquire()
    finally:
        alive.kill()
        alive.wait()


# ---------------------------------------------------------------- processes racing for it (from test_crash_safety.py)

_HOLDER = textwrap.dedent("""
    import sys, time
    from hf_zero_offload.run_lock import RunLock
    RunLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(60)
""")


def test_two_processes_on_one_output_dir(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockError, match=rf"{out}.*another run \(pid {holder.pid}"):
            RunLock(str(out)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # no atexit: the lock file stays, its owner dead
        holder.wait()
    lock = RunLock(str(out))
    assert f"pid {holder.pid}" in lock.acquire() and json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


_TAKER = textwrap.dedent("""
    import os, sys, time
    from hf_zero_offload import run_lock
    from hf_zero_offload.run_lock import RunLock, RunLockError
    out, judge_s, go, done = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
    alive = run_lock._alive

    def slow_alive(owner):  # widens the window between judging the owner gone and replacing it
        time.sleep(judge_s)
        return alive(owner)

    run_lock._alive = slow_alive
    print("ready", flush=True)
    while not os.path.exists(go):  # both start together, once both have imported
        time.sleep(0.005)
    try:
        RunLock(out).acquire()
        print("won", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:  # hold it until the other taker has looked
            time.sleep(0.005)
    except RunLockError as e:
        print("lost", e, flush=True)
""")


def test_two_takers_of_a_stale_lock_never_both_win(tmp_path):
    """Two runs started together on an output_dir whose lock's owner is dead: each judges the lock stale and
    takes it over. The one that judged faster finished taking it before the slower one replaced it, and both
    ran (the slower one's ownership check came after its own replacement). Now exactly one runs."""
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "process_start": 1.0,
                                             "started": "earlier"}))
    go, done = tmp_path / "go", tmp_path / "done"
    takers = [subprocess.Popen([sys.executable, "-c", _TAKER, str(out), str(judge), str(go), str(done)],
                               stdout=subprocess.PIPE, text=True) for judge in (0.1, 1.0)]
    stuck = threading.Timer(60, lambda: [t.kill() for t in takers])  # a taker that never says ends the test
    stuck.start()
    try:
        assert [t.stdout.readline().strip() for t in takers] == ["ready", "ready"]
        go.touch()
        said = [t.stdout.readline().strip() for t in takers]  # the winner holds the lock until both have said
    finally:
        done.touch()
        stuck.cancel()
    for t in takers:
        t.communicate(timeout=60)
    assert sorted(s.split()[0] for s in said) == ["lost", "won"], said
    assert "another run" in next(s for s in said if s.startswith("lost"))


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EOPNOTSUPP, errno.EACCES])
def test_a_file_system_without_flock_still_takes_a_stale_lock(tmp_path, monkeypatch, err):
    """Some NFS and FUSE mounts refuse flock: the takeover then runs unguarded, as before the guard existed,
    instead of the run failing to start."""
    import fcntl

    def no_flock(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname(),
                                             "process_start": 1.0, "started": "earlier"}))
    lock = RunLock(str(out))
    assert "took over the stale run lock" in lock.acquire()
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / LOCK_NAME).exists()
