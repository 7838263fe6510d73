"""Loads check the values the kernels rely on, and refuse before they write where they can.

An outside probe (session 23) found: an in-memory state dict with an int8 code the kernel never writes
overwrote the optimizer before it was refused; a checksum-valid fp32/bf16 state with a negative exp_avg_sq
loaded without a word (its param NaN at the next step); an int8 checkpoint whose shard starts off a
256-element block loaded another block's scales at 2 ranks and failed part way at 1; a sharded state dict
of another state_dtype was refused as "use ... to change the world size" at the same world size; a
save between two steps dropped the window's gradients without a word; CPUAdam converted state dtypes
without the log line the engines write.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from _dist import run_distributed
from _models import TinyNet, batches, loss_fn, param_groups, run_steps as train
from hf_zero_offload import CPUAdam
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam
from hf_zero_offload.engine.checkpoint import folder
from hf_zero_offload.engine.checkpoint import StateFileError

LR, WD = 1e-2, 0.1
SMALL = dict(bucket_numel=1000, tile_numel=300)


def engine(model, state_dtype):
    return OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(**SMALL, state_dtype=state_dtype))


def snapshot(opt, model):
    return {k: v.clone() for k, v in opt.state_tensors().items()}, [p.detach().clone() for p in model.parameters()]


def assert_unchanged(opt, model, before):
    tensors, params = before
    for k, v in opt.state_tensors().items():
        assert torch.equal(v, tensors[k]), k
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)


def trained(state_dtype, steps=2):
    torch.manual_seed(0)
    model = TinyNet()
    opt = engine(model, state_dtype)
    train(model, opt, batches(steps))
    return model, opt


@pytest.mark.parametrize("target", ["int8", "bf16"])
@pytest.mark.parametrize("key,code", [("exp_avg", -128), ("exp_avg", 121), ("exp_avg_sq", 249)])
def test_a_state_dict_with_codes_the_kernel_never_writes_changes_nothing(target, key, code):
    model, opt = trained("int8")
    sd = opt.state_dict()
    sd[key][5] = code
    sd["master"] += 1.0  # a load that wrote before refusing would move the masters
    other_model = copy.deepcopy(model)
    other = engine(other_model, target)
    train(other_model, other, batches(1))
    before = snapshot(other, other_model)
    with pytest.raises(StateFileError, match=f"state dict: {key} codes has code {code}, outside"):
        other.load_state_dict(sd)
    assert_unchanged(other, other_model, before)
    train(other_model, other, batches(1))  # not left half-loaded: it steps
    for o in (opt, other):
        o.close()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_a_negative_exp_avg_sq_is_refused(tmp_path, state_dtype):
    """A state dict: before any write. A checkpoint (valid checksums): once streamed in, as int8 codes are, with
    step and save refused until a load succeeds."""
    model, opt = trained(state_dtype)
    opt.moments.state["exp_avg_sq"][3] = -1.0
    sd = opt.state_dict()
    opt.save_checkpoint(str(tmp_path))
    other_model = copy.deepcopy(model)
    other = engine(other_model, state_dtype)
    before = snapshot(other, other_model)
    with pytest.raises(StateFileError, match=r"state dict: exp_avg_sq has a negative entry \(-1.0 at element 3\)"):
        other.load_state_dict(sd)
    assert_unchanged(other, other_model, before)
    with pytest.raises(StateFileError, match=f"{tmp_path}: exp_avg_sq has a negative entry"):
        other.load_checkpoint(str(tmp_path))
    with pytest.raises(RuntimeError, match="failed part way"):
        train(other_model, other, batches(1))
    for o in (opt, other):
        o.close()


def test_a_negative_exp_avg_sq_is_refused_when_converted_to_int8(tmp_path):
    """Converted, a negative one encoded as its magnitude and became its block's scale (outside probe, round 2)."""
    model, opt = trained("fp32")
    opt.moments.state["exp_avg_sq"][7] = -1.0
    opt.save_checkpoint(str(tmp_path))
    other = engine(copy.deepcopy(model), "int8")
    with pytest.raises(StateFileError, match=f"{tmp_path}: exp_avg_sq has a negative entry"):
        other.load_checkpoint(str(tmp_path))
    with pytest.raises(StateFileError, match="state dict: exp_avg_sq has a negative entry"):
        other.load_state_dict(opt.state_dict())
    for o in (opt, other):
        o.close()


