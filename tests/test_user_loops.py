"""The engines and CPUAdam in training loops of one's own, as an outside user writes them: an ``accelerate.Accelerator``
loop (accumulation, bf16 autocast, ``save_state``/``load_state``, fp16 overflow skips with ``adapt_accelerator``),
torch's and transformers' LR schedulers (OneCycleLR cycles the betas too), a group's settings edited by hand between
steps, gradient checkpointing, a module applied twice, a param without a gradient on some steps and gradient
penalties (``torch.autograd.grad(create_graph=True)``). Reference: the same loop with
``torch.optim.AdamW(foreach=False)``, element by element."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from hf_zero_offload import CPUAdam
from hf_zero_offload.accelerator_patch import adapt_accelerator
from hf_zero_offload.engine import OffloadAdam, OffloadOptions

accelerate = pytest.importorskip("accelerate")
from _accelerate_state import fresh_accelerate_state  # noqa: E402,F401 (autouse)
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

LR, WD = 1e-2, 0.1
KINDS = ["offload", "cpu_adam"]


class Net(nn.Module):
    """``b`` applied twice (a shared module), optionally checkpointed; ``extra`` used on some steps only."""

    def __init__(self, ck: bool | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.extra, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.ck = ck  # None: no checkpointing; else use_reentrant

    def block(self, h):
        return torch.tanh(self.b(h))

    def forward(self, x, use_extra: bool = True):
        h = torch.tanh(self.a(x))
        for _ in range(2):
            h = self.block(h) if self.ck is None else checkpoint(self.block, h, use_reentrant=self.ck)
        if use_extra:
            h = h + self.extra(h)
        return self.c(h)


def data(n: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def params(kind, model, prefix=""):
    named = [(n, p) for n, p in model.named_parameters() if n.startswith(prefix)]
    return named if kind == "offload" else [p for _, p in named]


def optimizer(kind, groups, **kw):
    kw = {"lr": LR, "weight_decay": WD, **kw}
    if kind == "torch":
        return torch.optim.AdamW(groups, foreach=False, **kw)
    return OffloadAdam(groups, **kw) if kind == "offload" else CPUAdam(groups, **kw)


def assert_same(ref: nn.Module, model: nn.Module, atol: float = 1e-7) -> None:
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")


# -- an Accelerate loop --------------------------------------------------------------------------------------------
def accelerate_run(kind, *, gas=1, mp="no", n=8):
    model = Net()
    opt = optimizer(kind, params(kind, model))
    xs, ys = zip(*data(2 * n))
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=4)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=gas, mixed_precision=mp)
    model, opt, loader, sched = acc.prepare(model, opt, loader, L.LambdaLR(opt, lambda s: 1 / (1 + s)))
    for i, (x, y) in enumerate(loader):
        with acc.accumulate(model):
            acc.backward(((model(x, i % 3 != 2).float() - y) ** 2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
    return acc.unwrap_model(model), opt


@pytest.mark.parametrize("gas,mp", [(1, "no"), (2, "no"), (1, "bf16")], ids=["plain", "accumulate2", "bf16-autocast"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_accelerate_loop_trains_as_adamw(kind, gas, mp):
    """``accelerator.accumulate`` skips step/zero_grad on the window's first micro-batch: the engine sums both
    backward passes' gradients (taken through its hooks) into the one step, as AdamW sums ``.grad``."""
    ref, ref_opt = accelerate_run("torch", gas=gas, mp=mp)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model, opt = accelerate_run(kind, gas=gas, mp=mp)
    assert_same(ref, model)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def _save_load_run(kind, tmp_path, stop=None):
    model = Net()
    opt = optimizer(kind, params(kind, model))
    sched = L.OneCycleLR(opt, max_lr=LR, total_steps=20)  # cycles betas[0] as well as the lr
    acc = accelerate.Accelerator(cpu=True)
    model, opt, sched = acc.prepare(model, opt, sched)
    if stop is None and (tmp_path / "state").exists():
        acc.load_state(str(tmp_path / "state"))
    for i, (x, y) in enumerate(data(8)):
        if (stop is not None and i == stop) or (stop is None and (tmp_path / "state").exists() and i < 4):
            if stop is not None:
                acc.save_state(str(tmp_path / "state"))
                break
            continue
        acc.backward(((model(x) - y) ** 2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    return acc.unwrap_model(model), opt.optimizer


@pytest.mark.parametrize("kind", KINDS)
def test_accelerate_save_state_then_load_state_goes_on_bit_for_bit(kind, tmp_path):
    whole, _ = _save_load_run(kind, tmp_path / "whole")
    _, first = _save_load_run(kind, tmp_path, stop=4)
    if kind == "offload":
        first.close()  # the resumed run's engine takes the params over
    resumed, _ = _save_load_run(kind, tmp_path)
    assert_same(whole, resumed, atol=0)


# -- adapt_accelerator -------------------------------------------------------------------------------------------
def fp16_run(adapt: bool | None, overflow_at=1, n=4):
    """``adapt`` None: no Accelerate, the LR schedule held by hand on the engine's skipped step (the reference)."""
    model = Net()
    opt = OffloadAdam(params("offload", model), lr=LR, options=OffloadOptions(fp16={"enabled": True,
                                                                                    "initial_scale_power": 16}))
    engine, sched = opt, L.LambdaLR(opt, lambda s: 1 / (1 + s))
    acc = None
    if adapt is not None:
        acc = accelerate.Accelerator(cpu=True)
        if adapt:
            adapt_accelerator(acc, engine)
        model, opt, sched = acc.prepare(model, opt, sched)
    skipped, lrs = [], []
    for i, (x, y) in enumerate(data(n)):
        loss = ((model(x.half()).float() - y) ** 2).mean() * (1e30 if i == overflow_at else 1.0)
        if acc is None:
            engine.scale_loss(loss).backward()
        else:
            acc.backward(loss if adapt else engine.scale_loss(loss))
        opt.step()
        if acc is None:
            if not engine.last.skipped:
                sched.step()
            skipped.append(engine.last.skipped)
        else:
            sched.step()
            skipped.append(acc.optimizer_step_was_skipped)
        opt.zero_grad()
        lrs.append(engine.param_groups[0]["lr"])
    return model if acc is None else acc.unwrap_model(model), skipped, lrs


def test_adapt_accelerator_reports_the_engines_skipped_steps_and_holds_the_schedule():
    """Without it Accelerate called the engine's skipped fp16 overflow step taken (``optimizer_step_was_skipped``
    False) and its scheduler wrapper advanced the LR on it."""
    ref, ref_skipped, ref_lrs = fp16_run(None)
    assert ref_skipped == [False, True, False, False]
    _, skipped, lrs = fp16_run(False)
    assert skipped == [False] * 4 and lrs != ref_lrs  # what Accelerate did alone
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model, skipped, lrs = fp16_run(True)
    assert (skipped, lrs) == (ref_skipped, ref_lrs)
    assert_same(ref, model, atol=0)


def test_adapt_accelerator_keeps_the_engine_state_where_it_is():
    """Accelerate's device placement round-trips ``state_dict()`` (fp32 masters and moments) through
    ``accelerator.device`` and loads it back; adapted, prepare leaves the engine's state alone."""
    for adapt in (False, True):
        AcceleratorState._reset_state(True)
        model = Net()
        engine = OffloadAdam(params("offload", model))
        loads = []
        engine.register_load_state_dict_pre_hook(lambda opt, sd: loads.append(1))
        acc = accelerate.Accelerator(cpu=True)
        if adapt:
            adapt_accelerator(acc, engine)
        acc.prepare(model, engine)
        assert len(loads) == (0 if adapt else 1)
        engine.close()


def test_adapt_accelerator_refuses_what_it_cannot_adapt():
    model = Net()
    engine = OffloadAdam(params("offload", model))
    with pytest.raises(TypeError, match="OffloadAdam or ShardedAdam, got CPUAdam"):
        adapt_accelerator(accelerate.Accelerator(cpu=True), CPUAdam(Net().parameters()))
    acc = accelerate.Accelerator(cpu=True)
    acc.prepare(engine)
    with pytest.raises(RuntimeError, match="before accelerator.prepare"):
        adapt_accelerator(acc, engine)
    acc = accelerate.Accelerator(cpu=True)
    adapt_accelerator(acc, engine)
    with pytest.raises(RuntimeError, match="already runs an engine"):
        adapt_accelerator(acc, engine)
    acc = accelerate.Accelerator(cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu")  # what mixed_precision="fp16" makes on a GPU (none on a CPU)
    with pytest.raises(ValueError, match="mixed_precision='fp16'.*GradScaler"):
        adapt_accelerator(acc, engine)
    engine.close()


# -- LR schedulers, and a group's settings edited by hand -------------------------------------------------------------
def two_groups(kind, model, lr=LR):
    return [{"params": params(kind, model, "a."), "weight_decay": 0.2, "betas": (0.8, 0.95), "eps": 1e-6},
            {"params": params(kind, model, ("b.", "c.", "extra.")), "lr": lr * 0.3, "weight_decay": 0.0}]


def loop_run(kind, *, sched=None, edit=None, tensor_lr=False, ck=None, loss="plain", n=6):
    model = Net(ck)
    lr = torch.tensor(LR) if tensor_lr else LR  # one per run: torch's schedulers write a tensor lr in place
    opt = optimizer(kind, two_groups(kind, model, lr), lr=lr)
    s = sched(opt) if sched else None
    for i, (x, y) in enumerate(data(n)):
        use_extra = i % 3 != 2  # no gradient for ``extra`` on every third step
        if loss == "plain":
            value = ((model(x, use_extra) - y) ** 2).mean()
        elif loss == "input_penalty":  # a gradient penalty on the input (WGAN-GP style)
            x = x.clone().requires_grad_(True)
            out = model(x, use_extra)
            g, = torch.autograd.grad(out.sum(), x, create_graph=True)
            value = ((out - y) ** 2).mean() + 0.1 * (g ** 2).sum()
        else:  # a penalty on the params' own gradients: double backward through every param
            value = ((model(x, use_extra) - y) ** 2).mean()
            gs = torch.autograd.grad(value, list(model.parameters()), create_graph=True, allow_unused=True)
            value = value + 0.1 * sum((g ** 2).sum() for g in gs if g is not None)
        value.backward()
        opt.step()
        opt.zero_grad()
        if s is not None:
            s.step(value.item()) if isinstance(s, L.ReduceLROnPlateau) else s.step()
        if edit:
            edit(opt.param_groups, i)
    return model


def _linear_warmup(opt):
    transformers = pytest.importorskip("transformers")
    return transformers.get_linear_schedule_with_warmup(opt, 2, 6)


SCHEDULERS = {
    "LambdaLR": lambda o: L.LambdaLR(o, [lambda s: 1 / (1 + s), lambda s: 0.9 ** s]),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=[LR, LR / 2], total_steps=8),  # cycles betas[0] too
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, 2), L.ExponentialLR(o, 0.8)], [2]),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "linear_schedule_with_warmup": _linear_warmup,
}


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("kind", KINDS)
def test_lr_schedulers_step_as_with_adamw(kind, name, tensor_lr):
    """Two groups of their own lr, weight decay, betas and eps; ``lr`` a 0-dim tensor, as torch allows."""
    assert_same(loop_run("torch", sched=SCHEDULERS[name], tensor_lr=tensor_lr),
                loop_run(kind, sched=SCHEDULERS[name], tensor_lr=tensor_lr))


