"""The delayed parameter update's side of ``AdamCore`` (a mixin, as ``SavedState`` and ``ParamOwner`` are): the step
on the worker thread is waited for, its masters are published to the device parameters, and what a flush, a drop
or a model given other weights does to a step still in flight. Its methods read the core's fields (``_pending``,
``needs_publish``, ``_step_unpublished``, ``_publish_params``, ``uploader``) as their own.
"""
from __future__ import annotations

import logging

import torch

from .runs import FlatIndex, make_contiguous
from .streams.device import outcome

logger = logging.getLogger("hf_zero_offload")


class DelayedUpdate:
    _write_streaks: dict = {}  # id(param) -> how many publishes in a row found it written (replaced, never mutated)

    def _publish(self) -> None:
        """DPU: the masters computed on the worker reach the device parameters. A param written while the step
        was in flight (a callback's edit, ``load_state_dict``) keeps the written values, as a torch optimizer's
        next step starts from a write: its values go back over the publish and its masters take them, so the
        in-flight step's update of that param is dropped (its moments stay)."""
        if self.needs_publish:
            moved = self._written_params()
            if moved and make_contiguous(self.param_groups):  # rebound (model.to(memory_format=...)): a write too
                logger.warning("hf_zero_offload: a param rebound non-contiguous while a delayed step (DPU) was in "
                               "flight counts as written: it keeps its values and that step's update of it is "
                               "dropped; change the memory format before training, or flush() before it")
            written = [(p, p.detach().to("cpu", copy=True)) for p in moved]
            self._note_writes(written)
            self._publish_params()
            self.needs_publish = self._step_unpublished = False
            if written:
                self._keep_written(written)

    @torch.no_grad()
    def _keep_written(self, written: list) -> None:
        if self.uploader is not None:
            self.uploader.wait_all()  # the publish's copies have read the staging before the masters' sync rewrites it
        for p, values in written:
            # on the current stream, which the publish's copies were queued before (ParamUploader.finish, _gather)
            p.data.copy_(values)
        self._masters_take([p for p, _ in written])
        self._sync_mirror()  # a param without a gradient next step is published from the mirror: not the stale value
        logger.info("hf_zero_offload: %d parameter(s) written while a delayed step (DPU) was in flight keep the "
                    "written values (that step's update of them is dropped; flush() before a write applies it first)",
                    len(written))

    def _note_writes(self, written: list) -> None:
        """A param written during every delayed step (an in-place renormalisation at each forward) never trains: said
        once, as a warning, after three publishes in a row (``_keep_written``'s INFO line is hidden by default)."""
        last = self._write_streaks
        self._write_streaks = streaks = {id(p): last.get(id(p), 0) + 1 for p, _ in written}
        for p, _ in written:
            if streaks[id(p)] == 3:
                logger.warning("hf_zero_offload: a parameter of shape %s was written in place during each of the "
                               "last 3 delayed steps (DPU): each write keeps its values and drops that step's update, "
                               "so it no longer trains. Find what writes it at every step (nn.Embedding(max_norm=...) "
                               "renormalises its weight at each forward), or turn delayed_param_update off",
                               tuple(p.shape))

    @torch.no_grad()
    def _masters_take(self, params: list) -> None:
        """This slice's masters of ``params`` take the params' values."""
        ids, lo = {id(p) for p in params}, self.lo
        for p, off, a, b in FlatIndex(self._flat).pieces(lo, self.hi) if ids else ():
            if id(p) in ids:
                self.master[a - lo:b - lo].copy_(p.detach().reshape(-1)[a - off:b - off])

    def _masters_with_writes(self) -> None:
        """Before the state is saved with a delayed step in flight: the params written since keep their values at
        its publish (``_publish``), so the saved masters hold them too, and a resume goes on as this run does (the
        mirror stays: the publish restores and syncs it)."""
        if self.needs_publish:
            self._masters_take(self._written_params())

    def _wait_worker(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None  # a failure is raised once, then refused by name
            try:
                # re-raises a failure of the worker here; in a child forked while the step ran, ForkedMidTask
                self._uploaded = outcome(pending)
            except BaseException as e:
                self._step_failed = f"the delayed (DPU) step stopped part way ({type(e).__name__}: {e})"
                self.needs_publish = self._step_unpublished = False  # its masters are a mix: not published
                raise

    def flush(self) -> None:
        """Finish an in-flight DPU step and publish its parameters (end of training, before
        evaluation or a final save; sharded, every rank calls it)."""
        self.check_open("flush()")
        # a model moved since the build (model.to("cuda") after building over the CPU model) is refused by name, as
        # at backward, step() and adopt_changed_params(): the publish would have written across devices (nothing
        # is waited for or published: the step stays in flight for a flush once the model is back)
        self._refuse_moved([p for p, _, _ in self._flat])
        self._wait_worker()
        self._publish()
        if self.uploader is not None:
            self.uploader.wait_all()
        self._mark_params()

    def drop_delayed_step(self) -> int:
        """The model was given other weights (the Trainer loaded its best checkpoint) while a delayed step (DPU)
        was in flight: its publish, at the next step or ``flush()``, would overwrite them. The step is dropped
        and the masters take the model's weights (``adopt_changed_params``; the moments stay, as a torch
        optimizer's do). Returns how many params of this slice were taken."""
        self.check_open("drop_delayed_step()")
        self._wait_worker()
        self.needs_publish, self._uploaded, self._step_unpublished = False, None, False
        return self.adopt_changed_params()

    def __del__(self):
        # an engine used directly, dropped with a delayed step pending: that step never reaches the model
        try:
            # (a loaded state that leads the model, as load_best_model_at_end leaves one, is as it was saved)
            if getattr(self, "_step_unpublished", False) and getattr(self, "_done_why", None) is None:
                logger.warning("hf_zero_offload: %s dropped with a delayed (DPU) step not published: the model keeps "
                               "the weights of one step before; call flush() when done", type(self).__name__)
        except Exception:  # interpreter shutdown: logging may be gone
            pass
