"""``ZeroOffloadCallback``: what a plain Trainer given one of our engines (``optimizers=(engine, scheduler)``) can
have of the integration."""
from __future__ import annotations

import os

from transformers import TrainerCallback

from .. import resume
from ..resume import report as resume_report
from ..engine_setup import accumulation_problem
from ..engine.param_names import KEY
from .last_step import publish_for_final_save, run_ends
from .mixin import adopt_changed_params, logger
from .saving import STATE_DIR
from .trainable_watch import TrainableWatch


class ZeroOffloadCallback(TrainerCallback):
    """For users who keep their own Trainer and pass an engine as ``optimizers=(engine, scheduler)``.

    What the callback does: logs the engine's gradient norm (as ``grad_norm``, which the Trainer's own
    clipping, finding no gradients, logged as 0.0) and loss scale, refuses a ``--max_grad_norm`` other
    than the engine's ``OffloadOptions.max_grad_norm`` (the engine clips; the Trainer's clipping sees no
    gradients), and finishes a pending delayed parameter update at the end of training, at the last epoch's
    end so that every callback's ``on_train_end`` sees the last step (with ``load_best_model_at_end``: drops it,
    as the best weights are loaded), and before a final ``--save_only_model`` save once it sees the stop (list it
    after callbacks that stop training). What it cannot do without the
    mixin: scale the loss (so fp16 is not supported: use bf16 or fp32), hold the LR schedule on skipped
    steps, or save the optimizer state per rank: the Trainer saves ``state_dict()`` into one
    ``optimizer.pt`` from rank 0, and a sharded engine's holds only that rank's slice, so an engine of
    several ranks is refused at ``train()`` (use ZeroOffloadTrainer / ZeroOffloadMixin).
    """

    @staticmethod
    def _engine(kwargs):
        opt = kwargs.get("optimizer")
        opt = getattr(opt, "optimizer", opt)
        return opt if hasattr(opt, "grad_norm") and hasattr(opt, "flush") else None

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._before_final_save(args, state, control, kwargs)
        engine = self._engine(kwargs)
        if engine is not None and logs is not None and "loss" in logs:
            logs["zero_grad_norm"] = engine.last.grad_norm
            logs["loss_scale"] = engine.loss_scale
            if "grad_norm" in logs:
                # the Trainer's clip_grad_norm_ found no .grad (the engine took them): 0.0; the engine's is the norm.
                # The history entry is a copy made before on_log: it gets the same values
                logs["grad_norm"] = engine.last.grad_norm
                last = state.log_history[-1] if state.log_history else None
                if last is not None and last.get("step") == state.global_step and last.get("loss") == logs["loss"]:
                    last.update(grad_norm=logs["grad_norm"], zero_grad_norm=logs["grad_norm"],
                                loss_scale=logs["loss_scale"])

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self._engine(kwargs)
        if engine is not None and getattr(engine, "world_size", 1) > 1:
            raise ValueError(f"ZeroOffloadCallback: the engine is sharded over {engine.world_size} ranks, and a plain "
                             "Trainer saves one optimizer.pt from rank 0, which holds only rank 0's slice (the other "
                             "ranks' state would be lost at every checkpoint); use ZeroOffloadTrainer or "
                             "ZeroOffloadMixin, which save every rank's state")
        gas = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        if engine is not None and (problem := accumulation_problem(engine, gas)):
            raise ValueError(f"ZeroOffloadCallback: {problem}; build the engine with OffloadOptions("
                             f"gradient_accumulation_steps={gas})")
        if engine is not None and getattr(args, "fp16", False):
            raise ValueError("ZeroOffloadCallback: --fp16 needs the engine's loss scaling, which only ZeroOffloadTrainer "
                             "/ ZeroOffloadMixin drive (here Accelerate's GradScaler would scale the loss and find no "
                             "gradients to unscale: the engine took them, 65536x too large); use --bf16 or fp32, or "
                             "ZeroOffloadTrainer")
        ranks = int(getattr(args, "world_size", 1) or 1)
        if engine is not None and getattr(engine, "world_size", 1) == 1 and ranks > 1:
            raise ValueError(f"ZeroOffloadCallback: {type(engine).__name__} is a one-process engine and this job has "
                             f"{ranks} ranks: it takes each gradient during backward, before DDP averages it, so every "
                             "rank would step on its own gradient and the replicas drift apart; use "
                             "ZeroOffloadTrainer or ZeroOffloadMixin with --sharded_ddp")
        clip = float(getattr(args, "max_grad_norm", 0.0) or 0.0)
        if engine is not None and clip != engine.options.max_grad_norm:
            raise ValueError(f"ZeroOffloadCallback: TrainingArguments.max_grad_norm={clip:g} but the engine's "
                             f"OffloadOptions.max_grad_norm={engine.options.max_grad_norm:g}: the engine takes the "
                             "gradients during backward, so the Trainer's clipping finds none and the engine's value "
                             "is the one that runs; set both to the same value (0: no clipping)")
        if engine is not None:  # what the mixin does at every train(): no window left part way, no stale masters
            engine.zero_grad(set_to_none=True)
            adopt_changed_params(engine)
            if state.is_world_process_zero and any(KEY not in g for g in engine.param_groups):
                logger.info("ZeroOffloadCallback: %s was built from unnamed params, so its optimizer.pt loads by "
                            "position at a resume (same-shaped params in another order would take each other's "
                            "saved weights); build it from model.named_parameters() and a resume compares the "
                            "names first", type(engine).__name__)
        model = kwargs.get("model")
        if engine is not None and model is not None:  # the params its builder left out of it, as they are now
            self._watch = TrainableWatch()
            self._watch.left_out = frozenset(id(p) for p in self._watch.outside(engine, model))
        if state.global_step > 0 and state.is_world_process_zero:  # a resume (its trainer_state.json loaded)
            self._say_unloaded_state(args, state, engine)

    @staticmethod
    def _say_unloaded_state(args, state, engine) -> None:
        """A plain Trainer loads optimizer.pt and scheduler.pt only when both are there, and never zero_offload/:
        a resume that left the engine as it was (its step count is not the checkpoint's) is said. Which checkpoint
        it was reaches no callback (train()'s argument is not in args): named when args or output_dir tell."""
        if engine is not None and engine.global_steps == state.global_step:
            return  # its optimizer.pt was loaded (the engine counts every step() call, as the Trainer its steps)
        named = [args.resume_from_checkpoint] if isinstance(args.resume_from_checkpoint, str) else []
        found = [c for c in named + [os.path.join(args.output_dir, f"checkpoint-{state.global_step}")]
                 if os.path.isdir(c) and (resume.held_step(c) or (None,))[0] == state.global_step]
        # An engine stepped in an earlier train() of its Trainer saves more steps than the Trainer's global_step (8
        # at checkpoint-4 of a second train()): its count equal to the one such a checkpoint's optimizer.pt holds is
        # that file loaded. (No hook can tell a load: accelerate's prepare round-trips the engine's state_dict)
        unloadable = {c: resume_report.unloaded_reason(c, STATE_DIR) is not None for c in found}
        if engine is not None and any(not unloadable[c] and resume_report.saved_optimizer_steps(c) ==
                                      engine.global_steps for c in found):
            return
        # a folder of that step that would not load (one that would, left unloaded, is not the one resumed)
        ckpt = next((c for c in found if unloadable[c]), None)
        if engine is not None:
            message = resume_report.unloaded_engine_message(ckpt, state.global_step, type(engine).__name__,
                                                            engine.global_steps, STATE_DIR)
        else:  # another optimizer than an engine: only our state is ours to name
            message = ckpt and resume_report.dropped_state_message(ckpt, STATE_DIR, "a plain Trainer does not load "
                                                                   "it; use ZeroOffloadTrainer / ZeroOffloadMixin")
        if message:
            logger.warning(message)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # a param made trainable since the run began (a callback's unfreezing): refused, as the mixin does; one left
        # out of the engine by its builder stays allowed, unless clipping would count its gradient (trainable_watch)
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.check(self._engine(kwargs), kwargs.get("model"), float(args.max_grad_norm or 0.0) > 0)

    def on_step_end(self, args, state, control, **kwargs):
        self._before_final_save(args, state, control, kwargs)

    def _before_final_save(self, args, state, control, kwargs) -> None:
        """DPU: a final --save_only_model checkpoint holds the last step (last_step.py). Looked at in each event
        before the save: a stop is seen once the callback that sets it has run (list this one after those)."""
        engine = self._engine(kwargs)
        if engine is not None and publish_for_final_save(args, state, control):
            engine.flush()

    def on_evaluate(self, args, state, control, **kwargs):
        self._before_final_save(args, state, control, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        # DPU: the last step reaches the model before the on_train_end of callbacks listed before this one
        # (report_to's integrations always are); with load_best_model_at_end the best weights stay instead
        engine = self._engine(kwargs)
        if engine is not None and run_ends(state, control) and not args.load_best_model_at_end:
            engine.flush()

    def on_train_end(self, args, state, control, **kwargs):
        engine = self._engine(kwargs)
        if engine is None:
            return
        if args.load_best_model_at_end and state.best_model_checkpoint and \
                os.path.isdir(state.best_model_checkpoint):
            # The Trainer has loaded the best checkpoint's weights: a flush would publish the last delayed step
            # (DPU) over them. Dropped instead, and the masters take the loaded weights (the moments stay, as a
            # torch optimizer's do): the model and a later train() go on from the best weights.
            engine.drop_delayed_step()
        else:
            engine.flush()
