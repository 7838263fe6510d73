"""CPUAdam with compact moments (int8, bf16) probed as a hostile user would: damaged state dicts
are refused by name before anything changes (the optimizer's state and params element for element
as before), and state dicts move between kinds (fp32, bf16, int8, torch.optim.AdamW) with the
numerics of the documented conversion. test_cpu_adam_integrity.py covers the plainer damage."""
from __future__ import annotations

import copy

import pytest
import torch

from hf_zero_offload import CPUAdam, ops

KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def _params(sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]


def _run(opt, params, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(k):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _snapshot(opt):
    return copy.deepcopy(([p.detach() for g in opt.param_groups for p in g["params"]],
                          [opt.state[p] for g in opt.param_groups for p in g["params"]]))


def _same(a, b):
    if torch.is_tensor(a):
        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                and (a.device.type == "meta" or torch.equal(a, b)))  # (a meta tensor has no values)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _trained(state_dtype="int8", sizes=(300, 6)):
    params = _params(sizes)
    opt = CPUAdam(params, lr=1e-2, state_dtype=state_dtype)
    _run(opt, params, 2)
    return params, opt


def _set(key, value):
    return lambda st: st.__setitem__(key, value)


def _poke(key, index, value):
    return lambda st: st[key].view(-1).__setitem__(index, value)


BAD = {  # each damages param 1's state; (mutation, error, message)
    "exp_avg code -128": (_poke("exp_avg_codes", 0, -128), ValueError, r"exp_avg_codes .*-128.*\[-120, 120\]"),
    "exp_avg code 121": (_poke("exp_avg_codes", 5, 121), ValueError, r"exp_avg_codes .*121.*\[-120, 120\]"),
    "exp_avg_sq code 249": (_poke("exp_avg_sq_codes", 2, 249), ValueError, r"exp_avg_sq_codes .*249.*\[0, 248\]"),
    "exp_avg_sq code 255": (_poke("exp_avg_sq_codes", 0, 255), ValueError, r"exp_avg_sq_codes .*255.*\[0, 248\]"),
    "uint8 step 255": (_set("step", torch.tensor(255, dtype=torch.uint8)), TypeError, "step .*uint8"),
    "bf16 step": (_set("step", torch.tensor(256.0, dtype=torch.bfloat16)), TypeError, "step .*bfloat16"),
    "step past the kernel's count": (_set("step", torch.tensor(1e19)), ValueError, r"step must be .* < 2\*\*53"),
    "meta step": (_set("step", torch.tensor(2.0, device="meta")), ValueError, "step .*meta"),
    "meta master": (_set("master", torch.zeros(6, device="meta")), ValueError, "master .*meta"),
    # these were right before this file; kept as the outline of what is refused
    "int16 codes": (_set("exp_avg_codes", torch.zeros(6, dtype=torch.int16)), TypeError, "exp_avg must have dtype"),
    "uint8 exp_avg codes": (_set("exp_avg_codes", torch.zeros(6, dtype=torch.uint8)), TypeError,
                            "exp_avg must have dtype"),
    "long scales": (_set("exp_avg_scale", torch.zeros(2)), ValueError, "exp_avg_scale has 2 elements, expected 1"),
    "meta codes": (lambda st: st.__setitem__("exp_avg_codes", st["exp_avg_codes"].to("meta")), ValueError,
                   "exp_avg is on the meta device"),
    "code map as a string": (_set("int8_codes", "2"), ValueError, "code map '2'"),
    "code map as a tensor": (_set("int8_codes", torch.tensor(2)), ValueError, "code map tensor"),
    "bool step": (_set("step", True), ValueError, "step must be a whole number"),
    "two-element step": (_set("step", torch.tensor([1.0, 2.0])), ValueError, "step must be a whole number"),
    "codes of another shape": (lambda st: st.__setitem__("exp_avg_codes", st["exp_avg_codes"].view(2, 3)),
                               ValueError, r"exp_avg has shape \(2, 3\), expected the param's \(6,\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_damaged_compact_state_is_refused_and_changes_nothing(case):
    """Loaded into a trained optimizer (not a fresh one): its state and params are as they were."""
    mutate, error, message = BAD[case]
    params, opt = _trained()
    bad = copy.deepcopy(opt.state_dict())
    mutate(bad["state"][1])
    target_params, target = _trained()
    _run(target, target_params, 1, seed=5)
    before = _snapshot(target)
    with pytest.raises(error, match=rf"optimizer state of param 1 \(shape \(6,\)\): .*{message}"):
        target.load_state_dict(bad)
    assert _same(_snapshot(target), before)


def test_the_kernels_codes_stay_in_the_range_the_load_accepts():
    """csrc/quant.h: exp_avg magnitudes 0..120 (EB 16), exp_avg_sq 0..248 (EB 32), even for inf/NaN."""
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 1.0, -1.0, 0.0] * 40)
    m, _ = ops.quantize_blockwise(x, "exp_avg")
    v, _ = ops.quantize_blockwise(x, "exp_avg_sq", step=3)
    assert int(m.to(torch.int32).abs().max()) == 120 and int(v.max()) == 248


