"""Trainer integration: the only module that imports ``transformers``.

``ZeroOffloadMixin`` goes before any ``transformers.Trainer`` subclass in the bases. With
``--zero_offload ds_config.json`` (or ``--sharded_ddp``) it:

- resolves the config against the TrainingArguments ("auto" values, one error listing mismatches);
- builds the engine in ``create_optimizer`` from the Trainer's own parameter grouping (no weight
  decay for biases and norms) and keeps the model in the training dtype on the device;
- owns loss scaling: Accelerate runs without mixed precision (no autocast, no GradScaler), the
  loss is multiplied by the engine's scale before backward, and the engine unscales, clips and
  checks overflow on the CPU; an overflow step does not advance the LR schedule;
- logs ``grad_norm`` (the engine's, before clipping) and ``loss_scale``;
- saves the optimizer state per rank under ``checkpoint-N/zero_offload/`` atomically and loads it
  back on ``--resume_from_checkpoint``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainerCallback, TrainingArguments

from . import ops
from .consolidate import write_param_names
from .config import ArgsView, TrainingConfig, check, resolve
from .engine import OffloadOptions, ShardOptions, factory
from .engine.core import AdamCore
from .engine.checkpoint import atomic_path
from .schedulers import SkipAwareScheduler, build_scheduler

__all__ = [
    "ZeroOffloadTrainingArguments",
    "ZeroOffloadSeq2SeqTrainingArguments",
    "ZeroOffloadMixin",
    "ZeroOffloadTrainer",
    "ZeroOffloadSeq2SeqTrainer",
    "ZeroOffloadCallback",
]

logger = logging.getLogger("hf_zero_offload")
STATE_DIR = "zero_offload"
_SCHEDULER_NAME = "scheduler.pt"


@dataclass
class _ZeroOffloadFields:
    # Typed str for HfArgumentParser; code may pass a dict (the dataclass does not enforce the annotation).
    zero_offload: Optional[str] = field(
        default=None,
        metadata={"help": "Path to a DeepSpeed-style ds_config.json (a dict is accepted in code): enables "
                          "hf_zero_offload's ZeRO-Offload / ZeRO-2 engine."},
    )
    sharded_ddp: bool = field(
        default=False,
        metadata={"help": "Partition optimizer states and gradients across data-parallel ranks (ZeRO stage 1/2)."},
    )


@dataclass
class ZeroOffloadTrainingArguments(TrainingArguments, _ZeroOffloadFields):
    pass


@dataclass
class ZeroOffloadSeq2SeqTrainingArguments(Seq2SeqTrainingArguments, _ZeroOffloadFields):
    pass


def _hidden_size(model) -> int | None:
    cfg = getattr(model, "config", None)
    for name in ("hidden_size", "d_model", "n_embd"):
        if cfg is not None and isinstance(getattr(cfg, name, None), int):
            return getattr(cfg, name)
    return None


def args_view(args: TrainingArguments, *, fp16: bool, bf16: bool, max_steps: int | None, model=None) -> ArgsView:
    warmup = args.get_warmup_steps(max_steps) if max_steps else int(args.warmup_steps or 0)
    return ArgsView(
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, world_size=args.world_size,
        max_grad_norm=args.max_grad_norm or 0.0, learning_rate=args.learning_rate, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon, weight_decay=args.weight_decay,
        warmup_steps=int(warmup), max_steps=max_steps, fp16=fp16, bf16=bf16,
        hidden_size=_hidden_size(model) if model is not None else None)


def engine_options(cfg: TrainingConfig) -> tuple[OffloadOptions, ShardOptions]:
    """The resolved config as the engine's typed options."""
    z = cfg.zero
    options = OffloadOptions(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, max_grad_norm=cfg.gradient_clipping,
        fp16=cfg.fp16 if cfg.fp16.enabled else None, bucket_numel=z.reduce_bucket_size, pin_memory=z.pin_memory,
        dpu=z.delayed_param_update.enabled, dpu_warmup_steps=z.delayed_param_update.warmup_steps,
        state_dtype=z.state_dtype)
    shard = ShardOptions(stage=z.stage, offload=z.offload, allgather_bucket_numel=z.allgather_bucket_size,
                         reduce_scatter=z.reduce_scatter)
    return options, shard


def training_dtype(cfg: TrainingConfig) -> torch.dtype:
    return torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16 else torch.float32


