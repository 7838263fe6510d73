"""Which engine takes a parameter's gradients: one engine at a time, and none once it is done.

The offload engine and ZeRO-2 take each gradient out of ``.grad`` during backward (post-accumulate-grad hooks)
and free it. Hooks left behind by an engine no longer in use took every gradient from whatever trained the model
next (a second Trainer on the same model, a plain torch optimizer, a manual ``backward()``), which then stepped
nothing, without an error. So:

- every engine claims its trainable params when it is built (:func:`claim`), before it allocates its memory; an
  engine that held any of them is replaced (``lifetime.EngineEnd._replaced``: its hooks go, its memory is released,
  and it refuses to step or take gradients again, as its masters no longer describe the model). It publishes
  nothing: whether it is still alive depends on the garbage collector, so the new engine starts from the model's
  weights as they are, on every rank alike;
- :class:`GradHooks` can be detached and attached again (the Trainer detaches them when ``train()`` returns, so
  between runs the model is plain torch) and are removed by ``close()``;
- a hook holds its engine's callback weakly and is removed when that callback's owner is garbage-collected, so a
  model that outlives its Trainer does not keep the engine and its host memory alive.

:class:`ParamOwner` is the engines' side of this (a mixin of ``AdamCore``, as ``SavedState`` is).
"""
from __future__ import annotations

import logging
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary  # tensors compare elementwise: keyed by identity

from .buffers import summed_in_16_bits

_owner = WeakIdKeyDictionary()  # param -> weakref to the engine that claimed it last
logger = logging.getLogger("hf_zero_offload")


def holders(engine, params) -> list:
    """The live engines other than ``engine`` that own any of ``params`` (each once)."""
    others = {}
    for p in params:
        ref = _owner.get(p)
        other = ref() if ref is not None else None
        if other is not None and other is not engine:
            others[id(other)] = other
    return list(others.values())


def claim(engine, params) -> None:
    """``engine`` owns ``params`` from now on; a live engine that owned any of them is replaced first."""
    for other in holders(engine, params):
        other._replaced(by=engine)
    for p in params:
        _owner[p] = weakref.ref(engine)


def check_dense(p: torch.Tensor) -> None:
    """The engines copy gradients as flat ranges: a sparse one (``nn.Embedding(sparse=True)``) is refused by
    name, as CPUAdam refuses it, not with torch's "reshape is not implemented for sparse tensors" from deep in
    backward."""
    if p.grad is not None and p.grad.layout != torch.strided:
        raise TypeError(f"the engines do not support sparse gradients: the grad of a {tuple(p.shape)} param is "
                        f"{p.grad.layout} (nn.Embedding(sparse=True)? use sparse=False)")


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class GradHooks:
    """Post-accumulate-grad hooks calling ``on_grad(p)`` (a bound method, held weakly) on each of ``params``;
    ``label(p)`` names a param in a refusal, ``who`` the engine."""

    def __init__(self, params, on_grad, *, label=lambda p: f"of shape {tuple(p.shape)}", who: str = "the engine"):
        self._params = list(params)
        # the sizes the engine's flat layout was built for: a param resized since would be copied into a slot of
        # another size (torch's "The size of tensor a (2048) must match the size of tensor b (2304)")
        self._numel = {id(p): p.numel() for p in self._params}
        # the device each param trains on (the engine's, its buffers' and streams'): a model moved after the build
        self._device = {id(p): p.device for p in self._params}
        self._label, self._who = label, who
        self._on_grad = weakref.WeakMethod(on_grad)
        self._handles: list = []
        self._ids: dict = {}  # id(param) -> our hook's key in its _post_accumulate_grad_hooks
        self._live = [False]  # this attach's hooks run: torch runs a param's hooks from a copy taken before the first
        # of them, so a hook detached by an earlier one (a user's hook closing the engine mid-backward) still ran
        # the finalizer holds the handles, not this object: it runs when the owner of ``on_grad`` goes
        weakref.finalize(on_grad.__self__, _remove, self._handles)
        self.attach()

    def attach(self) -> None:
        if self._handles:
            return
        target, numel, ids, devices, label, who = (self._on_grad, self._numel, self._ids, self._device, self._label,
                                                   self._who)
        self._live = live = [True]

        def hook(p):
            f = target() if live[0] else None
            if f is not None:  # its engine is gone: the gradient stays in .grad, as without hooks
                check_dense(p)
                _check_size(p, numel[id(p)])
                if p.device != devices[id(p)]:
                    raise RuntimeError(device_moved(who, label(p), devices[id(p)], p.device))
                _check_last(p, ids[id(p)])
                f(p)

        for p in self._params:
            # A param frozen now may be unfrozen during the run (a callback unfreezing layers): it needs its hook
            # then. torch refuses a hook on a tensor that does not require grad, but keeps one across a
            # requires_grad toggle, so the hook is registered with the flag set for the moment.
            frozen = not p.requires_grad
            if frozen:
                p.requires_grad_(True)
            try:
                handle = p.register_post_accumulate_grad_hook(hook)
            finally:
                if frozen:
                    p.requires_grad_(False)
            self._handles.append(handle)
            ids[id(p)] = handle.id

    def detach(self) -> None:
        self._live[0] = False
        _remove(self._handles)

    @property
    def attached(self) -> bool:
        return bool(self._handles)


def _check_size(p: torch.Tensor, numel: int) -> None:
    if p.numel() != numel:
        raise ValueError(size_changed(p, numel))


