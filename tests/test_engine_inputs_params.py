"""The engines against the params a torch.optim user hands any optimizer: params of a live engine taken over,
complex or sparse params refused by name, non-contiguous params (at the build, or rebound after it) made contiguous
and stepped as torch's AdamW steps them, a non-contiguous view sharing its storage refused."""
from __future__ import annotations

import copy

import pytest
import torch

from _models import TinyNet, batches, loss_fn, param_groups, run_steps
from _engine_inputs import KINDS
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

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
