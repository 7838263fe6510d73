"""``ds_config.json`` -> validated, frozen dataclasses, with ``"auto"`` resolved from TrainingArguments values.

The file uses DeepSpeed's key names, so a DeepSpeed ZeRO-1/2 config (the 2021 blog's ``ds_config_1gpu.json``, or
today's form with ``"offload_optimizer": {"device": "cpu"}`` and ``"auto"``) loads unchanged. Nothing here imports
transformers: the Trainer integration copies the few values it needs into an :class:`ArgsView`.

``load_config(path_or_dict)`` reads and validates; ``resolve(raw_or_path, args)`` returns a :class:`TrainingConfig`.
Every problem is a :class:`ConfigError` naming the file (or ``<dict>``) and the key path.

"auto" sources (``resolve(..., args)``; with ``args=None`` each "auto" below is an error, listed together, except
the two marked *):

=============================================  ================================================================
key                                            value
=============================================  ================================================================
train_micro_batch_size_per_gpu                 per_device_train_batch_size
gradient_accumulation_steps                    gradient_accumulation_steps
train_batch_size                               world_size * micro batch * gradient_accumulation_steps
gradient_clipping                              max_grad_norm
optimizer.params.lr / betas / eps              learning_rate / [adam_beta1, adam_beta2] / adam_epsilon
optimizer.params.weight_decay                  weight_decay
scheduler.params.warmup_min_lr *               0
scheduler.params.warmup_max_lr                 learning_rate
scheduler.params.warmup_num_steps              max(1, warmup_steps)  (DeepSpeed rejects 0)
scheduler.params.total_num_steps               max_steps (error when unknown)
fp16.enabled / bf16.enabled                    fp16 / bf16
zero_optimization.reduce_bucket_size           hidden_size * hidden_size (error when hidden_size is unknown)
zero_optimization.allgather_bucket_size *      the resolved reduce_bucket_size
=============================================  ================================================================

Explicit values are compared with args (every key above except warmup_min_lr and the bucket sizes); all
disagreements are reported in one ConfigError, one ``- key=value vs --arg value`` line each.

Missing keys. With ``args``, a missing key of the table above (except the bucket sizes) takes the same value as
"auto", so TrainingArguments stay in charge unless the file says otherwise (e.g. gradient_clipping follows
--max_grad_norm). Without args, DeepSpeed's defaults apply: micro batch 1, gradient accumulation 1 and
train_batch_size derived from the others assuming world_size 1; gradient_clipping 1.0; fp16/bf16 off; Adam
lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0; WarmupLR 0 -> 1e-3 over 1000 steps, warmup_type "log".
Always: stage 0, no offload, pin_memory true, overlap_comm false, contiguous_gradients true, reduce_scatter true,
allgather_partitions true, round_robin_gradients false, both bucket sizes 5e8, steps_per_print 10. A missing
"optimizer" block gives ``optimizer=None`` (the Trainer's AdamW from TrainingArguments); a missing "scheduler" gives
``scheduler=None`` (the Trainer's own scheduler). ``"type": "Adam"`` is AdamW unless ``adam_w_mode`` is false;
``"type": "AdamW"`` is AdamW whatever ``adam_w_mode`` says (DeepSpeed's rule; a false one is logged).

Accepted without effect (type-checked; the start log names those a config sets): overlap_comm,
contiguous_gradients, allgather_partitions, round_robin_gradients, steps_per_print, wall_clock_breakdown, and: zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer,
memory_breakdown, dump_state, dataloader_drop_last, checkpoint{...} (transformers writes use_node_local_storage),
bf16.immediate_grad_update / check_grad_overflow, optimizer.params.torch_adam (any bool),
scheduler.params.last_batch_iteration, zero_optimization.{load_from_fp32_weights, elastic_checkpoint,
ignore_unused_parameters, use_multi_rank_bucket_allreduce, sub_group_size, memory_efficient_linear,
[stage3_]gather_16bit_weights_on_model_save, stage3_gather_fp16_weights_on_model_save} (accelerate writes the
last for every stage), offload_optimizer.{nvme_path, buffer_count, pipeline, pipeline_read, pipeline_write,
fast_init}. Legacy spellings: "bfloat16" for "bf16", zero_optimization.cpu_offload (== offload_optimizer.device
"cpu") and cpu_offload_use_pin_memory (== offload_optimizer.pin_memory).

Unsupported DeepSpeed features are a ConfigError "not supported by hf_zero_offload: <why / what to use>" while they
are switched on, and ignored while switched off (false/null/0, ``{"enabled": false}``, offload_param
``{"device": "none"}``, ratio 1, gradient_predivide_factor 1...): ZeRO stage 3 and every other stage3_* key,
offload_param, NVMe offload, optimizer types other than Adam/AdamW, schedulers other than WarmupLR/WarmupDecayLR,
fp16.{consecutive_hysteresis, auto_cast, fp16_master_weights_and_grads}, amp, torch_autocast,
activation_checkpointing, flops_profiler, tensorboard/wandb/csv_monitor/comet, elasticity, pipeline,
sparse_gradients, sparse_attention, communication_data_type, prescale_gradients, data_types (fp32 accumulation
only), ZeRO++ / MiCS keys and the other DeepSpeed-only libraries; see :mod:`hf_zero_offload.config_schema`.
Unknown keys are errors, with "did you mean" for near misses. The extension
``zero_optimization.delayed_param_update {enabled, warmup_steps}`` (the paper's DPU) needs CPU offload, and so
does ``zero_optimization.offload_optimizer.state_dtype`` ("fp32" default, "bf16", "int8": how the Adam moments
are stored on the host; int8 is blockwise, 256 elements per scale, csrc/quant.h).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .config_schema import AUTO, ConfigError, validate
from .presets import resolve_config

logger = logging.getLogger("hf_zero_offload")

__all__ = ["FP16Config", "OptimizerConfig", "SchedulerConfig", "DPUConfig", "ZeroConfig", "TrainingConfig",
           "ArgsView", "ConfigError", "load_config", "resolve"]

DEFAULT_BUCKET_SIZE = 500_000_000


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0  # 0 = dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "AdamW"  # "Adam" | "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True  # decoupled weight decay; always True for "AdamW"


@dataclass(frozen=True)
class SchedulerConfig:
    type: str = "WarmupLR"  # "WarmupLR" | "WarmupDecayLR"
    warmup_min_lr: float = 0.0
    warmup_max_lr: float = 1e-3
    warmup_num_steps: int = 1000
    warmup_type: str = "log"  # "log" | "linear"
    total_num_steps: int | None = None  # WarmupDecayLR only


@dataclass(frozen=True)
class DPUConfig:
    enabled: bool = False
    warmup_steps: int = 40


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0
    offload: bool = False
    pin_memory: bool = True
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = DEFAULT_BUCKET_SIZE
    allgather_partitions: bool = True
    allgather_bucket_size: int = DEFAULT_BUCKET_SIZE
    round_robin_gradients: bool = False
    delayed_param_update: DPUConfig = field(default_factory=DPUConfig)
    state_dtype: str = "fp32"  # offload_optimizer.state_dtype: the Adam moments on the host


@dataclass(frozen=True)
class TrainingConfig:
    train_batch_size: int = 1
    train_micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 1.0  # 0 = off
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: bool = False
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    source: str = "<dict>"

    def to_dict(self) -> dict:
        """Field names as in the dataclasses; JSON-serialisable (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict) -> "TrainingConfig":
        """Inverse of :meth:`to_dict` (e.g. for checkpoint metadata)."""
        d = dict(d)
        d["fp16"] = FP16Config(**d["fp16"])
        if d.get("optimizer") is not None:
            d["optimizer"] = OptimizerConfig(**{**d["optimizer"], "betas": tuple(d["optimizer"]["betas"])})
        if d.get("scheduler") is not None:
            d["scheduler"] = SchedulerConfig(**d["scheduler"])
        zero = dict(d["zero"])
        zero["delayed_param_update"] = DPUConfig(**zero["delayed_param_update"])
        d["zero"] = ZeroConfig(**zero)
        return cls(**d)


