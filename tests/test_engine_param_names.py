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
    assert state["slot_names"] == ["a.weight", "b.weight", "a.bias", "b.bias"]
    opt.save_checkpoint(str(tmp_path / "ckpt"))

    other = Two(swapped=True)
    target = _engine(kind, other)
    _train(other, target, 1)
    snap = _snapshot(other, target)
    with pytest.raises(NameMismatch, match=r"trainable param 0 is 'a.weight' in the state and 'b.weight' here "
                                           r"\(and 3 more differ\)"):
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
    assert "param_names" not in state["param_groups"][0] and "slot_names" not in state
    named = _engine("offload", Two(swapped=True))
    named.load_state_dict(state)  # as torch.optim loads: by position
    assert named.param_groups[0]["param_names"] == ["b.weight", "a.weight"]

    opt_named = _engine("offload", Two())
    _train(Two(), opt_named, 0)
    plain = _engine("offload", Two(), named=False)
    plain.load_state_dict(opt_named.state_dict())
    assert "param_names" not in plain.param_groups[0]  # the saved names are not taken over


def test_compiles_and_ddps_prefixes_are_no_difference():
    saver = Two()
    # DDP over a compiled model: every name is module._orig_mod.<name>
    compiled_names = [{"params": [(f"module._orig_mod.{n}", p) for n, p in saver.named_parameters() if p.dim() == 2]},
                      {"params": [(f"module._orig_mod.{n}", p) for n, p in saver.named_parameters() if p.dim() < 2]}]
    opt = OffloadAdam(compiled_names, lr=0.01, options=OffloadOptions(**SMALL))
    _train(saver, opt)
    bare = Two()
    _engine("offload", bare).load_state_dict(opt.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(bare.parameters(), saver.parameters()))


def test_damaged_names_are_refused_by_name():
    opt = _engine("offload", Two())
    state = opt.state_dict()
    state["slot_names"] = ["a.weight"]
    with pytest.raises(ValueError, match=r"slot_names must be a list of 4 names.*not written by hf_zero_offload"):
        _engine("offload", Two()).load_state_dict(state)


def _frozen(model, *names):
    for n in names:
        getattr(model, n).requires_grad_(False)
    return model


def test_frozen_params_own_no_state_and_are_no_difference():
    """A group's param_names name its frozen params too (torch keeps them in the group): a frozen param added,
    removed or renamed was refused as a damaged state or as other params, while the trainable ones were the same."""
    saver = Two()
    saver.a.bias.requires_grad_(False)
    opt = _engine("offload", saver)
    _train(saver, opt)
    state = opt.state_dict()
    assert state["slot_names"] == ["a.weight", "b.weight", "b.bias"]
    fewer = Two()
    fewer.a.bias.requires_grad_(False)
    groups = _groups(fewer, True)
    groups[1]["params"] = [(n, p) for n, p in groups[1]["params"] if n != "a.bias"]  # the frozen one left out
    OffloadAdam(groups, lr=0.01, options=OffloadOptions(**SMALL)).load_state_dict(state)
    renamed = Two()
    renamed.a.bias.requires_grad_(False)
    groups = _groups(renamed, True)
    groups[1]["params"] = [("a.offset" if n == "a.bias" else n, p) for n, p in groups[1]["params"]]
    OffloadAdam(groups, lr=0.01, options=OffloadOptions(**SMALL)).load_state_dict(state)
    assert torch.equal(renamed.b.weight, saver.b.weight)


def test_the_other_of_two_same_shaped_layers_made_trainable_is_refused():
    """Both lists named all four params (torch keeps the frozen ones in the group): a.weight took b's weights."""
    saver = _frozen(Two(), "a")
    opt = _engine("offload", saver)
    _train(saver, opt)
    other = _frozen(Two(), "b")
    before = other.a.weight.detach().clone()
    with pytest.raises(NameMismatch, match=r"trainable param 0 is 'b.weight' in the state and 'a.weight' here"):
        _engine("offload", other).load_state_dict(opt.state_dict())
    assert torch.equal(other.a.weight, before)


@pytest.mark.parametrize("names, error", [
    (["w", 1], r"param group 0's param_names must be one name \(a str\) per param \(2\)"),
    (["w", "w"], r"the param name 'w' is given twice"),
], ids=["not a str", "twice"])
def test_names_a_load_could_not_compare_are_refused_when_built(names, error):
    model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=error):
        OffloadAdam([{"params": list(model.parameters()), "param_names": names}], lr=0.01,
                    options=OffloadOptions(**SMALL))


