"""The caller's param group dicts, as torch.optim keeps them: the optimizer's group is the dict given (filled with the
defaults, its params listed), for CPUAdam and the engines as for torch.optim.AdamW. The listed-twice check copied
each group, so ``opt.param_groups[0] is group`` no longer held, and a refused generator's params were read and lost."""
from __future__ import annotations

import pytest
import torch

from _models import TinyNet
from hf_zero_offload import CPUAdam
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

KINDS = {"AdamW": lambda g: torch.optim.AdamW(g, foreach=False), "CPUAdam": CPUAdam,
         "OffloadAdam": lambda g: OffloadAdam(g, options=OffloadOptions(num_threads=1))}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("torch_way", [False, True], ids=["plain", "decoupled_weight_decay"])
def test_the_optimizers_group_is_the_callers_dict(kind, torch_way):
    ps = [p for p in TinyNet().parameters() if p.requires_grad]
    groups = [{"params": iter(ps[:2]), "lr": 0.5, **({"decoupled_weight_decay": False} if torch_way else {})},
              {"params": (p for p in ps[2:])}]
    opt = KINDS[kind](groups)
    for given, held in zip(groups, opt.param_groups):
        assert held is given
    assert groups[0]["params"] == ps[:2] and groups[1]["params"] == ps[2:]
    groups[0]["lr"] = 0.25  # torch's: an edit of the caller's dict is the optimizer's
    assert opt.param_groups[0]["lr"] == 0.25
    getattr(opt, "close", lambda: None)()


@pytest.mark.parametrize("kind", ["CPUAdam", "OffloadAdam"])
def test_a_refused_generator_leaves_its_params_listed_in_the_callers_dict(kind):
    ps = [p for p in TinyNet().parameters() if p.requires_grad]
    group = {"params": (p for p in [ps[0], ps[1], ps[0]])}
    with pytest.raises(ValueError, match="param 0 of group 0 and param 2 of group 0 are the same tensor"):
        KINDS[kind]([group])
    assert group["params"] == [ps[0], ps[1], ps[0]]