@dataclass(frozen=True)
class ArgsView:
    """Plain values from TrainingArguments (built by the Trainer integration); defaults are transformers'."""

    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    max_grad_norm: float = 1.0
    learning_rate: float = 5e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0  # already computed (e.g. from warmup_ratio)
    max_steps: int | None = None  # total optimizer steps, when known
    fp16: bool = False
    bf16: bool = False
    hidden_size: int | None = None  # model.config.hidden_size / d_model


# ---------------------------------------------------------------- loading

def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _read(path_or_dict: Any) -> tuple[Any, str]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, "<dict>"
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigError(f"expected a ds_config path or dict, got {type(path_or_dict).__name__}")
    source = resolve_config(os.fspath(path_or_dict))  # a shipped config's name -> its packaged file
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{source}: cannot read the ds_config file: {e.strerror or e}") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates), source
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except ValueError as e:  # duplicate key
        raise ConfigError(f"{source}: invalid JSON: {e}") from None


class Checked(NamedTuple):
    """A ds_config read and validated once (normalised; ``resolve`` takes it without a second pass);
    ``no_effect``: the keys given that change nothing here (the start log names them)."""
    cfg: dict
    source: str
    no_effect: list


def check(path_or_dict: Any) -> Checked:
    raw, source = _read(path_or_dict)
    ignored: list = []
    return Checked(validate(raw, source, ignored), source, ignored)


def load_config(path_or_dict: Any) -> dict:
    """Read (when given a path) and validate a ds_config; return the raw dict, unchanged."""
    raw, source = _read(path_or_dict)
    validate(raw, source)
    return raw


# ---------------------------------------------------------------- resolution

