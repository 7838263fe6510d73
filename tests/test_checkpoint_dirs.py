"""Checkpoint directories of several rank files, in the style of DeepSpeed's tests/unit/checkpoint (a checkpoint
missing a file, files of two checkpoints mixed, a file only one rank reads damaged): what every rank checks before
its first write, and how the ranks agree that a load failed.

A 2-rank directory is built here on one process by cutting a 1-rank state in two (``folder.save`` once per
rank, as each rank of a run calls it), so the one-process checks need no spawn.
"""
from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from _dist import run_distributed
from _models import TinyNet, batches, param_groups, run_steps, save_as_two_ranks
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam, checkpoint
from hf_zero_offload.engine.checkpoint import folder

LR, WD = 1e-2, 0.01
SMALL = dict(bucket_numel=1200, tile_numel=300, num_threads=1)


def _engine(model, state_dtype="fp32"):
    return OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL, state_dtype=state_dtype))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, its state after 3 steps as 2 rank files, the same run's rank 1 file after 5 steps)."""
    root = tmp_path_factory.mktemp("dirs")
    torch.manual_seed(0)
    model = TinyNet()
    opt = _engine(model)
    run_steps(model, opt, batches(3))
    save_as_two_ranks(opt, root / "step3")
    state3 = {k: v.clone() for k, v in opt.state_tensors().items()}
    run_steps(model, opt, batches(2, seed=1))
    save_as_two_ranks(opt, root / "step5")
    opt.close()
    torch.manual_seed(1)  # another run of the same model, saved at the same step
    other = TinyNet()
    opt = _engine(other)
    run_steps(other, opt, batches(3, seed=2))
    save_as_two_ranks(opt, root / "run2")
    opt.close()
    return model, root, state3


def _copy(src, dst):
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_two_rank_files_load_whole(saved):
    model, root, state3 = saved
    fresh = _engine(copy.deepcopy(model))
    assert fresh.load_checkpoint(str(root / "step3"))["world_size"] == 2
    assert all(torch.equal(fresh.state_tensors()[k], v) for k, v in state3.items())
    fresh.close()


@pytest.mark.parametrize("damage, match", [
    ("missing", r"rank1_of_2.hzo is missing: .*meta.json lists it as rank 1's slice"),
    ("truncated", r"rank1_of_2.hzo: truncated"),
    ("other step", r"rank1_of_2.hzo and \S*rank0_of_2.hzo are of different saves: save_id .*mixes files"),
    ("other run", r"rank1_of_2.hzo and \S*rank0_of_2.hzo are of different saves: save_id '\w+' against '\w+' "
                  r"\(the states after 3 and 3 steps\).*mixes files"),
    ("other model", r"rank1_of_2.hzo and \S*rank0_of_2.hzo are of different saves: slots \[\["),
    ("old files, other step", r"rank1_of_2.hzo and \S*rank0_of_2.hzo are of different saves: global_steps 5 against "
                              r"3; the directory mixes files"),
], ids=["missing", "truncated", "other-step", "other-run", "other-model", "old-files-other-step"])
def test_a_bad_file_is_refused_before_the_first_write(saved, tmp_path, damage, match):
    """The file of rank 1 was read only once rank 0's part was in (missing, other step: not at all), so the engine
    was left half loaded (every later step refused), and a 2-rank job's rank 0 never heard of it."""
    model, root, _ = saved
    bad = _copy(root / "step3", tmp_path / "bad")
    victim = bad / "rank1_of_2.hzo"
    if damage == "missing":
        victim.unlink()
    elif damage == "truncated":
        os.truncate(victim, os.path.getsize(victim) - 100)
    elif damage in ("other step", "other run"):  # the files of another save of this model (another run: the
        # same step count too, and the same range; told apart by the save id alone)
        victim.write_bytes((root / ("step5" if damage == "other step" else "run2") / "rank1_of_2.hzo").read_bytes())
    elif damage == "other model":  # one param where the model has several (rewritten: checksums valid)
        _rewrite(victim, victim, lambda m: {**m, "slots": [[[0, m["numel"], [m["numel"]]]]]})
    else:  # both files and meta.json as written before save ids existed, rank 1's of another step
        def old(m):
            return {k: v for k, v in m.items() if k != "save_id"}
        _rewrite(bad / "rank0_of_2.hzo", bad / "rank0_of_2.hzo", old)
        _rewrite(root / "step5" / "rank1_of_2.hzo", victim, old)
        (bad / folder.META_FILE).write_text(json.dumps(old(json.loads((bad / folder.META_FILE).read_text()))))
    fresh = _engine(copy.deepcopy(model))
    before = {k: v.clone() for k, v in fresh.state_tensors().items()}
    with pytest.raises(checkpoint.StateFileError, match=match):
        fresh.load_checkpoint(str(bad))
    assert fresh._load_failed is None and fresh.global_steps == 0  # refused before anything was written
    assert all(torch.equal(fresh.state_tensors()[k], v) for k, v in before.items())
    fresh.close()


