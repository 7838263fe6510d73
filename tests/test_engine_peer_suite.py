"""The engines probed the way peer suites probe ZeRO optimizers (DeepSpeed's tests/unit/runtime/zero,
torch's test_zero_redundancy_optimizer, DeepSpeed's test_cpu_adam), on combinations the other engine
tests leave out: param groups with their own betas/eps/lr/weight decay and an lr changed mid-run,
torch.optim flags a group may carry, ``zero_grad(set_to_none=False)``, Adam with L2 weight decay per
group, a closure; the same on two ranks, and a model smaller than one shard's int8 block, are in
test_engine_peer_suite_ranks.py. Every state dtype (fp32, bf16, int8) and the delayed parameter update (DPU) run
where they apply.

References: ``torch.optim.AdamW(foreach=False)`` (fp32: to a few ulp, as test_engine.py), DDP + AdamW
on two ranks, and, for bf16/int8 moments, the one-process engine of the same state dtype (bit for bit
where both sum the same gradients in the same order, else within ``assert_compact_close``).
"""
from __future__ import annotations

import copy

import pytest
import torch

from _models import TinyNet, batches, loss_fn, param_groups
from _peer_suite import (LR, WD, BRANCH_STEPS, DROPS, DTYPES, SMALL, TIGHT, _sharded, dropping_data, flat, offload,
                         own_groups, run)
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

FLAGS = [("amsgrad", True), ("maximize", True), ("capturable", True), ("differentiable", True),
         ("foreach", True), ("fused", True), ("decoupled_weight_decay", False), ("state_dtype", "int8"),
         ("adamw_mode", "false")]


# -- param groups ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_own_group_hyperparameters_and_an_lr_change_match_adamw(dpu):
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(own_groups(ref_model), lr=LR, foreach=False)
    data = batches(8)
    # DPU after warm-up: the device params trail the masters one step; compared after flush()
    opt = offload(model, dpu=dpu, dpu_warmup_steps=100 if not dpu else 8)
    run(ref_model, ref, data)
    run(model, opt, data)
    torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    opt.close()


@pytest.mark.parametrize("kind", ["offload", "zero0"])
@pytest.mark.parametrize("key,value", FLAGS, ids=[k for k, _ in FLAGS])
def test_a_group_flag_the_engine_does_not_implement_is_refused_by_name(kind, key, value):
    """They used to be accepted and dropped: amsgrad=True or maximize=True trained as plain AdamW."""
    torch.manual_seed(0)
    model = TinyNet()
    groups = param_groups(model, WD)
    groups[1][key] = value
    cls, extra = (OffloadAdam, {}) if kind == "offload" else (ShardedAdam, dict(stage=0, offload=False))
    before = flat(model)
    if key == "decoupled_weight_decay":  # given the torch way at build, with no adamw_mode: L2 Adam, as CPUAdam reads it
        cls(groups, lr=LR, options=OffloadOptions(num_threads=1), **extra).close()
    else:
        with pytest.raises(ValueError, match=f"param group 1: {key}[= ]"):
            cls(groups, lr=LR, options=OffloadOptions(num_threads=1), **extra)
    assert torch.equal(flat(model), before)
    # set on a built engine (a group edited by hand): the next step refuses before anything moves
    opt = cls(param_groups(model, WD), lr=LR, options=OffloadOptions(num_threads=1), **extra)
    opt.param_groups[1][key] = value
    ids, labels, use_branch = batches(1)[0]
    loss_fn(model, ids, labels, use_branch).backward()
    with pytest.raises(ValueError, match=f"param group 1: {key}[= ]"):
        opt.step()
    assert torch.equal(flat(model), before) and int(opt._param_steps.sum()) == 0
    opt.close()


def test_flags_that_agree_with_the_engine_are_accepted():
    """A group copied from torch.optim.AdamW's (foreach None, fused None, amsgrad False...) steps."""
    torch.manual_seed(0)
    model = TinyNet()
    groups = param_groups(model, WD)
    torch_keys = torch.optim.AdamW(param_groups(TinyNet(), WD), foreach=False).param_groups[0]
    for g in groups:
        g.update({k: v for k, v in torch_keys.items() if k not in ("params", "lr", "weight_decay")})
    opt = OffloadAdam(groups, lr=LR, options=OffloadOptions(num_threads=1))
    run(model, opt, batches(2))
    opt.close()


