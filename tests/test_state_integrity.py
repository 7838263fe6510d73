"""State files that prove their integrity, and resume paths through the engine's own load (issue 12).

Damaged bytes, truncation and absurd headers give an error naming the file and the way out; dead
writers' temporaries go away on the next save; a checkpoint of any engine and world size loads into
any other engine (ZeRO-2 without offload -> offload, the first format -> today's), bit for bit.
"""
from __future__ import annotations

import copy
import json
import os
import struct
import socket
import subprocess
import sys

import pytest
import torch

from _models import TinyNet, batches, loss_fn, param_groups, run_steps
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam
from hf_zero_offload.engine import checkpoint

LR, WD = 1e-2, 0.01
SMALL = dict(bucket_numel=1200, tile_numel=300, num_threads=1)


def _saved(tmp_path, steps=3):
    torch.manual_seed(0)
    model = TinyNet()
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL))
    run_steps(model, opt, batches(steps))
    opt.save_checkpoint(str(tmp_path))
    return model, opt, checkpoint.rank_file(str(tmp_path), 0, 1)


def _fresh(model):
    return OffloadAdam(param_groups(copy.deepcopy(model), WD), lr=LR, options=OffloadOptions(**SMALL))


def _poke(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip(path, offset, mask: int):
    with open(path, "rb") as f:
        f.seek(offset)
        byte = f.read(1)[0]
    _poke(path, offset, bytes([byte ^ mask]))


@pytest.mark.parametrize("where", ["exp_avg-0xff", "master-bitflip", "header", "trailer"])
def test_a_damaged_byte_is_caught_and_names_the_file(tmp_path, where):
    model, opt, path = _saved(tmp_path)
    _, entries, base = checkpoint.read_header(path)
    if where == "exp_avg-0xff":
        _poke(path, base + entries["exp_avg"]["offset"] + 40, b"\xff" * 4)
    elif where == "master-bitflip":
        _flip(path, base + entries["master"]["offset"] + 123, 0x01)
    elif where == "header":
        raw = open(path, "rb").read(base)
        i = raw.index(b'"global_steps": 3')
        _poke(path, i + len(b'"global_steps": '), b"4")  # still valid JSON: only the checksum can tell
    else:  # flipped, not overwritten: the trailer holds the save's random id, so a byte written 0 was 0 1 in 256 runs
        _flip(path, os.path.getsize(path) - 20, 0xFF)
    with pytest.raises(checkpoint.StateFileError, match="earlier checkpoint") as e:
        _fresh(model).load_checkpoint(str(tmp_path))
    assert path in str(e.value)
    opt.close()


@pytest.mark.parametrize("length", [2**40, 2**64 - 1, "truncated", "garbage"])
def test_absurd_or_broken_headers_give_a_clear_error(tmp_path, length):
    path = str(tmp_path / "rank0_of_1.hzo")
    if length == "truncated":
        open(path, "wb").write(b"HZOSTAT2\x10\x00")
    elif length == "garbage":  # the first format (no checksum) with a header that is not JSON
        open(path, "wb").write(b"HZOSTATE" + struct.pack("<Q", 5) + b"{nope" + b"\0" * 64)
    else:
        open(path, "wb").write(b"HZOSTAT2" + struct.pack("<Q", length) + b"{}" * 8)
    with pytest.raises(checkpoint.StateFileError, match="earlier checkpoint") as e:
        checkpoint.read_header(path)
    assert path in str(e.value)


HEADER_EDITS = {
    "no numel": (lambda m: {k: v for k, v in m.items() if k != "numel"}, r"numel must be an int >= 0, got None"),
    "numel bool": (lambda m: {**m, "numel": True}, r"numel must be an int >= 0, got True"),
    "numel float": (lambda m: {**m, "numel": 2.0}, r"numel must be an int >= 0, got 2.0"),
    "numel -1": (lambda m: {**m, "numel": -1}, r"numel must be an int >= 0, got -1"),
    "numel 1e15": (lambda m: {**m, "numel": 10**15, "shard_end": 10**15},
                   r"master is float32, \d+ bytes, expected float32, 4000000000000000 bytes"),
    "not an object": (lambda m: [m], r"the header must be a JSON object"),
    "no format": (lambda m: {k: v for k, v in m.items() if k != "format"}, r"format must be one of"),
    "global_steps": (lambda m: {**m, "global_steps": 1.5}, r"global_steps must be an int >= 0, got 1.5"),
    "slot past the end": (lambda m: {**m, "slots": [[[0, m["numel"] + 1, [m["numel"] + 1]]]]},
                          r"slots must be \[offset, numel, shape\] entries within"),
    "slot shape": (lambda m: {**m, "slots": [[[0, 4, [3]]]]}, r"slots must be \[offset, numel, shape\]"),
}


@pytest.mark.parametrize("edit", sorted(HEADER_EDITS))
def test_a_header_that_does_not_add_up_is_refused_by_name_by_the_engine_and_consolidate(tmp_path, edit):
    """Valid checksums (the project's own writer), fields that do not add up: the engine's loader and consolidate
    (which has no model to compare with) gave KeyError/TypeError tracebacks, tried to allocate 4 PB, or (consolidate)
    accepted headers the engine refuses."""
    from hf_zero_offload.consolidate import full_masters
    model, opt, path = _saved(tmp_path / "state")
    opt.close()
    meta, entries, _ = checkpoint.read_header(path)
    tensors = {k: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"])) for k, e in entries.items()}
    checkpoint.read_into(path, tensors)
    change, match = HEADER_EDITS[edit]
    checkpoint.write_state(path, change(meta), tensors)
    (tmp_path / "state" / "param_names.json").write_text(json.dumps([[f"p{i}"] for i in range(len(opt._flat))]))
    with pytest.raises(checkpoint.StateFileError, match=match) as e:
        full_masters(str(tmp_path / "state"))
    assert path in str(e.value)
    fresh = _fresh(model)
    with pytest.raises(ValueError) as e:
        fresh.load_checkpoint(str(tmp_path / "state"))
    assert path in str(e.value) or "does not match this model" in str(e.value)
    assert fresh.global_steps == 0 and fresh._load_failed is None


def test_stale_temporaries_of_dead_writers_are_removed_on_save(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # that process has exited
    host = socket.gethostname()
    stale = [tmp_path / f"rank0_of_1.hzo.hzo-tmp.{host}.{pid}", tmp_path / f"param_names.json.tmp.{host}.{pid}"]
    live = tmp_path / f"rank1_of_2.hzo.hzo-tmp.{host}.{os.getppid()}"  # a live writer (our parent) keeps its file
    other_host = tmp_path / f"meta.json.hzo-tmp.some-other-host.{pid}"
    # a user's own files that merely look like temporaries (the first format's "<file>.tmp.<pid>" among them)
    users = [tmp_path / f"data.tmp.{pid}", tmp_path / f"notes.tmp.{pid}.bak", tmp_path / "x.tmp.y"]
    for p in [*stale, live, other_host, *users]:
        p.write_bytes(b"partial")
    _saved(tmp_path)
    left = sorted(os.listdir(tmp_path))
    assert left == sorted(["rank0_of_1.hzo", live.name, other_host.name, *(u.name for u in users)])


def _write_first_format(path, meta, tensors):
    """A state file as the first format wrote it (b"HZOSTATE", no checksum)."""
    entries, off = {}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        entries[k] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "offset": off, "nbytes": n}
        off += n
    header = json.dumps({"meta": meta, "tensors": entries}).encode()
    with open(path, "wb") as f:
        f.write(b"HZOSTATE" + struct.pack("<Q", len(header)) + header)
        for t in tensors.values():
            f.write(t.numpy().tobytes())


def test_first_format_checkpoint_still_loads_bit_for_bit(tmp_path):
    model, opt, _ = _saved(tmp_path / "new")
    meta = opt.state_meta()
    old = {"format": "hf_zero_offload.offload/1", **{k: meta[k] for k in (
        "numel", "param_dtype", "param_groups", "slots", "param_steps", "loss_scaler", "global_steps",
        "needs_publish")}}
    os.makedirs(tmp_path / "old")
    _write_first_format(str(tmp_path / "old" / "rank0_of_1.hzo"), old, opt.state_tensors())
    again = _fresh(model)
    info = again.load_checkpoint(str(tmp_path / "old"))
    assert info["format"] == "hf_zero_offload.offload/1" and info["world_size"] == 1
    for k, v in opt.state_tensors().items():
        assert torch.equal(again.state_tensors()[k], v)
    assert torch.equal(again._param_steps, opt._param_steps) and again.global_steps == opt.global_steps


def test_zero2_without_offload_resumes_into_offload_bit_for_bit(tmp_path):
    """ZeRO-2 on the device (one process) saved, resumed by the offload engine: the same masters and
    moments, and the continued run equals the uninterrupted one (the same kernel, the same order)."""
    data = batches(6)
    torch.manual_seed(0)
    model = TinyNet()
    full = copy.deepcopy(model)
    z2 = ShardedAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL), stage=2, offload=False)
    run_steps(model, z2, data[:3])
    z2.save_checkpoint(str(tmp_path))
    z2_full = ShardedAdam(param_groups(full, WD), lr=LR, options=OffloadOptions(**SMALL), stage=2, offload=False)
    run_steps(full, z2_full, data)
    resumed = copy.deepcopy(model)
    off = OffloadAdam(param_groups(resumed, WD), lr=LR, options=OffloadOptions(**SMALL))
    info = off.load_checkpoint(str(tmp_path))
    assert (info["stage"], info["offload"], info["world_size"], info["global_steps"]) == (2, False, 1, 3)
    assert torch.equal(off.master, z2.master[:z2.numel])
    run_steps(resumed, off, data[3:])
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_load_summary_says_what_was_restored(tmp_path):
    model, opt, _ = _saved(tmp_path)
    info = _fresh(model).load_checkpoint(str(tmp_path))
    assert info == {"format": "hf_zero_offload.state/2", "world_size": 1, "stage": 2, "offload": True,
                    "param_dtype": "float32", "global_steps": 3, "needs_publish": False}


