"""Adam's hyper-parameters as the kernel computes with them.

The kernel takes fp32 per-step constants (csrc/adam_scalar.cpp, ``make_adam_args``): the step size
lr / (1 - beta1^t) and the AdamW decay 1 - lr * weight_decay, formed in double and rounded to fp32, and eps and
weight_decay rounded to fp32. A value that is finite and in range as a Python float can still be no fp32 value:
``lr=1e300`` became an inf step size (every param NaN after one step) and ``eps=1e-320`` an eps of 0 (0/0 where a
gradient is 0), without a word. torch.optim.AdamW rounds the same constants to fp32 (``param.addcdiv_(value=...)``
raises "value cannot be converted to type float without overflow" for such an lr); here every such value is refused
by name, with the constant it would have made, before anything moves. A value that only rounds (lr=1e-50: a step
size of 0, the update lost in fp32 as in torch) computes what torch's does and is taken.

A 0-dim bf16/fp16 tensor lr, weight_decay or beta is refused too: torch.optim.AdamW keeps such a tensor through its
arithmetic, so it forms the step size and the decay in that dtype (1 - 1e-3 * 0.1 is 1.0 in bf16: the decay
vanishes; a bf16 lr of 1e-2 was 1.15e-3 off torch after 3 steps in a probe), while the kernel forms them in double.
fp32 and fp64 tensors are taken (an fp32 tensor lr: torch forms the constants in fp32 arithmetic, within an ulp of
the kernel's: 1.5e-8 apart after 3 steps).

Pure Python (no torch import at module level): the ds_config resolver names its keys with the same rules.
"""
from __future__ import annotations

import ctypes
import math
import numbers

FLT_MAX = 3.4028234663852886e38
_FLT_TRUE_MIN = 1.401298464324817e-45  # the smallest fp32 above 0 (a subnormal)


def _fp32(x: float) -> float:
    """``x`` rounded to fp32 as a C cast rounds it (to nearest even; inf past the largest finite fp32)."""
    return ctypes.c_float(x).value


def next_step(counts) -> int:
    """The step a group whose params have taken ``counts`` steps takes next, for the check: the earliest (its step
    size lr / (1 - beta1^t) the largest, the one that must fit in fp32); 1 for a group with none."""
    return 1 + min(counts, default=0)


def fp32_problem(*, lr: float, beta1: float, eps: float, weight_decay: float, adamw: bool = True,
                 step: int = 1) -> tuple[str, str] | None:
    """(key, why) for the first hyper-parameter whose fp32 constant is not what it says, or None. The values are
    numbers already checked for range (finite, >= 0, beta1 in [0, 1)). ``step``: the 1-based step the constants
    are for; 1 (the largest step size, lr / (1 - beta1)) where the caller does not know it."""
    for key, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if math.isinf(_fp32(v)):
            return key, (f"{key}={v!r} overflows float32 (largest {FLT_MAX:.4g}), the precision the step computes "
                         "in")
    if eps != 0 and _fp32(eps) == 0:
        return "eps", (f"eps={eps!r} is 0 in float32 (smallest {_FLT_TRUE_MIN:.4g}), the precision the step "
                       "computes in: the denominator would have no eps, 0/0 where a gradient is 0; give 0 to mean "
                       "none, or a larger eps")
    step_size = lr / (1.0 - beta1 ** step)
    if math.isinf(_fp32(step_size)):
        return "lr", (f"lr={lr!r} makes the step size lr / (1 - beta1^t) = {step_size:.4g} at step {step} (beta1="
                      f"{beta1!r}), which overflows float32 (largest {FLT_MAX:.4g}): torch.optim.AdamW's step "
                      "raises there too")
    decay = 1.0 - lr * weight_decay
    if adamw and math.isinf(_fp32(decay)):
        return "weight_decay", (f"weight_decay={weight_decay!r} with lr={lr!r} makes the decay 1 - lr * weight_decay "
                                f"= {decay:.4g}, which overflows float32 (largest {FLT_MAX:.4g})")
    return None


def sixteen_bit_problem(key: str, v) -> str | None:
    """Why a 0-dim tensor hyper-parameter of a 16-bit dtype is refused (module docstring), or None."""
    dtype = getattr(v, "dtype", None)
    if dtype is None or str(dtype) not in ("torch.bfloat16", "torch.float16"):
        return None
    name = str(dtype).replace("torch.", "")
    return (f"{key} is a {name} tensor: torch.optim.AdamW computes the step size lr / (1 - beta1^t) and the decay "
            f"1 - lr * weight_decay from it in {name} (the decay of a weight_decay below 2^-9 rounds away), the "
            "kernel in float64 then float32, so the two would differ; give a Python float or a float32/float64 "
            f"tensor ({key}.item(), or .float())")


def check_hyperparameters(*, lr, betas, eps, weight_decay, adamw: bool = True, step: int = 1) -> None:
    """Adam's hyper-parameters as a step uses them (a param group's values, as they are): lr, eps and
    weight_decay finite and >= 0, two betas in [0, 1); a one-element tensor counts as its value, one of a
    16-bit dtype is refused; the fp32 constants they make must be what they say (``fp32_problem``). A ValueError
    names the first bad one. Checked at every step, not only when an optimizer is built: an LR scheduler (or an
    edited param group) that yields nan, inf or a negative value would otherwise corrupt every master it reaches."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be two numbers, got {betas!r}") from None
    # plain floats well inside fp32's range (nan fails every comparison) pass at the cost of a few compares: this
    # runs at every kernel call
    if (type(lr) is float and type(eps) is float and type(weight_decay) is float and type(beta1) is float
            and type(beta2) is float and 0.0 <= lr < 1e30 and (eps == 0.0 or 1e-30 < eps < 1e30)
            and 0.0 <= weight_decay < 1e30 and 0.0 <= beta1 < 0.999999 and 0.0 <= beta2 < 1.0
            and lr * weight_decay < 1e30):
        return
    values = {}
    for name, v, top in (("lr", lr, math.inf), ("eps", eps, math.inf), ("weight_decay", weight_decay, math.inf),
                         ("beta1", beta1, 1.0), ("beta2", beta2, 1.0)):
        if hasattr(v, "numel") and hasattr(v, "item") and v.numel() == 1:
            if name != "eps" and (why := sixteen_bit_problem(name, v)):  # (a 16-bit eps is added as its value)
                raise ValueError(why)
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= v < top:
            want = "a finite number >= 0" if top == math.inf else "in [0, 1)"
            raise ValueError(f"{name} must be {want}, got {v!r}")
        try:
            values[name] = float(v)
        except OverflowError:  # an int past any float (10**400): refused as the overflow it is
            raise ValueError(f"{name}={str(v)[:20]}... ({len(str(v))} digits) overflows float32 (largest "
                             f"{FLT_MAX:.4g}), the precision the step computes in") from None
    problem = fp32_problem(lr=values["lr"], beta1=values["beta1"], eps=values["eps"],
                           weight_decay=values["weight_decay"], adamw=bool(adamw), step=step)
    if problem:
        raise ValueError(problem[1])
