"""Hyper-parameters that pass as Python floats but are not what the fp32 kernel computes with (ops/hparams.py).

The kernel's per-step constants are fp32 (csrc/adam_scalar.cpp ``make_adam_args``): ``lr=1e300`` made an inf step
size (every param NaN after one step; torch.optim.AdamW's step raises there) and ``eps=1e-320`` an eps of 0, without
a word, and a bf16 tensor lr stepped 1.15e-3 off torch's (torch forms the step size and the decay in bf16). Now each
is refused by name, at construction, at a hand edit or an LR scheduler's value between steps (the refused step changes
nothing), in the ds_config and the TrainingArguments; values that only round compute what torch computes.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_zero_offload import CPUAdam, ops
from hf_zero_offload.config import ArgsView, ConfigError, resolve
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

KINDS = ("cpu_adam", "offload", "offload-dpu")
BF16 = torch.bfloat16
BAD = [  # (group values, the key and value the error names)
    (dict(lr=1e300), r"lr=1e\+300 overflows float32"),
    (dict(lr=10**400), r"lr=10000000000000000000\.\.\. \(401 digits\) overflows float32"),
    (dict(lr=1e38), r"lr=1e\+38 makes the step size lr / \(1 - beta1\^t\) = [0-9.e+]+ at step [13]"),
    (dict(eps=1e-320), r"eps=1e-320 is 0 in float32"),
    (dict(eps=1e39), r"eps=1e\+39 overflows float32"),
    (dict(weight_decay=1e39), r"weight_decay=1e\+39 overflows float32"),
    (dict(lr=100.0, weight_decay=1e37), r"weight_decay=1e\+37 with lr=100.0 makes the decay 1 - lr \* weight_decay"),
    (dict(lr=torch.tensor(1e-2, dtype=BF16)), "lr is a bfloat16 tensor: torch.optim.AdamW computes the step size"),
    (dict(weight_decay=torch.tensor(0.1, dtype=torch.float16)), "weight_decay is a float16 tensor"),
    (dict(betas=(torch.tensor(0.9, dtype=BF16), torch.tensor(0.99))), "beta1 is a bfloat16 tensor"),
]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _make(kind, model, **kw):
    kw = {"lr": 1e-2, "weight_decay": 0.1, **kw}
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), foreach=False, **kw)
    if kind == "cpu_adam":
        return CPUAdam(model.parameters(), num_threads=1, **kw)
    dpu = {"dpu": True, "dpu_warmup_steps": 1} if kind == "offload-dpu" else {}
    return OffloadAdam(model.named_parameters(), options=OffloadOptions(num_threads=1, **dpu), **kw)


def _steps(model, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("values, match", BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_values_the_fp32_step_cannot_take_are_refused_by_name_and_change_nothing(kind, values, match):
    with pytest.raises(ValueError, match=match):
        _make(kind, _model(), **values)
    model = _model()
    opt = _make(kind, model)
    _steps(model, opt, 2)
    good = {k: opt.param_groups[0][k] for k in values}
    params, state = copy.deepcopy(list(model.parameters())), copy.deepcopy(opt.state_dict())
    opt.param_groups[0].update(values)  # a hand edit between steps (or a scheduler's value), as torch allows
    model(torch.randn(4, 6)).pow(2).mean().backward()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    opt.param_groups[0].update(good)
    assert _same(opt.state_dict(), state)  # moments, masters, step counts
    opt.step()  # the same gradients, once the value is put back


MATCHING = [  # values that only round, or an edge of the range: torch computes something finite, and so do we
    dict(lr=1e-50), dict(eps=1e-40), dict(eps=0.0), dict(betas=(0.0, 0.0)), dict(betas=(1 - 1e-10, 1 - 1e-10)),
    dict(lr=0.05, weight_decay=30.0),  # a negative decay 1 - lr * weight_decay
    dict(lr=torch.tensor(1e-2)), dict(lr=torch.tensor(1e-2, dtype=torch.float64)),
    dict(betas=(torch.tensor(0.9), torch.tensor(0.99))),
    dict(eps=torch.tensor(1e-8, dtype=BF16)),  # (torch adds its value: no arithmetic in bf16)
]


@pytest.mark.parametrize("kind", ["cpu_adam", "offload"])
@pytest.mark.parametrize("values", MATCHING, ids=[str(i) for i in range(len(MATCHING))])
def test_values_that_only_round_compute_what_adamw_computes(kind, values):
    ref, model = _model(), _model()
    _steps(ref, _make("torch", ref, **values), 3)
    _steps(model, _make(kind, model, **values), 3)
    for a, b in zip(model.parameters(), ref.parameters()):
        # the kernel's rounding against torch's (its sqrt; fp32 tensor betas: bias corrections in fp32, 1.2e-7 here)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_a_scheduler_that_overflows_fp32_mid_run_is_refused_at_that_step(kind):
    model = _model()
    opt = _make(kind, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 2 else 1e300)
    for _ in range(2):
        _steps(model, opt, 1)
        sched.step()
    params = copy.deepcopy(list(model.parameters()))
    model(torch.randn(4, 6)).pow(2).mean().backward()
    with pytest.raises(ValueError, match=r"param group 0: lr=1[.0-9]*e\+298 overflows float32"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


@pytest.mark.parametrize("kind", ["cpu_adam", "offload"])
def test_an_lr_only_step_one_could_not_take_is_taken_at_a_later_step(kind):
    # lr / (1 - beta1^t): 5e38 at step 1 (refused), 1.85e38 at step 3, which torch's AdamW takes and so do we
    ref, model = _model(), _model()
    opts = [_make("torch", ref, weight_decay=0.0), _make(kind, model, weight_decay=0.0)]
    with pytest.raises(ValueError, match=r"lr=5e\+37 makes the step size .* at step 1"):
        _make(kind, _model(), lr=5e37)
    for m, opt in zip((ref, model), opts):
        _steps(m, opt, 2)
        opt.param_groups[0]["lr"] = 5e37
        _steps(m, opt, 1, seed=2)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("how", ["cpu_adam", "state_dict", "checkpoint", "torch"])
def test_a_state_stepped_at_such_an_lr_resumes(how, tmp_path):
    """The load checked its values at step 1: the run's own state dict, checkpoint or torch AdamW's state (lr 5e37
    from step 3) was refused at the resume; now it loads and steps as torch's AdamW goes on. (A linear loss of one
    Linear and eps 1e30: gradients that do not grow with the params, steps of ~1e7 that stay finite.)"""
    kind, hyper = "cpu_adam" if how == "cpu_adam" else "offload", dict(weight_decay=0.0, eps=1e30)
    ref, model, resumed = (nn.Linear(6, 3) for _ in range(3))
    model.load_state_dict(ref.state_dict())
    resumed.load_state_dict(ref.state_dict())
    ref_opt, opt, new = _make("torch", ref, **hyper), _make(kind, model, **hyper), _make(kind, resumed, **hyper)

    def steps(m, o, seeds):
        for seed in seeds:
            (m(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))).sum() * 0.1).backward()
            o.step()
            o.zero_grad()
            o.param_groups[0]["lr"] = 5e37  # (from step 3)
    for m, o in ((ref, ref_opt), (model, opt)):
        steps(m, o, [1, 2, 3])
    resumed.load_state_dict(model.state_dict())
    if how == "checkpoint":
        opt.save_checkpoint(str(tmp_path))
        new.load_checkpoint(str(tmp_path))
    elif how == "torch":
        new.load_torch_state_dict(ref_opt.state_dict())
    else:
        new.load_state_dict(opt.state_dict())
    for m, o in ((ref, ref_opt), (resumed, new)):
        steps(m, o, [4])
    for a, b in zip(resumed.parameters(), ref.parameters()):
        assert torch.isfinite(b).all() and b.abs().max() > 1e6
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)


def test_the_kernel_call_checks_the_step_size_of_its_own_step():
    """``ops.adam_step`` knows the step: lr=1e38 overflows the step size at step 1 (beta1 0.9), not at step 100."""
    n = 8
    arrays = lambda: [torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n)]  # noqa: E731
    with pytest.raises(ValueError, match=r"= 1e\+39 at step 1 \(beta1=0.9\)"):
        ops.adam_step(*arrays(), step=1, lr=1e38)
    with pytest.raises(ValueError, match=r"= 1e\+39 at step 1 \(beta1=0.9\)"):  # (CPUAdam: the first step, always)
        CPUAdam([nn.Parameter(torch.ones(2))], lr=1e38)
    p, g, m, v = arrays()
    ops.adam_step(p, g, m, v, step=100, lr=1e38)
    assert torch.isfinite(p).all()
    # Adam's L2 mode forms no decay 1 - lr * weight_decay: taken there, refused in AdamW's
    CPUAdam([nn.Parameter(torch.ones(2))], lr=1e20, weight_decay=1e20, adamw_mode=False)
    with pytest.raises(ValueError, match=r"weight_decay=1e\+20 with lr=1e\+20 makes the decay"):
        CPUAdam([nn.Parameter(torch.ones(2))], lr=1e20, weight_decay=1e20)


CONFIG = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "train_micro_batch_size_per_gpu": 1}


@pytest.mark.parametrize("blocks, match", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e300}}}, r"optimizer\.params\.lr: lr=1e\+300 overflows"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-320}}}, r"optimizer\.params\.eps: eps=1e-320 is 0 in"),
    ({"optimizer": {"type": "Adam", "params": {"weight_decay": 1e39}}}, r"optimizer\.params\.weight_decay: weight_"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e300, "total_num_steps": 10}}},
     r"scheduler\.params\.warmup_max_lr: lr=1e\+300 overflows"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e39}}},  # (no optimizer block)
     r"scheduler\.params\.warmup_max_lr: lr=1e\+39 overflows"),
])
def test_a_ds_config_value_the_step_cannot_take_is_named_with_its_key(blocks, match):
    with pytest.raises(ConfigError, match=r"<dict>: " + match):
        resolve({**CONFIG, **blocks})


@pytest.mark.parametrize("arg, value, match", [("learning_rate", 1e300, r"--learning_rate 1e\+300: lr=1e\+300"),
                                               ("adam_epsilon", 1e-320, r"--adam_epsilon 1e-320: eps=1e-320 is 0"),
                                               ("learning_rate", 1e38, r"--learning_rate 1e\+38: lr=1e\+38 makes")])
def test_a_training_argument_the_step_cannot_take_is_named_as_the_flag(arg, value, match):
    auto = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": "auto"}}}
    for cfg in (CONFIG, {**CONFIG, **auto}):  # the engine's values from the arguments, or "auto" taking them
        with pytest.raises(ConfigError, match=match):
            resolve(cfg, ArgsView(**{arg: value}))