def test_adam_with_l2_weight_decay_per_group_matches_torch_adam():
    """adamw_mode per group: False is torch.optim.Adam's L2 decay, True AdamW's decoupled decay."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    groups = param_groups(model, WD)
    groups[0]["adamw_mode"] = False
    ref_groups = param_groups(ref_model, WD)
    refs = [torch.optim.Adam([ref_groups[0]], lr=LR, foreach=False),
            torch.optim.AdamW([ref_groups[1]], lr=LR, foreach=False)]
    opt = OffloadAdam(groups, lr=LR, options=OffloadOptions(**SMALL))
    for ids, labels, use_branch in batches(6):
        loss_fn(ref_model, ids, labels, use_branch).backward()
        for r in refs:
            r.step()
            r.zero_grad()
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    opt.close()


def test_a_closure_is_called_and_its_loss_returned_as_torch_does():
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    opt = offload(model, groups=lambda m: param_groups(m, WD))
    for ids, labels, use_branch in batches(5):
        losses = []
        for m, o in ((ref_model, ref), (model, opt)):
            def closure(m=m, o=o):
                o.zero_grad()
                loss = loss_fn(m, ids, labels, use_branch)
                loss.backward()
                return loss
            losses.append(o.step(closure).item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    opt.close()


# -- zero_grad(set_to_none=False) ------------------------------------------------------------------
def test_zero_grad_keeping_zeros_steps_unused_params_like_adamw():
    """torch: a param that had a .grad keeps a zero one and AdamW steps it (moments decay, weight decay
    applies); the engines skipped it, as if set_to_none=True."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    opt = offload(model, groups=lambda m: param_groups(m, WD))
    data = batches(6)
    run(ref_model, ref, data, keep_zero=True)
    run(model, opt, data, keep_zero=True)
    torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    assert int(opt._param_steps.min()) == 6 == ref.state[ref_model.branch.weight]["step"].item()
    # set_to_none=True forgets the kept zeros: the branch skips again
    opt.zero_grad()
    ids, labels, _ = data[0]
    loss_fn(model, ids, labels, False).backward()
    opt.step()
    opt.zero_grad()
    branch = next(i for i, (q, _, _) in enumerate(opt._flat) if q is model.branch.weight)
    assert int(opt._param_steps[branch]) == 6
    opt.close()