EDITS = {
    "lr": lambda groups, i: groups[0].update(lr=LR * (i + 2) / 3),
    "lr-tensor": lambda groups, i: groups[1].update(lr=torch.tensor(LR / (i + 1))),
    "weight_decay": lambda groups, i: groups[0].update(weight_decay=0.5 * (i % 2)),
    "eps": lambda groups, i: groups[1].update(eps=10.0 ** -(i % 4)),
    "betas": lambda groups, i: groups[0].update(betas=(0.5 + 0.05 * i, 0.9 + 0.01 * i)),
    "betas-list": lambda groups, i: groups[1].update(betas=[0.5 + 0.05 * i, 0.9 + 0.01 * i]),
}


@pytest.mark.parametrize("key", list(EDITS))
@pytest.mark.parametrize("kind", KINDS)
def test_a_group_setting_edited_between_steps_applies_at_the_next(kind, key):
    assert_same(loop_run("torch", edit=EDITS[key]), loop_run(kind, edit=EDITS[key]))


# -- gradient checkpointing, a shared module, double backward ---------------------------------------------------------
@pytest.mark.parametrize("loss", ["plain", "input_penalty", "param_penalty"])
@pytest.mark.parametrize("ck", [None, True, False], ids=["no-checkpoint", "reentrant", "non-reentrant"])
@pytest.mark.parametrize("kind", KINDS)
def test_checkpointing_a_shared_module_and_gradient_penalties(kind, ck, loss):
    """``b`` runs twice per forward (each checkpointed segment hands the engine its own piece of ``b``'s gradient
    with reentrant checkpointing); ``extra`` gets no gradient every third step; the penalties backward through
    ``autograd.grad``'s graph, and only the final backward's gradients reach the engine."""
    if ck is True and loss != "plain":
        pytest.skip("torch refuses autograd.grad through reentrant checkpointing")
    assert_same(loop_run("torch", ck=ck, loss=loss), loop_run(kind, ck=ck, loss=loss))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_t5_gradient_checkpointing_with_tied_embeddings(reentrant):
    """``gradient_checkpointing_enable()`` on a tiny T5 whose embedding is tied to its head: the shared weight's
    gradient comes from the encoder, the decoder and the head."""
    from _t5 import ToyDataset, tiny_t5
    ds = ToyDataset(12)
    models = {}
    for kind in ("torch", "offload"):
        model = tiny_t5()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        opt = optimizer(kind, params(kind, model))
        for i in range(3):
            batch = {k: torch.stack([ds[j][k] for j in range(4 * i, 4 * i + 4)])
                     for k in ("input_ids", "attention_mask", "labels")}
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        models[kind] = model
    assert models["offload"].lm_head.weight is models["offload"].shared.weight
    # within the Trainer tests' 1e-5 ("equal"): the kernel's rounding against torch's moves T5's weights (up to ~4)
    # apart by up to 2.5e-7 in 3 steps, with CPUAdam too and without checkpointing; a gradient piece missed or taken
    # twice moves them by ~lr (1e-2)
    assert_same(models["torch"], models["offload"], atol=1e-5)
