"""A validated ds_config dict -> :class:`~.training.TrainingConfig`, with ``"auto"`` (and missing keys) taken
from an :class:`~.training.ArgsView`; the rules are in the package docstring (:mod:`hf_zero_offload.config`).
"""
from __future__ import annotations

import logging
import math
import numbers
from typing import Any

from ..ops.hparams import fp32_problem
from .loader import Checked, check
from .schema import AUTO, ConfigError
from .training import (DEFAULT_BUCKET_SIZE, ArgsView, DPUConfig, FP16Config, OptimizerConfig, SchedulerConfig,
                       TrainingConfig, ZeroConfig)

logger = logging.getLogger("hf_zero_offload")
_said: set[str] = set()  # a Trainer resolves its config several times (built, at train(), with the step count)


def reset_warnings() -> None:
    """Say each config warning again (a test, or a process that trains anew)."""
    _said.clear()


def _warn_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning(message)


_MISSING = object()
# The Trainer schedules a "scheduler" block stands for (transformers' DeepSpeed guide: WarmupDecayLR is
# --lr_scheduler_type linear, WarmupLR constant_with_warmup; WarmupCosineLR is a warm-up then a cosine to a floor,
# the Trainer's cosine family); "linear" is also the default, so it goes with any of them.
SCHEDULE_OF = {"WarmupLR": ("linear", "constant_with_warmup"), "WarmupDecayLR": ("linear",),
               "WarmupCosineLR": ("linear", "cosine", "cosine_with_min_lr", "cosine_warmup_with_min_lr")}


def _number(v: Any) -> bool:  # numpy's too (a sweep's np.float32 learning rate), as the plain Trainer takes them
    return isinstance(v, numbers.Real) and not isinstance(v, bool)  # (numpy's bool_ is no numbers.Real)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def _show(v: Any) -> str:
    return repr(list(v)) if isinstance(v, tuple) else repr(v)


