"""``torch.nn.utils.clip_grad_norm_`` over an engine's params is the engine's clipping (engine/torch_clip.py).

The engines take each gradient during backward and free ``.grad``: torch's ``clip_grad_norm_`` between ``backward()``
and ``step()``, the most common PyTorch loop, found none, returned 0.0 and clipped nothing (ZeRO-0/1: this rank's
``.grad`` by this rank's norm, before the average), without a word. Reference: the same loop with
``torch.optim.AdamW(foreach=False)``, element by element; other params keep torch's function exactly."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _clip_ref import adamw_clipped, assert_ranks_match
from _dist import run_distributed
from _engine_pair import LR, WD, assert_models_close, make_pair
from _models import batches, loss_fn
from hf_zero_offload.engine import OffloadAdam

MAX = 0.05  # below every step's norm: clipping is active


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def xy(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), 3 * torch.randn(8, 4, generator=g)) for _ in range(n)]


def test_torchs_clip_grad_norm_clips_the_engines_gradients_as_adamws(mode):
    """2 micro-batches a step (a tied weight, a frozen layer, a branch some steps skip); every other step the norm
    alone (inf), as transformers' Trainer asks for it. It returned 0.0 and clipped nothing."""
    ref_model, ref, model, opt = make_pair(mode)
    data = mode.data(batches(8))
    ref_norms, norms = [], []
    for step in range(4):
        max_norm = MAX if step % 2 == 0 else float("inf")
        for m, o, out in ((ref_model, ref, ref_norms), (model, opt, norms)):
            for ids, labels, use_branch in data[2 * step:2 * step + 2]:
                (loss_fn(m, ids, labels, use_branch) / 2).backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            assert isinstance(norm, torch.Tensor) and norm.dim() == 0
            out.append(norm.item())
            o.step()
            o.zero_grad()
    assert min(ref_norms) > MAX
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    mode.sync()
    assert_models_close(ref_model, model, rtol=1e-5, atol=1e-6)
    opt.close()


def test_other_params_get_torchs_function_as_it_is():
    """Beside a live engine, a plain model's clipping is torch's own call, bit for bit; after ``close()`` the
    engine's params are plain torch's again."""
    engine_model, model = net(), net()
    engine = OffloadAdam(engine_model.named_parameters(), lr=LR)
    wrapper = torch.nn.utils.clip_grad_norm_
    original = wrapper._hzo_engine_aware  # (torch's, as it was before the first engine)
    assert wrapper.__wrapped__ is original and torch.nn.utils.clip_grad.clip_grad_norm_ is wrapper
    assert torch.nn.utils.clip_grad_value_._hzo_engine_aware.__module__ == "torch.nn.utils.clip_grad"
    ref = copy.deepcopy(model)
    x, y = xy(1)[0]
    for m in (model, ref, engine_model):
        mse(m, x, y).backward()
    assert torch.equal(wrapper(model.parameters(), MAX, norm_type=3.0), original(ref.parameters(), MAX, 3.0))
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    original_value = torch.nn.utils.clip_grad_value_._hzo_engine_aware
    original_value(ref.parameters(), 0.01)
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(q.grad, p.grad)
    with pytest.warns(UserWarning, match="empty generator"):  # (torch's own warning, through the wrapper)
        wrapper((p for p in ()), MAX)
    engine.close()
    ref = copy.deepcopy(engine_model)  # (the same weights, no engine)
    for m in (engine_model, ref):
        m.zero_grad()
        mse(m, x, y).backward()
    assert torch.equal(torch.nn.utils.clip_grad_norm_(engine_model.parameters(), MAX),
                       original(ref.parameters(), MAX))
    for p, q in zip(ref.parameters(), engine_model.parameters()):
        assert torch.equal(q.grad, p.grad)