class Holder(nn.Module):
    """A submodule that is really called ``module`` beside one called ``a``: DDP's prefix is stripped only where
    every name has it, so ``module.a`` and ``a`` stay two names."""

    def __init__(self, swapped: bool = False):
        super().__init__()
        for name in (("module", "a") if swapped else ("a", "module")):
            setattr(self, name, nn.Linear(6, 6) if name == "a" else nn.Sequential())
        self.module.add_module("a", nn.Linear(6, 6))

    def forward(self, x):
        return self.module.a(self.a(x))


def test_wrappers_segments_are_no_difference_and_a_module_called_module_keeps_its_name():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    saver = Two()
    opt = OffloadAdam(saver.named_parameters(), lr=0.01, options=OffloadOptions(**SMALL))
    _train(saver, opt)
    wrapped = nn.Sequential()
    wrapped.add_module("inner", checkpoint_wrapper(Two()))
    bare_names = [(n.replace("inner._checkpoint_wrapped_module.", ""), p) for n, p in wrapped.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n, _ in wrapped.named_parameters())
    OffloadAdam(bare_names, lr=0.01, options=OffloadOptions(**SMALL)).load_state_dict(opt.state_dict())
    inner = checkpoint_wrapper(Two())
    OffloadAdam(inner.named_parameters(), lr=0.01, options=OffloadOptions(**SMALL)).load_state_dict(opt.state_dict())
    assert torch.equal(inner._checkpoint_wrapped_module.a.weight, saver.a.weight)

    holder = Holder()
    x = torch.randn(2, 6)
    hopt = OffloadAdam(holder.named_parameters(), lr=0.01, options=OffloadOptions(**SMALL))
    holder(x).sum().backward()
    hopt.step()
    swapped = Holder(swapped=True)
    with pytest.raises(NameMismatch, match=r"'a.weight' in the state and 'module.a.weight' here"):
        OffloadAdam(swapped.named_parameters(), lr=0.01, options=OffloadOptions(**SMALL)).load_state_dict(
            hopt.state_dict())


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
    assert all("trainable param 0 is 'a.weight' in the state and 'b.weight' here" in r for r in out), out


class Beside(nn.Module):
    """A submodule called ``module`` holding a layer ``a``, beside a same-shaped layer ``a``."""

    def __init__(self, trainable: str):
        super().__init__()
        torch.manual_seed(0)
        self.module = nn.Module()
        self.module.a = nn.Linear(6, 6)
        self.a = nn.Linear(6, 6)
        for n, p in self.named_parameters():
            p.requires_grad_(n.startswith(trainable + "."))

    def forward(self, x):
        return self.a(torch.tanh(self.module.a(x)))


def test_ddps_prefix_is_judged_over_every_name_the_groups_give():
    """Only module.a trained when saved, only a when loaded: judged over the trainable names alone, 'module.a.weight'
    lost its 'module.' and matched 'a.weight', and a took module.a's trained weights."""
    saver = Beside("module.a")
    opt = OffloadAdam(saver.named_parameters(), lr=0.01, options=OffloadOptions(**SMALL))
    _train(saver, opt)
    assert opt.state_dict()["slot_names"] == ["module.a.weight", "module.a.bias"]
    other = Beside("a")
    with pytest.raises(NameMismatch, match=r"'module.a.weight' in the state and 'a.weight' here"):
        OffloadAdam(other.named_parameters(), lr=0.01, options=OffloadOptions(**SMALL)).load_state_dict(
            opt.state_dict())


def test_a_state_saved_before_slot_names_is_compared_by_its_groups_names_where_they_map_one_for_one():
    saver = Two()
    opt = _engine("offload", saver)
    _train(saver, opt)
    state = opt.state_dict()
    del state["slot_names"]  # as the engines saved it before: torch's param_names in the groups only
    with pytest.raises(NameMismatch, match=r"'a.weight' in the state and 'b.weight' here"):
        _engine("offload", Two(swapped=True)).load_state_dict(state)
    _engine("offload", Two()).load_state_dict(state)
    frozen = _frozen(Two(), "a")  # its groups also name a frozen param: which names own state cannot be told
    fopt = _engine("offload", frozen)
    fstate = fopt.state_dict()
    del fstate["slot_names"]
    _engine("offload", _frozen(Two(swapped=True), "a")).load_state_dict(fstate)  # by position, as before
