"""``ZeroOffloadCallback``: what a plain Trainer given one of our engines (``optimizers=(engine, scheduler)``) can
have of the integration."""
from __future__ import annotations

import os

from transformers import TrainerCallback

from .. import resume
from .mixin import STATE_DIR, adopt_changed_params, logger


class ZeroOffloadCallback(TrainerCallback):
    """For users who keep their own Trainer and pass an engine as ``optimizers=(engine, scheduler)``.

    What the callback does: logs the engine's gradient norm and loss scale, and finishes a pending
    delayed parameter update at the end of training. What it cannot do without the mixin: scale the
    loss (so fp16 is not supported: use bf16 or fp32), stop the Trainer's own clipping (which sees no
    gradients: clip with the engine's ``max_grad_norm`` instead), hold the LR schedule on skipped
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
        engine = self._engine(kwargs)
        if engine is not None and logs is not None and "loss" in logs:
            logs["zero_grad_norm"] = engine.last.grad_norm
            logs["loss_scale"] = engine.loss_scale

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self._engine(kwargs)
        if engine is not None and getattr(engine, "world_size", 1) > 1:
            raise ValueError(f"ZeroOffloadCallback: the engine is sharded over {engine.world_size} ranks, and a plain "
                             "Trainer saves one optimizer.pt from rank 0, which holds only rank 0's slice (the other "
                             "ranks' state would be lost at every checkpoint); use ZeroOffloadTrainer or "
                             "ZeroOffloadMixin, which save every rank's state")
        if engine is not None:  # what the mixin does at every train(): no window left part way, no stale masters
            engine.zero_grad(set_to_none=True)
            adopt_changed_params(engine)
        # A plain Trainer never loads zero_offload/: say so when it resumed a checkpoint that holds it.
        if state.global_step == 0:
            return
        ckpt = args.resume_from_checkpoint if isinstance(args.resume_from_checkpoint, str) else \
            os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(ckpt) and (engine is None or engine.global_steps == 0):
            message = resume.dropped_state_message(ckpt, STATE_DIR, "a plain Trainer does not load it; use "
                                                   "ZeroOffloadTrainer / ZeroOffloadMixin")
            if message:
                logger.warning(message)

    def on_train_end(self, args, state, control, **kwargs):
        engine = self._engine(kwargs)
        if engine is not None:
            engine.flush()