def test_what_torch_would_do_and_the_engine_cannot_is_refused_by_name():
    model, other, third = net(), net(), net()
    engine = OffloadAdam(model.named_parameters(), lr=LR)
    engine3 = OffloadAdam(third.named_parameters(), lr=LR)
    x, y = xy(1)[0]
    for m in (model, other, third):
        mse(m, x, y).backward()
    clip = torch.nn.utils.clip_grad_norm_
    with pytest.raises(ValueError, match=r"clip_grad_norm_ over the params of OffloadAdam: 4 of the given params "
                                         r"\(\(16, 8\).*not trainable params of this engine"):
        clip([*model.parameters(), *other.parameters()], MAX)
    with pytest.raises(ValueError, match=r"clip_grad_norm_: the given params belong to 2 engines \(OffloadAdam and "
                                         r"OffloadAdam\).*joint norm"):
        clip([*model.parameters(), *third.parameters()], MAX)
    with pytest.raises(ValueError, match=r"over the params of OffloadAdam: norm_type=inf: .*L2 norm"):
        clip(model.parameters(), MAX, float("inf"))
    with pytest.raises(ValueError, match="clip_grad_value_ on the params of OffloadAdam.*clip_grad_norm_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    with pytest.raises(ValueError, match="clip_grads_with_norm_ on the params of OffloadAdam.*clip_grad_norm_"):
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX, torch.tensor(0.0))
    early = clip._hzo_engine_aware  # what `from torch.nn.utils import clip_grad_norm_` bound before any engine
    with pytest.raises(ValueError, match="as bound before the first engine was built .*would return 0.0"):
        early(model.parameters(), MAX)
    assert clip(model.parameters(), MAX).item() == pytest.approx(engine.grad_norm(), rel=1e-6)  # (none asked before)
    with pytest.raises(RuntimeError, match=r"over the params of OffloadAdam: called a second time"):
        clip(model.parameters(), MAX)
    engine.close()
    engine3.close()


def test_error_if_nonfinite_raises_as_torchs_and_clips_nothing():
    model, ref = net(), net()
    engine = OffloadAdam(model.named_parameters(), lr=LR)
    x, y = xy(1)[0]
    x[0, 0] = float("inf")
    for m in (model, ref):
        mse(m, x, y).backward()
    with pytest.raises(RuntimeError) as torchs:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as ours:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX, error_if_nonfinite=True)
    assert str(ours.value) == str(torchs.value)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX)  # (not "a second time": none was asked)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX, error_if_nonfinite=False)
    assert norm.isnan() and ref_norm.isnan()
    engine.close()


# -- two gloo ranks of a ShardedAdam --------------------------------------------------------------------------------
def sharded_rank(rank, world):
    """Stage 2 (gradients reduce-scattered during backward) and stage 1 (.grad reduced at the step), 2 micro-batches
    a step: torch's clipping is the engine's, by the global norm of the averaged gradients."""
    from hf_zero_offload.engine import ShardedAdam

    out = []
    for stage in (2, 1):
        model = net()
        engine = ShardedAdam(model.named_parameters(), lr=LR, weight_decay=WD, stage=stage, offload=True)
        norms = []
        for i, (x, y) in enumerate(xy(6)):
            (mse(model, x.chunk(world)[rank], y.chunk(world)[rank]) / 2).backward()
            if i % 2:
                if i == 1:  # (stage 1: this rank's .grad is there, not yet averaged; unclipped, the check below says)
                    with pytest.raises(ValueError, match="as bound before the first engine"):
                        torch.nn.utils.clip_grad_norm_._hzo_engine_aware(model.parameters(), MAX)
                    with pytest.raises(ValueError, match="clip_grad_value_ on the params of ShardedAdam"):
                        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX).item())
                engine.step()
                engine.zero_grad()
        engine.close()
        out.append((norms, [p.detach().clone() for p in model.parameters()]))
    return out


def test_two_ranks_of_a_sharded_engine_clip_by_the_global_norm():
    """torch's clipping found no .grad (stage 2), or this rank's .grad before the average (stage 1)."""
    model = net()
    norms = adamw_clipped(model, xy(6), MAX, lr=LR, weight_decay=WD)
    assert_ranks_match(run_distributed(sharded_rank, world_size=2), model, norms, rel=1e-6)


def test_items_that_are_not_params_get_torchs_own_error_and_warning():
    """``opt.param_groups`` (dicts) or ``named_parameters()`` pairs, over an engine's params or others: torch's
    AttributeError, not "cannot create weak reference to 'dict' object" from the owner lookup. The empty-generator
    warning names the caller's line, as torch's does (torch's stacklevel named this wrapper's file)."""
    model, plain = net(), net()
    engine = OffloadAdam(model.named_parameters(), lr=LR)
    original = torch.nn.utils.clip_grad_norm_._hzo_engine_aware
    value, value_original = torch.nn.utils.clip_grad_value_, torch.nn.utils.clip_grad_value_._hzo_engine_aware
    for given in (lambda: engine.param_groups, lambda: [{"params": list(plain.parameters())}],
                  model.named_parameters, plain.named_parameters, lambda: [1]):
        for ours, torchs in ((torch.nn.utils.clip_grad_norm_, original), (value, value_original)):
            with pytest.raises(Exception) as expected:
                torchs(given(), MAX)
            with pytest.raises(type(expected.value), match=f"^{expected.value}$"):
                ours(given(), MAX)
    with pytest.warns(UserWarning) as torchs:
        original((p for p in ()), MAX)
    with pytest.warns(UserWarning) as ours:
        torch.nn.utils.clip_grad_norm_((p for p in ()), MAX)
    assert [(str(w.message), w.filename) for w in ours] == [(str(w.message), w.filename) for w in torchs]
    assert ours[0].filename == __file__
    engine.close()