class _Resolver:
    def __init__(self, cfg: dict, args: ArgsView | None, source: str):
        self.cfg, self.args, self.source = cfg, args, source
        self.needs_args: list[str] = []  # "auto" without args
        self.problems: list[str] = []  # "auto" whose args value is unknown
        self.mismatches: list[str] = []

    def get(self, path: str) -> Any:
        node: Any = self.cfg
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def take(self, path: str, arg: Any, arg_name: str, default: Any, match: bool = True, example: str = "") -> Any:
        """Explicit value (checked against ``arg``), "auto" / missing -> ``arg`` (missing without args -> default).
        ``example``: a value to suggest where "auto" cannot be resolved."""
        v = self.get(path)
        if v is AUTO or v == AUTO:
            if self.args is None:
                self.needs_args.append(path)
            elif arg is None:
                self.problems.append(f"{path}: \"auto\" needs {arg_name}, which is unknown here: replace \"auto\" "
                                     f"with a value{example}")
            return arg if arg is not None else default
        if v is _MISSING:
            return arg if self.args is not None and arg is not None else default
        if self.args is not None and match and arg is not None and not _same(v, arg):
            self.mismatches.append(f"{path}={_show(v)} vs {arg_name} {_show(arg)}")
        return v

    def batch(self) -> tuple[int, int, int]:
        a = self.args
        if a is not None:
            micro = self.take("train_micro_batch_size_per_gpu", a.per_device_train_batch_size,
                              "--per_device_train_batch_size", 1)
            gas = self.take("gradient_accumulation_steps", a.gradient_accumulation_steps,
                            "--gradient_accumulation_steps", 1)
            total = a.world_size * a.per_device_train_batch_size * a.gradient_accumulation_steps
            self.take("train_batch_size", total,
                      "world_size*per_device_train_batch_size*gradient_accumulation_steps", total)
            return a.world_size * micro * gas, micro, gas
        vals = {k: self.take(k, None, "", None) for k in
                ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
        tbs, micro, gas = vals.values()
        if self.needs_args:
            return 1, 1, 1
        if tbs is None:  # world_size unknown without args: assume 1
            micro, gas = micro or 1, gas or 1
            return micro * gas, micro, gas
        if micro is None and gas is None:
            micro, gas = tbs, 1
        elif micro is None:
            micro = tbs // gas
        elif gas is None:
            gas = tbs // micro
        if micro < 1 or gas < 1 or tbs % (micro * gas):
            raise ConfigError(f"{self.source}: train_batch_size: {tbs} is not a multiple of train_micro_batch_"
                              f"size_per_gpu * gradient_accumulation_steps = {micro} * {gas} (times world_size)")
        return tbs, micro, gas

    def optimizer(self) -> OptimizerConfig | None:
        opt = self.cfg.get("optimizer")
        if opt is None:
            return None
        a = self.args
        p = "optimizer.params."
        lr = self.take(p + "lr", a and a.learning_rate, "--learning_rate", 1e-3)
        betas = self.take(p + "betas", a and (a.adam_beta1, a.adam_beta2), "--adam_beta1/--adam_beta2",
                          (0.9, 0.999))
        eps = self.take(p + "eps", a and a.adam_epsilon, "--adam_epsilon", 1e-8)
        wd = self.take(p + "weight_decay", a and a.weight_decay, "--weight_decay", 0.0)
        w_mode = _adam_w_mode(opt)
        if opt["type"] == "AdamW" and opt.get("params", {}).get("adam_w_mode") is False:
            _warn_once(f'{self.source}: "type": "AdamW" with adam_w_mode=false runs AdamW (decoupled weight decay), as '
                       'in DeepSpeed; for L2-style decay use "type": "Adam"')
        return OptimizerConfig(opt["type"], float(lr), (float(betas[0]), float(betas[1])), float(eps), float(wd),
                               bool(w_mode))

    def scheduler(self) -> SchedulerConfig | None:
        sched = self.cfg.get("scheduler")
        if sched is None:
            return None
        a, p, kind = self.args, "scheduler.params.", sched["type"]
        params = sched.get("params", {})
        # 0 and 1 are the same warm-up (the schedulers take max(1, n)): compared as such, and the message shows the
        # user's --warmup_steps, not the 1 it became (a config's 500 was said to contradict "--warmup_steps 1")
        n = self.take(p + "warmup_num_steps", a and max(1, a.warmup_steps), "--warmup_steps", 1000, match=False)
        if a is not None and not isinstance(n, str) and max(1, n) != max(1, a.warmup_steps):
            self.mismatches.append(f"{p}warmup_num_steps={_show(n)} vs --warmup_steps {_show(a.warmup_steps)}")
        if a is not None and a.lr_scheduler_type not in SCHEDULE_OF[kind]:
            # the block replaces the Trainer's schedule (as under DeepSpeed): an explicit other one would be dropped
            self.mismatches.append(f"scheduler.type={kind!r} vs --lr_scheduler_type {a.lr_scheduler_type} "
                                   "(drop one of them; a shipped config: copy it without its 'scheduler' block)")
        elif a is not None and a.lr_scheduler_type != "linear":  # (linear is also the default: not a choice made)
            self._other_shape(kind, a.lr_scheduler_type, params.get("warmup_type", "log"), a.warmup_steps)
        total = None
        if kind != "WarmupLR":
            total = self.take(p + "total_num_steps", a and a.max_steps, "the number of training steps", None)
            if total is None and not self.needs_args and not self.problems:
                self.problems.append(f"{p}total_num_steps: required by {kind} (give it, or \"auto\" with "
                                     "the number of training steps known)")
        common = dict(type=kind, warmup_num_steps=int(n), warmup_type=params.get("warmup_type", "log"),
                      total_num_steps=None if total is None else int(total))
        if kind == "WarmupCosineLR":  # its peak is each param group's own lr: no LR of its own to resolve
            return SchedulerConfig(**common, warmup_min_ratio=float(params.get("warmup_min_ratio", 0.0)),
                                   cos_min_ratio=float(params.get("cos_min_ratio", 1e-4)))
        lo = 0.0 if params.get("warmup_min_lr", 0.0) == AUTO else params.get("warmup_min_lr", 0.0)
        # left out: DeepSpeed's WarmupLR peaks at the optimizer's (first group's) lr, WarmupDecayLR at 1e-3; with the
        # Trainer's arguments, --learning_rate (as "auto" would: docs/CONFIGURATION.md)
        peak = self.get("optimizer.params.lr") if kind == "WarmupLR" else None
        hi = self.take(p + "warmup_max_lr", a and a.learning_rate, "--learning_rate",
                       peak if isinstance(peak, (int, float)) and not isinstance(peak, bool) else 1e-3)
        return SchedulerConfig(**common, warmup_min_lr=float(lo), warmup_max_lr=float(hi))

    def _other_shape(self, kind: str, given: str, warmup_type: str, warmup_steps) -> None:
        """A WARNING where the block runs in place of an explicit --lr_scheduler_type it goes with (as under
        DeepSpeed) but not in its shape: an outside probe's constant_with_warmup ran DeepSpeed's logarithmic warm-up
        (step 1 at 0.005 where the Trainer's is at 0.0025, weights 0.056 apart after 8 steps) with no word."""
        how = []
        if warmup_type == "log" and warmup_steps and warmup_steps > 1:
            how.append('its warm-up is logarithmic (DeepSpeed\'s default "warmup_type": "log"; "linear" in the block '
                       "warms up as the Trainer does)")
        if kind == "WarmupCosineLR":
            how.append("its cosine is DeepSpeed's: one step later than the Trainer's, down to cos_min_ratio")
        if how:
            _warn_once(f"{self.source}: scheduler.type={kind!r} runs in place of --lr_scheduler_type {given}, as under "
                       f"DeepSpeed, but not in its shape: {'; '.join(how)}")

    def check_schedule(self, s: SchedulerConfig) -> None:
        """Rules across the resolved scheduler values (a value may come from the arguments)."""
        p = "scheduler.params."
        if s.type != "WarmupCosineLR" and s.warmup_min_lr > s.warmup_max_lr:
            # it warmed down: step 1 ran at warmup_min_lr (100x --learning_rate in the report that found it), the
            # only LR key compared with nothing; the ratios of WarmupCosineLR are refused above 1 alike
            given = self.get(p + "warmup_max_lr") not in (AUTO, _MISSING)
            origin = " (from --learning_rate)" if self.args is not None else " (from optimizer.params.lr)"
            raise ConfigError(f"{self.source}: {p}warmup_min_lr: {s.warmup_min_lr:g} is above {p}warmup_max_lr "
                              f"{s.warmup_max_lr:g}" + ("" if given else origin) + ": the "
                              "warm-up would go down; lower warmup_min_lr (0 is DeepSpeed's default)")
        placeholder = self.args is not None and self.args.max_steps_placeholder  # the count comes at train start
        if s.total_num_steps is not None and s.warmup_num_steps > s.total_num_steps and not placeholder:
            # DeepSpeed's WarmupDecayLR warns too: the run ends inside the warm-up, never at the peak LR, never decaying
            _warn_once(f"{self.source}: {p}total_num_steps {s.total_num_steps} is less than warmup_num_steps "
                       f"{s.warmup_num_steps}: {s.type} warms up for the whole run (it never reaches its peak LR nor "
                       "decays)")

    def zero(self) -> ZeroConfig:
        z = self.cfg.get("zero_optimization", {})
        off = z.get("offload_optimizer", {})
        rbs = z.get("reduce_bucket_size", DEFAULT_BUCKET_SIZE)
        if rbs == AUTO:
            hidden = self.args.hidden_size if self.args is not None else None
            rbs = self.take("zero_optimization.reduce_bucket_size", hidden and hidden * hidden,
                            "the model's hidden_size (its config's hidden_size, d_model or n_embd)", DEFAULT_BUCKET_SIZE,
                            example=f", a number of elements (DeepSpeed's default: {DEFAULT_BUCKET_SIZE})")
        agbs = z.get("allgather_bucket_size", DEFAULT_BUCKET_SIZE)
        dpu = z.get("delayed_param_update", {})
        if self.args is not None and self.args.sharded_ddp and z.get("stage") == 0:  # it ran stage 2, without a word
            self.mismatches.append("zero_optimization.stage=0 (no partitioning) vs --sharded_ddp (ZeRO stage 1 or 2: "
                                   "set the stage, or leave it out for 2)")
        return ZeroConfig(
            stage=z.get("stage", 0),
            offload=off.get("device") == "cpu" or z.get("cpu_offload", False),
            pin_memory=off.get("pin_memory", z.get("cpu_offload_use_pin_memory", True)),
            overlap_comm=z.get("overlap_comm", False),
            contiguous_gradients=z.get("contiguous_gradients", True),
            reduce_scatter=z.get("reduce_scatter", True),
            reduce_bucket_size=int(rbs),
            allgather_partitions=z.get("allgather_partitions", True),
            allgather_bucket_size=int(rbs if agbs == AUTO else agbs),
            round_robin_gradients=z.get("round_robin_gradients", False),
            delayed_param_update=DPUConfig(dpu.get("enabled", False), dpu.get("warmup_steps", 40)),
            state_dtype=off.get("state_dtype", "fp32"),
            cpu_threads=None if off.get("cpu_threads", AUTO) == AUTO else int(off["cpu_threads"]),
        )

    def check_arguments(self) -> None:
        """The TrainingArguments values the run takes, named as the user wrote them (the file's own values are checked
        by the schema): --gradient_accumulation_steps 0 divided by zero after the model work, -1 was named as the
        engine's OffloadOptions field, --learning_rate -1 as "OffloadAdam param group 0: lr"."""
        a = self.args
        if a is None:
            return
        count = (lambda v: isinstance(v, numbers.Integral) and _number(v) and v >= 1, "an int >= 1")
        nonneg = (lambda v: _number(v) and math.isfinite(v) and v >= 0, "a finite number >= 0")
        beta = (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)")
        rules = (("gradient_accumulation_steps", count), ("per_device_train_batch_size", count),
                 ("learning_rate", nonneg), ("weight_decay", nonneg), ("adam_epsilon", nonneg),
                 ("adam_beta1", beta), ("adam_beta2", beta),
                 ("max_grad_norm", (nonneg[0], nonneg[1] + " (0 turns clipping off)")))
        bad = [f"--{name} {getattr(a, name)!r}: must be {what}" for name, (ok, what) in rules
               if not ok(getattr(a, name))]
        if bad:
            raise ConfigError("; ".join(bad))
        # in range as Python floats, but the step computes in fp32 (ops/hparams.py): --learning_rate 1e300 trained
        # every weight to NaN, --adam_epsilon 1e-320 with no eps
        # (in the mode the run steps in: an "Adam" block's L2 decay forms no 1 - lr * weight_decay to overflow)
        problem = fp32_problem(lr=a.learning_rate, beta1=a.adam_beta1, eps=a.adam_epsilon, weight_decay=a.weight_decay,
                               adamw=_adam_w_mode(self.cfg.get("optimizer")))
        if problem:
            name = _ARG_OF[problem[0]]
            raise ConfigError(f"--{name} {getattr(a, name)!r}: {problem[1]}")

    def check_fp32(self, opt: OptimizerConfig | None, sched: SchedulerConfig | None) -> None:
        """The resolved optimizer values, and the peak lr a WarmupLR/WarmupDecayLR sets, as the step computes with them
        (``ops.hparams.fp32_problem``), named by their key (a value an "auto" took from the arguments was named as
        the argument already: check_arguments)."""
        a = self.args
        if opt is None:  # the arguments' values run (checked by check_arguments), or the defaults: a peak lr is left
            opt = OptimizerConfig() if a is None else OptimizerConfig(
                lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon, weight_decay=a.weight_decay)
        p = "optimizer.params."
        lrs = [(p + "lr", opt.lr)]
        if sched is not None and sched.type != "WarmupCosineLR":  # (its ratios scale the optimizer's lr down)
            lrs.append(("scheduler.params.warmup_max_lr", sched.warmup_max_lr))
        for lr_key, lr in lrs:
            problem = fp32_problem(lr=lr, beta1=opt.betas[0], eps=opt.eps, weight_decay=opt.weight_decay,
                                   adamw=opt.adam_w_mode)
            if problem:
                key = lr_key if problem[0] == "lr" else p + problem[0]
                raise ConfigError(f"{self.source}: {key}: {problem[1]}")

    def run(self) -> TrainingConfig:
        a, cfg = self.args, self.cfg
        self.check_arguments()
        tbs, micro, gas = self.batch()
        clip = self.take("gradient_clipping", a and a.max_grad_norm, "--max_grad_norm", 0.0)  # DeepSpeed's: off
        fp16 = bool(self.take("fp16.enabled", a and a.fp16, "--fp16", False))
        bf16 = bool(self.take("bf16.enabled", a and a.bf16, "--bf16", False))
        optimizer, scheduler, zero = self.optimizer(), self.scheduler(), self.zero()
        if self.needs_args:
            raise ConfigError(f"{self.source}: \"auto\" values need TrainingArguments (resolve(..., args=ArgsView"
                              "(...))), or replace them with numbers: " + ", ".join(self.needs_args))
        if self.problems:
            raise ConfigError(f"{self.source}: cannot resolve: " + "; ".join(self.problems))
        if self.mismatches:  # one line (a command line prints it as "error: ..."), every key on it
            raise ConfigError(f"{self.source}: ds_config values contradict TrainingArguments (set them to \"auto\" "
                              "or to the TrainingArguments values): " + "; ".join(self.mismatches))
        if fp16 and bf16:
            raise ConfigError(f"{self.source}: fp16.enabled and bf16.enabled: cannot both be true")
        check_overflow = (cfg.get("bf16") or {}).get("check_grad_overflow") is True
        if check_overflow and not bf16:
            _warn_once(f"hf_zero_offload: {self.source}: bf16.check_grad_overflow has no effect in a run without bf16 "
                       "(as in DeepSpeed): a step with non-finite gradients is applied"
                       + ("; fp16's loss scaling skips overflow steps itself" if fp16 else ""))
        if scheduler is not None:
            self.check_schedule(scheduler)
        self.check_fp32(optimizer, scheduler)
        f = cfg.get("fp16", {})
        fp16_cfg = FP16Config(fp16, float(f.get("loss_scale", 0.0)), f.get("initial_scale_power", 16),
                              f.get("loss_scale_window", 1000), f.get("hysteresis", 2),
                              float(f.get("min_loss_scale", 1.0)))
        return TrainingConfig(tbs, micro, gas, float(clip), fp16_cfg, bf16, optimizer, scheduler, zero,
                              cfg.get("steps_per_print", 10), cfg.get("wall_clock_breakdown", False), self.source,
                              grad_accum_fp32=(cfg.get("data_types") or {}).get("grad_accum_dtype") == "fp32",
                              check_grad_overflow=bf16 and check_overflow)


def _adam_w_mode(opt: dict | None) -> bool:
    """Whether the run's Adam decays as AdamW: unless an "Adam" block says adam_w_mode false (DeepSpeed reads the key
    for "Adam" only); AdamW without a block (the Trainer's)."""
    return opt is None or opt["type"] == "AdamW" or opt.get("params", {}).get("adam_w_mode") is not False


# the TrainingArguments an optimizer key's "auto" takes (check_arguments)
_ARG_OF = {"lr": "learning_rate", "eps": "adam_epsilon", "weight_decay": "weight_decay"}


def resolve(raw_or_path: Any, args: ArgsView | None = None) -> TrainingConfig:
    """Validate a ds_config (path, dict, or ``Checked``: validated already) and resolve it, with ``"auto"``
    taken from ``args``."""
    checked = raw_or_path if isinstance(raw_or_path, Checked) else check(raw_or_path)
    return _Resolver(checked.cfg, args, checked.source).run()