def _save_misaligned(directory, opt, cut):
    """``opt``'s int8 state as a 2-rank checkpoint cut at element ``cut`` (off a block): each file whole and
    checksummed, the scales those of the blocks each range touches, as a foreign writer would lay them out."""
    tensors = {k: v.clone() for k, v in opt.state_tensors().items()}
    meta = opt.state_meta()
    numel = meta["numel"]
    for rank, (a, b) in enumerate([(0, cut), (cut, numel)]):
        part = {"master": tensors["master"][a:b]}
        for k in ("exp_avg", "exp_avg_sq"):
            part[k] = tensors[k][a:b]
        for k in ("exp_avg_scale", "exp_avg_sq_scale"):
            part[k] = tensors[k][a // 256:-(-b // 256)]
        folder.save(directory, rank, 2, {**meta, "world_size": 2, "rank": rank, "shard_start": a, "shard_end": b,
                                            "save_id": "feedfeedfeedfeed"}, part, barrier=lambda: None,
                       partition=[[0, cut], [cut, numel]])


def test_an_int8_checkpoint_cut_off_a_block_is_refused_before_any_write(tmp_path):
    model, opt = trained("int8")
    _save_misaligned(str(tmp_path), opt, cut=600)
    other_model = copy.deepcopy(model)
    other = engine(other_model, "int8")
    before = snapshot(other, other_model)
    with pytest.raises(StateFileError, match=r"rank1_of_2\.hzo: its int8 state starts at element 600, not on a "
                                             r"256-element block"):
        other.load_checkpoint(str(tmp_path))
    assert_unchanged(other, other_model, before)
    train(other_model, other, batches(1))
    # a rank whose slice reads only the first file refuses too (else it loaded while its peer refused)
    srcs, meta = folder.sources(str(tmp_path))
    with pytest.raises(StateFileError, match="rank1_of_2.hzo: its int8 state starts at element 600"):
        folder.check_sources(srcs, "int8", 0, 256)
    for o in (opt, other):
        o.close()


def _sharded_state_dict_job(rank, world, saved_dtype, target_dtype):
    torch.manual_seed(0)
    model = TinyNet()
    opt = ShardedAdam(param_groups(model, WD), lr=LR, stage=2, options=OffloadOptions(**SMALL, state_dtype=saved_dtype))
    train(model, opt, batches(2))
    sd = opt.state_dict()
    other = ShardedAdam(param_groups(copy.deepcopy(model), WD), lr=LR, stage=2,
                        options=OffloadOptions(**SMALL, state_dtype=target_dtype))
    try:
        other.load_state_dict(sd)
        return "loaded"
    except ValueError as e:
        return str(e)
    finally:
        for o in (opt, other):
            o.close()


def test_a_sharded_state_dict_of_other_shard_bounds_names_them_and_the_way():
    """int8 shards are cut on 256-element blocks, fp32/bf16 ones are not: at the same world size a state dict of
    the other kind covers other elements. The refusal says so (it said "to change the world size")."""
    msgs = run_distributed(_sharded_state_dict_job, "bf16", "int8")
    for rank, msg in enumerate(msgs):
        assert "world size or state_dtype" in msg and "bf16" in msg and "int8" in msg, msg
        assert f"rank {rank} of 2" in msg, msg


def test_a_save_between_two_steps_says_the_windows_gradients_are_not_in_it(tmp_path, caplog):
    model, opt = trained("int8")
    ids, labels, branch = batches(1)[0]
    loss_fn(model, ids, labels, branch).backward()  # half a window: taken by the engine, not yet stepped
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        opt.save_checkpoint(str(tmp_path / "mid"))
    assert any("gradients taken since the last step() are not saved" in r.message for r in caplog.records)
    opt.step()
    opt.zero_grad()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        opt.save_checkpoint(str(tmp_path / "clean"))
    assert not caplog.records
    opt.close()


def test_cpu_adam_says_once_that_it_converted_saved_moments(caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 5))
    opt = CPUAdam(model.parameters(), lr=1e-2, state_dtype="int8")
    model(torch.randn(4, 40)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    other = CPUAdam(model.parameters(), lr=1e-2, state_dtype="bf16")
    other.load_state_dict(sd)
    model(torch.randn(4, 40)).sum().backward()
    with caplog.at_level(logging.INFO, logger="hf_zero_offload"):
        other.step()
        other.step()
    lines = [r.message for r in caplog.records if "converted" in r.message]
    assert lines == ["hf_zero_offload: optimizer moments saved as int8 (code map 2) converted to state_dtype=bf16"]


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_cpu_adam_refuses_a_negative_exp_avg_sq_when_loaded(state_dtype):
    """torch's AdamW takes one and steps its param to NaN; CPUAdam checks a state dict before loading it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 3)
    opt = CPUAdam(model.parameters(), lr=1e-2, state_dtype=state_dtype)
    model(torch.randn(4, 30)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_sq"].view(-1)[5] = -1.0
    other = CPUAdam(model.parameters(), lr=1e-2, state_dtype=state_dtype)
    with pytest.raises(ValueError, match=r"optimizer state of param 0 \(shape \(3, 30\)\): exp_avg_sq has a negative "
                                         r"entry \(-1.0 at element 5\)"):
        other.load_state_dict(sd)
    assert not other.state


def test_a_save_between_two_steps_says_so_with_the_gradients_still_in_a_bucket(tmp_path, caplog):
    """A README audit: with the default 200M-element buckets the window's gradients wait in the partly filled bucket
    until the step, and the save said nothing (the test above uses 1000-element buckets)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OffloadOptions(gradient_accumulation_steps=2))
    ids, labels, branch = batches(1)[0]
    loss_fn(model, ids, labels, branch).backward()
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        opt.save_checkpoint(str(tmp_path / "mid"))
    assert any("gradients taken since the last step() are not saved" in r.message for r in caplog.records)
    opt.close()


