"""The gradient norm summed as the gradients land (engine/landed_norms.py): a sum voided by a later write of one of
its params, never counted stale; the engine's norm and clipping equal torch's when the micro-batches of a step
touch different params (so the store ranges summed in one micro-batch are written in part by the next)."""
from __future__ import annotations

import pytest
import torch

from _engine_pair import assert_models_close, make_pair
from _models import batches, loss_fn
from hf_zero_offload.engine.landed_norms import LandedNorms


def test_a_range_written_again_in_part_is_voided_and_its_other_params_missing():
    n = LandedNorms(4)
    n.landed([0, 1], 5.0)
    n.landed([2], 7.0)
    assert n.total([True, True, True, False]) == (12.0, [])
    n.landed([1], 2.0)  # param 1 again: the sum over 0 and 1 no longer holds; param 0 needs its own pass
    assert n.total([True, True, True, False]) == (9.0, [0])
    assert n.total([False, False, False, True]) == (0.0, [3])  # never written in this window
    n.reset()
    assert n.total([True, False, False, False]) == (0.0, [0])


@pytest.mark.parametrize("gas", [3, 1], ids=["gas3", "gas1"])
def test_norm_and_clipping_when_micro_batches_touch_different_params(mode, gas):
    """Three micro-batches per step, the branch used in some of them only (ranges over the branch and its neighbours
    written again in part), clipped at 0.05: norms and params as torch AdamW + clip_grad_norm_ on the sum. gas=1: the
    three backward passes summed into one step all the same (fp32 model: an fp32 store)."""
    ref_model, ref, model, opt = make_pair(mode, max_grad_norm=0.05, gradient_accumulation_steps=gas)
    uses = [(True, False, True), (False, True, True), (True, True, False), (False, False, True)]
    for (ids, labels, _), branch in zip(mode.data(batches(4, batch=3)), uses):
        for m in (ref_model, model):
            for i, b in enumerate(branch):
                (loss_fn(m, ids[i:i + 1], labels[i:i + 1], b) / 3).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05).item()
        ref.step()
        ref.zero_grad()
        assert opt.grad_norm() == pytest.approx(norm, rel=1e-5)
        opt.step()
        opt.zero_grad()
        assert norm > 0.05  # clipping was active
    mode.sync()
    assert_models_close(ref_model, model, rtol=1e-5, atol=1e-6)
