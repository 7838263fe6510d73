"""``ZeroOffloadMixin`` (see the package's docstring for what it does) and the two Trainers built with it."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch
from transformers import Seq2SeqTrainer, Trainer

from .. import presets, resume
from ..resume import report as resume_report
from ..args_view import args_view, early_view, training_precision
from ..config import ConfigError, TrainingConfig, check, resolve
from ..engine.core import AdamCore
from ..engine.param_names import smallest_names
from ..engine_setup import (build_engine, check_user_groups, groups_from_optimizer,
                            start_line, training_dtype)
from ..launch_checks import (check_arguments, check_dpu_writers, check_even_batches, check_optimizer_cls,
                             check_world_size, refuse_given_optimizer, refuse_user_optimizer,
                             refuse_view_ties, warn_bf16_on_cpu, warn_fp16_on_cpu, warn_full_eval_trains,
                             warn_keep_fp32, warn_upcast)
from ..run_lock import RunLock, take_job_lock
from ..schedulers import build_scheduler
from .agreed_control import AgreedControl
from .buffer_sync import BroadcastBuffers
from .placement import PlaceWithEngine
from .same_run import SameBatches, check_same_run
from .peer_failure import NamedPeerFailures
from .last_step import PublishBeforeTrainEnd
from .loss_precision import LossInFp32
from .mean_loss import LossScaleNote
from .trainable_watch import RefuseNewTrainable
from .later_args import ArgsAfterInit, engine_args, no_mixed_precision
from .loading import CheckpointLoading
from .saving import CheckpointSaving
from .next_train import CarriedOverEngine, adopt_changed_params  # noqa: F401 (adopt_changed_params: callback.py's)
from . import end_rotation
from .shared_dir import agreed_target, distributed, first_problem
from .args import checked_config

logger = logging.getLogger("hf_zero_offload")


def _users_create_optimizer(cls):
    """The user's ``create_optimizer`` (a descriptor) that ``cls`` runs: the first defined before the mixin in its MRO
    (a class body's, kept by its wrapper), or None."""
    mro = cls.__mro__
    for c in mro[:mro.index(ZeroOffloadMixin)]:
        f = c.__dict__.get("create_optimizer")
        if f is None:
            continue
        if getattr(f, "_zo_own", None) is not None:
            return f._zo_own
        if not getattr(f, "_zo_takes_over", False):
            return f
    return None


class ZeroOffloadMixin(NamedPeerFailures, SameBatches, CheckpointSaving, AgreedControl, CheckpointLoading,
                       CarriedOverEngine, LossInFp32, BroadcastBuffers, PlaceWithEngine, LossScaleNote, ArgsAfterInit):
    """Mix into any ``transformers.Trainer`` subclass (before it in the bases) to gain the feature."""

    def __init__(self, *args, **kwargs):
        # (a rank failing here, its peers at the run lock's broadcast or in train(): peer_failure.py)
        self._zo_named("the Trainer's constructor", functools.partial(self._zo_init, *args, **kwargs), next_train=True)

    def _zo_init(self, *args, **kwargs):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.zero_config: TrainingConfig | None = None
        self._zo_raw = None
        self._zo_precision = (False, False)
        self._zo_dtype: torch.dtype | None = None  # the 16-bit training dtype once the model is cast
        self._zo_lock: RunLock | None = None
        self._zo_left_said: set[str] = set()  # folders a rotation left out, named once (saving.py)
        if targs is not None and (getattr(targs, "zero_offload", None) is not None or getattr(targs, "sharded_ddp", False)):
            if targs.zero_offload is not None:
                self._zo_raw = checked_config(targs)  # validated once: fail fast, before any model work
            else:  # --sharded_ddp alone: ZeRO-2 without offload, named so in the start line
                self._zo_raw = check({"zero_optimization": {"stage": 2}})._replace(source="--sharded_ddp (stage 2)")
            # as transformers' DeepSpeed integration: --fp16_full_eval means the fp16 model (ours trains as it evals)
            self._zo_precision = training_precision(targs)
            # The whole config, resolved against the arguments, before any model work (values that depend
            # on a step count not known yet are checked again at train start).
            early = resolve(self._zo_raw, early_view(targs, self._zo_raw.cfg, *self._zo_precision,
                                                     kwargs.get("model", args[0] if args else None)))
            check_world_size(targs)
            check_arguments(targs, early.scheduler.type if early.scheduler is not None else None)
            refuse_given_optimizer(super().__init__, args, kwargs)
            self._zo_take_lock(targs, check_paths=True)  # (train(): its output_dir_problem checks them)
            # Loss scaling and the 16-bit model are ours: Accelerate, created in Trainer.__init__, must
            # neither autocast nor run a GradScaler (it would find no gradients: they already left the
            # device). The caller's arguments get their values back once the accelerator exists (created
            # again later, by a hyperparameter search trial, it is created alike: later_args.py).
            try:
                with no_mixed_precision(targs):
                    super().__init__(*args, **kwargs)
            finally:
                if self._zo_lock is not None:  # taken above to refuse a live run before any work; held in train()
                    self._zo_lock.release()  # only: a Trainer built for evaluate() or dropped kept other runs out
        else:
            super().__init__(*args, **kwargs)
        if targs is not None:  # the dtype the run trains in (with zero_offload, --fp16_full_eval's too)
            fp16, bf16 = self._zo_precision if self._zo_raw is not None else (targs.fp16, targs.bf16)
            warn_fp16_on_cpu(targs, bool(fp16))
            warn_bf16_on_cpu(targs, bool(bf16))
            if self._zo_raw is not None:
                warn_full_eval_trains(targs)
        self._zo_engine_args = engine_args(self.args)  # (checked again before training: later_args.py)
        if self._zo_raw is not None:
            # what __init__ kept, however it was passed (a base class's own (*args, **kwargs) hides the names)
            refuse_user_optimizer(getattr(self, "optimizer", None), getattr(self, "lr_scheduler", None))
            check_optimizer_cls(getattr(self, "optimizer_cls_and_kwargs", None))
            check_even_batches(self.args, getattr(self, "train_dataset", None))
            self._zo_patch_accelerator()  # (done already by create_accelerator_and_postprocess: once per Accelerator)

    def _zo_take_lock(self, targs, check_paths: bool = False) -> None:
        if targs.output_dir:  # (paths over the file system's limits at __init__: before the lock, ranks agreeing)
            if check_paths and (too_long := first_problem(resume.path_limits.problem(
                    targs.output_dir, targs.max_steps, targs.world_size), targs.world_size)):
                raise ValueError(too_long)
            lock = self._zo_lock
            if lock is None or not lock.held:  # a relative output_dir is where it points now (after any chdir)
                lock = RunLock(targs.output_dir)
            self._zo_lock = take_job_lock(lock, targs.process_index, targs.world_size)

    @property
    def zero_engine(self):
        opt = getattr(self, "optimizer", None)
        opt = getattr(opt, "optimizer", opt)  # unwrap Accelerate's AcceleratedOptimizer
        return opt if isinstance(opt, AdamCore) else None

    def _zo_resolve(self, max_steps: int | None = None) -> TrainingConfig:
        max_steps = max_steps or getattr(getattr(self, "state", None), "max_steps", 0) or None
        fp16, bf16 = self._zo_precision
        if max_steps is None:  # create_optimizer() before train(), epochs: create_scheduler resolves the schedule
            return resolve(self._zo_raw, early_view(self.args, self._zo_raw.cfg, fp16, bf16, self.model))
        view = args_view(self.args, fp16=fp16, bf16=bf16, max_steps=max_steps, model=self.model)
        return resolve(self._zo_raw, view)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # the class's own, or one it inherits from a class before the mixin (class T(LayerwiseLR, ZeroOffloadTrainer):
        # that one was refused as "not built by create_optimizer", though it was)
        if _users_create_optimizer(cls) is None:
            return
        body = cls.__dict__.get("create_optimizer")

        # transformers' documented way to change the optimizer is to override create_optimizer: the torch optimizer
        # it builds is never fed gradients here (train() failed deep in torch), so the engine takes over its groups.
        # Looked up at each call, as Python would: a helper's method patched after the class was made is the one run.
        def create_optimizer(self, *args, **kwargs):
            method = _users_create_optimizer(cls).__get__(self, type(self))  # (cls's MRO: a super() call goes on)
            return self._zo_take_over(method(*args, **kwargs), f"{cls.__qualname__}.create_optimizer")

        if body is not None and not getattr(body, "_zo_takes_over", False):
            create_optimizer._zo_own = body  # the class body's, which this replaces in the class
            functools.update_wrapper(create_optimizer, body) if callable(body) else None
        create_optimizer._zo_takes_over = True
        cls.create_optimizer = create_optimizer

    def _zo_base_create_optimizer(self) -> str | None:
        """``Base.create_optimizer`` of a user's class below the mixin (``class T(ZeroOffloadMixin, Base)``), if any."""
        mro = type(self).__mro__
        for c in mro[mro.index(ZeroOffloadMixin) + 1:]:
            if c.__module__.split(".")[0] == "transformers":
                return None
            if "create_optimizer" in c.__dict__:
                return f"{c.__qualname__}.create_optimizer"
        return None

    def _zo_take_over(self, built, where: str):
        """After a user's ``create_optimizer``: the engine in place of the torch optimizer it built."""
        if self._zo_raw is None:
            return built
        opt = self.optimizer if self.optimizer is not None else built
        if opt is None or isinstance(getattr(opt, "optimizer", opt), AdamCore):  # it called ours (super())
            return opt
        self.optimizer = None
        return self._zo_build(self.model, groups_from_optimizer(opt, where, self.model), where)

    def create_optimizer(self, model=None):
        if self._zo_raw is None:
            return super().create_optimizer(model)
        if self.optimizer is not None:
            if (engine := self.zero_engine) is not None:
                # closed, or replaced by another Trainer's (or a user's) engine on this model: said now, naming why,
                # as train() says it; it was handed back, to be refused only at its first use
                engine.check_open("create_optimizer()")
            return self.optimizer
        model = self.model if model is None else model
        base = self._zo_base_create_optimizer()
        if base is None and getattr(self, "optimizer_cls_and_kwargs", None) is not None:
            check_optimizer_cls(self.optimizer_cls_and_kwargs)  # (set after __init__) before it is built
            base = f"optimizer_cls_and_kwargs ({self.optimizer_cls_and_kwargs[0].__qualname__})"  # transformers' build
        if base is not None:  # its groups (a layer-wise LR, ...) are what the user asked for: the engine runs them
            built = super().create_optimizer(model)
            built, self.optimizer = (self.optimizer if self.optimizer is not None else built), None
            return self._zo_build(model, groups_from_optimizer(built, base, model), base)
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # the engine keeps the names (torch.optim's param_names; an empty group's too), and a load compares them
        split = [[p for n, p in named if n in decay], [p for n, p in named if n not in decay]]
        names = smallest_names(model.named_parameters(remove_duplicate=False))
        groups = [{"params": ps, "param_names": [names[id(p)] for p in ps], "weight_decay": wd}
                  for ps, wd in zip(split, (self.args.weight_decay, 0.0))]
        # an empty group stays, as the plain Trainer keeps it (LoRA-style frozen norms, BitFit): a per-group LambdaLR
        # and a callback's param_groups[i] count on both
        return self._zo_build(model, groups if any(g["params"] for g in groups) else [], None)

    def _zo_build(self, model, groups: list[dict], where: str | None):
        """The engine over ``groups`` (``where``: the user's create_optimizer they come from, whose per-group
        values the engine keeps), and the model in the training dtype."""
        check_optimizer_cls(getattr(self, "optimizer_cls_and_kwargs", None))  # (set after __init__)
        self._zo_check_args_again()  # (--optim and the like set after __init__)
        self.zero_config = cfg = self._zo_resolve()
        if where is not None:
            check_user_groups(cfg, self._zo_raw.cfg, groups, where)
        warn_upcast(model, training_dtype(cfg))  # before the engine casts the trainable params
        warn_keep_fp32(model, training_dtype(cfg))
        check_dpu_writers(model, cfg.zero.delayed_param_update.enabled)
        refuse_view_ties(model)
        place = self._zo_placement(model)  # (placement.py) None: the model is where it trains
        self.optimizer = build_engine(groups, cfg, self.args, groups_decide=where is not None, device=place)
        model.to(device=place, dtype=training_dtype(cfg))  # frozen params and buffers follow the trainable ones
        self._zo_broadcast_buffers(model, frozen=True)  # as DDP's wrap: rank 0's frozen params and buffers
        self._zo_dtype = training_dtype(cfg) if training_dtype(cfg) != torch.float32 else None
        self._zo_widen_logits(model, training_dtype(cfg))
        logger.info(start_line(cfg, self.zero_engine, self.args.world_size, self.args.device))
        eng = self.zero_engine
        if getattr(eng, "stage", None) == 0 and not getattr(eng, "offload", True) and self.args.should_log:
            logger.warning('hf_zero_offload: %s gives ZeRO stage 0 without offload (as DeepSpeed reads a missing or '
                           'empty "zero_optimization"): nothing is offloaded or sharded; for ZeRO-Offload set '
                           '"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}', cfg.source)
        if self._zo_raw.no_effect and self.args.should_log:  # once per job, not once per rank
            # A warning for the user's own file; our shipped configs keep those keys so that --deepspeed reads
            # the same file, which is no reason to alarm whoever uses them as they are.
            level = logging.INFO if presets.is_shipped(cfg.source) else logging.WARNING
            logger.log(level, "hf_zero_offload: accepted, no effect here: %s (help(hf_zero_offload.config): "
                       "\"Accepted without effect\")", ", ".join(self._zo_raw.no_effect))
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self._zo_raw is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.zero_engine is None:  # create_optimizer_and_scheduler overridden, self.optimizer set by hand...
            raise ConfigError(f"{type(self).__name__}: with zero_offload the optimizer must be built by "
                              "create_optimizer (the mixin's, or an override returning a torch.optim.AdamW/Adam, "
                              f"whose groups the engine takes over); the Trainer holds a "
                              f"{type(getattr(self.optimizer, 'optimizer', self.optimizer)).__name__} instead")
        if self.lr_scheduler is None:
            cfg = self.zero_config
            if cfg is not None and cfg.scheduler is not None:
                # resolved again for this train()'s step count ("auto" total_num_steps / warm-up ratio): a second
                # train() may run another number of steps, on the engine of the first
                sched = self._zo_resolve(num_training_steps).scheduler
                kept = getattr(self, "_zo_peak", None)
                if kept is not None and kept[0] is self.zero_engine and kept[1] != sched.warmup_max_lr:
                    # as the plain Trainer: its optimizer kept, the rebuilt schedule keeps each group's initial_lr
                    # (LambdaLR's setdefault), so --learning_rate changed between two train() calls is not taken
                    logger.warning("hf_zero_offload: warmup_max_lr %g (the learning rate changed since the first "
                                   "train() of this Trainer?) is not taken: this train() goes on with the engine of "
                                   "the first, at its %g, as the plain Trainer keeps its optimizer's; build a new "
                                   "Trainer for another learning rate", sched.warmup_max_lr, kept[1])
                    sched = dataclasses.replace(sched, warmup_max_lr=kept[1])
                self._zo_peak = (self.zero_engine, sched.warmup_max_lr)
                self.zero_config = cfg = dataclasses.replace(cfg, scheduler=sched)
                self.lr_scheduler = build_scheduler(self.zero_engine, cfg.scheduler)
                # as transformers marks the schedule it creates: the next train() builds it again (it was kept,
                # already at its end, and a second train() with WarmupDecayLR ran at lr 0 without a word)
                self._created_lr_scheduler = True
            else:
                super().create_scheduler(num_training_steps, self.zero_engine)
        return self.lr_scheduler

    def _prepare_input(self, data):
        # Float inputs (audio, vision, regression features) follow the 16-bit model, as transformers
        # does for DeepSpeed; integer ids stay as they are.
        data = super()._prepare_input(data)
        if self._zo_dtype is not None and isinstance(data, torch.Tensor) and torch.is_floating_point(data):
            return data.to(self._zo_dtype)
        return data

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

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # (its checks before the loop too: a rank that failed there left the others in the next gather)
        out = self._zo_named("train()", functools.partial(self._zo_train, resume_from_checkpoint, *args, **kwargs))
        self._zo_returned()  # (a peer left in a call this rank never makes names it: peer_failure.py)
        return out

    def _zo_train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._zo_resume, self._zo_best, self._zo_buffers_stale = None, False, True
        self._zo_new_run()  # (the saves' agreement: saving.py)
        engine = self.zero_engine
        if engine is not None and self.model_init is not None:
            engine.close()  # transformers builds a new model, so a new engine: this one is done
            engine = None
        elif engine is not None:  # a second train(): the engine of the first one goes on (next_train.py)
            self._zo_carry_over(engine)
        resume_from_checkpoint = resume.no_resume_word(resume_from_checkpoint)
        given = resume_from_checkpoint is not None and resume_from_checkpoint is not False
        if given or distributed(self.args.world_size):  # (every rank's gather: given on some only, it is named)
            resume_from_checkpoint = self._zo_resume_target(resume_from_checkpoint if given else None)
        problem = resume.output_dir_problem(self.args.output_dir, max_steps=self.args.max_steps,
                                            world_size=self.args.world_size) if self.args.output_dir else None
        problem = first_problem(problem, self.args.world_size)  # (every rank: one that raised alone left the others)
        if problem:  # a checkpoint-N file met at its save lost the steps since the last one
            raise ValueError(problem)
        if self._zo_raw is not None:  # before the run lock's collective: every rank raises alike here
            check_same_run(self.args, self.train_dataset, self.eval_dataset)
        self._zo_take_lock(self.args)
        if self._zo_lock is not None and self._zo_lock.held:
            for path in resume.remove_stale_temp_files(self.args.output_dir):
                logger.warning("hf_zero_offload: removed %s, left by a writer that was stopped mid-save", path)
        first, watch = PublishBeforeTrainEnd(self), RefuseNewTrainable(self)
        self.callback_handler.callbacks[:0] = [first, watch]
        try:
            if engine is not None:  # refused, naming why, when another engine has taken the model since
                engine.attach_hooks()
            with end_rotation.running(self):  # (transformers' end-of-training cleanup under our rotation's rule)
                out = super().train(resume_from_checkpoint, *args, **kwargs)
            self._zo_publish_last()  # (done already unless training stopped before on_train_end)
        except BaseException:
            self._zo_publish_after_failure()
            raise
        finally:
            self.callback_handler.callbacks.remove(first)
            self.callback_handler.callbacks.remove(watch)
            if self.zero_engine is not None:  # between runs the model is plain torch: a manual backward, a plain
                self.zero_engine.detach_hooks()  # optimizer or another Trainer find their .grad (the hooks took it)
            if self._zo_lock is not None:
                self._zo_lock.release()
        return out

    def _zo_publish_last(self) -> None:
        """DPU: the last step's parameters reach the model (last_step.py says when); not over the best weights
        that load_best_model_at_end loaded."""
        if self.zero_engine is not None and not self._zo_best:
            self.zero_engine.flush()

    def _zo_publish_after_failure(self) -> None:
        """A callback's error or a Ctrl-C out of train(): the model takes the last whole step (for save_model(),
        evaluate()). One process only: sharded, the publish is a collective the ranks that did not fail never join."""
        engine = self.zero_engine
        if engine is None or not engine.needs_publish or self._zo_best or self.args.world_size > 1:
            return
        try:
            engine.flush()
        except Exception as e:  # noqa: BLE001 - the error that stopped training is the one raised
            logger.warning("hf_zero_offload: the last delayed (DPU) step could not be published (%s: %s)",
                           type(e).__name__, e)

    def _inner_training_loop(self, *args, **kwargs):
        self._zo_check_args_again()  # (after a hyperparameter search trial set its values: later_args.py)
        self._zo_say_loss_scale(logger)
        if self.zero_engine is not None:
            # transformers' model.zero_grad() here misses the gradients the engine took from .grad: a window left
            # part way (stop, interrupt, a failed auto_find_batch_size attempt) was summed into the next first step
            self.zero_engine.zero_grad(set_to_none=True)
        return super()._inner_training_loop(*args, **kwargs)

    def _zo_resume_target(self, target) -> str:
        path, self._zo_resume, notes = agreed_target(target, self.args.output_dir, self.args.world_size)
        if target is None or not self.args.should_log:  # every rank chooses the same one: said once per job
            return path
        for level, note in notes:
            logger.log(level, note)
        named = isinstance(target, str) and os.path.abspath(target) == os.path.abspath(path)
        done = resume_report.nothing_left_message(path, self.args.max_steps, chosen=not named)
        if done is not None:
            logger.warning(done)
        return path


class ZeroOffloadTrainer(ZeroOffloadMixin, Trainer):
    pass


class ZeroOffloadSeq2SeqTrainer(ZeroOffloadMixin, Seq2SeqTrainer):
    pass
