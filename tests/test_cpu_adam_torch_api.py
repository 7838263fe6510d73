"""CPUAdam as torch.optim's own tests use an optimizer (test_optim.py, OptimizerInfo of AdamW):
the flags supported exactly or refused by name, duplicate and sparse params, the step and
state-dict hooks in torch's order, a tensor lr, schedulers that change betas."""
from __future__ import annotations

import copy

import pytest
import torch

from hf_zero_offload import CPUAdam

FLAGS = {"amsgrad": True, "foreach": True, "fused": True, "capturable": True, "differentiable": True}


def _params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen).to(dtype)) for s in ((7, 3), (3,), (257,))]


def _grads(params, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params] for _ in range(k)]


def _run(opt, params, grads, sched=None):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_maximize_is_torchs(adamw):
    """maximize=True ascends like torch's (it was an unexpected keyword; as a group key, refused)."""
    ours_p, ref_p = _params(), _params()
    kw = dict(lr=1e-2, weight_decay=0.1, maximize=True)
    ours = CPUAdam(ours_p, adamw_mode=adamw, **kw)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref_p, foreach=False, **kw)
    grads = _grads(ours_p, 5)
    _run(ours, ours_p, grads)
    _run(ref, ref_p, grads)
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.state[a]["exp_avg"], ref.state[b]["exp_avg"], rtol=1e-5, atol=1e-6)
    plain = _params()
    opt = CPUAdam([{"params": plain[:2]}, {"params": plain[2:], "maximize": True}], lr=1e-2)
    before = [p.detach().clone() for p in plain]
    for p in plain:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(bool((p < b).all()) for p, b in zip(plain[:2], before[:2])) and bool((plain[2] > before[2]).all())


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_a_flag_cpu_adam_does_not_implement_is_refused_by_name(flag):
    """Refused, naming the flag, wherever it can come in: the constructor, add_param_group, a
    state dict, a group edited between steps (it used to be ignored in a group)."""
    value = FLAGS[flag]
    match = rf"{flag}={value} is not supported"
    with pytest.raises(ValueError, match=rf"CPUAdam: {match}"):
        CPUAdam(_params(), **{flag: value})
    for off in (None, False):
        if not (flag in ("capturable", "differentiable", "amsgrad") and off is None):
            CPUAdam(_params(), **{flag: off})  # torch's defaults are accepted
    params = _params()
    opt = CPUAdam(params[:2], lr=1e-2)
    with pytest.raises(ValueError, match=rf"param group 1: {match}"):
        opt.add_param_group({"params": params[2:], flag: value})
    assert len(opt.param_groups) == 1
    opt.param_groups[0][flag] = value
    before = [p.detach().clone() for p in params[:2]]
    for p in params[:2]:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=rf"param group 0: {match}"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params[:2], before))


def test_implementation_flags_of_a_torch_state_dict_are_this_optimizers():
    """A torch.optim.AdamW(foreach=True) state dict loads (foreach says how that optimizer ran, not
    what it computed) and the run continues like torch's; its amsgrad=True is refused before
    anything loads."""
    ref_p, ours_p = _params(), _params()
    ref = torch.optim.AdamW(ref_p, lr=1e-2, foreach=True)
    grads = _grads(ref_p, 6)
    _run(ref, ref_p, grads[:3])
    with torch.no_grad():
        for a, b in zip(ours_p, ref_p):
            a.copy_(b)
    ours = CPUAdam(ours_p, lr=1.0)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert ours.param_groups[0]["foreach"] is None and ours.param_groups[0]["lr"] == 1e-2
    _run(ours, ours_p, grads[3:])
    _run(ref, ref_p, grads[3:])
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    back_p = _params()
    back = torch.optim.AdamW(back_p, foreach=True)
    back.load_state_dict(ours.state_dict())  # and back: torch reads our flags as its defaults
    _run(back, back_p, grads[:1])
    assert float(back.state[back_p[0]]["step"]) == 7.0


