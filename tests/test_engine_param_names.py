"""An engine built from named params keeps the names, and a load compares them (engine/param_names.py).

The engines match a state to the params by position and write its fp32 masters into them: loaded into params of the
same shapes in another order (two layers registered the other way round), each took the other's trained weights,
silently. With names on both sides the load is refused before anything is written; without names on one side it
loads by position, as torch's optimizers do; the prefixes wrappers add (torch.compile, DDP) are not a difference."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _dist import run_distributed
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam
from hf_zero_offload.engine.param_names import NameMismatch

SMALL = dict(bucket_numel=40, tile_numel=30, num_threads=1)


class Two(nn.Module):
    """Two layers of the same shapes; ``swapped`` registers them in the other order (a refactor)."""

    def __init__(self, swapped: bool = False):
        super().__init__()
        first, second = ("b", "a") if swapped else ("a", "b")
        torch.manual_seed(0)
        setattr(self, first, nn.Linear(6, 6))
        setattr(self, second, nn.Linear(6, 6))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train(model, opt, steps=2):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _groups(model, named: bool):
    pairs = list(model.named_parameters())
    return [{"params": [(n, p) if named else p for n, p in pairs if p.dim() == 2], "weight_decay": 0.1},
            {"params": [(n, p) if named else p for n, p in pairs if p.dim() < 2], "weight_decay": 0.0}]


def _engine(kind, model, named=True):
    if kind == "offload":
        return OffloadAdam(_groups(model, named), lr=0.01, options=OffloadOptions(**SMALL))
    return ShardedAdam(_groups(model, named), lr=0.01, options=OffloadOptions(**SMALL), stage=2, offload=True)


def _snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), {k: v.clone() for k, v in opt.state_tensors().items()}


def _unchanged(model, opt, snap):
    params, tensors = snap
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in params.items())
    assert all(torch.equal(v, opt.state_tensors()[k]) for k, v in tensors.items())


@pytest.mark.parametrize("kind", ["offload", "sharded"])
@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
def test_same_shapes_under_other_names_are_refused_before_any_write(tmp_path, kind, how):
    saver = Two()
    opt = _engine(kind, saver)
    _train(saver, opt)
    assert [g["param_names"] for g in opt.param_groups] == [["a.weight", "b.weight"], ["a.bias", "b.bias"]]
    state = opt.state_dict()
    assert state["param_groups"][0]["param_names"] == ["a.weight", "b.weight"]
    opt.save_checkpoint(str(tmp_path / "ckpt"))

    other = Two(swapped=True)
    target = _engine(kind, other)
    _train(other, target, 1)
    snap = _snapshot(other, target)
    with pytest.raises(NameMismatch, match=r"param group 0 holds 'a.weight' where this engine has 'b.weight' "
                                           r"\(and 1 more differ\)"):
        target.load_state_dict(state) if how == "state_dict" else target.load_checkpoint(str(tmp_path / "ckpt"))
    _unchanged(other, target, snap)
    _train(other, target, 1)  # nothing half-loaded: the engine steps on

    # the same model, built again: loads, and takes the saved masters
    same = Two()
    again = _engine(kind, same)
    again.load_state_dict(state) if how == "state_dict" else again.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(p, q) for p, q in zip(same.parameters(), saver.parameters()))


def test_without_names_on_one_side_a_state_loads_by_position_and_the_engine_keeps_its_own_names():
    saver = Two()
    opt = _engine("offload", saver, named=False)
    _train(saver, opt)
    state = opt.state_dict()
    assert "param_names" not in state["param_groups"][0]
    named = _engine("offload", Two(swapped=True))
    named.load_state_dict(state)  # as torch.optim loads: by position
    assert named.param_groups[0]["param_names"] == ["b.weight", "a.weight"]

    opt_named = _engine("offload", Two())
    _train(Two(), opt_named, 0)
    plain = _engine("offload", Two(), named=False)
    plain.load_state_dict(opt_named.state_dict())
    assert "param_names" not in plain.param_groups[0]  # the saved names are not taken over


def test_wrappers_prefixes_are_not_a_difference():
    saver = Two()
    compiled_names = [{"params": [(f"_orig_mod.{n}", p) for n, p in saver.named_parameters() if p.dim() == 2]},
                      {"params": [(f"module.{n}", p) for n, p in saver.named_parameters() if p.dim() < 2]}]
    opt = OffloadAdam(compiled_names, lr=0.01, options=OffloadOptions(**SMALL))
    _train(saver, opt)
    bare = Two()
    _engine("offload", bare).load_state_dict(opt.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(bare.parameters(), saver.parameters()))


def test_damaged_names_are_refused_by_name():
    opt = _engine("offload", Two())
    state = opt.state_dict()
    state["param_groups"][0]["param_names"] = ["a.weight"]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.param_names must be a list of 2 names"):
        _engine("offload", Two()).load_state_dict(state)


def _two_rank_job(rank, world_size, directory):
    model = Two()
    opt = _engine("sharded", model)
    _train(model, opt)
    opt.save_checkpoint(directory)
    other = Two(swapped=True)
    target = _engine("sharded", other)
    try:
        target.load_checkpoint(directory)
    except NameMismatch as e:
        return str(e)
    return "loaded"


def test_two_ranks_both_refuse_and_neither_waits(tmp_path):
    out = run_distributed(_two_rank_job, str(tmp_path / "ckpt"))
    assert all("holds 'a.weight' where this engine has 'b.weight'" in r for r in out), out