def _engine_state(opt) -> dict:
    return {"tensors": {k: v.clone() for k, v in opt.state_tensors().items()},
            "steps": opt._param_steps.clone(),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "scaler": opt.scaler.state_dict(), "global": opt.global_steps}


def _assert_same(opt, before: dict) -> None:
    now = _engine_state(opt)
    for k, t in before["tensors"].items():
        assert torch.equal(now["tensors"][k], t), k
    assert torch.equal(now["steps"], before["steps"])
    assert now["groups"] == before["groups"] and now["scaler"] == before["scaler"]
    assert now["global"] == before["global"]


def _set(key, value):
    return lambda s: s.__setitem__(key, value)


# A state dict that is not what this engine wrote: each refused by name before the first write.
BAD_STATES = {
    "float codes": (lambda s: s.__setitem__("exp_avg", s["exp_avg"].float()), "exp_avg is float32, expected int8"),
    "short codes": (lambda s: s.__setitem__("exp_avg_sq", s["exp_avg_sq"][:-300]), "exp_avg_sq has .* expected"),
    "fp64 master": (lambda s: s.__setitem__("master", s["master"].double()), "master is float64, expected float32"),
    "short scales": (lambda s: s.__setitem__("exp_avg_scale", s["exp_avg_scale"][:1]), "exp_avg_scale has 1 elem"),
    "negative scale": (lambda s: s["exp_avg_sq_scale"].__setitem__(0, -1.0), "negative or NaN entries"),
    "nan scale": (lambda s: s["exp_avg_sq_scale"].__setitem__(0, float("nan")), "negative or NaN entries"),
    "missing moment": (lambda s: s.pop("exp_avg_sq"), "exp_avg_sq is missing"),
    "label says fp32": (_set("state_dtype", "fp32"), "exp_avg is int8, expected float32 \\(fp32 state\\)"),
    "unknown dtype": (_set("state_dtype", "int4"), "state_dtype must be one of"),
    "negative steps": (lambda s: s.__setitem__("param_steps", [-1] * len(s["param_steps"])), "param_steps must"),
    "steps too few": (_set("param_steps", [1]), "param_steps must be a list of"),
    "global steps": (_set("global_steps", "3"), "global_steps must be an int"),
    "nan lr": (lambda s: s["param_groups"][0].__setitem__("lr", float("nan")), "param_groups\\[0\\].lr"),
    "one beta": (lambda s: s["param_groups"][1].__setitem__("betas", [0.9]), "param_groups\\[1\\].betas"),
    "a group less": (lambda s: s["param_groups"].pop(), "param_groups must be a list of 2"),
    "zero loss scale": (lambda s: s["loss_scaler"].__setitem__("scale", 0.0), "scale must be a finite number > 0"),
    "scaler flag": (lambda s: s["loss_scaler"].__setitem__("dynamic", "yes"), "dynamic must be a bool"),
    "code map 7": (_set("int8_codes", 7), "code map 7"),
}


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_a_foreign_state_dict_is_refused_before_any_write(case):
    mutate, message = BAD_STATES[case]
    torch.manual_seed(0)
    model = TinyNet()
    opts = OffloadOptions(**{**SMALL, "state_dtype": "int8"})
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=opts)
    run_steps(model, opt, batches(2))
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    mutate(bad)
    other = OffloadAdam(param_groups(copy.deepcopy(model), WD), lr=LR, options=opts)
    before = _engine_state(other)
    with pytest.raises(checkpoint.StateFileError, match=f"state dict: .*{message}"):
        other.load_state_dict(bad)
    _assert_same(other, before)
    other.load_state_dict(good)  # and the engine still takes a good one
    assert torch.equal(other.state_tensors()["exp_avg"], good["exp_avg"])
    for o in (opt, other):
        o.close()


