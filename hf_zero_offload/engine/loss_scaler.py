"""fp16 loss scaling with DeepSpeed's semantics.

Dynamic (``loss_scale == 0``): start at ``2**initial_scale_power``. On an overflow the step is
skipped; the scale is halved only once ``hysteresis`` overflows have been absorbed (the hysteresis
budget is refilled each time the scale grows), never below ``min_loss_scale``. After
``loss_scale_window`` steps without an overflow, the scale doubles.
Static (``loss_scale > 0``): the scale never changes; overflow steps are still skipped.
An overflow with the dynamic scale at ``min_loss_scale`` and the hysteresis spent raises ``LossScaleAtMinimum``,
as DeepSpeed's ``DynamicLossScaler`` does (its ``raise_error_at_min_scale``, on in ZeRO's optimizers): such a run
only skipped every later step, with no word (a NaN loss: the gradients overflow at any scale).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger("hf_zero_offload")


class LossScaleAtMinimum(RuntimeError):
    """An fp16 step overflowed with the dynamic loss scale at its minimum and the hysteresis spent."""


def _check_fp16(loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale) -> None:
    """The ds_config's bounds (config/schema.py ``FP16``), for options built without a ds_config: a window of 0 failed
    with a ZeroDivisionError at the third step, a hysteresis of 0 never lowered the scale (every step skipped)."""
    def bad(key, want, value):
        return ValueError(f"OffloadOptions.fp16.{key} must be {want}, got {value!r}")

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    def integer(v, lo, hi=None):
        return number(v) and float(v).is_integer() and lo <= v and (hi is None or v <= hi)

    if not (number(loss_scale) and (loss_scale == 0 or 1 <= loss_scale <= 2.0 ** 126)):
        raise bad("loss_scale", "0 (dynamic) or a static scale in [1, 2**126]", loss_scale)
    if not integer(initial_scale_power, 0, 126):
        raise bad("initial_scale_power", "an integer in [0, 126]", initial_scale_power)
    for key, value in (("loss_scale_window", loss_scale_window), ("hysteresis", hysteresis)):
        if not integer(value, 1):
            raise bad(key, "an integer >= 1", value)
    if not (number(min_loss_scale) and 2.0 ** -126 <= min_loss_scale <= 2.0 ** 126):
        raise bad("min_loss_scale", "a number in [2**-126, 2**126]", min_loss_scale)
    if loss_scale == 0 and min_loss_scale > 2.0 ** initial_scale_power:
        initial = 2.0 ** initial_scale_power
        raise bad("min_loss_scale", f"at most the initial scale 2**initial_scale_power = {initial:g}", min_loss_scale)


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    scale_window: int = 1000
    min_scale: float = 1.0
    hysteresis: int = 2
    cur_hysteresis: int = 2
    cur_iter: int = 0
    last_overflow_iter: int = -1
    scale_factor: float = 2.0
    enabled: bool = False     # fp16 on: overflow steps are skipped

    @classmethod
    def from_fp16(cls, *, enabled: bool, loss_scale: float = 0.0, initial_scale_power: int = 16,
                  loss_scale_window: int = 1000, hysteresis: int = 2, min_loss_scale: float = 1.0) -> "LossScaler":
        if not enabled:
            return cls()
        _check_fp16(loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale)
        initial_scale_power, loss_scale_window = int(initial_scale_power), int(loss_scale_window)
        hysteresis = int(hysteresis)
        if loss_scale > 0:
            return cls(scale=float(loss_scale), enabled=True)
        return cls(scale=float(2 ** initial_scale_power), dynamic=True, enabled=True, scale_window=loss_scale_window,
                   min_scale=float(min_loss_scale), hysteresis=hysteresis, cur_hysteresis=hysteresis)

    @classmethod
    def from_options(cls, fields: dict | None) -> "LossScaler":
        """From ``OffloadOptions.fp16_fields`` (``from_fp16``'s keywords, checked by name); None: no loss scaling."""
        return cls() if fields is None else cls.from_fp16(**fields)

    def scale_loss(self, loss):
        """The loss to call backward on: multiplied by the current scale (unchanged at scale 1)."""
        return loss * self.scale if self.scale != 1.0 else loss

    def refuse_overflow_at_minimum(self, overflow: bool, step: int) -> None:
        """Before a step's verdict changes anything: an overflow that ``update`` could no longer answer by lowering
        the scale (DeepSpeed raises there too, in the same words)."""
        if (overflow and self.enabled and self.dynamic and self.scale <= self.min_scale
                and (self.hysteresis == 1 or self.cur_hysteresis == 1)):
            raise LossScaleAtMinimum(
                "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run. (hf_zero_offload: "
                f"step {step} overflowed at the minimum fp16 loss scale {self.min_scale:g} with the hysteresis spent: "
                "its gradients hold inf/NaN at any scale. Look for a NaN loss or inputs, lower fp16.min_loss_scale, "
                "or train in bf16; nothing of this step was applied)")

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step; ``overflow`` says whether its gradients held inf/nan."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.cur_hysteresis == 1:
                    self.scale = max(self.scale / self.scale_factor, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.cur_iter
            # DeepSpeed's count since its 0.17.1 (PR 6976): a window of clean steps after the last overflow (or the
            # start) doubles the scale at the step after it; before, one step earlier (the first at scale_window)
            elif (stable := self.cur_iter - self.last_overflow_iter - 1) > 0 and stable % self.scale_window == 0:
                self.cur_hysteresis = self.hysteresis
                self.scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def check_state_dict(self, state) -> None:
        """Refuse a saved scaler state before anything is loaded: unknown keys, or a value of another
        type than this scaler's (a bool for a flag, a number for the rest; the scale finite and > 0)."""
        if not isinstance(state, dict):
            raise ValueError(f"loss scaler state must be a dict, got {type(state).__name__}")
        unknown = set(state) - set(self.__dict__)
        if unknown:
            raise ValueError(f"loss scaler state has unknown keys {sorted(unknown)}")
        for key, value in state.items():
            flag = isinstance(getattr(self, key), bool)
            ok = isinstance(value, bool) if flag else (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                       and math.isfinite(value))
            if not ok or (key == "scale" and value <= 0):
                want = "a bool" if flag else ("a finite number > 0" if key == "scale" else "a finite number")
                raise ValueError(f"loss scaler state: {key} must be {want}, got {value!r}")

    def load_state_dict(self, state: dict) -> None:
        """Where a saved run's scaling stood, into this scaler as this run configured it. The configuration
        (on or off, dynamic or static, window, hysteresis, minimum) stays this run's: loading it too made a
        bf16 run resumed as fp16 train without loss scaling or overflow skips (the saved scaler was off), and
        an fp16 run resumed as bf16 scale its loss and skip steps. The running values (scale, overflow
        history) carry over between two dynamic scalers; a dynamic one resumed from anything else starts at
        its initial scale. The step count always carries over."""
        self.check_state_dict(state)
        self.cur_iter = int(state.get("cur_iter", self.cur_iter))
        if not (self.dynamic and state.get("dynamic") and state.get("enabled")):
            return
        self.scale = max(float(state.get("scale", self.scale)), self.min_scale)
        self.last_overflow_iter = int(state.get("last_overflow_iter", self.last_overflow_iter))
        self.cur_hysteresis = max(1, min(int(state.get("cur_hysteresis", self.hysteresis)), self.hysteresis))

    def describe(self) -> str:
        """The configuration in a few words (for the log line of a resume that changes it)."""
        if not self.enabled:
            return "no loss scaling"
        return f"dynamic loss scaling from {self.scale:g}" if self.dynamic else f"static loss scale {self.scale:g}"


@dataclass
class StepResult:
    skipped: bool
    grad_norm: float
    loss_scale: float


def unscaled_norm(scaler: LossScaler, sumsq: float, divisor: float = 1.0) -> float:
    """The L2 norm of the gradients before loss scaling (and ``divisor``: the world size for a sum
    over ranks) from ``sumsq``, the squared norm of what backward produced: inf with an infinite
    gradient, nan with a NaN one, as ``torch.nn.utils.clip_grad_norm_`` returns."""
    return math.sqrt(sumsq) / (scaler.scale * divisor)


def decide_step(scaler: LossScaler, sumsq: float, max_grad_norm: float, divisor: float = 1.0,
                skip_nonfinite: bool = False) -> tuple[StepResult, float | None]:
    """One optimizer step's verdict from ``sumsq``, the squared norm of the loss-scaled gradient
    ``divisor`` times over (the sum over ranks: ``divisor`` = world size). Updates the scaler.

    Returns the result to report and ``grad_scale``, the factor the fused kernel applies to the stored
    gradients (unscale, average, clip: ``torch.nn.utils.clip_grad_norm_``'s coefficient clamped to 1),
    or None when fp16 overflowed and the step is skipped. Without fp16 a non-finite norm is a skip only with
    ``skip_nonfinite`` (DeepSpeed's bf16 ``check_grad_overflow``; the scale stays 1); otherwise the step does what
    torch's ``clip_grad_norm_`` + AdamW do: an inf norm clips by 0 (the inf elements become NaN, every other
    gradient 0), a NaN norm by NaN; unclipped, the values go through."""
    finite = math.isfinite(sumsq)
    if skip_nonfinite and not scaler.enabled and not finite:  # (said, as DeepSpeed says each skipped step)
        logger.warning("hf_zero_offload: step skipped: its gradients are not finite (bf16.check_grad_overflow); "
                       "nothing moved")
        return StepResult(True, unscaled_norm(scaler, sumsq, divisor), scaler.scale), None
    if scaler.enabled and not finite:
        norm = unscaled_norm(scaler, sumsq, divisor)  # before the update: what grad_norm() reported for this step
        scaler.update(True)
        return StepResult(True, norm, scaler.scale), None
    unscale = scaler.scale * divisor
    norm = unscaled_norm(scaler, sumsq, divisor)
    clip = 1.0
    if max_grad_norm > 0:  # min(nan, 1.0) is nan: a NaN norm clips by NaN, as torch's clamp does
        clip = min(max_grad_norm / (norm + 1e-6), 1.0)
    scaler.update(False)
    return StepResult(False, norm, scaler.scale), clip / unscale


class LossScaled:
    """The loss-scaling face both engines show the training loop."""
    scaler: LossScaler

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss):
        return self.scaler.scale_loss(loss)

    def _refuse_torch_grad_scaler(self, grads_from_backward: bool) -> None:
        """The error for a ``step()`` called by ``torch.amp.GradScaler.step``, which sets ``found_inf`` and
        ``grad_scale`` on the optimizer and deletes them only after a step that returns: left there, every later
        plain ``step()`` (the scaler dropped, as the error advises) was refused as GradScaler's."""
        for name in ("found_inf", "grad_scale"):
            self.__dict__.pop(name, None)
        raise RuntimeError(f"torch.amp.GradScaler with {type(self).__name__}: " + (
            "the engine takes each gradient during backward and frees .grad, so GradScaler's unscale_ and inf checks "
            "see none" if grads_from_backward else "the engine unscales .grad and checks it for overflow at step(), "
            "across the ranks") + "; scale the loss with the engine's own scaler instead: "
            "OffloadOptions(fp16={\"loss_scale\": 0, ...}), engine.scale_loss(loss).backward(), "
            "engine.step() (it unscales, skips overflow steps and adjusts the scale)")