@pytest.mark.parametrize("step", [torch.tensor(4, dtype=torch.int64), torch.tensor(4.0, dtype=torch.float64),
                                  4, 4.0, torch.tensor([4.0])])
def test_a_step_count_of_another_exact_kind_loads_as_torchs_float32(step):
    """Whole numbers an int64/float64 tensor or a Python number hold exactly load, as float32 (torch's)."""
    params, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][1]["step"] = step
    fresh = CPUAdam(_clone(params), lr=1e-2, state_dtype="int8")
    fresh.load_state_dict(sd)
    got = fresh.state[fresh.param_groups[0]["params"][1]]["step"]
    assert got.dtype == torch.float32 and got.shape == () and got.item() == 4.0


def test_strided_codes_load_as_their_values():
    """A 1-D strided view (every other byte of a larger buffer) holds valid codes: loaded as a copy,
    as the load copies every state tensor, not refused for a contiguity only the step needs."""
    params, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    codes = sd["state"][1]["exp_avg_codes"]
    sd["state"][1]["exp_avg_codes"] = torch.stack([codes, -codes], 1)[:, 0]
    assert not sd["state"][1]["exp_avg_codes"].is_contiguous()
    fresh = CPUAdam(_clone(params), lr=1e-2, state_dtype="int8")
    fresh.load_state_dict(sd)
    q = fresh.param_groups[0]["params"][1]
    assert torch.equal(fresh.state[q]["exp_avg"], codes) and fresh.state[q]["exp_avg"].is_contiguous()


def _torch_adamw_from(params, moments, steps, **kw):
    """torch.optim.AdamW(foreach=False) over copies of ``params``, with the given fp32 moments and steps."""
    theirs = _clone(params)
    opt = torch.optim.AdamW(theirs, foreach=False, **kw)
    for q, (m, v), s in zip(theirs, moments, steps):
        opt.state[q] = {"step": torch.tensor(float(s)), "exp_avg": m.clone().view(q.shape),
                        "exp_avg_sq": v.clone().view(q.shape)}
    return theirs, opt


@pytest.mark.parametrize("saved", ["int8", "bf16"])
def test_a_compact_state_continues_in_an_fp32_cpuadam_from_its_decoded_moments(saved):
    """Element for element as an fp32 CPUAdam given the decoded moments (ops.state_to_fp32), and
    as torch.optim.AdamW from them within 1e-6 (the fp32 kernel's param was 1 ulp from torch's on
    one element of 300 in these runs; the moments matched)."""
    sizes = (0, 1, 255, 256, 257)
    params, opt = _trained(saved, sizes)
    moments = [ops.state_to_fp32({k: opt.state[p][k].reshape(-1) for k in KEYS if k in opt.state[p]})
               for p in params]
    mine, exact = _clone(params), _clone(params)
    fp32 = CPUAdam(mine, lr=1e-2, state_dtype="fp32")
    fp32.load_state_dict(opt.state_dict())
    ref = CPUAdam(exact, lr=1e-2, state_dtype="fp32")
    for q, (m, v) in zip(exact, moments):
        ref.state[q] = {"step": torch.tensor(2.0), "exp_avg": m.view(q.shape), "exp_avg_sq": v.view(q.shape)}
    theirs, adamw = _torch_adamw_from(params, moments, [2] * len(sizes), lr=1e-2, weight_decay=0.0)
    for o, ps in ((fp32, mine), (ref, exact), (adamw, theirs)):
        _run(o, ps, 3, seed=9)
    for a, b, c in zip(mine, exact, theirs):
        assert torch.equal(a, b) and _same(fp32.state[a], ref.state[b])
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(fp32.state[a]["exp_avg_sq"], adamw.state[c]["exp_avg_sq"], rtol=1e-6, atol=0)


def _int8_state_dict_from(moments, steps, lr):
    """An int8 CPUAdam state dict holding ``moments`` converted as the documented load does."""
    state = {}
    for i, ((m, v), s) in enumerate(zip(moments, steps)):
        st = ops.state_from_fp32(m.reshape(-1), v.reshape(-1), "int8")
        state[i] = {"step": torch.tensor(float(s)), "exp_avg_codes": st["exp_avg"].view(m.shape),
                    "exp_avg_sq_codes": st["exp_avg_sq"].view(m.shape), "exp_avg_scale": st["exp_avg_scale"],
                    "exp_avg_sq_scale": st["exp_avg_sq_scale"], "int8_codes": ops.INT8_CODES}
    return {"state": state, "param_groups": [{"params": list(range(len(moments))), "lr": lr, "betas": (0.9, 0.999),
                                               "eps": 1e-8, "weight_decay": 0.0, "adamw_mode": True}]}