def test_a_checkpoint_that_fails_part_way_blocks_step_and_save(tmp_path):
    """Checkpoint tensors stream into the arena (no second copy of the state), so a damaged chunk
    found after the first write leaves a mix: step and save refuse it until a load succeeds."""
    model, opt, path = _saved(tmp_path / "good")
    opt.save_checkpoint(str(tmp_path / "bad"))
    bad = checkpoint.rank_file(str(tmp_path / "bad"), 0, 1)
    _, entries, base = checkpoint.read_header(bad)
    _poke(bad, base + entries["exp_avg_sq"]["offset"] + 8, b"\xff" * 4)  # read after master and exp_avg
    fresh = _fresh(model)
    with pytest.raises(checkpoint.StateFileError, match="earlier checkpoint"):
        fresh.load_checkpoint(str(tmp_path / "bad"))
    for call in (fresh.step, fresh.state_dict, lambda: fresh.save_checkpoint(str(tmp_path / "again"))):
        with pytest.raises(RuntimeError, match="failed part way"):
            call()
    assert not (tmp_path / "again").exists()
    fresh.load_checkpoint(str(tmp_path / "good"))  # a load that succeeds clears it
    assert torch.equal(fresh.state_tensors()["exp_avg_sq"], opt.state_tensors()["exp_avg_sq"])
    fresh.step()
    for o in (opt, fresh):
        o.close()


