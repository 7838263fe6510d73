"""CPUAdam state dicts as torch's and bitsandbytes' tests use them: saved mid-training through
torch.save/torch.load(weights_only=True), loaded into a fresh optimizer, the run continues bit for
bit; and the way to torch.optim.AdamW from every state dtype (int8 codes never pass for moments)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from hf_zero_offload import CPUAdam, ops

PDTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _params(sizes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]


def _grads(params, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params] for _ in range(k)]


def _run(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def _through_disk(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("pdtype", sorted(PDTYPES))
@pytest.mark.parametrize("state_dtype", ops.STATE_DTYPES)
def test_saved_mid_training_continues_bit_for_bit(state_dtype, pdtype):
    """Sizes around an int8 block (255, 256, 257) and a lone element; one group with other
    hyper-parameters; the fresh optimizer is built with other values, which the load replaces."""
    sizes, dtype = (1, 255, 256, 257), PDTYPES[pdtype]
    kw = dict(lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "betas": (0.8, 0.99)}]  # noqa: E731
    whole = _params(sizes, dtype)
    grads = _grads(whole, 7)
    ref = CPUAdam(groups(whole), **kw)
    _run(ref, whole, grads)
    first = _params(sizes, dtype)
    opt = CPUAdam(groups(first), **kw)
    _run(opt, first, grads[:4])
    saved = _through_disk({"params": [p.detach() for p in first], "opt": opt.state_dict()})
    second = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    fresh = CPUAdam(groups(second), lr=9.0, weight_decay=0.0, state_dtype=state_dtype)
    fresh.load_state_dict(saved["opt"])
    _run(fresh, second, grads[4:])
    for a, b in zip(whole, second):
        assert torch.equal(a, b)
        for k, v in ref.state[a].items():
            assert torch.equal(v, fresh.state[b][k]) if torch.is_tensor(v) else v == fresh.state[b][k], k


def test_loading_a_deep_copy_leaves_the_saved_dict_alone():
    params = _params((300, 7), torch.bfloat16)
    opt = CPUAdam(params, lr=1e-2, state_dtype="int8")
    _run(opt, params, _grads(params, 2))
    saved = opt.state_dict()
    frozen = copy.deepcopy(saved)
    fresh_p = _params((300, 7), torch.bfloat16)
    fresh = CPUAdam(fresh_p, lr=1e-2, state_dtype="int8")
    fresh.load_state_dict(copy.deepcopy(saved))
    _run(fresh, fresh_p, _grads(fresh_p, 2, seed=5))
    for pid, st in frozen["state"].items():
        for k, v in st.items():
            assert torch.equal(v, saved["state"][pid][k]) if torch.is_tensor(v) else v == saved["state"][pid][k]


def test_int8_state_dict_does_not_pass_for_moments_in_torch():
    """torch.optim casts every state tensor to the param's dtype: int8 codes saved as exp_avg
    were loaded by torch.optim.AdamW as moments and it trained on them, silently. Under their own
    names torch's first step stops, naming the missing moment."""
    params = _params((300,), torch.float32)
    opt = CPUAdam(params, lr=1e-2, state_dtype="int8")
    _run(opt, params, _grads(params, 2))
    theirs = [torch.nn.Parameter(params[0].detach().clone())]
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2)
    torch_opt.load_state_dict(opt.state_dict())
    theirs[0].grad = torch.ones(300)
    with pytest.raises(KeyError, match="exp_avg"):
        torch_opt.step()
    assert torch.equal(theirs[0], params[0])


@pytest.mark.parametrize("pdtype", ["fp32", "bf16"])
@pytest.mark.parametrize("state_dtype", ops.STATE_DTYPES)
def test_to_torch_state_dict_continues_in_torch(state_dtype, pdtype):
    """CPUAdam.to_torch_state_dict: the moments in fp32 (int8 decoded, bf16 widened), no master or
    scales, adamw_mode as decoupled_weight_decay. torch.optim.AdamW / Adam load it and continue
    exactly as from those decoded moments; the CPUAdam dict is left as it was."""
    dtype = PDTYPES[pdtype]
    params = _params((300, 5), dtype)
    opt = CPUAdam(params, lr=1e-2, weight_decay=0.1, adamw_mode=state_dtype != "bf16", state_dtype=state_dtype)
    _run(opt, params, _grads(params, 3))
    saved = opt.state_dict()
    before = copy.deepcopy(saved)
    converted = CPUAdam.to_torch_state_dict(_through_disk(saved))
    for pid, st in converted["state"].items():
        assert sorted(st) == ["exp_avg", "exp_avg_sq", "step"]
        p = params[pid]
        m, v = ops.state_to_fp32({k: opt.state[p][k].reshape(-1) for k in
                                  ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale") if k in opt.state[p]})
        assert torch.equal(st["exp_avg"], m.view(p.shape)) and torch.equal(st["exp_avg_sq"], v.view(p.shape))
    group = converted["param_groups"][0]
    assert "state_dtype" not in group and "adamw_mode" not in group
    assert group["decoupled_weight_decay"] is (state_dtype != "bf16")
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = (torch.optim.AdamW if state_dtype != "bf16" else torch.optim.Adam)(theirs, foreach=False)
    torch_opt.load_state_dict(converted)
    # the same run from the same decoded moments, by hand
    expect = [torch.nn.Parameter(p.detach().clone()) for p in params]
    by_hand = (torch.optim.AdamW if state_dtype != "bf16" else torch.optim.Adam)(
        expect, lr=1e-2, weight_decay=0.1, foreach=False)
    for q, (pid, st) in zip(expect, converted["state"].items()):
        by_hand.state[q] = {k: v.clone().to(q.dtype) if k != "step" else v.clone() for k, v in st.items()}
    grads = _grads(params, 2, seed=7)
    _run(torch_opt, theirs, grads)
    _run(by_hand, expect, grads)
    assert all(torch.equal(a, b) for a, b in zip(theirs, expect))
    for pid, st in before["state"].items():  # the CPUAdam dict is untouched (steps not shared)
        for k, v in st.items():
            assert torch.equal(v, saved["state"][pid][k]) if torch.is_tensor(v) else v == saved["state"][pid][k]
    # and back: CPUAdam loads torch's dict (fp32 moments, converted to its state_dtype at the next step)
    again = CPUAdam([torch.nn.Parameter(p.detach().clone()) for p in theirs], state_dtype=state_dtype)
    again.load_state_dict(torch_opt.state_dict())
    assert again.param_groups[0]["adamw_mode"] is (state_dtype != "bf16")


def test_to_torch_state_dict_names_a_bad_entry():
    params = _params((300,), torch.float32)
    opt = CPUAdam(params, state_dtype="int8")
    _run(opt, params, _grads(params, 1))
    bad = opt.state_dict()
    bad["state"][0] = {**bad["state"][0], "exp_avg_sq_codes": bad["state"][0]["exp_avg_sq_codes"].float()}
    with pytest.raises(TypeError, match="exp_avg is int8 .int8 state., so exp_avg_sq must be uint8; got float32"):
        CPUAdam.to_torch_state_dict(bad)
    with pytest.raises(ValueError, match="has both exp_avg and exp_avg_codes"):
        CPUAdam.to_torch_state_dict({"state": {0: {**opt.state_dict()["state"][0], "exp_avg": torch.zeros(300)}},
                                     "param_groups": [{"params": [0]}]})
