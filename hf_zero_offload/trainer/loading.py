"""``CheckpointLoading``: the load half of ``ZeroOffloadMixin`` (as ``CheckpointSaving`` is its save half): a resume's
checks, the engine's state and the LR schedule from ``checkpoint-N/``, and the best checkpoint's state for
``load_best_model_at_end``. Its methods read the Trainer's fields (``args``, ``state``, ``zero_engine``, ``_zo_raw``)
as their own."""
from __future__ import annotations

import logging
import os

from .. import resume
from ..resume import report as resume_report
from ..saved_names import names_difference, names_mismatch, trainable_set_mismatch
from ..engine.checkpoint.contents import GroupingMismatch, LayoutMismatch
from ..engine.checkpoint.folder import check_save_id, sources
from .saving import SCHEDULER_NAME, STATE_DIR
from .torch_resume import TorchStateResume
from .unloaded import other_shapes, unloaded_params

logger = logging.getLogger("hf_zero_offload")


class CheckpointLoading(TorchStateResume):
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # transformers loads the model's weights (a PEFT model's adapters) before the engine's state: a checkpoint
        # the engine would refuse left the model in memory holding its weights. What the files alone can tell is
        # refused first (the state's param order needs the engine, built later: checked at its load).
        if self._zo_raw is not None and model is None:
            self._zo_check_before_weights(resume_from_checkpoint)
        self._zo_missing = []
        out = super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._zo_unloaded = unloaded_params(self.model, self._zo_missing) if model is None else []
        return out

    def _issue_warnings_after_load(self, load_result) -> None:
        # what the Trainer's load of a checkpoint's weights did not find (unloaded.py says when that happens)
        self._zo_missing = list(getattr(load_result, "missing_keys", None) or ())
        return super()._issue_warnings_after_load(load_result)

    def _zo_check_before_weights(self, checkpoint: str) -> None:
        if shapes := other_shapes(self.model, checkpoint):  # (names alike: the names' check below took it)
            raise LayoutMismatch(f"{checkpoint} was saved for another model: {len(shapes)} tensor(s) of another shape "
                                 f"({'; '.join(shapes[:2])}{'; ...' if len(shapes) > 2 else ''}). Resume with that "
                                 f"run's model config. {resume.FRESH_START}")
        state_dir = os.path.join(checkpoint, STATE_DIR)
        if not os.path.isdir(state_dir):
            if self._zo_torch_state(checkpoint) is None:  # a plain Trainer's optimizer.pt is taken over
                raise FileNotFoundError(resume_report.no_state_message(checkpoint, STATE_DIR))
            return
        _, meta = sources(state_dir)  # every header checked: a damaged or foreign state file is named here
        check_save_id(meta, resume.recorded_save_id(checkpoint), state_dir)
        if self.zero_engine is not None:  # a second train(): the engine's slots, in their order
            self._zo_refuse_other_params(state_dir, names_mismatch(state_dir, self._zo_slot_names()))
            return
        aliases: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                aliases.setdefault(id(p), []).append(name)
        self._zo_refuse_other_params(state_dir, trainable_set_mismatch(state_dir, list(aliases.values())))

    @staticmethod
    def _zo_refuse_other_params(state_dir: str, moved: str | None) -> None:
        if moved:  # "" or None: the same params, or nothing to compare with
            raise LayoutMismatch(f"{state_dir} was saved for other trainable params than this model's, or the same "
                                 "in another order: the engine matches its state to the params by position and "
                                 f"would write the saved weights into other params{moved}. Resume with the model "
                                 f"and trainable params of that run. {resume.FRESH_START}")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        has_optimizer = any(os.path.isfile(os.path.join(checkpoint, n)) for n in resume.TORCH_OPTIMIZER_FILES)
        if self._zo_raw is None:
            dropped = None if has_optimizer else resume_report.dropped_state_message(checkpoint, STATE_DIR,
                                                                              "no --zero_offload")
            if dropped:
                logger.warning(dropped)
            elif has_optimizer and not os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
                logger.warning("hf_zero_offload: %s has optimizer.pt but no %s: transformers loads neither, so the "
                               "optimizer and the LR schedule both restart", checkpoint, SCHEDULER_NAME)
            return super()._load_optimizer_and_scheduler(checkpoint)
        state_dir = os.path.join(checkpoint, STATE_DIR)
        torch_sd = None if os.path.isdir(state_dir) else self._zo_torch_state(checkpoint)
        if torch_sd is None and not os.path.isdir(state_dir):
            raise FileNotFoundError(resume_report.no_state_message(checkpoint, STATE_DIR))
        moved = None if torch_sd is not None else names_mismatch(state_dir, self._zo_slot_names())  # (None: no file)
        self._zo_refuse_other_params(state_dir, moved)
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        before = self.lr_scheduler.state_dict() if os.path.isfile(sched) else None
        try:
            if before is not None:  # first: a damaged file is refused before the engine's state is touched
                if note := resume.load_scheduler(self.lr_scheduler, sched, resume.recorded_step(checkpoint)):
                    logger.warning(note)
            try:
                if torch_sd is not None:
                    self._zo_load_torch_state(checkpoint, torch_sd)
                else:  # names compared above with every alias: the engine's check by one name each could refuse a
                    # tied param whose names changed (an alias added)
                    self.zero_engine.load_checkpoint(state_dir, expected_save_id=resume.recorded_save_id(checkpoint),
                                                     names_checked=moved == "")
            except GroupingMismatch:
                raise  # (it names the groups: the params are the same)
            except LayoutMismatch as e:  # the totals alone may read the same: name the params that differ
                raise LayoutMismatch(f"{e}{names_difference(state_dir, self._zo_slot_names())}") from None
        except BaseException:
            if before is not None:  # a refused file or state leaves the schedule as it was
                self.lr_scheduler.load_state_dict(before)
            raise
        self._zo_after_unloaded_weights(checkpoint, from_masters=torch_sd is None)
        if before is None:
            logger.warning(resume_report.missing_scheduler_message(checkpoint, self._get_learning_rate(), SCHEDULER_NAME))
        state = getattr(self, "_zo_resume", None) or resume.status(checkpoint)
        if self.args.should_log:  # once per job (per node with log_on_each_node), not once per rank
            held = resume_report.saved_engine(checkpoint, STATE_DIR)
            logger.info(resume_report.describe(checkpoint, state, held,
                                        {"world_size": self.args.world_size, **(self._zo_engine_info() or {})}))
            options = self.zero_engine.options  # a changed schedule changes the numerics: warned, not only logged
            if changed := resume_report.dpu_change_message(held, options.dpu, options.dpu_warmup_steps):
                logger.warning(changed)
        saved = (getattr(self.zero_engine, "restored", None) or {}).get("world_size")
        if saved not in (None, self.args.world_size) and self.args.should_log and getattr(
                self, "model_accepts_loss_kwargs", False) and getattr(self.args, "average_tokens_across_devices", 0):
            # transformers multiplies the loss by the rank count for such models, expecting it divided by the batch's
            # token count over every rank; a model computing its own mean (T5) has N-times gradients on N ranks
            logger.warning("hf_zero_offload: this state was saved on %d rank(s) and goes on on %d, with "
                           "average_tokens_across_devices: transformers multiplies the loss by the rank count, so a "
                           "model that computes its own mean loss (T5) has gradients %g times those the saved moments "
                           "hold; the next steps differ from an uninterrupted run (t5-tiny, no clipping: 1.2e-3 after "
                           "3 steps), as under the plain Trainer; --average_tokens_across_devices false keeps one scale",
                           saved, self.args.world_size, self.args.world_size / saved)

    def _zo_after_unloaded_weights(self, checkpoint: str, from_masters: bool, best: bool = False) -> None:
        """Params the Trainer's load left as they were (``unloaded``' module says why): our state's masters set them,
        a DPU state's with its step published now (its lagging weights are gone with the names), and a plain
        Trainer's checkpoint cannot restore them (as under the plain Trainer). ``best``: the best model's load."""
        unloaded, self._zo_unloaded = getattr(self, "_zo_unloaded", None) or [], []
        if not unloaded or self._zo_raw is None:
            return
        names = f"{len(unloaded)} trainable param(s) ({', '.join(unloaded[:3])}{', ...' if len(unloaded) > 3 else ''})"
        why = (f"{checkpoint}'s weight files hold {names} under other names (transformers saves this architecture's "
               f"weights under their older names and the Trainer's {'best-model load' if best else 'resume'} reads "
               "them by name)")
        say = self.args.should_log  # once per job (per node with log_on_each_node); the flush is every rank's
        if not from_masters:
            if say:
                logger.warning("hf_zero_offload: %s: they keep the values they had before the resume (their "
                               "initialisation), as under the plain Trainer, and the optimizer's moments go on from "
                               "there", why)
        elif self.zero_engine.needs_publish:  # a DPU state: its lagging weights were those params' only copy
            self.zero_engine.flush()
            if say:
                logger.warning("hf_zero_offload: %s: the delayed (DPU) step's lagging weights cannot be restored, so "
                               "its masters are published now, one step early: %s", why,
                               "the model holds the weights one step after those that checkpoint was evaluated with"
                               if best else "the first step after the resume differs from an uninterrupted run's by "
                               "that lag")
        elif say:
            logger.info("hf_zero_offload: %s: the engine's fp32 masters set them (transformers' 'missing keys' "
                        "warning above does not apply: the load is exact)", why)

    def _load_best_model(self) -> None:
        engine = self.zero_engine
        if engine is None:
            return super()._load_best_model()
        engine.flush()  # DPU: the step in flight lands first, so nothing overwrites the best weights later
        self._zo_missing = []
        super()._load_best_model()
        # The model holds the best checkpoint's weights: its masters, moments and step counts follow (the masters
        # are the weights in fp32), so that a save, consolidate or more training goes on from the best state.
        best = self.state.best_model_checkpoint
        self._zo_unloaded = unloaded_params(self.model, self._zo_missing)  # (left at the last step's values)
        state_dir = os.path.join(best, STATE_DIR)
        # the best may be a checkpoint of the plain run this one resumed (its optimizer.pt taken over, as at a
        # resume): it failed at the end of train(), the whole run done, looking for a zero_offload/ it never had
        torch_sd = None if os.path.isdir(state_dir) else self._zo_torch_state(best)
        if torch_sd is not None:
            self._zo_load_torch_state(best, torch_sd)
        elif os.path.isdir(state_dir) or resume.read_marker(best) is not None:  # (ours without it: damage, named)
            engine.load_checkpoint(state_dir, expected_save_id=resume.recorded_save_id(best))
        else:  # a plain checkpoint without optimizer state: as the plain Trainer, its weights with this run's moments
            engine.adopt_changed_params()
            if self.args.should_log:
                logger.warning("hf_zero_offload: load_best_model_at_end: %s holds no optimizer state (no %s/, no "
                               "optimizer.pt): the model and the engine's masters take its weights, Adam's "
                               "moments and step counts stay the last step's, as the plain Trainer's optimizer "
                               "keeps its own", best, STATE_DIR)
        self._zo_after_unloaded_weights(best, from_masters=os.path.isdir(state_dir), best=True)
        self._zo_best = True  # no flush at the end of train(): a DPU state's masters publish at its next step
