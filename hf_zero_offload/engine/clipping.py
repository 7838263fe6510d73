"""``engine.clip_grad_norm_(max_norm)``: torch's ``clip_grad_norm_`` for gradients that already left.

The engines take each gradient during backward (OffloadAdam, ZeRO-2) and free ``.grad``, so
``torch.nn.utils.clip_grad_norm_`` between backward and ``step()`` finds nothing, clips nothing and returns 0.0; under
ZeRO-0/1 it finds this rank's ``.grad`` before the average and clips by the wrong norm. Called in its place,
``clip_grad_norm_`` returns this step's global norm (``grad_norm()``: unscaled, averaged over the ranks, every
accumulated micro-batch) and has ``step()`` clip by ``max_norm``: the same coefficient ``OffloadOptions(max_grad_norm)``
applies inside the fused Adam pass, so there is one clipping per step and no second pass over the gradients.
``accelerator.clip_grad_norm_`` on an adapted Accelerator calls it (accelerator_patch.py), and so does
``torch.nn.utils.clip_grad_norm_`` over an engine's params once an engine is built (torch_clip.py).

What torch would do and the engine cannot is refused by name, before anything moves: another ``norm_type`` than 2
(the engine sums squares only), params that are not all of the engine's trainable ones (their norm is not the one the
engine can clip by), a ``max_norm`` other than ``OffloadOptions.max_grad_norm`` where that is set (two clippings with
two norms), a second call for the same step, and a backward between the call and ``step()`` (torch clips what
``.grad`` held at the call and adds the later gradient unclipped; the engine's one clipping would clip both).
"""
from __future__ import annotations

import math
import reprlib

import torch