@pytest.mark.parametrize("saved", ["fp32", "bf16", "adamw"])
def test_another_kind_continues_in_an_int8_cpuadam_as_its_moments_quantized(saved):
    """fp32/bf16 CPUAdam or torch.optim.AdamW state -> int8 CPUAdam: the next step runs on the
    moments quantized to nearest (ops.state_from_fp32), element for element."""
    sizes = (0, 1, 255, 256, 257)
    params = _params(sizes)
    if saved == "adamw":
        src = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, foreach=False)
    else:
        src = CPUAdam(params, lr=1e-2, state_dtype=saved)
    _run(src, params, 2)
    moments = [(src.state[p]["exp_avg"].float(), src.state[p]["exp_avg_sq"].float()) for p in params]
    mine, ref_params = _clone(params), _clone(params)
    int8 = CPUAdam(mine, lr=1e-2, state_dtype="int8")
    int8.load_state_dict(src.state_dict())
    ref = CPUAdam(ref_params, lr=1e-2, state_dtype="int8")
    ref.load_state_dict(_int8_state_dict_from(moments, [2] * len(sizes), 1e-2))
    _run(int8, mine, 3, seed=9)
    _run(ref, ref_params, 3, seed=9)
    for a, b in zip(mine, ref_params):
        assert torch.equal(a, b)
        assert _same(int8.state[a], ref.state[b])


def test_int8_to_adamw_and_back_continues_from_adamws_moments():
    sizes = (0, 1, 255, 256, 257)
    params, opt = _trained("int8", sizes)
    theirs = _clone(params)
    adamw = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    adamw.load_state_dict(CPUAdam.to_torch_state_dict(opt.state_dict()))
    _run(adamw, theirs, 2, seed=4)
    back_params, ref_params = _clone(theirs), _clone(theirs)
    back = CPUAdam(back_params, lr=1e-2, state_dtype="int8")
    back.load_state_dict(adamw.state_dict())
    moments = [(adamw.state[p]["exp_avg"], adamw.state[p]["exp_avg_sq"]) for p in theirs]
    ref = CPUAdam(ref_params, lr=1e-2, state_dtype="int8")
    ref.load_state_dict(_int8_state_dict_from(moments, [4] * len(sizes), 1e-2))
    _run(back, back_params, 2, seed=6)
    _run(ref, ref_params, 2, seed=6)
    for a, b in zip(back_params, ref_params):
        assert torch.equal(a, b) and _same(back.state[a], ref.state[b])


def test_mixed_groups_save_load_and_convert_per_group():
    """One group int8, one bf16, one fp32 with other hyper-parameters: the load continues bit for
    bit, and to_torch_state_dict gives each param fp32 moments in its shape."""
    sizes = (257, 1, 256, 0, 255, 3)

    def groups(ps):
        return [{"params": ps[:2], "state_dtype": "int8"}, {"params": ps[2:4], "state_dtype": "bf16"},
                {"params": ps[4:], "state_dtype": "fp32", "lr": 3e-3, "betas": (0.8, 0.99)}]
    whole = _params(sizes)
    ref = CPUAdam(groups(whole), lr=1e-2)
    _run(ref, whole, 5)
    first = _params(sizes)
    opt = CPUAdam(groups(first), lr=1e-2)
    _run(opt, first, 3)
    second = _clone(first)
    fresh = CPUAdam(groups(second), lr=9.0)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # the grads _run gave the first three steps
        [torch.randn(p.shape, generator=gen) for p in first]
    for _ in range(2):
        for p, q in zip(second, whole):
            p.grad = torch.randn(p.shape, generator=gen)
        fresh.step()
    for a, b in zip(whole, second):
        assert torch.equal(a, b) and _same(ref.state[a], fresh.state[b])
    converted = CPUAdam.to_torch_state_dict(fresh.state_dict())
    for pid, p in enumerate(second):
        st = converted["state"][pid]
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == p.shape