@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_zero_grad_keeping_zeros_is_an_explicit_zero_gradient(state_dtype, dpu):
    """Every state dtype, with and without DPU: bit for bit the run whose unused branch got a zero
    gradient from backward."""
    runs = []
    for keep in (True, False):
        torch.manual_seed(0)
        model = TinyNet()
        opt = offload(model, state_dtype=state_dtype, dpu=dpu, dpu_warmup_steps=2)
        run(model, opt, batches(6), keep_zero=keep, explicit_zero=not keep)
        runs.append((flat(model), opt.state_tensors()))
        opt.close()
    assert torch.equal(runs[0][0], runs[1][0])
    for k, t in runs[1][1].items():
        assert torch.equal(runs[0][1][k], t), k


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_gradients_dropped_by_zero_grad_keeping_zeros_leave_the_zeros_adamw_steps(state_dtype):
    """zero_grad(set_to_none=False) part way through a window leaves a zero .grad exactly on the params that
    hold a .grad then, and AdamW steps those even when the rest of the window gives them none. The engines
    went by the last step's gradients instead, even after a zero_grad() had set them to None. fp32 against
    AdamW; bf16/int8 bit for bit against the run that gives those params explicit zero gradients."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model, zeros_model = copy.deepcopy(ref_model), copy.deepcopy(ref_model)
    opt = offload(model, groups=lambda m: param_groups(m, WD), state_dtype=state_dtype)
    run(model, opt, dropping_data(), drops=DROPS)
    branch = next(i for i, (q, _, _) in enumerate(opt._flat) if q is model.branch.weight)
    assert int(opt._param_steps[branch]) == BRANCH_STEPS
    if state_dtype == "fp32":
        ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
        run(ref_model, ref, dropping_data(), drops=DROPS)
        assert ref.state[ref_model.branch.weight]["step"].item() == BRANCH_STEPS
        torch.testing.assert_close(flat(model), flat(ref_model), **TIGHT)
    else:
        zeros = offload(zeros_model, groups=lambda m: param_groups(m, WD), state_dtype=state_dtype)
        for i, ((ids, labels, use), drop) in enumerate(zip(dropping_data(), DROPS)):
            if i == 3:
                zeros.param_groups[1]["lr"] = 5e-3  # as run() does
            loss = loss_fn(zeros_model, ids, labels, use)
            if drop and not use:
                loss = loss + 0 * sum(p.sum() for p in zeros_model.branch.parameters())
            loss.backward()
            zeros.step()
            zeros.zero_grad()
        assert torch.equal(flat(model), flat(zeros_model))
        zeros.close()
    opt.close()


ENGINES = {"offload": lambda m, wd: OffloadAdam(param_groups(m, wd), lr=LR, options=OffloadOptions(**SMALL)),
           "sharded1": lambda m, wd: _sharded(m, lambda q: param_groups(q, wd), dict(stage=1, offload=True)),
           "sharded2": lambda m, wd: _sharded(m, lambda q: param_groups(q, wd), dict(stage=2, offload=False))}


@pytest.mark.parametrize("then", ["close", "replace", "torch"])
@pytest.mark.parametrize("kind", list(ENGINES))
def test_an_optimizer_built_next_steps_the_zero_grads_torch_keeps(kind, then):
    """zero_grad(set_to_none=False), then a new optimizer over the same params (after close(), or replacing the
    engine alive): torch's steps the params holding a zero .grad (the branch, unused from step 2 on). The engines
    free each .grad they take, so the next engine found none and skipped them: 0.198 off AdamW with weight decay
    0.5, silently. Element by element against AdamW(foreach=False) rebuilt at the same point."""
    wd = 0.5
    data = [(ids, labels, i == 0) for i, (ids, labels, _) in enumerate(batches(5))]
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    for m, make in ((ref_model, lambda: torch.optim.AdamW(param_groups(ref_model, wd), lr=LR, foreach=False)),
                    (model, lambda: ENGINES[kind](model, wd))):
        opt = make()
        run(m, opt, data[:2], keep_zero=True, lr_at=-1)
        if m is model and then == "close":
            opt.close()
        opt = make() if m is ref_model or then != "torch" else (opt.close(), torch.optim.AdamW(
            param_groups(model, wd), lr=LR, foreach=False))[1]
        run(m, opt, data[2:], keep_zero=True, lr_at=-1)
        if m is model and then != "torch":
            assert all(p.grad is None for p in model.parameters())  # taken: the zeros live in the engine's flags
            opt.close()
    assert model.branch.weight.grad is not None and not model.branch.weight.grad.any()  # handed back at close
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, **TIGHT, msg=name)


def test_closing_after_zero_grad_to_none_hands_back_no_grads():
    """torch's default zero_grad(): a close allocates no .grad (nothing torch would hold is a zero)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = ENGINES["offload"](model, WD)
    run(model, opt, batches(2), lr_at=-1)
    opt.close()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_int8_results_do_not_depend_on_the_tile_size(dpu):
    """A tile under one quantization block (256) split a block's update into parts, each re-encoding it: params
    moved by 3e-3 at lr 1e-2 against the default tile. Tiles are now whole blocks."""
    runs = []
    for tile in (4, 100, 300, 1 << 22):
        torch.manual_seed(0)
        model = TinyNet()
        opt = offload(model, groups=lambda m: param_groups(m, WD), state_dtype="int8", tile_numel=tile, dpu=dpu,
                      dpu_warmup_steps=2)
        assert opt.options.tile_numel % 256 == 0
        run(model, opt, batches(6))
        runs.append(flat(model))
        opt.close()
    for r in runs[1:]:
        assert torch.equal(r, runs[0])