def test_a_param_listed_twice_is_refused():
    """torch only warns (and steps it twice per step); across groups torch refuses it too, naming neither place."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"CPUAdam: param 0 of group 0 and param 2 of group 0 are the same tensor "
                                         r"\(shape \(3,\)\), listed twice"):
        CPUAdam([p, q, p])
    with pytest.raises(ValueError, match=r"'b' \(param 1 of group 0\) and 'c' \(param 2 of group 0\) are the same "
                                         r"tensor \(shape \(3,\), one weight tied under two names\)"):
        CPUAdam([("a", q), ("b", p), ("c", p)])
    opt = CPUAdam([q])
    with pytest.raises(ValueError, match="param 0 of group 1 and param 1 of group 1"):
        opt.add_param_group({"params": iter([p, p])})
    with pytest.raises(ValueError, match="param 0 of group 0 and param 0 of group 1 are the same tensor"):
        opt.add_param_group({"params": [q]})
    assert len(opt.param_groups) == 1


def test_sparse_and_complex_params_are_refused_when_added():
    """A sparse param was accepted and failed at the first step ("sparse gradients"); a sparse
    grad of a dense param (nn.Embedding(sparse=True)) is refused naming the param and the fix."""
    sparse = torch.nn.Parameter(torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match=r"param group 0: needs dense parameters; got a torch.sparse_coo one"):
        CPUAdam([sparse])
    with pytest.raises(TypeError, match="float32, bfloat16 or float16 parameters; got torch.complex64"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = CPUAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match=r"the grad of a \(5, 3\) param in group 0 is torch.sparse_coo"):
        opt.step()


def test_load_state_dict_hooks_run_in_torchs_order():
    """A load pre hook sees the dict first (it can repair it: the checks used to run before it);
    a post hook sees the state as loaded (it used to see torch's cast: int8 codes and the fp32
    master of a bf16 param as bf16)."""
    params = _params(dtype=torch.bfloat16)
    opt = CPUAdam(params, lr=1e-2, state_dtype="int8")
    _run(opt, params, _grads(params, 2))
    saved = copy.deepcopy(opt.state_dict())
    broken = copy.deepcopy(saved)
    broken["state"][0]["step"] = "two"
    fresh = CPUAdam(_params(dtype=torch.bfloat16), state_dtype="int8")
    seen = []

    def repair(o, sd):
        sd["state"] = {**sd["state"], 0: {**sd["state"][0], "step": saved["state"][0]["step"].clone()}}

    fresh.register_load_state_dict_pre_hook(repair)
    fresh.register_load_state_dict_post_hook(lambda o: seen.append({k: v.dtype for k, v in o.state[
        o.param_groups[0]["params"][0]].items() if torch.is_tensor(v)}))
    fresh.load_state_dict(broken)
    assert seen == [{"step": torch.float32, "exp_avg": torch.int8, "exp_avg_sq": torch.uint8,
                     "exp_avg_scale": torch.float32, "exp_avg_sq_scale": torch.float32, "master": torch.float32}]
    assert torch.equal(fresh.state[fresh.param_groups[0]["params"][0]]["master"], opt.state[params[0]]["master"])


def test_step_and_state_dict_hooks_run():
    params = _params()
    opt = CPUAdam(params, lr=1e-2, state_dtype="int8")
    log = []
    opt.register_step_pre_hook(lambda o, a, k: log.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: log.append("post"))
    opt.register_state_dict_pre_hook(lambda o: log.append("sd pre"))
    opt.register_state_dict_post_hook(lambda o, sd: log.append(sorted(sd["state"][2])))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 1})
    _run(opt, params, _grads(params, 1))
    assert opt.state_dict()["tag"] == 1  # a post hook's result is the state dict, as in torch
    assert log == ["pre", "post", "sd pre", ["exp_avg_codes", "exp_avg_scale", "exp_avg_sq_codes",
                                             "exp_avg_sq_scale", "int8_codes", "step"]]


@pytest.mark.parametrize("sched", ["onecycle", "cyclic", "lambda"])
def test_tensor_lr_and_schedulers_that_change_betas(sched):
    """lr as a one-element tensor (kept a tensor by the schedulers) and OneCycleLR/CyclicLR, which
    cycle beta1 through ``betas``: element by element like torch.optim.AdamW(foreach=False)."""
    ours_p, ref_p = _params(), _params()
    ours = CPUAdam(ours_p, lr=torch.tensor(1e-3), weight_decay=0.01)
    ref = torch.optim.AdamW(ref_p, lr=torch.tensor(1e-3), weight_decay=0.01, foreach=False)
    make = {"onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=12),
            "cyclic": lambda o: torch.optim.lr_scheduler.CyclicLR(o, 1e-3, 0.05, step_size_up=3),
            "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.8**s)}[sched]
    grads = _grads(ours_p, 10)
    _run(ours, ours_p, grads, make(ours))
    _run(ref, ref_p, grads, make(ref))
    assert torch.is_tensor(ours.param_groups[0]["lr"]) and ours.param_groups[0]["betas"] == ref.param_groups[0]["betas"]
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    floats = _params()
    as_float = CPUAdam(floats, lr=1e-3, weight_decay=0.01)
    tensors = _params()
    as_tensor = CPUAdam(tensors, lr=torch.tensor(1e-3, dtype=torch.float64), weight_decay=0.01)
    _run(as_float, floats, grads)
    _run(as_tensor, tensors, grads)
    assert all(torch.equal(a, b) for a, b in zip(floats, tensors))


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n", [1, 7, 22, 55, 127, 1024, 2**20 + 1])
def test_deepspeed_sizes_match_adamw(n, pdtype):
    """DeepSpeed's test_cpu_adam sizes (vector tails, thread splits): element by element like
    torch.optim.AdamW(foreach=False) on an fp32 copy given the same gradients; a 16-bit param is
    its fp32 master rounded to nearest even."""
    gen = torch.Generator().manual_seed(n)
    start = torch.randn(n, generator=gen).to(pdtype)
    ours, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.float())
    opt = CPUAdam([ours], lr=1e-3, weight_decay=0.01)
    torch_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01, foreach=False)
    for _ in range(10):
        g = torch.randn(n, generator=gen).to(pdtype)
        ours.grad, ref.grad = g, g.float()
        opt.step()
        torch_opt.step()
    master = ours.detach() if pdtype == torch.float32 else opt.state[ours]["master"]
    torch.testing.assert_close(master, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[ours]["exp_avg_sq"], torch_opt.state[ref]["exp_avg_sq"], rtol=1e-5, atol=0.0)
    assert torch.equal(ours.detach(), master.to(pdtype))


def test_the_rest_of_torchs_optimizer_contract():
    """An empty param list, zero_grad both ways, deepcopy (continues bit for bit), the repr."""
    with pytest.raises(ValueError, match="empty parameter list"):
        CPUAdam([])
    params = _params()
    opt = CPUAdam(params, lr=1e-2, state_dtype="bf16", maximize=True)
    _run(opt, params, _grads(params, 2))
    twin = copy.deepcopy(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    grads = _grads(params, 2, seed=3)
    _run(opt, params, grads)
    _run(twin, twin_params, grads)
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    assert "state_dtype: bf16" in repr(opt) and "maximize: True" in repr(opt) and "amsgrad: False" in repr(opt)


@pytest.mark.parametrize("how", ["no_grad_copy", "load_state_dict", "data_rebind"])
def test_a_16bit_param_written_between_steps_is_what_the_next_step_starts_from(how):
    """The fp32 master follows a 16-bit param written since the last step: seen by its version counter,
    or, for ``p.data = t`` (which does not move it), by its storage."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1).bfloat16()
    opt = CPUAdam(lin.parameters(), lr=1e-2)
    for k in range(3):
        if k == 1:
            new = {n: torch.full_like(t, 2.0) for n, t in lin.state_dict().items()}
            if how == "load_state_dict":
                lin.load_state_dict(new)
            elif how == "no_grad_copy":
                with torch.no_grad():
                    for p in lin.parameters():
                        p.copy_(torch.full_like(p, 2.0))
            else:
                for p in lin.parameters():
                    p.data = torch.full_like(p, 2.0)
            start = [p.detach().float().clone() for p in lin.parameters()]
        lin(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        opt.zero_grad()
        if k == 1:  # one step from 2.0: the update is about lr, never back to the old weights
            for p, s in zip(lin.parameters(), start):
                assert ((p.float() - s).abs() <= 0.02).all(), (how, p)


@pytest.mark.skipif("decoupled_weight_decay" not in __import__("inspect").signature(torch.optim.Adam).parameters,
                    reason="torch.optim.Adam takes decoupled_weight_decay from torch 2.7")
def test_a_state_dict_loaded_into_adam_with_decoupled_weight_decay_stays_adamw():
    """The saved groups say torch's decoupled_weight_decay: without it torch.optim.Adam(decoupled_weight_decay=True)
    defaulted the key to False on load and went on as L2 Adam."""
    g = torch.Generator().manual_seed(0)
    start, grads = torch.randn(9, generator=g), [torch.randn(9, generator=g) for _ in range(6)]
    p, q = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = CPUAdam([p], lr=1e-2, weight_decay=0.5)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.5, foreach=False)
    for gr in grads[:3]:
        p.grad, q.grad = gr.clone(), gr.clone()
        ours.step()
        ref.step()
    p2 = torch.nn.Parameter(p.detach().clone())
    torch_adam = torch.optim.Adam([p2], lr=1e-2, weight_decay=0.5, decoupled_weight_decay=True, foreach=False)
    torch_adam.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert torch_adam.param_groups[0]["decoupled_weight_decay"] is True
    for gr in grads[3:]:
        p2.grad, q.grad = gr.clone(), gr.clone()
        torch_adam.step()
        ref.step()
    torch.testing.assert_close(p2, q, rtol=1e-6, atol=1e-7)
    ours.load_state_dict(copy.deepcopy(ours.state_dict()))  # and back into CPUAdam