def test_a_group_added_after_a_load_starts_fresh_beside_the_loaded_ones():
    params, opt = _trained("int8", (257, 3))
    mine = _clone(params)
    fresh = CPUAdam(mine, lr=1e-2, state_dtype="int8")
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    extra = _params((0, 256, 1), seed=3)
    fresh.add_param_group({"params": extra, "state_dtype": "int8"})
    gen = torch.Generator().manual_seed(2)
    for p, q in zip(params, mine):
        p.grad = q.grad = torch.randn(p.shape, generator=gen)
    for p in extra:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    fresh.step()
    for a, b in zip(params, mine):  # the loaded params continue as the original optimizer
        assert torch.equal(a, b) and _same(opt.state[a], fresh.state[b])
    for p in extra:
        st = fresh.state[p]
        assert st["step"].item() == 1 and st["exp_avg"].dtype == torch.int8 and st["exp_avg"].shape == p.shape
    again = CPUAdam([{"params": _clone(mine)}, {"params": _clone(extra)}], state_dtype="int8")
    again.load_state_dict(fresh.state_dict())


LIVE_BAD = {  # a hand edit of param 1's state in the optimizer itself (no load): (mutation, error, message)
    "exp_avg code -128": (_poke("exp_avg", 0, -128), ValueError, r"exp_avg has code -128, outside \[-120, 120\]"),
    "exp_avg code 121": (_poke("exp_avg", 5, 121), ValueError, r"exp_avg has code 121, outside \[-120, 120\]"),
    "exp_avg_sq code 249": (_poke("exp_avg_sq", 2, 249), ValueError, r"exp_avg_sq has code 249, outside \[0, 248\]"),
    "exp_avg_sq code 255": (_poke("exp_avg_sq", 0, 255), ValueError, r"exp_avg_sq has code 255, outside \[0, 248\]"),
    "uint8 exp_avg codes": (_set("exp_avg", torch.zeros(6, dtype=torch.uint8)), TypeError, "exp_avg must have dtype"),
    "float exp_avg codes": (_set("exp_avg", torch.zeros(6)), TypeError, "exp_avg_sq must be float32"),
    "codes of another shape": (lambda st: st.__setitem__("exp_avg", st["exp_avg"].view(2, 3)), ValueError,
                               r"exp_avg has shape \(2, 3\), expected the param's \(6,\)"),
    "meta codes": (lambda st: st.__setitem__("exp_avg", st["exp_avg"].to("meta")), ValueError,
                   "exp_avg is on the meta device"),
    "long scales": (_set("exp_avg_scale", torch.zeros(2)), ValueError, "exp_avg_scale has 2 elements, expected 1"),
    "negative scale": (_poke("exp_avg_sq_scale", 0, -1.0), ValueError, "exp_avg_sq_scale has negative or NaN"),
    "code map as a string": (_set("int8_codes", "2"), ValueError, "code map '2'"),
    "step past the kernel's count": (_set("step", torch.tensor(1e19)), ValueError, r"step must be .* < 2\*\*53"),
    "uint8 step": (_set("step", torch.tensor(255, dtype=torch.uint8)), TypeError, "step .*uint8"),
}


@pytest.mark.parametrize("case", sorted(LIVE_BAD))
def test_a_hand_edited_compact_state_is_refused_at_the_next_step_and_changes_nothing(case):
    """A review: the pre-step check looked at the moments' dtypes and sizes only, so an int8 state edited in the
    optimizer (not through load_state_dict, which refused the same damage) stepped: a code of -128 or above the top
    code decoded past its block's absmax, a string code map was decoded with the old map, a step count past the
    kernel's stopped the step after the params before it were updated. Now refused, naming the param and the field,
    before anything changes (param 0, stepped before param 1, included)."""
    mutate, error, message = LIVE_BAD[case]
    params, opt = _trained()
    mutate(opt.state[params[1]])
    gen = torch.Generator().manual_seed(7)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    before = _snapshot(opt)
    with pytest.raises(error, match=rf"CPUAdam state of param 1 \(shape \(6,\)\): .*{message}"):
        opt.step()
    assert _same(_snapshot(opt), before)


def test_a_state_is_checked_whole_only_after_an_edit(monkeypatch):
    """The whole check (a pass over every code) runs for a state edited since its last step, not at every step."""
    from hf_zero_offload.adam import state_dict as sdict
    params, opt = _trained()
    calls = []
    real = sdict.check_saved_state
    monkeypatch.setattr(sdict, "check_saved_state", lambda *a, **k: (calls.append(a[2]), real(*a, **k)))
    _run(opt, params, 2, seed=3)
    assert calls == []
    opt.state[params[1]]["exp_avg"].view(-1)[0] = 3  # a valid code, written in place
    _run(opt, params, 2, seed=4)
    assert calls == [1]
    fresh = CPUAdam(_clone(params), lr=1e-2, state_dtype="int8")
    fresh.load_state_dict(opt.state_dict())  # (checked by the load: not again at the step)
    calls.clear()
    _run(fresh, [p for g in fresh.param_groups for p in g["params"]], 1, seed=5)
    assert calls == []
