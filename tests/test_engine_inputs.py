"""The engines against inputs a torch.optim user (or test suite) hands any optimizer at construction and load:
options out of range, float64 or meta-device params, groups added later, state dicts and directories of the wrong
kind, saved groups. Each is refused by name before anything changes, or behaves as torch.optim does (the params:
test_engine_inputs_params.py; the gradients: test_engine_inputs_grads.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from _models import TinyNet, param_groups
from _engine_inputs import KINDS, _backward, _engine
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardOptions


@pytest.mark.parametrize("field,value", [("gradient_accumulation_steps", 0), ("max_grad_norm", float("nan")),
                                         ("max_grad_norm", -1.0), ("bucket_numel", 0), ("tile_numel", -1),
                                         ("dpu_warmup_steps", -1), ("num_threads", 0), ("bucket_numel", 2.5)])
def test_options_out_of_range_are_refused_by_name(field, value):
    """They used to be clamped or read as "off" (a nan clipping norm: no clipping) without a word."""
    with pytest.raises(ValueError, match=f"OffloadOptions.{field} must be"):
        OffloadOptions(**{field: value})
    with pytest.raises(ValueError, match="ShardOptions.allgather_bucket_numel must be an int >= 1, got 0"):
        ShardOptions(allgather_bucket_numel=0)


@pytest.mark.parametrize("cls,field,value", [
    (OffloadOptions, "dpu", "false"), (OffloadOptions, "pin_memory", "false"), (OffloadOptions, "dpu", 1),
    (OffloadOptions, "scatter_thread", "no"), (ShardOptions, "offload", "false"), (ShardOptions, "reduce_scatter", 0),
])
def test_option_switches_take_bools_only(cls, field, value):
    """bool("false") is True: OffloadOptions(dpu="false") ran the delayed update (0.010 off a plain run after 5 steps,
    in an outside probe) and ShardOptions(offload="false") chose the offload engine, without a word."""
    with pytest.raises(TypeError, match=f"{cls.__name__}.{field} must be True or False.*got {value!r}"):
        cls(**{field: value})
    assert cls(**{field: np.bool_(False)}).__getattribute__(field) is False  # numpy's bool is a bool
    assert OffloadOptions(scatter_thread=None).scatter_thread is None


@pytest.mark.parametrize("kind", ["offload", "zero2"])
def test_options_may_be_a_dict_of_their_fields(kind):
    """options={"dpu": True} (a ds_config's habit) failed inside the build with "'dict' object has no attribute
    'state_dtype'", which named neither the argument nor what it takes; now a dict of OffloadOptions' fields is taken,
    checked as OffloadOptions checks them, and anything else is refused by name."""
    cls, extra = KINDS[kind]
    opt = cls(TinyNet().named_parameters(), options={"dpu": kind == "offload", "num_threads": 1}, **extra)
    assert opt.options == OffloadOptions(dpu=kind == "offload", num_threads=1)
    opt.close()
    for bad, named in (({"dpuu": True}, r"options has unknown field\(s\) dpuu; OffloadOptions' fields are "),
                       ({"dpu": "false"}, "OffloadOptions.dpu must be True or False"),
                       ([("dpu", True)], r"options must be an OffloadOptions \(hf_zero_offload.engine.OffloadOptions\) "
                                         "or a dict of its fields, got list")):
        with pytest.raises(TypeError, match=named):
            cls(TinyNet().named_parameters(), options=bad, **extra)


@pytest.mark.parametrize("stage", [2.0, True, 3, -1, "2"])
def test_shard_stage_is_0_1_or_2(stage):
    with pytest.raises(ValueError, match=f"ShardOptions.stage must be 0, 1 or 2.*got {stage!r}"):
        ShardOptions(stage=stage)
    assert ShardOptions(stage=np.int64(1)).stage == 1 and type(ShardOptions(stage=np.int64(1)).stage) is int


@pytest.mark.parametrize("fp16,err,named", [
    ({"enabled": "false"}, TypeError, r"OffloadOptions.fp16.enabled must be True or False, got 'false'"),
    ({"loss_scale": 0}, TypeError, r"OffloadOptions.fp16.enabled must be True or False, got 'nothing'"),
    (True, TypeError, r"OffloadOptions.fp16 must be None, a dict of fp16 fields \(enabled, loss_scale"),
    ({"enabled": True, "loss_scale": "x"}, ValueError, r"OffloadOptions.fp16.loss_scale must be 0 \(dynamic\)"),
    ({"enabled": True, "bogus": 1}, ValueError, r"OffloadOptions.fp16 has unknown field\(s\) bogus; the fields are enabled"),
])
def test_fp16_option_is_checked_by_field_at_construction(fp16, err, named):
    """{"enabled": "false"} turned fp16 on (the model cast to float16, then torch's dtype error at the forward);
    fp16=True failed in vars(), an unknown field in a keyword error naming neither the option nor the fields."""
    with pytest.raises(err, match=named):
        OffloadOptions(fp16=fp16)
    assert not OffloadOptions(fp16={"enabled": np.bool_(False)}).fp16_enabled
    import dataclasses
    import types

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        enabled: bool = True
        loss_scale: float = 0.0

    assert OffloadOptions(fp16=Slotted()).fp16_fields == {"enabled": True, "loss_scale": 0.0}
    assert OffloadOptions(fp16=types.MappingProxyType({"enabled": True})).fp16_enabled


def test_float64_params_are_refused_when_the_engine_is_built():
    """Not at the first step with a message about some gradient's dtype."""
    with pytest.raises(ValueError, match=r"train in float32, bfloat16 or float16; got torch.float64"):
        OffloadAdam(torch.nn.Linear(3, 4).double().parameters(), options=OffloadOptions(num_threads=1))


@pytest.mark.parametrize("kind", ["offload", "zero0"])
def test_add_param_group_after_construction_is_refused(kind):
    """The flat layout is fixed at construction: a group added later used to be accepted and never
    stepped."""
    model, engine = _engine(kind)
    extra = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(RuntimeError, match="add_param_group: the engine's flat layout"):
        engine.add_param_group({"params": [extra]})
    assert len(engine.param_groups) == 2
    engine.close()


def test_a_state_dict_or_directory_of_the_wrong_kind(tmp_path):
    model, engine = _engine()
    with pytest.raises(TypeError, match="load_state_dict: expected the dict its state_dict"):
        engine.load_state_dict(None)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="afile is a file"):
        engine.save_checkpoint(str(tmp_path / "afile"))
    engine.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_meta_device_params_are_refused_when_the_engine_is_built(kind):
    """OffloadAdam failed in torch ("Cannot copy out of meta tensor"); ZeRO-0 was built and failed at step()."""
    cls, extra = KINDS[kind]
    with torch.device("meta"):
        model = TinyNet()
    with pytest.raises(ValueError, match=r"a parameter of shape \(\d+, \d+\) is on the meta device \(not "
                                         r"materialised: init_empty_weights"):
        cls(param_groups(model, 0.01), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)


def test_a_saved_group_never_replaces_the_engines_params():
    """A state dict whose groups carry "params" (torch.optim's layout lists param ids there) was loaded into the
    live groups: the engine's params became ints and the next step failed with an AttributeError."""
    model, opt = _engine()
    _backward(model)
    opt.step()
    own = [list(g["params"]) for g in opt.param_groups]
    state = opt.state_dict()
    for i, g in enumerate(state["param_groups"]):
        g["params"] = list(range(i, i + 2))
    opt.load_state_dict(state)
    assert [g["params"] for g in opt.param_groups] == own
    _backward(model, 1)
    opt.step()
    opt.close()


@pytest.mark.parametrize("value, saved", [
    (np.float32(0.5), 0.5), (np.float64(0.25), 0.25), (torch.tensor(0.125), 0.125), (np.int64(3), 3),
    ((torch.tensor(0.9), np.float32(0.5)), [0.8999999761581421, 0.5]),
], ids=["np.float32", "np.float64", "tensor", "np.int64", "tuple-of-mixed"])
def test_group_values_a_step_takes_are_saved_as_numbers(tmp_path, value, saved):
    """A LambdaLR whose lambda returns numpy floats (NumPy 2), or a tensor lr, stepped fine; save_checkpoint then
    failed in json ("Object of type float32 is not JSON serializable") with the checkpoint half written."""
    model, opt = _engine()
    key = "betas" if isinstance(value, tuple) else "extra" if isinstance(value, np.int64) else "lr"
    opt.param_groups[0][key] = value
    _backward(model)
    opt.step()
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    assert opt.state_meta()["param_groups"][0][key] == saved
    fresh = _engine()[1]
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert fresh.param_groups[0][key] == (tuple(saved) if key == "betas" else saved)
    opt.param_groups[0]["unsaveable"] = {1, 2}
    with pytest.raises(TypeError, match=r"param_groups\[0\].unsaveable is \{1, 2\} \(set\): an optimizer checkpoint "
                                        "holds a param group's values as numbers"):
        opt.save_checkpoint(str(tmp_path / "ckpt2"))
    assert not (tmp_path / "ckpt2").exists()  # refused before the directory was made
    opt.close()
    fresh.close()


@pytest.mark.parametrize("kind", ["offload", "zero2"])
def test_a_torch_optimizer_state_dict_is_refused_by_name(kind):
    """It failed with "not an hf_zero_offload optimizer state (format=None)", not saying what it was."""
    lin = torch.nn.Linear(3, 2)
    ref = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 3)).sum().backward()
    ref.step()
    cls, extra = KINDS[kind]
    opt = cls(list(lin.named_parameters()), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    with pytest.raises(TypeError, match=rf"{cls.__name__}.load_state_dict: expected the dict its state_dict\(\) "
                                        r"returns, got a torch optimizer state_dict: load an AdamW.s with load_torch_state_dict"):
        opt.load_state_dict(ref.state_dict())
    with pytest.raises(TypeError, match=r"got list"):
        opt.load_state_dict([])
    opt.close()