@pytest.mark.parametrize("partition,error,message", [
    (lambda n: [[0, n - 10]], ValueError, r"does not cut \[0, \d+\) into 1 consecutive"),
    (lambda n: [[0, 100], [200, n]], ValueError, "does not cut"),
    (lambda n: [[0, n], [0, n]], ValueError, "does not cut"),
    (lambda n: [[n, 0]], ValueError, "does not cut"),
    (lambda n: [[0, 100], [100, n]], checkpoint.StateFileError,  # a valid map, but each file holds [0, n)
     r"rank0_of_2.hzo holds elements \[0, \d+\) of the flat state, but the checkpoint's map says \[0, 100\)"),
])
def test_a_partition_map_that_does_not_match_its_files_is_refused(tmp_path, partition, error, message):
    """meta.json's partition used to be trusted: a gap, an overlap or a shift loaded part of the
    state (the rest kept the fresh engine's values), or read it from the wrong offsets, silently."""
    model, opt, path = _saved(tmp_path / "one")
    n = opt.numel
    ranges = partition(n)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for r in range(len(ranges)):
        (damaged / f"rank{r}_of_{len(ranges)}.hzo").write_bytes(open(path, "rb").read())
    (damaged / "meta.json").write_text(json.dumps({
        "format": "hf_zero_offload.sharded-meta/1", "world_size": len(ranges), "numel": n, "partition": ranges,
        "files": [f"rank{r}_of_{len(ranges)}.hzo" for r in range(len(ranges))], "param_dtype": "float32",
        "slots": opt.state_meta()["slots"]}))
    fresh = _fresh(model)
    with pytest.raises(error, match=message):
        fresh.load_checkpoint(str(damaged))


FP16 = dict(enabled=True, loss_scale=0, initial_scale_power=8, loss_scale_window=2, hysteresis=2, min_loss_scale=1)