@pytest.mark.parametrize("bad", ["sparse_grad", "nan_lr", "state_of_another_size"])
def test_a_refused_step_creates_or_converts_no_state(bad):
    """Every check of a step comes before any state is made: a step refused by a later group or param had made
    the earlier params' states (step 0, in the state dict) and converted their moments to an edited state_dtype
    (int8, lossy) first."""
    params = _params()
    opt = CPUAdam([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2)
    _run(opt, params[:1], _grads(params[:1], 2))  # only the first param has a state
    before = copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["state_dtype"] = "int8"  # converted at the next step that goes ahead
    for p, g in zip(params, _grads(params, 1, seed=5)[0]):
        p.grad = g
    if bad == "sparse_grad":
        params[2].grad = params[2].grad.to_sparse()
    elif bad == "nan_lr":
        opt.param_groups[1]["lr"] = float("nan")
    else:  # a state loaded for a param of another size
        opt.state[params[2]].update(step=torch.tensor(1.0), exp_avg=torch.zeros(5), exp_avg_sq=torch.zeros(5))
    with pytest.raises((TypeError, ValueError), match="sparse gradients|lr must be|exp_avg has 5 elements"):
        opt.step()
    after = opt.state_dict()
    ids = [0] if bad != "state_of_another_size" else [0, 2]
    assert sorted(after["state"]) == ids and sorted(before["state"]) == [0]
    st, was = after["state"][0], before["state"][0]
    assert st.keys() == was.keys() and all(torch.equal(st[k], was[k]) for k in was)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float32


def test_frozen_params_the_kernel_cannot_step_are_accepted_as_torch_accepts_them():
    """``CPUAdam(model.parameters())`` over a model with a frozen int8 weight, a float64 or complex table or a sparse
    param was refused when built, though no step would touch them (torch.optim.AdamW and the engines take them); one
    unfrozen and given a gradient is refused at that step, by name, before any param moves."""
    frozen = [torch.nn.Parameter(t, requires_grad=False) for t in (
        torch.arange(3, dtype=torch.int8), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.complex64),
        torch.eye(2).to_sparse())]
    ours_p, ref_p = _params(), _params()
    ours = CPUAdam(ours_p + frozen, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_p + frozen, lr=1e-2, weight_decay=0.1, foreach=False)
    grads = _grads(ours_p, 3)
    _run(ours, ours_p, grads)
    _run(ref, ref_p, grads)
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    table = frozen[1]
    table.requires_grad_(True)
    table.grad = torch.ones(2, dtype=torch.float64)
    before = [p.detach().clone() for p in ours_p]
    with pytest.raises(TypeError, match=r"needs float32, bfloat16 or float16 parameters; got torch.float64"):
        _run(ours, ours_p, grads[:1])
    assert all(torch.equal(a, b) for a, b in zip(before, ours_p))