def test_a_load_says_which_group_values_it_takes_from_the_saved_state(tmp_path, caplog):
    """A resumed run asked for another weight decay (or betas, eps, base lr) trained on with the saved ones without a
    word (an outside probe; the plain Trainer's resume does the same, as torch's load_state_dict): said now."""
    import logging

    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    def engine(**kw):
        model = torch.nn.Linear(4, 3)
        eng = OffloadAdam([{"params": list(model.parameters()), "initial_lr": kw.pop("initial_lr", 1e-2)}],
                          lr=1e-2, options=OffloadOptions(num_threads=1), **kw)
        model(torch.randn(2, 4)).sum().backward()
        return eng

    saved = engine(weight_decay=0.01)
    saved.step()
    saved.save_checkpoint(str(tmp_path / "s"))
    same = engine(weight_decay=0.01)
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        same.load_checkpoint(str(tmp_path / "s"))
    assert "values are taken" not in caplog.text
    other = engine(weight_decay=0.5, betas=(0.8, 0.99), initial_lr=3e-3)
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        other.load_checkpoint(str(tmp_path / "s"))
    assert ("values are taken, as torch.optim's load_state_dict takes them: group 0 initial_lr 0.003 now, 0.01 saved; "
            "group 0 betas (0.8, 0.99) now, (0.9, 0.999) saved; group 0 weight_decay 0.5 now, 0.01 saved") in caplog.text
    assert other.param_groups[0]["weight_decay"] == 0.01 and other.param_groups[0]["betas"] == (0.9, 0.999)
    for e in (saved, same, other):
        e.close()


def test_a_resume_under_a_momentum_cycling_schedule_is_not_said_to_take_other_betas(tmp_path, caplog):
    """OneCycleLR/CyclicLR with cycle_momentum move betas[0] each step: the usual resume order (optimizer, scheduler,
    then both loaded) warned that the saved betas were taken (an outside probe); betas[1] and the momentum bounds are
    still compared."""
    import logging

    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    def run(max_momentum=0.95, beta2=0.999):
        model = torch.nn.Linear(4, 3)
        eng = OffloadAdam(model.parameters(), lr=1e-2, betas=(0.9, beta2), options=OffloadOptions(num_threads=1))
        sched = torch.optim.lr_scheduler.OneCycleLR(eng, max_lr=1e-2, total_steps=10, max_momentum=max_momentum)
        return model, eng, sched

    model, eng, sched = run()
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        eng.step()
        sched.step()
    eng.save_checkpoint(str(tmp_path / "s"))
    _, same, _ = run()
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        same.load_checkpoint(str(tmp_path / "s"))
    assert "values are taken" not in caplog.text
    assert same.param_groups[0]["betas"] == eng.param_groups[0]["betas"] != (0.95, 0.999)
    _, other, _ = run(max_momentum=0.97, beta2=0.99)
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        other.load_checkpoint(str(tmp_path / "s"))
    assert "group 0 max_momentum 0.97 now, 0.95 saved; group 0 betas[1] (0.99,) now, (0.999,) saved" in caplog.text
    # resumed without the cycling: the saved mid-cycle betas[0] stays for good, which is said
    plain = OffloadAdam(torch.nn.Linear(4, 3).parameters(), lr=1e-2, options=OffloadOptions(num_threads=1))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_zero_offload"):
        plain.load_checkpoint(str(tmp_path / "s"))
    assert f"group 0 betas (0.9, 0.999) now, {eng.param_groups[0]['betas']} saved" in caplog.text
    for e in (eng, same, other, plain):
        e.close()