class StepClipping:
    """The mixin of ``AdamCore`` that owns a clipping asked for the coming step (``_clip_request``)."""
    _clip_request: tuple[float, object] | None = None  # (max_norm, _arrivals() at the call), until step/zero_grad

    @property
    def holds_whole_grad(self) -> bool:
        """``.grad`` holds the step's whole gradient (ZeRO-0/1 on one rank: read at the step, nothing to average), so
        torch's clipping of ``.grad`` by a norm computed from it is right; elsewhere it is gone, or this rank's alone."""
        return not self._grads_from_backward and self.world_size == 1

    def clip_grad_norm_(self, max_norm, norm_type=2.0, *, parameters=None, error_if_nonfinite: bool = False,
                        caller: str | None = None) -> torch.Tensor:
        """Clip this step's gradients (the sum of the backward passes since the last ``step()``) by ``max_norm`` at
        ``step()``, as ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` clips ``.grad`` before a torch
        optimizer's step; returns their total L2 norm before clipping (a 0-dim float32 tensor on the params' device,
        inf or nan as torch's). Every rank of a ``ShardedAdam`` calls it (the norm is one small collective).
        ``parameters``: where given (Accelerate's and torch's signature), they must be the engine's trainable params.
        ``error_if_nonfinite``: torch's, raised as torch raises it (nothing is clipped). ``caller``: who names the
        problem in a refusal (torch_clip.py: ``torch.nn.utils.clip_grad_norm_``, which delegates here)."""
        self.check_open("clip_grad_norm_()")
        name = type(self).__name__
        who = caller or f"{name}.clip_grad_norm_"
        if parameters is not None and (problem := self._clip_params_problem(parameters)):
            raise ValueError(f"{who}: {problem}")
        try:  # (first: torch's order, clip_grad_norm_(model.parameters(), 1.0), was refused as norm_type=1.0)
            if isinstance(max_norm, torch.Tensor) and max_norm.requires_grad:  # (a one-element param: a number)
                raise TypeError
            max_norm = float(max_norm)
        except (TypeError, ValueError, RuntimeError):  # (RuntimeError: a tensor of several elements)
            hint = "" if caller else (": the engine's takes max_norm first (the params are its own; Accelerate's "
                                      "signature passes them as parameters=...), where torch.nn.utils.clip_grad_norm_ "
                                      "takes the params first")
            raise TypeError(f"{who}: max_norm must be a number, got {reprlib.repr(max_norm)}{hint}") from None
        try:
            p_norm = float(norm_type)
        except (TypeError, ValueError):
            p_norm = None
        if p_norm != 2.0:
            raise ValueError(f"{who}: norm_type={norm_type!r}: the engine computes the L2 norm of "
                             "the gradients only (norm_type=2), as they arrive; another norm is not available")
        if not max_norm > 0:  # (inf is allowed: the norm without clipping, as transformers' Trainer asks for it)
            raise ValueError(f"{who}: max_norm={max_norm!r}: need a number > 0 (torch's 0 zeroes "
                             "every gradient; for the norm alone ask for inf, or call grad_norm())")
        configured = self.options.max_grad_norm
        if configured > 0 and configured != max_norm:
            raise ValueError(f"{who}: max_norm={max_norm:g} but the engine clips every step by "
                             f"OffloadOptions.max_grad_norm={configured:g}: the two would be two clippings; leave "
                             "max_grad_norm at 0 to clip here, or ask here for the same value (one clipping)")
        if self._clip_request is not None:
            raise RuntimeError(f"{who}: called a second time for this step (clipped by "
                               f"{self._clip_request[0]:g} already): torch would clip the clipped gradients again, "
                               "which the engine's one clipping at step() cannot; call it once between the last "
                               "backward of a step and step()")
        norm = self.grad_norm()
        if error_if_nonfinite and not math.isfinite(norm):  # (torch's words; every rank has the same global norm)
            raise RuntimeError(f"The total norm of order {p_norm} for gradients from `parameters` is non-finite, so it "
                               "cannot be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")
        self._clip_request = (max_norm, self._prepared_at)  # (grad_norm() prepared the step: its arrivals)
        return torch.tensor(norm, dtype=torch.float32, device=self.device)

    def holds_any(self, parameters) -> bool:
        """Whether any of ``parameters`` (a list, or one tensor) is in this engine's param groups."""
        given = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        return any(id(p) in mine for p in given)

    def _step_max_norm(self) -> float:
        """``step()``'s clipping norm (0: none): the one asked for this step, else ``OffloadOptions.max_grad_norm``.
        Read before the step prepares its gradients (ZeRO-0/1 take ``.grad`` then, so arrivals reset)."""
        if self._clip_request is None:
            return self.options.max_grad_norm
        max_norm, arrivals = self._clip_request
        if self._arrivals() != arrivals:
            raise RuntimeError(f"{type(self).__name__}.step(): a gradient arrived after clip_grad_norm_ (a backward "
                               "between it and step()): torch clips what .grad held at the call and adds the later "
                               "gradient unclipped, which the engine's one clipping cannot do; call clip_grad_norm_ "
                               "after the last backward of the step (the step is not taken; zero_grad() drops it)")
        return max_norm

    def _clip_params_problem(self, parameters) -> str | None:
        """Why ``clip_grad_norm_(parameters)`` cannot be honoured (None: it can). Params without a gradient that are
        not the engine's (frozen ones in ``model.parameters()``) are left out, as torch leaves them out; an engine
        param frozen since the build may be missing (it gets no gradient)."""
        given = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        mine = {id(p): p for p, _, _ in self._flat}
        ids = {id(p) for p in given}
        others = [p for p in given if id(p) not in mine and (p.requires_grad or p.grad is not None)]
        if others:
            shapes = ", ".join(str(tuple(p.shape)) for p in others[:3])
            return (f"{len(others)} of the given params ({shapes}{', ...' if len(others) > 3 else ''}) are not "
                    "trainable params of this engine: torch would clip them all by their joint norm, and the engine "
                    "knows its own gradients only; clip another optimizer's params on their own")
        if len(ids) < len(given):  # (torch sums a gradient once per time its param is listed)
            twice = next(p for k, p in enumerate(given) if any(q is p for q in given[:k]))
            return (f"a param ({self._param_label(twice) if id(twice) in mine else tuple(twice.shape)}) is given "
                    "more than once (a tied weight listed with each module?): torch would count its gradient once "
                    "per listing in the norm, the engine counts each param once; pass model.parameters()")
        missing = [p for i, p in mine.items() if i not in ids and p.requires_grad]
        if missing:
            labels = ", ".join(self._param_label(p) for p in missing[:3])
            return (f"the given params leave out {len(missing)} of the engine's {len(mine)} trainable params "
                    f"({labels}{', ...' if len(missing) > 3 else ''}): the engine clips all of its params by their "
                    "global norm, not a subset by its own; pass all of them (model.parameters())")
        return None
