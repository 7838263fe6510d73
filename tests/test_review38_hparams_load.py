"""A loaded state's hyper-parameters are checked as the next step checks them (engine/checkpoint/contents.py): with
the group's adamw_mode, and with the loading engine's own values where the saved group lacks a key. An Adam (L2,
adamw_mode=False) state whose lr * weight_decay overflows the AdamW decay 1 - lr * weight_decay (a constant Adam
never forms) was refused at load as "not written by hf_zero_offload (or is damaged)" while its step took it; the
TrainingArguments an "Adam" ds_config block takes were checked as AdamW's too (config/resolver.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero_offload.engine import OffloadAdam, OffloadOptions
from hf_zero_offload.engine.checkpoint.contents import StateFileError

L2 = dict(lr=10.0, weight_decay=1e38, adamw_mode=False)  # lr * weight_decay = 1e39: past fp32 only as AdamW's decay


def _run(model, engine, seeds):
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
        engine.step()
        engine.zero_grad()


def _engine(model, **kw):
    return OffloadAdam(model.named_parameters(), options=OffloadOptions(num_threads=1), **kw)


def _pair():
    torch.manual_seed(0)
    a = nn.Linear(4, 3)
    b = nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("drop_mode", [False, True])
def test_an_adam_state_the_step_takes_is_loaded_and_resumes_as_the_run_that_saved_it(drop_mode):
    a, b = _pair()
    ea, eb = _engine(a, **L2), _engine(b, **L2)
    _run(a, ea, [1])
    state = ea.state_dict()
    if drop_mode:  # a saved group without the key keeps the loading engine's own mode (Adam here)
        for g in state["param_groups"]:
            g.pop("adamw_mode", None)
    eb.load_state_dict(state)  # before: StateFileError "... makes the decay 1 - lr * weight_decay = -1e+39 ..."
    b.load_state_dict(a.state_dict())
    _run(a, ea, [2, 3])
    _run(b, eb, [2, 3])
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=0, atol=0, equal_nan=True)


def test_the_same_values_in_adamw_mode_are_refused_at_load_as_at_the_step():
    a, b = _pair()
    ea = _engine(a, **L2)
    _run(a, ea, [1])
    state = ea.state_dict()
    for g in state["param_groups"]:
        g["adamw_mode"] = True
    eb = _engine(b, lr=1e-3)
    with pytest.raises(StateFileError, match=r"param_groups\[0\]\.weight_decay=1e\+38 with lr=10\.0 makes the decay"):
        eb.load_state_dict(state)
    with pytest.raises(ValueError, match=r"weight_decay=1e\+38 with lr=10\.0 makes the decay"):
        _engine(nn.Linear(4, 3), **{**L2, "adamw_mode": True})


def test_the_arguments_an_adam_block_takes_are_checked_in_its_l2_mode():
    from hf_zero_offload.config import ArgsView, ConfigError, resolve
    block = {"type": "Adam", "params": {"lr": "auto", "weight_decay": "auto", "adam_w_mode": False}}
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer": block}
    args = ArgsView(learning_rate=L2["lr"], weight_decay=L2["weight_decay"])
    # before: "--weight_decay 1e+38: ... makes the decay 1 - lr * weight_decay", a constant this Adam never forms
    assert resolve(cfg, args).optimizer.adam_w_mode is False
    block["params"]["adam_w_mode"] = True
    with pytest.raises(ConfigError, match=r"--weight_decay 1e\+38: weight_decay=1e\+38 with lr=10\.0 makes the decay"):
        resolve(cfg, args)
