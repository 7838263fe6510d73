"""CPUAdam refuses what it cannot use before it changes anything: a foreign per-param state at
``load_state_dict`` (nothing loaded), a bad gradient at ``step`` (no param updated, no count moved)."""
from __future__ import annotations

import copy

import pytest
import torch

from hf_zero_offload import CPUAdam


def _trained(state_dtype="int8"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 2), torch.nn.Linear(2, 3))  # a weight of 600: 3 blocks
    opt = CPUAdam(model.parameters(), lr=1e-2, state_dtype=state_dtype)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 300)).square().mean().backward()
        opt.step()
    return model, opt


def _put(key, value):
    return lambda st: st.__setitem__(key, value)


# Each breaks the state of param 2 (the second Linear's weight); param 0 stays good, so a load
# that had started would have loaded it.
BAD = {
    "float codes": (lambda st: st.__setitem__("exp_avg_codes", st["exp_avg_codes"].float()), TypeError,
                    "exp_avg_sq must be float32"),
    "short codes": (lambda st: st.__setitem__("exp_avg_codes", st["exp_avg_codes"].reshape(-1)[:-1]), ValueError,
                    "exp_avg has 5 elements, expected 6"),
    "short sq codes": (lambda st: st.__setitem__("exp_avg_sq_codes", st["exp_avg_sq_codes"].reshape(-1)[:-1]),
                       ValueError,
                       "exp_avg_sq has 5 elements, expected 6"),
    "signed sq codes": (lambda st: st.__setitem__("exp_avg_sq_codes", st["exp_avg_sq_codes"].to(torch.int8)), TypeError,
                        "exp_avg_sq must have dtype"),
    "no scales": (lambda st: st.pop("exp_avg_scale"), ValueError, "exp_avg_scale is required"),
    "fp64 scales": (lambda st: st.__setitem__("exp_avg_scale", st["exp_avg_scale"].double()), TypeError,
                    "exp_avg_scale must have dtype float32"),
    "negative scale": (lambda st: st["exp_avg_sq_scale"].fill_(-1.0), ValueError, "negative or NaN entries"),
    "nan scale": (lambda st: st["exp_avg_sq_scale"].fill_(float("nan")), ValueError, "negative or NaN entries"),
    "code map 9": (_put("int8_codes", 9), ValueError, "code map 9"),
    "no exp_avg": (lambda st: st.pop("exp_avg_codes"), ValueError, "exp_avg is missing"),
    "no step": (lambda st: st.pop("step"), ValueError, "step is missing"),
    "negative step": (_put("step", torch.tensor(-3.0)), ValueError, "step must be a whole number >= 0"),
    "fractional step": (_put("step", torch.tensor(2.5)), ValueError, "step must be a whole number >= 0"),
    "nan step": (_put("step", float("nan")), ValueError, "step must be a whole number >= 0"),
    "short master": (_put("master", torch.zeros(5)), TypeError, "master must be float32 of 6 elements"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_foreign_state_is_refused_before_anything_loads(case):
    mutate, error, message = BAD[case]
    model, opt = _trained()
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    mutate(bad["state"][2])
    fresh = CPUAdam(copy.deepcopy(model).parameters(), lr=1e-2, state_dtype="int8")
    with pytest.raises(error, match=rf"optimizer state of param 2 \(shape \(3, 2\)\): .*{message}"):
        fresh.load_state_dict(bad)
    assert len(fresh.state) == 0
    fresh.load_state_dict(good)
    assert all(torch.equal(fresh.state[q]["exp_avg"], opt.state[p]["exp_avg"])
               for p, q in zip(model.parameters(), fresh.param_groups[0]["params"]))


@pytest.mark.parametrize("grad", ["int", "shape", "its param", "its moment"])
def test_a_refused_step_updates_no_param(grad):
    """A grad sharing memory with its param or its state was refused by the kernel call, after the params
    before it in the step were updated."""
    model, opt = _trained("fp32")
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    steps = [float(opt.state[p]["step"]) for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    # through .data: the only way past torch's own checks on assigning a grad
    error, match = TypeError, r"the grad of a \(3, 2\) param is"
    if grad in ("int", "shape"):
        params[2].grad.data = torch.ones(3, 2, dtype=torch.int32) if grad == "int" else torch.ones(6)
    else:
        shared = params[2].data if grad == "its param" else opt.state[params[2]]["exp_avg"]
        params[2].grad.data = shared.view(3, 2)
        error, match = ValueError, r"a \(3, 2\) param in group 0: (grad and \w+|\w+ and grad) share memory"
    with pytest.raises(error, match=match):
        opt.step()
    for p, b, s, m in zip(params, before, steps, moments):
        assert torch.equal(p, b) and float(opt.state[p]["step"]) == s and torch.equal(opt.state[p]["exp_avg"], m)


@pytest.mark.parametrize("key,value", [("lr", float("nan")), ("lr", -1e-3), ("lr", float("inf")),
                                       ("eps", -1.0), ("weight_decay", float("nan")), ("lr", torch.tensor(-1.0))])
def test_a_hyperparameter_gone_bad_is_refused_at_step(key, value):
    """A scheduler or a hand-edited group can set any value between steps: checked at every step
    (CPUAdam and the engines), before any param moves, naming the group and the key."""
    from _models import TinyNet, batches, loss_fn, param_groups
    from hf_zero_offload.engine import OffloadAdam, OffloadOptions

    model, opt = _trained("fp32")
    torch.manual_seed(0)
    tiny = TinyNet()
    engine = OffloadAdam(param_groups(tiny, 0.01), lr=1e-2, options=OffloadOptions(num_threads=1))
    ids, labels, use_branch = batches(1)[0]
    loss_fn(tiny, ids, labels, use_branch).backward()
    model(torch.randn(4, 300)).square().mean().backward()
    for o, params in ((opt, list(model.parameters())), (engine, list(tiny.parameters()))):
        o.param_groups[-1][key] = value
        before = [p.detach().clone() for p in params]
        with pytest.raises(ValueError, match=rf"param group {len(o.param_groups) - 1}: {key} must be a finite"):
            o.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert engine.global_steps == 0
    engine.close()
    with pytest.raises(ValueError, match="OffloadAdam param group 0: lr must be a finite number >= 0, got -1"):
        OffloadAdam(param_groups(tiny, 0.01), lr=-1, options=OffloadOptions(num_threads=1))


def _layouts():
    torch.manual_seed(3)
    base = torch.randn(2, 3, 4, 5)
    return {"transposed": lambda dt: base[0, 0].to(dt).t(),
            "channels_last": lambda dt: base.to(dt).to(memory_format=torch.channels_last),
            "strided slice": lambda dt: base.to(dt)[:, :, :, ::2]}


@pytest.mark.parametrize("layout", sorted(_layouts()))
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_non_contiguous_params_step_like_adamw(layout, pdtype):
    """A transposed, channels_last or sliced param (a view into a larger tensor) is updated where it
    lives, like torch.optim.AdamW's; it used to be refused half-way through a step, after the
    params before it had moved."""
    make = _layouts()[layout]
    first, p = torch.nn.Parameter(torch.ones(3, dtype=pdtype)), torch.nn.Parameter(make(pdtype))
    ref = [torch.nn.Parameter(first.detach().float().clone()), torch.nn.Parameter(make(pdtype).float())]
    strides = p.stride()
    assert not p.is_contiguous()
    opt = CPUAdam([first, p], lr=0.1, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for a, b in zip((first, p), ref):
            g = torch.randn(b.shape, generator=gen)
            a.grad, b.grad = g.to(pdtype), g.to(pdtype).float()
        opt.step()
        torch_opt.step()
    assert p.stride() == strides
    masters = [opt.state[q]["master"] for q in (first, p)] if pdtype != torch.float32 else [first, p]
    for got, want in zip(masters, ref):
        torch.testing.assert_close(got.detach().reshape(want.shape), want.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(p.detach(), masters[1].view(p.shape).to(pdtype))  # the 16-bit param: its master rounded


@pytest.mark.parametrize("kw,message", [
    (dict(lr=None), "lr must be a finite number >= 0, got None"),
    (dict(lr="1e-3"), "lr must be a finite number >= 0, got '1e-3'"),
    (dict(lr=float("nan")), "lr must be a finite number >= 0, got nan"),
    (dict(weight_decay=float("inf")), "weight_decay must be a finite number >= 0, got inf"),
    (dict(betas=(0.9,)), r"betas must be two numbers, got \(0.9,\)"),
    (dict(num_threads=0), r"num_threads must be a positive int .*got 0"),
])
def test_the_constructor_names_a_bad_argument(kw, message):
    """Refused when the optimizer is built, by name (it used to be an opaque TypeError or
    IndexError, or accepted until the first step)."""
    with pytest.raises(ValueError, match=message):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], **kw)


@pytest.mark.parametrize("group,error,message", [
    ({"params": [torch.nn.Parameter(torch.ones(4, dtype=torch.float64))]}, TypeError,
     r"param group 1: needs float32, bfloat16 or float16 parameters; got torch.float64 \(shape \(4,\)\)"),
    ({"params": [torch.nn.Parameter(torch.ones(4))], "state_dtype": "int4"}, ValueError,
     "param group 1: state_dtype must be one of fp32, bf16, int8; got 'int4'"),
    ({"params": [torch.nn.Parameter(torch.ones(4))], "lr": float("nan")}, ValueError,
     "param group 1: lr must be a finite number >= 0, got nan"),
    ({"params": [torch.nn.Parameter(torch.ones(4))], "adamw_mode": "false"}, TypeError,
     "param group 1: adamw_mode must be a bool, got 'false'"),
])
def test_add_param_group_refuses_a_bad_group_whole(group, error, message):
    """A group added after construction gets the constructor's checks; refused, it is not added,
    and the optimizer steps on as before."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = CPUAdam([p], lr=0.1)
    with pytest.raises(error, match=message):
        opt.add_param_group(group)
    assert len(opt.param_groups) == 1
    p.grad = torch.ones(4)
    opt.step()
    assert torch.allclose(p, torch.full((4,), 0.9))


@pytest.mark.parametrize("change", ["resized", "float64"])
def test_a_param_replaced_since_its_last_step_is_refused_before_any_update(change):
    """``p.data`` replaced by a tensor of another size or dtype: the step is refused, naming it,
    before any param moves (it used to fail half-way, after the params before it were updated)."""
    model, opt = _trained("fp32")
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    new = torch.ones(7) if change == "resized" else torch.ones(2, dtype=torch.float64)
    params[3].data, params[3].grad = new, torch.ones_like(new)
    before = [p.detach().clone() for p in params]
    with pytest.raises((TypeError, ValueError), match="exp_avg has 3 elements, expected 7" if change == "resized"
                       else r"got torch.float64 \(shape \(2,\)\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("moment_dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
def test_adamw_state_of_fp16_or_fp64_params_loads(moment_dtype):
    """torch.optim.AdamW over fp16 (or fp64) params keeps its moments in that dtype; loaded into
    CPUAdam they are read as fp32 (as torch casts them for an fp32 param) instead of refused."""
    torch.manual_seed(0)
    w = torch.randn(4, 5).to(moment_dtype)
    theirs = torch.nn.Parameter(w.clone())
    ref = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.0, foreach=False)
    for _ in range(2):
        theirs.grad = torch.randn(4, 5).to(moment_dtype)
        ref.step()
    pdtype = torch.float16 if moment_dtype == torch.float16 else torch.float32
    mine = torch.nn.Parameter(theirs.detach().to(pdtype))
    opt = CPUAdam([mine], lr=1e-2)
    saved = ref.state_dict()
    opt.load_state_dict(saved)
    assert saved["state"][0]["exp_avg"].dtype == moment_dtype  # the caller's dict is left as it was
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state[mine][k], saved["state"][0][k].float())
    mine.grad = torch.ones(4, 5, dtype=pdtype)
    opt.step()
    assert float(opt.state[mine]["step"]) == 3.0


@pytest.mark.parametrize("bad", [None, {}, {"state": [], "param_groups": []}, {"state": {}, "param_groups": [{}]},
                                 {"state": {0: [1]}, "param_groups": [{"params": [0]}]}])
def test_a_state_dict_of_the_wrong_outline_names_what_it_expected(bad):
    opt = CPUAdam([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match=r"expected an optimizer state dict|optimizer state of param 0: expected a dict"):
        opt.load_state_dict(bad)
    assert len(opt.state) == 0


@pytest.mark.parametrize("pdtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_16bit_param_written_between_steps_is_kept(pdtype):
    """model.load_state_dict (or an in-place edit) after a step: the next step starts from the new
    weights; it used to step from the fp32 master and put the old weights back. A write of the
    master's own rounding (the model's weights loaded after the optimizer state) keeps the master."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300).to(pdtype))
    opt = CPUAdam([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    opt.step()
    master = opt.state[p]["master"].clone()
    new = torch.randn(300).to(pdtype)
    with torch.no_grad():
        p.copy_(new)
    opt.param_groups[0]["lr"] = 0.0  # a step that moves nothing
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(p.detach(), new) and torch.equal(opt.state[p]["master"], new.float())
    with torch.no_grad():  # the master's rounding written back: nothing of the master is lost
        opt.state[p]["master"].copy_(master)
        p.copy_(master.to(pdtype))
    opt.step()
    assert torch.equal(opt.state[p]["master"], master)


def test_an_fp32_param_drops_a_master_saved_by_16bit_training():
    """The fp32 param is its own master: one loaded from 16-bit training went stale as it trained
    and was saved again, so a later load into 16-bit params stepped from the old weights."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = CPUAdam([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    q = torch.nn.Parameter(p.detach().float())
    fp32 = CPUAdam([q], lr=0.1)
    fp32.load_state_dict(opt.state_dict())
    q.grad = torch.ones_like(q)
    fp32.step()
    assert "master" not in fp32.state[q] and "master" not in fp32.state_dict()["state"][0]


def test_a_pickled_optimizer_steps_on(tmp_path):
    """torch.save(optimizer) / torch.load: torch.optim pickles defaults, state and groups only, so
    the loaded CPUAdam lost num_threads and failed at its first step with an AttributeError."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = CPUAdam([p], lr=0.1, num_threads=1, state_dtype="int8")
    p.grad = torch.ones_like(p)
    opt.step()
    torch.save(opt, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=False)
    q = loaded.param_groups[0]["params"][0]
    q.grad = p.grad = torch.ones_like(p)
    opt.step()
    loaded.step()
    assert loaded.num_threads == 1 and torch.equal(q, p) and torch.equal(loaded.state[q]["master"], opt.state[p]["master"])
