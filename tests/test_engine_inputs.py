"""The engines against inputs a torch.optim user (or test suite) hands any optimizer: options out of
range, float64 params, groups added later, gradients that did not come from backward, zero_grad()
between backward and step, state dicts and directories of the wrong kind. Each is refused by name
before anything changes, or behaves as torch.optim does."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from _models import TinyNet, batches, loss_fn, param_groups, run_steps
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam, ShardOptions


KINDS = {"offload": (OffloadAdam, {}), "zero2": (ShardedAdam, {"stage": 2, "offload": False}),
         "zero0": (ShardedAdam, {"stage": 0, "offload": False})}


def _engine(kind="offload", groups=param_groups):
    torch.manual_seed(0)
    model = TinyNet()
    cls, extra = KINDS[kind]
    return model, cls(groups(model, 0.01), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)


def _backward(model, k=0):
    ids, labels, use_branch = batches(k + 1)[k]
    loss_fn(model, ids, labels, use_branch).backward()


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


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_grad_the_engine_would_ignore_is_refused_before_the_step(kind):
    """A param frozen when the engine was built then unfrozen (gradual unfreezing), or (an engine
    that takes gradients from backward) a .grad assigned by hand: torch.optim would step these
    params; the engine used to skip them silently."""
    model, engine = _engine(kind, lambda m, wd: m.parameters())  # the frozen layer's params included
    frozen = model.frozen.weight
    frozen.requires_grad_(True)
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"a \(24, 24\) param has a .grad but was frozen"):
        engine.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and engine.global_steps == 0
    frozen.grad = None
    engine.step()  # the gradients of that backward are still there
    assert not torch.equal(model.body[0].weight, before[3]) and torch.equal(frozen, before[1])
    model.body[0].weight.grad = torch.ones_like(model.body[0].weight)
    if kind != "zero0":
        with pytest.raises(ValueError, match=r"a \(48, 24\) param has a .grad that the engine did not take "
                                             r"from backward"):
            engine.step()
    else:  # stage 0 and 1 take the gradients from .grad at step(): used as torch.optim would
        engine.step()
    engine.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zero_grad_between_backward_and_step_drops_the_gradients(kind):
    """As torch.optim: the step after zero_grad() updates nothing; it used to apply the gradients
    the engine had already taken from backward."""
    model, engine = _engine(kind)
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    engine.zero_grad()
    engine.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    _backward(model, 1)  # and the next window works as usual
    engine.step()
    assert not torch.equal(model.body[0].weight, before[3])
    engine.close()


def test_a_state_dict_or_directory_of_the_wrong_kind(tmp_path):
    model, engine = _engine()
    with pytest.raises(TypeError, match="load_state_dict: expected the dict its state_dict"):
        engine.load_state_dict(None)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="afile is a file"):
        engine.save_checkpoint(str(tmp_path / "afile"))
    engine.close()


def _stray_on_rank_0(rank, world_size):
    torch.manual_seed(0)
    model = TinyNet()
    engine = ShardedAdam(param_groups(model, 0.01), stage=2, offload=True, lr=1e-2,
                         options=OffloadOptions(num_threads=1))
    _backward(model, rank)
    if rank == 0:
        model.norm.weight.grad = torch.ones_like(model.norm.weight)
    try:
        engine.step()
    except ValueError as e:
        return str(e)
    finally:
        engine.close()
    return None


def test_a_grad_ignored_on_one_rank_is_an_error_on_every_rank():
    """Checked inside the step's one small collective: every rank raises after it (one rank raising
    before it would leave the others waiting in it)."""
    from _dist import run_distributed

    errors = run_distributed(_stray_on_rank_0, world_size=2)
    assert "a (24,) param has a .grad that the engine did not take from backward" in errors[0]
    assert "another rank holds a .grad the engine would ignore" in errors[1]


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


HANDOVER = {"offload": (OffloadAdam, {}, {}), "offload-dpu": (OffloadAdam, {}, {"dpu": True, "dpu_warmup_steps": 1}),
            "zero2": (ShardedAdam, {"stage": 2, "offload": False}, {}),
            "zero1": (ShardedAdam, {"stage": 1, "offload": False}, {})}


@pytest.mark.parametrize("kind", sorted(HANDOVER))
def test_an_engine_built_on_the_params_of_a_live_one_takes_them_over(kind):
    """A notebook cell building the engine run again while the old engine lives on (or another Trainer on the
    model): the old engine's hooks took every gradient, so the new one stepped nothing without an error (ZeRO-2:
    crashed in backward). Now the new one steps like a fresh AdamW from the model's weights as they are (the old
    engine publishes nothing: whether it is still alive depends on the garbage collector, which differs between
    ranks), element by element, the old one refuses to step, and a closed engine leaves .grad to torch."""
    cls, extra, opts = HANDOVER[kind]

    def build(m):
        return cls(param_groups(m, 0.01), lr=1e-2, options=OffloadOptions(num_threads=1, **opts), **extra)

    def adamw(m):
        return torch.optim.AdamW(param_groups(m, 0.01), lr=1e-2, foreach=False)

    torch.manual_seed(0)
    model, data = TinyNet(), batches(4)  # DPU, warm-up 1: step 2 of each engine runs delayed, on exact params
    old = build(model)
    run_steps(model, old, data[:2])
    assert old.needs_publish == bool(opts)  # DPU: step 2 is still on the worker
    before = [p.detach().clone() for p in model.parameters()]
    new = build(model)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # nothing published
    ref = copy.deepcopy(model)
    run_steps(model, new, data[2:])
    new.flush()
    run_steps(ref, adamw(ref), data[2:])
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(RuntimeError, match=f"{cls.__name__} was replaced by a new {cls.__name__} built on the same "
                                           "parameters"):
        old.step()
    new.close()
    with pytest.raises(RuntimeError, match=f"{cls.__name__} was closed; build a new engine"):
        new.step()
    loss_fn(model, *data[0]).backward()
    assert all(p.grad is not None for p in model.body.parameters())
    old.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sparse_gradients_are_refused_by_name(kind):
    """An nn.Embedding(sparse=True) failed with torch's "reshape is not implemented for sparse tensors" from inside
    backward (offload, ZeRO-2) or at step (ZeRO-0): CPUAdam's refusal, by name."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    cls, extra = KINDS[kind]
    opt = cls(emb.parameters(), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    with pytest.raises(TypeError, match=r"the engines do not support sparse gradients: the grad of a \(10, 4\) param "
                                        r"is torch.sparse_coo \(nn.Embedding\(sparse=True\)\? use sparse=False\)"):
        emb(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
    opt.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_complex_param_is_refused_by_name(kind):
    """Its masters' copy cast it to real, dropping the imaginary part with only torch's UserWarning; a dtype-generic
    forward then trained another model (0.47 off the plain run after 5 steps)."""
    lin, w = torch.nn.Linear(3, 3), torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    cls, extra = KINDS[kind]
    with pytest.raises(TypeError, match=r"parameter w \(shape \(3,\)\) is torch.complex64: the engine trains real "
                                        r"floating-point params.*torch.view_as_real"):
        cls([("lin.weight", lin.weight), ("w", w)], lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    assert w.dtype == torch.complex64


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_sparse_param_is_refused_by_name(kind):
    """torch's "Cannot access storage of SparseTensorImpl" came out of the engine's contiguity check (an outside
    probe; CPUAdam named it)."""
    lin, w = torch.nn.Linear(3, 3), torch.nn.Parameter(torch.randn(4, 4).to_sparse())
    cls, extra = KINDS[kind]
    with pytest.raises(TypeError, match=r"parameter w \(shape \(4, 4\)\) is torch.sparse_coo: the engines train "
                                        r"dense params.*\.to_dense\(\)"):
        cls([("lin.weight", lin.weight), ("w", w)], lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    from hf_zero_offload.engine.runs import shares_storage

    assert not shares_storage(w, lin.weight) and not shares_storage(lin.weight, w)  # (the Trainer's tie check asks)
    frozen = torch.nn.Parameter(torch.randn(4, 4).to_sparse(), requires_grad=False)  # owns no range: trains on
    opt = cls([lin.weight, lin.bias, frozen], lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    before = lin.weight.detach().clone()
    lin(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert not torch.equal(lin.weight, before)
    opt.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_non_contiguous_params_are_made_contiguous_and_step_like_adamw(kind, layout, caplog):
    """They were refused from inside train() ("not contiguous; updates are copied into parameters as flat ranges"),
    unnamed: a ResNet after model.to(memory_format=torch.channels_last) could not train; DDP and AdamW train it."""
    def model():
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 4, 3)
        if layout == "channels_last":
            conv = conv.to(memory_format=torch.channels_last)
        else:
            conv.weight = torch.nn.Parameter(conv.weight.detach().permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3))
        assert not conv.weight.is_contiguous()
        return conv

    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    ref, ours = model(), model()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    cls, extra = KINDS[kind]
    with caplog.at_level("WARNING", logger="hf_zero_offload"):
        opt = cls(list(ours.named_parameters()), lr=1e-2, weight_decay=0.01, options=OffloadOptions(num_threads=1),
                  **extra)
    assert "1 trainable param(s) were not contiguous" in caplog.text and "weight (shape (4, 3, 3, 3))" in caplog.text
    assert ours.weight.is_contiguous()
    for m, o in ((ref, opt_ref), (ours, opt)):
        for _ in range(3):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    opt.close()


@pytest.mark.parametrize("kind,dpu", [("offload", False), ("offload", True), ("zero2", False)])
def test_a_param_rebound_non_contiguous_after_the_build_is_made_contiguous_again(kind, dpu, caplog):
    """model.to(memory_format=torch.channels_last) after the engine was built (a second train(), a callback)
    crashed in the update's copy into the param ("view size is not compatible with input tensor's size"). Between two
    steps it is the same run; while a delayed step (DPU) is in flight it is a write of the same values (the step's
    update of it dropped, as for any write then), said as a warning."""
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    cls, extra = KINDS[kind]
    runs = []
    for rebind in (False, True):
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 4, 3)
        opt = cls(list(conv.named_parameters()), lr=1e-2, options=OffloadOptions(num_threads=1, dpu=dpu,
                                                                                 dpu_warmup_steps=1), **extra)
        for i in range(5):
            if i == 3 and rebind:
                conv.to(memory_format=torch.channels_last)
                assert not conv.weight.is_contiguous()
            elif i == 3 and dpu:  # the reference: an in-place write of the same values
                with torch.no_grad():
                    conv.weight.copy_(conv.weight.clone())
            opt.zero_grad()
            conv(x).square().mean().backward()
            with caplog.at_level("WARNING", logger="hf_zero_offload"):
                opt.step()
        opt.flush() if dpu else None
        opt.close()
        runs.append(conv)
    assert "1 trainable param(s) were not contiguous (channels_last or a transposed view: weight" in caplog.text
    assert ("counts as written: it keeps its values and that step's update of it is dropped" in caplog.text) == dpu
    assert runs[1].weight.is_contiguous()
    for a, b in zip(*(r.parameters() for r in runs)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["offload", "zero2"])
@pytest.mark.parametrize("view", ["transposed weight", "slice of a wider weight"])
def test_a_non_contiguous_param_sharing_its_storage_is_refused_by_name(kind, view):
    """A contiguous copy of it untied it from the param it views (a tie through .t()), without a word. A reference
    the user keeps (a state_dict set aside) is no tie: the param is made contiguous as any other."""
    lin = torch.nn.Linear(6, 4)
    w = torch.nn.Parameter(lin.weight.detach().t() if view == "transposed weight" else lin.weight.detach()[:, :3])
    cls, extra = KINDS[kind]
    with pytest.raises(ValueError, match=r"parameter w \(shape \((6, 4|4, 3)\)\) is not contiguous and shares its "
                                         r"storage with lin.weight.*untie"):
        cls([("lin.weight", lin.weight), ("w", w)], lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    assert not w.is_contiguous() and w.untyped_storage().data_ptr() == lin.weight.untyped_storage().data_ptr()
    kept = {"w": w.detach()}  # the user's own reference: no tie
    opt = cls([("w", w)], lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    assert w.is_contiguous() and torch.equal(w, kept["w"])
    opt.close()


@pytest.mark.parametrize("kind", ["offload", "zero2"])
def test_a_param_cast_after_the_engine_was_built_is_named_at_backward(kind):
    """SwitchTransformers' router casts its classifier to router_dtype (fp32) in forward: a bf16 run failed with
    "gradient dtype torch.float32 differs from the engine's torch.bfloat16", naming no param. A user's own
    model.to(dtype) after the build was told of router_dtype alone (an outside probe)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).bfloat16()
    cls, extra = KINDS[kind]
    opt = cls(list(net.named_parameters()), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    net[1].float()
    with pytest.raises(TypeError, match=r"the gradient of parameter 1\.(weight|bias) \(shape \((1, 4|1,)\)\) is "
                                        r"torch.float32, and the engine trains in torch.bfloat16: something cast the "
                                        r"param after the engine was built: a model\.to\(torch\.float32\) \(cast the "
                                        r"model first, then build the engine\).*router_dtype='bfloat16'"):
        net[1](net[0](torch.randn(2, 4, dtype=torch.bfloat16)).float()).sum().backward()
    opt.close()


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="Tensor.grad_dtype is torch's from 2.9")
@pytest.mark.parametrize("kind", ["offload", "zero2"])
def test_a_grad_dtype_other_than_the_params_is_named_at_backward(kind):
    """p.grad_dtype = torch.float32 on a bf16 param (torch's way to accumulate in fp32) was told as a cast of the
    param after the build (model.to, router_dtype), which had not happened."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1).bfloat16()
    cls, extra = KINDS[kind]
    opt = cls(list(net.named_parameters()), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    net.weight.grad_dtype = torch.float32
    with pytest.raises(TypeError, match=r"the gradient of parameter weight \(shape \(1, 4\)\) is torch.float32, and "
                                        r"the engine trains in torch.bfloat16: the param is torch.bfloat16, but its "
                                        r"grad_dtype is torch.float32 .*set p.grad_dtype = torch.bfloat16"):
        net(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.close()


@pytest.mark.parametrize("kind", ["offload", "zero2", "zero0"])
def test_torch_grad_scaler_is_refused_naming_the_engines_own_scaling(kind):
    """GradScaler.step failed with torch's "No inf checks were recorded for this optimizer" (the engine had taken and
    freed every .grad), naming neither the engine nor its own loss scaling."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    cls, extra = KINDS[kind]
    opt = cls(list(lin.named_parameters()), lr=1e-2, options=OffloadOptions(num_threads=1), **extra)
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in lin.parameters()]
    scaler.scale(lin(torch.randn(2, 4)).square().mean()).backward()
    why = (r"the engine unscales .grad and checks it for overflow at step\(\)" if kind == "zero0" else
           r"the engine takes each gradient during backward")  # (stage 0 keeps .grad: it was said to free it)
    with pytest.raises(RuntimeError, match=rf"torch.amp.GradScaler with {cls.__name__}: {why}.*"
                                           r"engine.scale_loss\(loss\)"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters()))
    # the refusal leaves the engine as it was: GradScaler's found_inf/grad_scale (it deletes them only after a step
    # that returns) made every later plain step() refused as GradScaler's, in a notebook that dropped the scaler
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    opt.zero_grad()
    lin(torch.randn(2, 4)).square().mean().backward()
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, lin.parameters()))
    opt.close()


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


@pytest.mark.parametrize("kind", ["offload", "sharded"])
def test_micro_batches_summed_in_16_bits_without_the_option_are_said_once(kind, caplog):
    """An outside probe (Accelerate loop, bf16 model, 3 micro-batches per step with the default
    gradient_accumulation_steps=1): summed in bf16, 2.8% from an fp32 sum after 8 steps, without a word."""
    def run(gas, micro):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(torch.bfloat16)
        opts = OffloadOptions(gradient_accumulation_steps=gas, bucket_numel=64)
        opt = (OffloadAdam(model.parameters(), lr=1e-2, options=opts) if kind == "offload" else
               ShardedAdam(model.parameters(), lr=1e-2, options=opts, stage=2, offload=True))
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_zero_offload"):
            for _ in range(3):
                for _ in range(micro):
                    model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
                opt.step()
                opt.zero_grad()
        opt.close()
        return [r.getMessage() for r in caplog.records if "summed in bfloat16" in r.getMessage()]

    said = run(1, 3)
    assert len(said) == 1 and "3 or more backward passes" in said[0] and "gradient_accumulation_steps=3" in said[0]
    assert run(3, 3) == [] and run(1, 1) == []


def _offload_adam_messages(rank, world_size):
    import logging

    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    log = logging.getLogger("hf_zero_offload")
    log.addHandler(handler)
    try:
        OffloadAdam(torch.nn.Linear(4, 2).parameters(), options=OffloadOptions(num_threads=1)).close()
    finally:
        log.removeHandler(handler)
    return said


def test_offload_adam_under_a_process_group_says_it_averages_nothing(caplog):
    """An OffloadAdam per rank of a data-parallel loop trained each rank's own copy, which drifted apart (0.076 after a
    few steps) without a word (an outside probe); one process says nothing."""
    from _dist import run_distributed

    for said in run_distributed(_offload_adam_messages, world_size=2):
        assert any("OffloadAdam is one process's engine and averages no gradient across the 2 ranks of this process "
                   "group: for data parallelism use ShardedAdam(..., offload=True)" in s for s in said), said
    assert not any("averages no gradient" in s for s in _offload_adam_messages(0, 1))