def size_changed(p: torch.Tensor, numel: int) -> str:
    return (f"a param of {numel} elements when the engine was built is now {tuple(p.shape)} ({p.numel()} elements): "
            "the engine's flat layout is fixed when it is built (resize_token_embeddings, or p.data = t of another "
            "size, after building it?): change the model first, then build the engine (the Trainer)")


def device_moved(who: str, label: str, built: torch.device, now: torch.device) -> str:
    """A param on another device than the one its engine was built for (``model.to("cuda")``, ``accelerator.prepare``
    or a plain Trainer placing the model after the engine was built over it on the CPU): the engine's gradient
    buckets, its streams and its copies are set for one device when it is built. Refused by name: before, the
    gradients took a synchronous copy path the engine was not built for (unverified on a GPU)."""
    return (f"{who} was built with its params on {built}; param {label} is now on {now}: an engine's gradient buckets "
            "and copy streams are set for one device when it is built. Build the engine after moving the model "
            "(model.to(device) first, or give the engine device=..., which moves the params itself; a plain "
            "Trainer moves the model in its __init__: build the engine with device=args.device, or use "
            f"ZeroOffloadTrainer, which builds it after), or move the model back to {built}")


def _check_last(p: torch.Tensor, key: int) -> None:
    """torch runs a param's post-accumulate-grad hooks in the order they were registered. One registered after the
    engine's ran after the gradient had left ``.grad``: it found None (an AttributeError in the user's code) or,
    guarded by ``if p.grad is not None``, its edit was lost without a word. Refused here, by name."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    if hooks and next(reversed(hooks)) != key:
        raise RuntimeError(
            f"a post-accumulate-grad hook was registered on a {tuple(p.shape)} param after the engine's: it would run "
            "after the engine took the gradient out of .grad (it would find None, and an edit would be lost). "
            "Register it before building the engine (with the Trainer: before train()), or edit the gradient in "
            "a Tensor.register_hook hook, which runs before it is accumulated")


class ParamOwner:
    """Which engine takes the params' gradients: the part of ``AdamCore`` that attaches or detaches its hooks and
    takes or hands back the zero ``.grad`` (its claim of the params and its replacement: ``lifetime.EngineEnd``). Its
    methods read the core's fields (``_flat``, ``_pending``, ``_wait_worker``) as their own."""
    _said_16bit_sum = False       # summed_in_16_bits said once per engine
    _zeros_kept = False           # the last zero_grad() kept zeros (set_to_none=False): torch's .grad stay

    def _say_if_summed_in_16_bits(self, store: torch.Tensor, counts: list[int]) -> None:
        """Once: several backward passes of this window summed into a 16-bit store (``buffers.summed_in_16_bits``)."""
        if not self._said_16bit_sum and (said := summed_in_16_bits(type(self).__name__, store, counts)):
            self._said_16bit_sum = True
            logger.warning(said)

    def _take_zero_grads(self) -> None:
        """The zero ``.grad`` a param holds when the engine is built (torch's ``zero_grad(set_to_none=False)``,
        or one handed back by the engine this one replaces, ``_hand_back_zero_grads``): torch's AdamW steps that
        param with it (weight decay, the moments' decay), so the engine does until a ``zero_grad(set_to_none=True)``
        (``_kept_grad``), and frees it as it frees every gradient it takes. A new engine did not step them: one
        that takes gradients during backward frees .grad, so the next engine found none (0.198 off AdamW with
        weight_decay 0.5). An engine that reads .grad at step() (ZeRO-1) counts it there itself."""
        if not self._grads_from_backward:
            return
        for i, (p, _, _) in enumerate(self._flat):
            g = p.grad
            if g is not None and g.layout == torch.strided and g.numel() == p.numel() and not bool(g.any()):
                self._kept_grad[i], p.grad = True, None
                self._zeros_kept = True

    def _hand_back_zero_grads(self) -> None:
        """At close or replacement, after zero_grad(set_to_none=False): a zero ``.grad`` again on each param torch
        would hold one for (its gradient since the last zero_grad(set_to_none=True) freed by the engine), so the
        optimizer built next over these params (another engine, torch's AdamW) steps them as torch's would. Not
        after zero_grad(set_to_none=True), torch's default, nor before any zero_grad: no memory is allocated."""
        if not self._zeros_kept:
            return
        try:
            window = self._window_received()
        except Exception:  # noqa: BLE001 - a window that cannot be read (a failed build): the steps' own flags
            window = [False] * len(self._flat)
        with torch.no_grad():
            for (p, _, _), k, r, w in zip(self._flat, self._kept_grad, self._last_received, window):
                if (k or r or w) and p.grad is None:
                    p.grad = torch.zeros_like(p)

    def _hooks(self) -> GradHooks | None:
        """The subclass's gradient hooks (None: it reads ``.grad`` at ``step()``)."""
        return None

    @property
    def owns_grads_now(self) -> bool:
        """The params' gradients are this engine's now: taken by its hooks during backward, or read from ``.grad`` at
        its step (ZeRO-0/1). With its hooks detached (the Trainer detaches them when ``train()`` returns) backward
        leaves ``.grad`` as without the engine, for whatever trains the params next (torch_clip.py asks)."""
        if not self._grads_from_backward:
            return True
        hooks = self._hooks()
        return hooks is not None and hooks.attached

    def attach_hooks(self) -> None:
        """Gradients go to this engine during backward again (after ``detach_hooks``)."""
        self.check_open("attach_hooks() (training it)")
        hooks = self._hooks()
        if hooks is not None:
            hooks.attach()

    def detach_hooks(self) -> None:
        """Backward leaves gradients in ``.grad`` until ``attach_hooks``, as without this engine."""
        hooks = self._hooks()
        if hooks is not None:
            hooks.detach()