def test_compiled_fullgraph_clip_of_other_params_beside_a_live_engine():
    """``torch.compile(fullgraph=True)`` of a function clipping a plain model (a discriminator, a reward model) failed
    once an engine was alive ("Attempted to inline function marked as skipped: WeakIdKeyDictionary.get"). Compiled
    before an engine takes that model, the function delegates to the engine after (a recompile, not a stale graph)."""
    engine_model, plain, ref = net(), net(), net()
    engine = OffloadAdam(engine_model.named_parameters(), lr=LR)
    x, y = xy(1)[0]
    for m in (plain, ref):
        mse(m, x, y).backward()

    def clip(m):
        return torch.nn.utils.clip_grad_norm_(m.parameters(), MAX)

    torch._dynamo.reset()
    got = torch.compile(clip, backend="eager", fullgraph=True)(plain)
    assert torch.equal(got, torch.nn.utils.clip_grad_norm_._hzo_engine_aware(ref.parameters(), MAX))
    for p, q in zip(ref.parameters(), plain.parameters()):
        assert torch.equal(q.grad, p.grad)
    compiled = torch.compile(clip, backend="eager")
    compiled(plain)
    plain.zero_grad()
    late = OffloadAdam(plain.named_parameters(), lr=LR)  # (takes the plain model's params now)
    mse(plain, x, y).backward()
    assert compiled(plain).item() == pytest.approx(late.grad_norm(), rel=1e-6) and late._clip_request is not None
    torch._dynamo.reset()
    late.close()
    engine.close()


def test_a_reload_of_the_module_keeps_the_live_engines():
    """``importlib.reload`` (a notebook's autoreload) emptied the list the installed wrappers read: a live engine's
    params got torch's clipping again, 0.0 and nothing clipped."""
    import importlib

    from hf_zero_offload.engine import torch_clip

    model = net()
    engine = OffloadAdam(model.named_parameters(), lr=LR)
    importlib.reload(torch_clip)
    assert torch.nn.utils.clip_grad_norm_._hzo_engine_aware.__module__ == "torch.nn.utils.clip_grad"  # (once)
    x, y = xy(1)[0]
    mse(model, x, y).backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), MAX).item() == pytest.approx(engine.grad_norm(),
                                                                                            rel=1e-6)
    engine.close()


def test_an_engine_with_its_hooks_detached_leaves_the_params_to_torch():
    """After ``detach_hooks()`` (the Trainer's, when ``train()`` returns) backward leaves ``.grad`` as without the
    engine, for whatever trains the params next (a plain Trainer on the same model: Accelerate's clipping calls
    ``clip_grads_with_norm_``, which was refused as the engine's): torch's three functions, bit for bit; attached
    again, the engine's."""
    engine_model = net()
    engine = OffloadAdam(engine_model.named_parameters(), lr=LR)
    engine.detach_hooks()
    ref = copy.deepcopy(engine_model)
    x, y = xy(1)[0]
    for m in (engine_model, ref):
        mse(m, x, y).backward()
    originals = {name: getattr(torch.nn.utils, name)._hzo_engine_aware
                 for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")}
    assert torch.equal(torch.nn.utils.clip_grad_norm_(engine_model.parameters(), 1.0),
                       originals["clip_grad_norm_"](ref.parameters(), 1.0))
    norm = torch.nn.utils.get_total_norm([p.grad for p in engine_model.parameters()])
    assert norm > MAX  # (so the next call scales the gradients)
    torch.nn.utils.clip_grads_with_norm_(engine_model.parameters(), MAX, norm)
    originals["clip_grads_with_norm_"](ref.parameters(), MAX, norm)
    torch.nn.utils.clip_grad_value_(engine_model.parameters(), 0.001)
    originals["clip_grad_value_"](ref.parameters(), 0.001)
    for p, q in zip(ref.parameters(), engine_model.parameters()):
        assert torch.equal(q.grad, p.grad)
    engine_model.zero_grad(set_to_none=True)
    engine.attach_hooks()
    mse(engine_model, x, y).backward()
    assert all(p.grad is None for p in engine_model.parameters())  # taken by the engine again
    assert torch.nn.utils.clip_grad_norm_(engine_model.parameters(), MAX) == pytest.approx(engine.grad_norm())
    engine.close()
