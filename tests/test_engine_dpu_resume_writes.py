"""A state saved with a delayed step (DPU) in flight, resumed, then a param written before the first step: the write is
what the next step starts from, as in the uninterrupted run (a write during a delayed step keeps its values,
test_engine_dpu.py), whichever order the model's weights and the engine's state were loaded in. The model's weights of
the saved moment loaded after the engine's state are not such a write (the digests saved with the state tell them
apart). Compared element by element with the uninterrupted run given the same write at the same point."""
from __future__ import annotations

import copy

import pytest
import torch

from _engine_pair import LR, WD, engine, resume_and_train
from _models import TinyNet, batches, param_groups, run_steps
from hf_zero_offload.engine import OffloadAdam, OffloadOptions
from hf_zero_offload.engine.checkpoint import StateFileError

DIGESTS_KEY = "dpu_param_digests"  # (written_params.DIGESTS_KEY)
OPTIONS = OffloadOptions(num_threads=1, dpu=True, dpu_warmup_steps=2)


def _by_hand(model, earlier):
    with torch.no_grad():
        model.body[0].weight.mul_(0)  # on purpose: torch's next step starts from the zeros


def _other_weights(model, earlier):
    model.load_state_dict(earlier)  # weights other than the saved moment's


@pytest.mark.parametrize("engine_first", [True, False], ids=["engine-first", "model-first"])
@pytest.mark.parametrize("write", [_by_hand, _other_weights, None], ids=["by-hand", "other-weights", "none"])
def test_a_write_after_a_dpu_resume_is_what_the_next_step_starts_from(tmp_path, engine_first, write):
    data = batches(8)
    torch.manual_seed(0)
    model = TinyNet()
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OPTIONS)
    run_steps(model, opt, data[:3])
    earlier = copy.deepcopy(model.state_dict())
    run_steps(model, opt, data[3:5])
    assert opt.needs_publish
    weights = copy.deepcopy(model.state_dict())
    opt.save_checkpoint(str(tmp_path))
    if write is not None:  # during the delayed step in flight: the write is kept, that step's update of it dropped
        write(model, earlier)
    run_steps(model, opt, data[5:])
    opt.flush()
    opt.close()

    # the write after both loads (before the engine's, weights are published over, as DeepSpeed's load does)
    again, resumed = resume_and_train(weights, lambda e: e.load_checkpoint(str(tmp_path)), OPTIONS, data[5:],
                                      engine_first=engine_first,
                                      write=None if write is None else lambda m: write(m, earlier))
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), (name, (p - q).abs().max())
    resumed.close()


def test_a_flush_and_a_save_right_after_a_dpu_resume_keep_a_write(tmp_path):
    """A load, a write, then flush() without a step, or a save and a load of that save: the write is kept."""
    data = batches(6)
    torch.manual_seed(0)
    model = TinyNet()
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OPTIONS)
    run_steps(model, opt, data[:5])
    state, weights = opt.state_dict(), copy.deepcopy(model.state_dict())
    opt.close()
    again = TinyNet()
    resumed = OffloadAdam(param_groups(again, WD), lr=LR, options=OPTIONS)
    resumed.load_state_dict(state)
    again.load_state_dict(weights)
    _by_hand(again, None)
    resaved = resumed.state_dict()  # the write goes into the saved masters, as a save mid-delay does
    resumed.flush()
    assert again.body[0].weight.eq(0).all()
    assert not again.norm.weight.equal(weights["norm.weight"])  # the others took the step's update
    third = TinyNet()
    engine = OffloadAdam(param_groups(third, WD), lr=LR, options=OPTIONS)
    engine.load_state_dict(resaved)
    third.load_state_dict({**weights, "body.0.weight": weights["body.0.weight"] * 0})
    engine.flush()
    for (name, p), q in zip(again.named_parameters(), third.parameters()):
        assert torch.equal(p, q), name
    resumed.close()
    engine.close()


def test_damaged_digests_are_refused_by_name():
    torch.manual_seed(0)
    model = TinyNet()
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OPTIONS)
    run_steps(model, opt, batches(3))
    state = opt.state_dict()
    assert len(state[DIGESTS_KEY]) == len(opt._flat)
    opt.close()
    engine = OffloadAdam(param_groups(TinyNet(), WD), lr=LR, options=OPTIONS)
    with pytest.raises(StateFileError, match=DIGESTS_KEY):
        engine.load_state_dict({**state, DIGESTS_KEY: state[DIGESTS_KEY][:-1]})
    engine.close()


def test_a_write_after_a_dpu_resume_is_kept_on_the_stream_simulator(mode, tmp_path):
    """The same (engine first, an edit by hand) where copies land late (tests/_modes.py): the digests saved are those
    of the params the device holds (the publish's copies landed), not of what the host saw part way."""
    data = mode.data(batches(8))
    torch.manual_seed(0)
    model = mode.model(TinyNet())
    opt = engine(mode, model, dpu=True, dpu_warmup_steps=2)
    run_steps(model, opt, data[:5])
    opt.save_checkpoint(str(tmp_path))
    mode.sync()
    weights = copy.deepcopy(model.state_dict())
    for m, o in ((model, opt), (None, None)):
        if m is None:
            torch.manual_seed(1)
            m = mode.model(TinyNet())
            o = engine(mode, m, dpu=True, dpu_warmup_steps=2)
            o.load_checkpoint(str(tmp_path))
            m.load_state_dict(weights)
            again, resumed = m, o
        mode.host_write()
        _by_hand(m, None)
        run_steps(m, o, data[5:])
        o.flush()
        mode.sync()
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), (name, (p - q).abs().max())
    opt.close()
    resumed.close()


def test_a_bf16_runs_dpu_state_resumes_into_fp32_in_either_order(tmp_path):
    """A bf16 run's checkpoint resumed in fp32 (docs/CHECKPOINTS.md): its weights loaded after the engine's state hold
    the saved values in another dtype, which are no write either (the digests are of the values as fp32; of the
    bits as stored, they counted as a write and dropped the in-flight step's update, loaded after only)."""
    data = batches(7)
    torch.manual_seed(0)
    model = TinyNet().bfloat16()
    opt = OffloadAdam(param_groups(model, WD), lr=LR, options=OPTIONS)
    run_steps(model, opt, data[:5])
    weights = copy.deepcopy(model.state_dict())
    opt.save_checkpoint(str(tmp_path))
    opt.close()
    ends = []
    for engine_first in (True, False):
        again, resumed = resume_and_train(weights, lambda e: e.load_checkpoint(str(tmp_path)), OPTIONS, data[5:],
                                          engine_first=engine_first)
        ends.append([p.detach().clone() for p in again.parameters()])
        resumed.close()
    for a, b in zip(*ends):
        assert torch.equal(a, b), (a - b).abs().max()