_MISSING = object()


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

    def take(self, path: str, arg: Any, arg_name: str, default: Any, match: bool = True) -> Any:
        """Explicit value (checked against ``arg``), "auto" / missing -> ``arg`` (missing without args -> default)."""
        v = self.get(path)
        if v is AUTO or v == AUTO:
            if self.args is None:
                self.needs_args.append(path)
            elif arg is None:
                self.problems.append(f"{path}: \"auto\" needs {arg_name}, which is unknown here")
            return arg if arg is not None else default
        if v is _MISSING:
            return arg if self.args is not None and arg is not None else default
        if self.args is not None and match and arg is not None and not _same(v, arg):
            self.mismatches.append(f"- {path}={_show(v)} vs {arg_name} {_show(arg)}")
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
        given = opt.get("params", {}).get("adam_w_mode")  # DeepSpeed reads it for "Adam" only
        w_mode = opt["type"] == "AdamW" or given is not False
        if opt["type"] == "AdamW" and given is False:
            logger.warning('%s: "type": "AdamW" with adam_w_mode=false runs AdamW (decoupled weight decay), as in '
                           'DeepSpeed; for L2-style decay use "type": "Adam"', self.source)
        return OptimizerConfig(opt["type"], float(lr), (float(betas[0]), float(betas[1])), float(eps), float(wd),
                               bool(w_mode))

    def scheduler(self) -> SchedulerConfig | None:
        sched = self.cfg.get("scheduler")
        if sched is None:
            return None
        a, p = self.args, "scheduler.params."
        params = sched.get("params", {})
        lo = 0.0 if params.get("warmup_min_lr", 0.0) == AUTO else params.get("warmup_min_lr", 0.0)
        hi = self.take(p + "warmup_max_lr", a and a.learning_rate, "--learning_rate", 1e-3)
        n = self.take(p + "warmup_num_steps", a and max(1, a.warmup_steps), "--warmup_steps", 1000)
        total = None
        if sched["type"] == "WarmupDecayLR":
            total = self.take(p + "total_num_steps", a and a.max_steps, "the number of training steps", None)
            if total is None and not self.needs_args and not self.problems:
                self.problems.append(f"{p}total_num_steps: required by WarmupDecayLR (give it, or \"auto\" with "
                                     "the number of training steps known)")
        return SchedulerConfig(sched["type"], float(lo), float(hi), int(n), params.get("warmup_type", "log"),
                               None if total is None else int(total))

    def zero(self) -> ZeroConfig:
        z = self.cfg.get("zero_optimization", {})
        off = z.get("offload_optimizer", {})
        rbs = z.get("reduce_bucket_size", DEFAULT_BUCKET_SIZE)
        if rbs == AUTO:
            hidden = self.args.hidden_size if self.args is not None else None
            rbs = self.take("zero_optimization.reduce_bucket_size", hidden and hidden * hidden,
                            "the model's hidden_size", DEFAULT_BUCKET_SIZE)
        agbs = z.get("allgather_bucket_size", DEFAULT_BUCKET_SIZE)
        dpu = z.get("delayed_param_update", {})
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
        )

    def run(self) -> TrainingConfig:
        a, cfg = self.args, self.cfg
        tbs, micro, gas = self.batch()
        clip = self.take("gradient_clipping", a and a.max_grad_norm, "--max_grad_norm", 1.0)
        fp16 = bool(self.take("fp16.enabled", a and a.fp16, "--fp16", False))
        bf16 = bool(self.take("bf16.enabled", a and a.bf16, "--bf16", False))
        optimizer, scheduler, zero = self.optimizer(), self.scheduler(), self.zero()
        if self.needs_args:
            raise ConfigError(f"{self.source}: \"auto\" values need TrainingArguments (resolve(..., args=ArgsView"
                              "(...))), or replace them with numbers: " + ", ".join(self.needs_args))
        if self.problems:
            raise ConfigError(f"{self.source}: cannot resolve:\n- " + "\n- ".join(self.problems))
        if self.mismatches:
            raise ConfigError(f"{self.source}: these ds_config values contradict TrainingArguments:\n"
                              + "\n".join(self.mismatches)
                              + "\nSet them to \"auto\" (or to the TrainingArguments values).")
        if fp16 and bf16:
            raise ConfigError(f"{self.source}: fp16.enabled and bf16.enabled: cannot both be true")
        f = cfg.get("fp16", {})
        fp16_cfg = FP16Config(fp16, float(f.get("loss_scale", 0.0)), f.get("initial_scale_power", 16),
                              f.get("loss_scale_window", 1000), f.get("hysteresis", 2),
                              float(f.get("min_loss_scale", 1.0)))
        return TrainingConfig(tbs, micro, gas, float(clip), fp16_cfg, bf16, optimizer, scheduler, zero,
                              cfg.get("steps_per_print", 10), cfg.get("wall_clock_breakdown", False), self.source)


def resolve(raw_or_path: Any, args: ArgsView | None = None) -> TrainingConfig:
    """Validate a ds_config (path, dict, or ``Checked``: validated already) and resolve it, with ``"auto"``
    taken from ``args``."""
    checked = raw_or_path if isinstance(raw_or_path, Checked) else check(raw_or_path)
    return _Resolver(checked.cfg, args, checked.source).run()