def _snapshot(model, opt) -> dict:
    return {"state": {k: v.clone() for k, v in opt.state_tensors().items()}, "global": opt.global_steps,
            "steps": opt._param_steps.clone(), "params": [p.detach().clone() for p in model.parameters()]}


def _unchanged(model, opt, before: dict) -> bool:
    now = _snapshot(model, opt)
    return (all(torch.equal(now["state"][k], v) for k, v in before["state"].items()) and now["global"] == before["global"]
            and torch.equal(now["steps"], before["steps"]) and opt._load_failed is None
            and all(torch.equal(p, q) for p, q in zip(now["params"], before["params"])))


def _splice_exp_avg(path, change: int) -> None:
    """``-change`` bytes cut out of (or ``change`` added to) exp_avg's data, 100 bytes in; header and trailer stay
    whole. A load reads that after the masters of every file it reads, so it used to write before finding it."""
    _, entries, base = checkpoint.read_header(path)
    at, raw = base + entries["exp_avg"]["offset"] + 100, open(path, "rb").read()
    open(path, "wb").write(raw[:at] + raw[at - change:] if change < 0 else raw[:at] + b"\x5a" * change + raw[at:])


SPLICES = {"cut in the middle": (-400, "400 bytes are missing"), "bytes inserted": (64, "it has 64 bytes too many")}


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("splice", sorted(SPLICES))
def test_a_rank_file_missing_or_gaining_bytes_in_its_data_is_refused_before_the_first_write(tmp_path, splice,
                                                                                            state_dtype):
    """Header and trailer whole, their checksums valid: the file passed every check made before the load, which failed
    only on the checksum of the chunk the cut shifted, with the master, moments and step count already overwritten
    (int8: refused before, but by chance: its scales, read first, lay past the end)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = _engine(model, state_dtype)
    run_steps(model, opt, batches(3))
    save_as_two_ranks(opt, tmp_path / "ck")
    change, says = SPLICES[splice]
    victim = str(tmp_path / "ck" / "rank1_of_2.hzo")
    _splice_exp_avg(victim, change)
    run_steps(model, opt, batches(1, seed=1))  # the engine holds a state the checkpoint's would replace
    before = _snapshot(model, opt)
    with pytest.raises(checkpoint.StateFileError, match=re.escape(f"{victim}: the file is ") + f".*: {says}"):
        opt.load_checkpoint(str(tmp_path / "ck"))
    assert _unchanged(model, opt, before)
    run_steps(model, opt, batches(1, seed=2))  # and it still steps
    opt.close()


def _cut_peer_job(rank, world, root):
    """A 2-rank ZeRO-2 offload save, rank 1's file cut in the middle, then a load into the same engines a step
    later: both ranks refuse it (each checks every file of the map) and keep their state."""
    out = {}
    for state_dtype in ("fp32", "bf16", "int8"):
        torch.manual_seed(0)
        model = TinyNet()
        opt = ShardedAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL, state_dtype=state_dtype),
                          stage=2, offload=True)
        run_steps(model, opt, batches(2, seed=10 + rank))
        directory = os.path.join(root, state_dtype)
        opt.save_checkpoint(directory)
        if rank == 1:
            _splice_exp_avg(checkpoint.rank_file(directory, 1, 2), -400)
        run_steps(model, opt, batches(1, seed=20 + rank))  # (a collective: rank 1's cut is done by then)
        before = _snapshot(model, opt)
        try:
            opt.load_checkpoint(directory)
            out[state_dtype] = "loaded"
        except Exception as e:  # noqa: BLE001 - the test reads the message
            out[state_dtype] = f"{type(e).__name__}: {e}"
        out[state_dtype + " unchanged"] = _unchanged(model, opt, before)
        opt.close()
    return out


def test_two_ranks_refuse_a_peer_file_cut_in_the_middle_before_the_first_write(tmp_path):
    for r in run_distributed(_cut_peer_job, str(tmp_path), timeout=180):
        for state_dtype in ("fp32", "bf16", "int8"):
            victim = checkpoint.rank_file(str(tmp_path / state_dtype), 1, 2)
            assert r[state_dtype].startswith(f"StateFileError: optimizer state file {victim}: the file is "), r
            assert "400 bytes are missing" in r[state_dtype] and r[state_dtype + " unchanged"], r


@pytest.mark.parametrize("own", ["int8", "fp32"])
@pytest.mark.parametrize("rank", [0, 1])
def test_an_int8_code_out_of_range_names_the_rank_file_that_holds_it(tmp_path, rank, own):
    """Checked once loaded, on the engine's whole slice: the error named the directory, so with several rank files
    the user could not tell which one was damaged."""
    model = _int8_two_ranks(tmp_path / "ck", 3)
    path = str(tmp_path / "ck" / f"rank{rank}_of_2.hzo")
    _rewrite(path, path, lambda m: m, change=lambda t: t["exp_avg_sq"].__setitem__(-1, 255))
    fresh = _engine(copy.deepcopy(model), own)
    with pytest.raises(checkpoint.StateFileError, match=re.escape(f"{path}: exp_avg_sq codes has code 255, outside")):
        fresh.load_checkpoint(str(tmp_path / "ck"))
    fresh.close()


def _int8_two_ranks(directory, steps: int):
    """A model and its int8 engine's state after ``steps`` steps, saved in ``directory`` as 2 rank files."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = _engine(model, "int8")
    run_steps(model, opt, batches(steps))
    save_as_two_ranks(opt, directory)
    opt.close()
    return model


