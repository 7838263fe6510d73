"""The engines' gradient hooks against what users do to params and hooks between building an engine and stepping
it: a layer frozen when the hooks are attached and unfrozen during the run, a post-accumulate-grad hook of their
own, a param resized after the engine was built, a model with several dtypes. Each either trains as
torch.optim.AdamW(foreach=False) does, element by element, or is refused by name before anything changes."""
from __future__ import annotations

import copy

import pytest
import torch

from _models import TinyNet, batches, loss_fn, param_groups
from hf_zero_offload.engine import OffloadAdam, OffloadOptions, ShardedAdam

LR, WD = 1e-2, 0.1
# the engines that take gradients from backward through the hooks (ZeRO-0 reads .grad at step())
KINDS = {"offload": (OffloadAdam, {}), "zero2": (ShardedAdam, {"stage": 2, "offload": False}),
         "zero2-offload": (ShardedAdam, {"stage": 2, "offload": True})}


def _pair(kind):
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    cls, extra = KINDS[kind]
    opt = cls(param_groups(model, WD), lr=LR, options=OffloadOptions(num_threads=1, bucket_numel=1000), **extra)
    return ref_model, ref, model, opt


def _step_both(pairs, k):
    ids, labels, use_branch = batches(k + 1)[k]
    for m, o in pairs:
        loss_fn(m, ids, labels, use_branch).backward()
        o.step()
        o.zero_grad()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_layer_frozen_when_the_hooks_attach_and_unfrozen_later_trains(kind):
    """The Trainer detaches the hooks after train() and attaches them at the next: a layer frozen then (torch refuses
    a hook on it) and unfrozen by a callback mid-run had no hook, and its first gradient was refused as one "that did
    not come from backward" (a plain Trainer trains straight through)."""
    ref_model, ref, model, opt = _pair(kind)
    pairs = [(ref_model, ref), (model, opt)]
    _step_both(pairs, 0)
    opt.detach_hooks()  # train() returns
    for m in (ref_model, model):
        m.body.requires_grad_(False)
    opt.attach_hooks()  # the next train()
    _step_both(pairs, 1)
    for m in (ref_model, model):
        m.body.requires_grad_(True)  # a callback unfreezes it
    for k in (2, 3, 4):
        _step_both(pairs, k)
    opt.close()
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_post_accumulate_grad_hook_registered_after_the_engines_is_refused_by_name(kind):
    """Hooks run in the order registered: the user's, after the engine's, found .grad None (an AttributeError in the
    user's code) or, guarded by `if p.grad is not None`, had its edit dropped without a word (the ZeRO-2 engine
    kept .grad until the bucket went, so some edits counted and some did not)."""
    ref_model, ref, model, opt = _pair(kind)
    seen = []
    model.body[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    ids, labels, use_branch = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"a post-accumulate-grad hook was registered on a \(48, 24\) param after "
                                           r"the engine's.*Tensor.register_hook"):
        loss_fn(model, ids, labels, use_branch).backward()
    assert seen == []
    opt.close()


def _quarter(p):
    p.grad.mul_(0.25)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_hooks_registered_before_the_engine_and_tensor_hooks_edit_the_gradient(kind):
    """What the refusal points to works: a post-accumulate-grad hook registered before the engine, and a
    Tensor.register_hook hook, both see and scale the gradient the engine takes, as torch AdamW sees it."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    for m in (ref_model, model):
        m.body[0].weight.register_post_accumulate_grad_hook(_quarter)
        m.body[2].weight.register_hook(lambda g: g * 3.0)
    ref = torch.optim.AdamW(param_groups(ref_model, WD), lr=LR, foreach=False)
    cls, extra = KINDS[kind]
    opt = cls(param_groups(model, WD), lr=LR, options=OffloadOptions(num_threads=1, bucket_numel=1000), **extra)
    for k in range(4):
        _step_both([(ref_model, ref), (model, opt)], k)
    opt.close()
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("kind", sorted(KINDS) + ["zero0"])
def test_a_param_resized_after_the_engine_was_built_is_refused_by_name(kind):
    """resize_token_embeddings keeps the Parameter and rebinds its data: the engine copied the larger gradient into the
    old slot and failed with torch's bare "The size of tensor a (1200) must match the size of tensor b (1536)"."""
    cls, extra = KINDS.get(kind, (ShardedAdam, {"stage": 0, "offload": False}))
    torch.manual_seed(0)
    model = TinyNet()
    opt = cls(param_groups(model, WD), lr=LR, options=OffloadOptions(num_threads=1), **extra)
    with torch.no_grad():
        model.embed.weight.data = torch.cat([model.embed.weight, torch.zeros(14, 24)])  # 50 -> 64 rows, tied head
    ids, labels, use_branch = batches(1)[0]
    with pytest.raises(ValueError, match=r"a param of 1200 elements when the engine was built is now \(64, 24\) "
                                         r"\(1536 elements\).*resize_token_embeddings"):
        loss_fn(model, ids, labels, use_branch).backward()
        opt.step()
    opt.close()


def test_a_model_of_several_dtypes_is_refused_unless_param_dtype_says_which():
    """The engine trains one dtype: it took the first param's and cast the others to it without a word (a model's
    fp32 LayerNorm beside bf16 Linears became bf16, and its forward then failed on the mixed dtypes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"several dtypes \(torch.bfloat16: the first, shape \(8, 8\); torch.float32: "
                                         r"shape \(8,\), \.\.\.\).*pass param_dtype="):
        OffloadAdam(model.parameters(), lr=LR, options=OffloadOptions(num_threads=1))
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2  # nothing cast
    opt = OffloadAdam(model.parameters(), lr=LR, param_dtype=torch.bfloat16, options=OffloadOptions(num_threads=1))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # asked for: cast
    opt.close()
