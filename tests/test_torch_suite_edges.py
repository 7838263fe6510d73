"""What a port of torch's own optimizer tests (test/optim/test_optim.py) found: torch.compile over CPUAdam's step, a
tensor lr that a scheduler writes in place under DPU, param lists edited after an engine was built, and torch's
``decoupled_weight_decay`` in a CPUAdam group. Each compared with torch.optim.AdamW/Adam(foreach=False)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_zero_offload import CPUAdam
from hf_zero_offload.engine import OffloadAdam, OffloadOptions


def _two_of_one_shape():
    torch.manual_seed(1)
    return [nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))]


def test_cpu_adam_step_under_torch_compile_steps_each_param_once():
    """Traced, the kernel's pointers were constants: from the second call param 0 stepped twice, param 1 never."""
    ps = _two_of_one_shape()
    ref = [nn.Parameter(p.detach().clone()) for p in ps]
    ours, theirs = CPUAdam(ps, lr=0.1), torch.optim.AdamW(ref, lr=0.1, weight_decay=0.0, foreach=False)
    step = torch.compile(ours.step, backend="eager")
    for k in range(4):
        for i, p in enumerate(ps + ref):
            p.grad = torch.full_like(p, (k + 1) * (1.0 if i % 2 == 0 else -3.0))
        step()
        theirs.step()
    assert [int(ours.state[p]["step"]) for p in ps] == [4, 4]
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
        assert torch.equal(ours.state[a]["exp_avg"], theirs.state[b]["exp_avg"])


def _dpu_run(lr):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    opt = OffloadAdam(model.parameters(), lr=lr, weight_decay=0.01,
                      options=OffloadOptions(num_threads=1, dpu=True, dpu_warmup_steps=0, tile_numel=1024))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)  # a tensor lr: param_group["lr"].fill_(new)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.flush()
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


def test_a_delayed_step_reads_the_lr_of_its_own_step_when_a_scheduler_writes_a_tensor_lr_in_place():
    """The worker read the group's tensor after the scheduler had divided it by 10 (1.0e-2 off the float lr run)."""
    for a, b in zip(_dpu_run(1e-2), _dpu_run(torch.tensor(1e-2))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)  # (float32 1e-2 against the double)


def _engine_over_two_groups():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    groups = [{"params": list(model[0].parameters()), "lr": 1e-2}, {"params": list(model[1].parameters()), "lr": 1e-1}]
    return model, OffloadAdam(groups, lr=1e-3, options=OffloadOptions(num_threads=1))


@pytest.mark.parametrize("edit, what", [
    (lambda groups, extra: groups[1]["params"].append(groups[0]["params"].pop(0)), "moved between groups"),
    (lambda groups, extra: groups[0]["params"].pop(0), "params removed"),
    (lambda groups, extra: groups.reverse(), "moved between groups or reordered"),
    (lambda groups, extra: groups[0]["params"].append(extra), "params added"),
    (lambda groups, extra: groups.append({**groups[0], "params": [extra]}), "has 3 groups; the engine was built with 2"),
], ids=["moved", "removed", "reversed", "appended", "group-appended"])
def test_param_lists_edited_after_the_engine_was_built_are_refused_before_anything_moves(edit, what):
    """torch reads the lists at each step; the engine kept its layout and applied group 0's lr to a param moved to
    group 1 (0.19 off AdamW), stepped a removed param, and named an appended one 'frozen when built'."""
    model, opt = _engine_over_two_groups()
    model(torch.ones(2, 4)).sum().backward()
    before = copy.deepcopy(model.state_dict())
    edit(opt.param_groups, nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match=what):
        opt.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    opt.close()


def test_cpu_adam_honours_decoupled_weight_decay_in_a_group_and_refuses_a_contradiction():
    """A torch-style group {"decoupled_weight_decay": False} ran AdamW's decay (0.042 off torch.optim.Adam's L2);
    an edit of it between steps was ignored (0.299 off)."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(6))]
    ref = [nn.Parameter(ps[0].detach().clone())]
    ours = CPUAdam([{"params": ps, "decoupled_weight_decay": False}], lr=0.1, weight_decay=0.1)
    theirs = torch.optim.Adam(ref, lr=0.1, weight_decay=0.1, foreach=False)
    for k in range(3):
        ps[0].grad = ref[0].grad = torch.full((6,), 0.5 * (k + 1))
        ours.step()
        theirs.step()
    assert ours.param_groups[0]["adamw_mode"] is False
    torch.testing.assert_close(ps[0], ref[0], rtol=0, atol=1e-7)
    ours.param_groups[0]["decoupled_weight_decay"] = True  # edited as torch's name alone
    before = ps[0].detach().clone()
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=True contradicts adamw_mode=False"):
        ours.step()
    assert torch.equal(ps[0], before)


@pytest.mark.parametrize("group", [{"amsgrad": True}, {"fused": True}, {"foreach": True}, {"capturable": True},
                                   {"differentiable": True}, {"adamw_mode": False, "decoupled_weight_decay": True},
                                   {"adamw_mode": True, "decoupled_weight_decay": False}])
def test_cpu_adam_and_the_engine_refuse_a_group_flag_in_the_same_words(group):
    """One table (adam/flags.py) for both: each had its own, worded apart, and a flag could be refused by one alone."""
    def message(make):
        p = nn.Parameter(torch.ones(4))
        p.grad = torch.ones(4)
        opt = None
        with pytest.raises(ValueError) as e:
            opt = make(p)
            opt.step()
        assert torch.equal(p.detach(), torch.ones(4)), "a refused flag must not step"
        return str(e.value).split(": ", 1)[1]  # after "CPUAdam param group 0: " / "OffloadAdam param group 0: "

    ours = message(lambda p: CPUAdam([{"params": [p], **group}], lr=0.1))
    engine = message(lambda p: OffloadAdam([{"params": [p], **group}], lr=0.1))
    assert ours == engine
    assert next(iter(group)) in ours


def test_maximize_runs_in_cpu_adam_and_is_refused_by_the_engine():
    p, ref = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    ours, theirs = CPUAdam([p], lr=0.1, maximize=True, weight_decay=0.0), torch.optim.AdamW([ref], lr=0.1, maximize=True, weight_decay=0.0, foreach=False)
    p.grad = ref.grad = torch.full((4,), 0.5)
    ours.step()
    theirs.step()
    torch.testing.assert_close(p, ref, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match=r"maximize=True is not supported: the engine descends the gradient; negate"):
        q = nn.Parameter(torch.ones(4))
        q.grad = torch.ones(4)
        OffloadAdam([{"params": [q], "maximize": True}], lr=0.1).step()
