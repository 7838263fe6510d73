"""Crash safety of saves and resumes, probed as a hostile outsider would: a save stopped at every stage (a full disk,
Ctrl-C, SIGKILL), a checkpoint written again over an older one, a read-only checkpoint, a renamed checkpoint,
consolidate stopped part way. The rule: the last good checkpoint stays loadable, no half-written file or directory
is ever taken for a complete one, and the next save succeeds. (Marker, rotation: test_trainer_resume.py; the lock,
two processes on one output_dir: test_trainer_resume_lock.py; CRC: test_state_integrity.py.)"""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_zero_offload import resume
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, checkpoint
from hf_zero_offload.engine.checkpoint import folder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli_errors import _checkpoint_of_a_linear  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"master": torch.randn(300, generator=g), "exp_avg": torch.randn(300, generator=g)}


def _load(path):
    out = {k: torch.empty(300) for k in ("master", "exp_avg")}
    return checkpoint.read_into(path, out), out


class _Stop(Exception):
    pass


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["ENOSPC", "ctrl-c"])
def test_a_save_stopped_at_any_stage_keeps_the_previous_file(tmp_path, monkeypatch, where, exc):
    monkeypatch.setattr(checkpoint, "_CHUNK", 64)  # several chunks: stopped after the first one was written
    path = checkpoint.rank_file(str(tmp_path), 0, 1)
    checkpoint.write_state(path, {"step": 1}, _state(1))
    calls = {"n": 0}

    def fail(real):
        def f(*a, **k):
            calls["n"] += 1
            if calls["n"] == 2 or where != "write":
                raise exc
            return real(*a, **k)
        return f

    with monkeypatch.context() as m, pytest.raises(type(exc)):
        if where == "write":
            real_chunks = checkpoint._byte_chunks
            m.setattr(checkpoint, "_byte_chunks", lambda t: (fail(lambda x: x)(c) for c in real_chunks(t)))
        else:
            m.setattr(os, where, fail(getattr(os, where)))
        checkpoint.write_state(path, {"step": 2}, _state(2))
    assert os.listdir(tmp_path) == ["rank0_of_1.hzo"]  # no temporary left behind
    meta, got = _load(path)
    assert meta == {"step": 1} and torch.equal(got["master"], _state(1)["master"])
    checkpoint.write_state(path, {"step": 2}, _state(2))  # the next save succeeds
    assert _load(path)[0] == {"step": 2}


_KILLED_WRITER = textwrap.dedent("""
    import sys, time, torch
    from hf_zero_offload.engine import checkpoint
    checkpoint._CHUNK = 64
    real = checkpoint._byte_chunks
    def slow(t):
        for i, c in enumerate(real(t)):
            if i == 2:
                print("mid-save", flush=True)
                time.sleep(60)
            yield c
    checkpoint._byte_chunks = slow
    checkpoint.write_state(sys.argv[1], {"step": 4}, {"master": torch.zeros(300), "exp_avg": torch.zeros(300)})
""")


def test_sigkill_mid_save_then_resume_true_takes_the_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    for step in (2, 4):
        (run / f"checkpoint-{step}" / "zero_offload").mkdir(parents=True)
    two = run / "checkpoint-2"
    checkpoint.write_state(checkpoint.rank_file(str(two / "zero_offload"), 0, 1), {"step": 2}, _state(2))
    (two / resume.TRAINER_STATE).write_text("{}")
    resume.write_marker(str(two), {"step": 2})
    victim = checkpoint.rank_file(str(run / "checkpoint-4" / "zero_offload"), 0, 1)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, victim], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mid-save"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = os.listdir(run / "checkpoint-4" / "zero_offload")
    assert len(left) == 1 and checkpoint.TMP_TAG in left[0]  # only the killed writer's temporary: no rank file
    path, state, notes = resume.target(True, str(run))
    assert path == str(two) and state == "complete" and notes[0][0] == logging.WARNING and "skipping" in notes[0][1] and "checkpoint-4" in notes[0][1]
    with pytest.raises(resume.IncompleteCheckpoint, match="checkpoint-4 is incomplete.*checkpoint-2"):
        resume.target(str(run / "checkpoint-4"), str(run))
    assert resume.remove_stale_temp_files(str(run)) == [str(run / "checkpoint-4" / "zero_offload" / left[0])]