def _rewrite(src, dst, edit, change=lambda tensors: None):
    """``src``'s state file written again at ``dst`` with its header edited, its tensors changed (valid checksums)."""
    meta, entries, _ = checkpoint.read_header(str(src))
    tensors = {key: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"])) for key, e in entries.items()}
    checkpoint.read_into(str(src), tensors)
    change(tensors)
    checkpoint.write_state(str(dst), edit(meta), tensors)


@pytest.mark.parametrize("edit", ["other map in rank 1", "no map in rank 0"])
def test_rank_files_of_int8_moments_in_different_code_maps_are_refused(tmp_path, edit):
    """Only rank 0's file said which code map the int8 moments are in: rank 1's another map loaded silently, and rank
    0's without one (map 1) decoded every file's codes as map 1 (an outside probe, files rewritten by hand)."""
    model = _int8_two_ranks(tmp_path / "s", 2)
    if edit == "other map in rank 1":
        victim, match = tmp_path / "s" / "rank1_of_2.hzo", "int8_codes 3 against 2"
        _rewrite(victim, victim, lambda m: {**m, "int8_codes": 3})
    else:
        victim, match = tmp_path / "s" / "rank0_of_2.hzo", "int8_codes 2 against None"
        _rewrite(victim, victim, lambda m: {k: v for k, v in m.items() if k != "int8_codes"})
    fresh = _engine(copy.deepcopy(model), "int8")
    with pytest.raises(checkpoint.StateFileError, match=r"rank1_of_2.hzo and \S*rank0_of_2.hzo are of different "
                                                        rf"saves: {match}"):
        fresh.load_checkpoint(str(tmp_path / "s"))
    fresh.close()


def _damaged_peer_job(rank, world, directory):
    """Both ranks save a ZeRO-2 offload checkpoint; a byte of rank 1's moments is then damaged: only rank 1 reads
    that chunk, yet both ranks must raise (rank 0 went on training, to fail in its next collective)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = TinyNet()
    opt = ShardedAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL), stage=2, offload=True)
    run_steps(model, opt, batches(2, seed=10 + rank))
    opt.save_checkpoint(directory)
    if rank == 1:
        path = checkpoint.rank_file(directory, 1, 2)
        _, entries, base = checkpoint.read_header(path)
        with open(path, "r+b") as f:
            f.seek(base + entries["exp_avg"]["offset"] + 8)
            f.write(b"\xff" * 4)
    dist.barrier()
    fresh = ShardedAdam(param_groups(copy.deepcopy(model), WD), lr=LR, options=OffloadOptions(**SMALL), stage=2,
                        offload=True)
    out = {}
    try:
        fresh.load_checkpoint(directory)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        out["load"] = f"{type(e).__name__}: {e}"
    try:
        fresh.step()
    except RuntimeError as e:
        out["step"] = str(e)
    return out


def test_a_rank_that_fails_to_load_fails_every_rank(tmp_path):
    r0, r1 = run_distributed(_damaged_peer_job, str(tmp_path / "ckpt"), timeout=120)
    assert "checksum mismatch" in r1["load"] and "rank1_of_2.hzo" in r1["load"]
    assert r0["load"].startswith("StateFileError: loading the optimizer state in") and "failed on rank(s) [1]" in r0["load"]
    for r in (r0, r1):  # each holds part of the checkpoint: refused until a load succeeds
        assert "failed part way" in r["step"]