def build_engine(model: torch.nn.Module, param_groups: list[dict], cfg: TrainingConfig, args: TrainingArguments):
    """The engine for this config and world size (the optimizer the Trainer will drive)."""
    opt = cfg.optimizer
    hyper = dict(lr=opt.lr, betas=opt.betas, eps=opt.eps, adamw_mode=opt.adam_w_mode) if opt else dict(
        lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, adamw_mode=True)
    if opt is not None:  # the config's weight decay replaces the Trainer's for the decayed group
        param_groups = [{**g, "weight_decay": opt.weight_decay if g["weight_decay"] else 0.0} for g in param_groups]
    options, shard = engine_options(cfg)
    return factory.build_engine(param_groups, world_size=args.world_size, shard=shard, options=options,
                                param_dtype=training_dtype(cfg), sharded_ddp=args.sharded_ddp, **hyper)


class ZeroOffloadMixin:
    """Mix into any ``transformers.Trainer`` subclass (before it in the bases) to gain the feature."""

    def __init__(self, *args, **kwargs):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.zero_config: TrainingConfig | None = None
        self._zo_raw = None
        self._zo_precision = (False, False)
        if targs is not None and (getattr(targs, "zero_offload", None) is not None or getattr(targs, "sharded_ddp", False)):
            raw = targs.zero_offload if targs.zero_offload is not None else {"zero_optimization": {"stage": 2}}
            self._zo_raw = check(raw)  # validated once: fail fast on unknown keys, before any model work
            self._zo_precision = (bool(targs.fp16), bool(targs.bf16))
            saved = (targs.fp16, targs.bf16, targs.mixed_precision)
            # Loss scaling and the 16-bit model are ours: Accelerate, created in Trainer.__init__, must
            # neither autocast nor run a GradScaler (it would find no gradients: they already left the
            # device). The caller's arguments get their values back once the accelerator exists.
            targs.fp16 = targs.bf16 = False
            targs.mixed_precision = "no"
            try:
                super().__init__(*args, **kwargs)
            finally:
                targs.fp16, targs.bf16, targs.mixed_precision = saved
        else:
            super().__init__(*args, **kwargs)
        if self._zo_raw is not None:
            backward = self.accelerator.backward

            def scaled_backward(loss, **kw):
                engine = self.zero_engine
                return backward(engine.scale_loss(loss) if engine is not None else loss, **kw)

            self.accelerator.backward = scaled_backward
            prepare_model = self.accelerator.prepare_model

            def prepare_without_ddp(model, device_placement=None, evaluation_mode=False):
                # No DDP wrapper: the engine reduces (or reduce-scatters) gradients itself, and a DDP
                # all-reduce on top would double the reduction. evaluation_mode skips only the wrapping.
                return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

            self.accelerator.prepare_model = prepare_without_ddp
            prepare_optimizer = self.accelerator.prepare_optimizer

            def prepare_in_place(optimizer, device_placement=None):
                # Accelerate's device placement round-trips state_dict() through the accelerator's
                # device: a full copy of the fp32 masters and moments (12 B/param) on the GPU. Our
                # state stays where the engine put it.
                return prepare_optimizer(optimizer, device_placement=False)

            self.accelerator.prepare_optimizer = prepare_in_place

    @property
    def zero_engine(self):
        opt = getattr(self, "optimizer", None)
        opt = getattr(opt, "optimizer", opt)  # unwrap Accelerate's AcceleratedOptimizer
        return opt if isinstance(opt, AdamCore) else None

    def _zo_resolve(self) -> TrainingConfig:
        max_steps = getattr(getattr(self, "state", None), "max_steps", 0) or None
        fp16, bf16 = self._zo_precision
        view = args_view(self.args, fp16=fp16, bf16=bf16, max_steps=max_steps, model=self.model)
        return resolve(self._zo_raw, view)

    def create_optimizer(self, model=None):
        if self._zo_raw is None or self.optimizer is not None:
            return super().create_optimizer(model) if self._zo_raw is None else self.optimizer
        model = self.model if model is None else model
        self.zero_config = cfg = self._zo_resolve()
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        self.optimizer = build_engine(model, groups, cfg, self.args)
        model.to(training_dtype(cfg))  # frozen params and buffers follow the trainable ones
        self._zo_log_start(cfg)
        if self._zo_raw.no_effect:
            logger.warning("hf_zero_offload: accepted, no effect here: %s (see hf_zero_offload.config_schema."
                           "NO_EFFECT)", ", ".join(self._zo_raw.no_effect))
        return self.optimizer

    def _zo_log_start(self, cfg: TrainingConfig) -> None:
        eng = self.zero_engine
        logger.warning(
            "hf_zero_offload: config=%s stage=%d offload=%s dpu=%s simd=%s threads=%d host_reserved=%.2fGiB pinned=%s "
            "dtype=%s params=%d streams=%s", cfg.source, eng.stage, eng.offload,
            cfg.zero.delayed_param_update.enabled, ops.simd_level(), torch.get_num_threads(),
            getattr(getattr(eng, "arena", None), "nbytes", 0) / 2**30,
            getattr(getattr(eng, "arena", None), "pinned", False), str(training_dtype(cfg)).replace("torch.", ""),
            eng.numel, eng.streams.kind)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self._zo_raw is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            engine = self.zero_engine
            cfg = self.zero_config
            if cfg is not None and cfg.scheduler is not None:
                sched = build_scheduler(engine, cfg.scheduler)
            else:
                sched = super().create_scheduler(num_training_steps, engine)
            self.lr_scheduler = SkipAwareScheduler(sched, engine)
        return self.lr_scheduler

    # The engine computes the norm on the CPU once per step (and clips inside its fused kernel).
    def _clip_grad_norm(self, model):
        if self._zo_raw is None:
            return super()._clip_grad_norm(model)
        return self.zero_engine.grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        if self._zo_raw is None:
            return super()._get_grad_norm(model, grad_norm)
        return grad_norm if grad_norm is not None else self.zero_engine.grad_norm()

    def log(self, logs: dict, *args, **kwargs):
        engine = self.zero_engine
        if engine is not None and "loss" in logs and self.zero_config is not None and self.zero_config.fp16.enabled:
            logs["loss_scale"] = engine.loss_scale
        return super().log(logs, *args, **kwargs)

    def train(self, *args, **kwargs):
        out = super().train(*args, **kwargs)
        if self.zero_engine is not None:
            self.zero_engine.flush()  # DPU: the last step's parameters reach the model
        return out

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._zo_raw is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        state_dir = os.path.join(output_dir, STATE_DIR)
        self.zero_engine.save_checkpoint(state_dir)
        if self.args.should_save:
            write_param_names(state_dir, self._zo_slot_names())
        if self.args.should_save:
            with atomic_path(os.path.join(output_dir, _SCHEDULER_NAME)) as tmp:
                torch.save(self.lr_scheduler.state_dict(), tmp)

    def _zo_slot_names(self) -> list[list[str]]:
        aliases: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        return [aliases[id(p)] for g in self.zero_engine.slot_params() for p in g]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._zo_raw is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        state_dir = os.path.join(checkpoint, STATE_DIR)
        if not os.path.isdir(state_dir):
            raise FileNotFoundError(f"{checkpoint} has no {STATE_DIR}/ optimizer state (was it saved without "
                                    "--zero_offload?)")
        self.zero_engine.load_checkpoint(state_dir)
        sched = os.path.join(checkpoint, _SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


class ZeroOffloadTrainer(ZeroOffloadMixin, Trainer):
    pass


class ZeroOffloadSeq2SeqTrainer(ZeroOffloadMixin, Seq2SeqTrainer):
    pass


class ZeroOffloadCallback(TrainerCallback):
    """For users who keep their own Trainer and pass an engine as ``optimizers=(engine, scheduler)``.

    What the callback does: logs the engine's gradient norm and loss scale, and finishes a pending
    delayed parameter update at the end of training. What it cannot do without the mixin: scale the
    loss (so fp16 is not supported: use bf16 or fp32), stop the Trainer's own clipping (which sees no
    gradients: clip with the engine's ``max_grad_norm`` instead), hold the LR schedule on skipped
    steps, or save the optimizer state per rank (the Trainer would call ``state_dict()``, which
    copies the whole state into one file).
    """

    @staticmethod
    def _engine(kwargs):
        opt = kwargs.get("optimizer")
        opt = getattr(opt, "optimizer", opt)
        return opt if hasattr(opt, "grad_norm") and hasattr(opt, "flush") else None

    def on_log(self, args, state, control, logs=None, **kwargs):
        engine = self._engine(kwargs)
        if engine is not None and logs is not None and "loss" in logs:
            logs["zero_grad_norm"] = engine.last.grad_norm
            logs["loss_scale"] = engine.loss_scale

    def on_train_end(self, args, state, control, **kwargs):
        engine = self._engine(kwargs)
        if engine is not None:
            engine.flush()