def _engine(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = OffloadAdam(model.parameters(), lr=1e-2, options=OffloadOptions(num_threads=1))
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return opt


def test_a_directory_saved_again_at_another_world_size_loads_the_new_state(tmp_path):
    """A 2-rank run's zero_offload/ written again by a 1-rank run (a restarted run into the same output_dir): the old
    meta.json stayed, and the load read the old 2-rank state instead of the new file, silently."""
    old, new = _engine(0), _engine(1)
    meta, tensors = old.state_meta(), old.state_tensors()
    cut = old.numel // 2
    ranges = [[0, cut], [cut, old.numel]]
    for r in (1, 0):
        a, b = ranges[r]
        folder.save(str(tmp_path), r, 2, {**meta, "rank": r, "world_size": 2, "shard_start": a, "shard_end": b},
                       {k: v[a:b] for k, v in tensors.items()}, barrier=lambda: None, partition=ranges)
    new.save_checkpoint(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["rank0_of_1.hzo"]  # the other layout's files are gone
    fresh = _engine(2)
    fresh.load_checkpoint(str(tmp_path))
    assert all(torch.equal(fresh.state_tensors()[k], v) for k, v in new.state_tensors().items())
    for o in (old, new, fresh):
        o.close()


def test_a_stale_temporary_in_a_read_only_checkpoint_does_not_stop_the_run(tmp_path, monkeypatch):
    """Running as root here, so the read-only file system is simulated (EROFS from unlink). The best-effort cleanup
    at train start raised, and a run resumed from a read-only checkpoint (e.g. a mounted snapshot) never started."""
    ro = tmp_path / "run" / "checkpoint-2" / "zero_offload"
    ro.mkdir(parents=True)
    (ro / f"rank0_of_1.hzo.hzo-tmp.{socket.gethostname()}.999999").write_bytes(b"torn")
    real = os.unlink

    def unlink(path, *a, **k):
        if str(path).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    assert resume.remove_stale_temp_files(str(tmp_path / "run")) == []


def test_a_renamed_or_moved_checkpoint_still_resumes(tmp_path):
    ckpt = tmp_path / "run" / "checkpoint-6"
    ckpt.mkdir(parents=True)
    (ckpt / resume.TRAINER_STATE).write_text("{}")
    resume.write_marker(str(ckpt), {"step": 6})
    moved = tmp_path / "elsewhere" / "best"
    moved.parent.mkdir()
    os.rename(ckpt, moved)
    assert resume.target(str(moved), str(tmp_path / "run"))[:2] == (str(moved), "complete")


def test_a_missing_resume_path_says_where_it_looked_and_what_output_dir_holds(tmp_path, monkeypatch):
    """`--resume_from_checkpoint checkpoint-6` is read from the current directory, not from output_dir: the error said
    only "checkpoint-6 does not exist", neither where it looked nor the checkpoint beside it."""
    run = tmp_path / "run"
    for step in (4, 6):
        ckpt = run / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / resume.TRAINER_STATE).write_text("{}")
        resume.write_marker(str(ckpt), {"step": step})
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(resume.NotACheckpoint) as e:
        resume.target("checkpoint-6", str(run))
    assert str(e.value).endswith(f"checkpoint-6 does not exist (a relative path is read from the current directory, "
                                 f"{tmp_path / 'cwd'}); did you mean {run / 'checkpoint-6'}, in output_dir?"), e.value
    with pytest.raises(resume.NotACheckpoint) as e:
        resume.target(str(run / "checkpoint-9"), str(run))
    assert str(e.value).endswith(f"checkpoint-9 does not exist; output_dir {run} holds 2 checkpoint(s), the newest "
                                 f"complete one {run / 'checkpoint-6'} (what --resume_from_checkpoint true takes)")
    with pytest.raises(resume.NotACheckpoint, match=r"nope does not exist \(a relative path is read from the current "
                                                    r"directory, [^)]*\)$"):
        resume.target("nope", str(tmp_path / "empty"))


def test_atomic_writes_reach_the_disk_directory_entry_included(tmp_path, monkeypatch):
    """fsync of the file alone leaves the rename in the page cache: after a power cut the name can be the old file
    (or none) while the completion marker, written later, survived."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd)), real(fd))[1])
    checkpoint.write_state(checkpoint.rank_file(str(tmp_path), 0, 1), {}, _state(0))
    assert any(stat.S_ISDIR(s.st_mode) and s.st_ino == os.stat(tmp_path).st_ino for s in synced)


@pytest.fixture
def ckpt_model(tmp_path):
    from safetensors.torch import save_file

    ckpt, model, _ = _checkpoint_of_a_linear(tmp_path)
    save_file({"weight": model.weight.detach().to(torch.bfloat16), "bias": model.bias.detach().to(torch.bfloat16)},
              str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "linear", "torch_dtype": "bfloat16"}))
    (ckpt / "generation_config.json").write_text("{}")
    return ckpt


def _stop_at_the_config(monkeypatch):
    import hf_zero_offload.consolidate as cons

    real = cons.json.dump

    def dump(obj, f, *a, **k):
        if isinstance(obj, dict) and "model_type" in obj:
            raise KeyboardInterrupt
        return real(obj, f, *a, **k)

    monkeypatch.setattr(cons.json, "dump", dump)


def test_consolidate_stopped_part_way_leaves_no_output(ckpt_model, tmp_path, monkeypatch):
    """The weights were written (renamed into place) before config.json: stopped there, the output folder held
    fp32 weights without a config, a half output that looks like a result."""
    from hf_zero_offload.consolidate import consolidate

    out = tmp_path / "out"
    _stop_at_the_config(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        consolidate(str(ckpt_model), str(out))
    assert not out.exists()
    monkeypatch.undo()
    consolidate(str(ckpt_model), str(out))
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]


def test_consolidate_stopped_over_its_previous_output_leaves_that_output_whole(ckpt_model, tmp_path, monkeypatch):
    from hf_zero_offload.consolidate import consolidate

    out = tmp_path / "out"
    consolidate(str(ckpt_model), str(out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    from safetensors.torch import save_file
    save_file({"weight": torch.zeros(3, 4, dtype=torch.bfloat16), "bias": torch.zeros(3, dtype=torch.bfloat16),
               "extra": torch.ones(2)}, str(ckpt_model / "model.safetensors"))  # the new output differs
    _stop_at_the_config(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        consolidate(str(ckpt_model), str(out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# ---------------------------------------------------------------- the Trainer's save path

def _trainer(out, **kw):
    from _t5 import ToyDataset, tiny_t5
    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, ZeroOffloadSeq2SeqTrainingArguments

    args = ZeroOffloadSeq2SeqTrainingArguments(**{
        **dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, use_cpu=True, report_to=[], seed=0,
               disable_tqdm=True, learning_rate=1e-3, save_strategy="steps", save_steps=2,
               zero_offload={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}), **kw})
    return ZeroOffloadSeq2SeqTrainer(model=tiny_t5(0), args=args, train_dataset=ToyDataset())


def test_a_checkpoint_written_again_is_not_complete_until_its_new_marker(tmp_path, monkeypatch):
    """A second run (or a second train()) into the same output_dir writes checkpoint-2 again: the first run's marker
    stayed in place during the save, so a save stopped part way left the new model beside the old optimizer state
    under a marker that said complete. Also: every file is on disk (fsynced) before the marker says complete."""
    out = tmp_path / "out"
    synced = set()
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.add(os.fstat(fd).st_ino), real(fd))[1])
    _trainer(out).train()
    monkeypatch.undo()
    ckpt = out / "checkpoint-2"
    unsynced = [str(p.relative_to(ckpt)) for p in [ckpt, *ckpt.rglob("*")] if os.stat(p).st_ino not in synced]
    assert not unsynced, f"not fsynced before the marker: {unsynced}"
    again = _trainer(out)

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(again, "_save_optimizer_and_scheduler", stop)
    with pytest.raises(KeyboardInterrupt):
        again.train()
    assert resume.status(str(ckpt)) == "incomplete"
    with pytest.raises(resume.IncompleteCheckpoint):
        resume.target(True, str(out))


def test_clearing_a_marker_cut_between_its_two_files_never_leaves_a_finished_looking_folder(tmp_path, monkeypatch):
    """Before a save over a checkpoint, and before rotation removes one, its completion records go: the marker was
    unlinked first, so a crash before trainer_state.json went left trainer_state.json without a marker, which reads
    as a plain Trainer's finished --save_only_model checkpoint (rotation counts it, a resume may take it over). Now
    trainer_state.json goes first (durably): cut there, the marker records a file that is missing (incomplete)."""
    out = tmp_path / "out"
    _trainer(out, save_only_model=True).train()
    ckpt = out / "checkpoint-2"
    assert resume.status(str(ckpt)) == "complete"
    real, calls = os.unlink, []

    def unlink(path, *a, **k):
        calls.append(os.path.basename(str(path)))
        if len(calls) == 2:  # (the crash: the second of the two never happens)
            raise KeyboardInterrupt
        return real(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        resume.clear_marker(str(ckpt))
    monkeypatch.undo()
    assert calls == [resume.TRAINER_STATE, resume.MARKER]
    assert resume.status(str(ckpt)) == "incomplete" and not resume.looks_plain(str(ckpt))


@pytest.mark.parametrize("error, said", [
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8384 vs 8278"), "RuntimeError"),
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
], ids=["torch.save", "json"])
def test_a_save_that_fails_names_the_checkpoint_and_the_newest_complete_one(tmp_path, monkeypatch, error, said):
    """A full disk during a save: torch.save said "unexpected pos 8384 vs 8278", json a bare "[Errno 28]", safetensors
    "Error while serializing", none naming the checkpoint (outside probe F); the earlier checkpoint stays complete."""
    from transformers import Trainer
    out = tmp_path / "out"
    real = Trainer._save_rng_state

    def rng_state(self, output_dir):
        if self.state.global_step == 4:
            raise error
        return real(self, output_dir)
    monkeypatch.setattr(Trainer, "_save_rng_state", rng_state)
    with pytest.raises(OSError, match=rf"saving \S*checkpoint-4 failed\W.*{said}.*the newest complete checkpoint is "
                                      rf"\S*checkpoint-2"):
        _trainer(out, max_steps=4).train()
    assert resume.status(str(out / "checkpoint-2")) == "complete"
    assert resume.status(str(out / "checkpoint-4")) == "incomplete"