@pytest.mark.parametrize("saved_fp16, now_fp16, want", [
    (FP16, None, dict(enabled=False, scale=1.0)),                                  # fp16 -> bf16
    (None, FP16, dict(enabled=True, dynamic=True, scale=256.0)),                   # bf16 -> fp16: its initial scale
    (FP16, {**FP16, "loss_scale": 128}, dict(enabled=True, dynamic=False, scale=128.0)),  # -> a static scale
    (FP16, {**FP16, "hysteresis": 1, "loss_scale_window": 50},                     # -> dynamic, other settings:
     dict(enabled=True, dynamic=True, scale=512.0, hysteresis=1, cur_hysteresis=1, scale_window=50)),
], ids=["fp16-to-bf16", "bf16-to-fp16", "dynamic-to-static", "dynamic-to-other-dynamic"])
def test_a_resumed_loss_scaler_keeps_this_runs_precision(saved_fp16, now_fp16, want):
    """The saved loss scaler was loaded whole, configuration included: an fp16 run resumed from a bf16 state trained
    with scaling off (scale 1, no overflow skips) and a bf16 run resumed from fp16 scaled its loss. The running
    values carry over between two dynamic scalers only."""
    def engine(model, fp16):
        dtype = torch.float16 if fp16 else torch.bfloat16
        opt = OffloadAdam(param_groups(model, WD), lr=LR, param_dtype=dtype, options=OffloadOptions(**SMALL, fp16=fp16))
        return opt, model.to(dtype)

    torch.manual_seed(0)
    base = TinyNet()
    opt, model = engine(copy.deepcopy(base), saved_fp16)
    for ids, labels, use_branch in batches(4):  # fp16, window 2: 256, 256, 512, 512 (DeepSpeed >= 0.17.1)
        opt.scale_loss(loss_fn(model, ids, labels, use_branch)).backward()
        opt.step()
        opt.zero_grad()
    fresh, _ = engine(copy.deepcopy(base), now_fp16)
    fresh.load_state_dict(opt.state_dict())
    assert {k: getattr(fresh.scaler, k) for k in want} == want
    assert fresh.scaler.cur_iter == 4 and fresh.global_steps == 4
    for o in (opt, fresh):
        o.close()


def test_a_resume_in_a_higher_precision_starts_from_the_masters(tmp_path):
    """A bf16 run's checkpoint resumed in fp32: the model read from the checkpoint holds bf16-rounded weights, and
    they stayed in the model until the first step published the masters (DeepSpeed's load_from_fp32_weights sets
    them at load). Now the model holds the fp32 masters from the load on."""
    torch.manual_seed(0)
    base = TinyNet()
    model = copy.deepcopy(base).to(torch.bfloat16)
    opt = OffloadAdam(param_groups(model, WD), lr=LR, param_dtype=torch.bfloat16, options=OffloadOptions(**SMALL))
    run_steps(model, opt, batches(3))
    opt.save_checkpoint(str(tmp_path))
    resumed = copy.deepcopy(model).float()  # what the Trainer does: the checkpoint's weights into the fp32 model
    fresh = _fresh(resumed)
    fresh.load_checkpoint(str(tmp_path))
    for p, off, n in fresh._flat:
        assert torch.equal(p.detach().reshape(-1), opt.master[off:off + n])
    assert any(not torch.equal(p.detach().reshape(-1), opt.master[off:off + n].bfloat16().float())
               for p, off, n in fresh._flat)  # the masters are not bf16 values: the check can fail
    for o in (opt, fresh):
        o.close()


@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_a_rank_file_that_is_a_broken_link_is_named_as_such(tmp_path, link):
    """A dangling link (or a loop of links) in place of rank0_of_1.hzo was reported as "no meta.json: a save was
    interrupted"."""
    from hf_zero_offload.engine.checkpoint import folder
    path = tmp_path / "rank0_of_1.hzo"
    os.symlink(tmp_path / "gone.hzo" if link == "dangling" else path, path)
    with pytest.raises(ValueError, match=r"rank0_of_1.hzo is a link to nothing \(or a loop of links\)"):
        folder.sources(str(tmp_path))


def test_a_renamed_rank_file_is_named_as_renamed_not_as_an_interrupted_save(tmp_path):
    """rank0_of_1.hzo renamed (say to rank0.hzo.bak.hzo) was reported as "the checkpoint is incomplete (a save was
    interrupted)": a save never writes that name, so the message says the files were renamed or copied in."""
    from hf_zero_offload.engine.checkpoint import folder
    (tmp_path / "rank0_of_1.old.hzo").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not names a save writes .*renamed"):
        folder.sources(str(tmp_path))
    (tmp_path / "rank0_of_1.old.hzo").unlink()
    (tmp_path / "rank1_of_2.hzo").write_bytes(b"x")  # another rank's file alone: a save cut short
    with pytest.raises(ValueError, match=r"incomplete \(a save was interrupted\)"):
        folder.sources(str(tmp_path))
