"""``WrittenParams``: which params were written since the engine last set them (a version counter and a storage per
param), and their masters taken from the model then, as torch.optim starts from the params it finds. A mixin of
``AdamCore`` (core.py), through ``SavedState``: its methods read the core's fields (``_flat``, ``master``, ``lo``,
``hi``, ``needs_publish``...) as their own."""
from __future__ import annotations

import logging

import torch

from .checkpoint import StateFileError
from .grad_hooks import device_moved, size_changed
from .runs import FlatIndex, make_contiguous

logger = logging.getLogger("hf_zero_offload")

#: a state saved with a delayed step (DPU) in flight: each param's ``param_digest`` as the model held it then
DIGESTS_KEY = "dpu_param_digests"
_M = 65521  # the position weights run 1.._M, again and again
_CHUNK = _M * 64  # elements per pass (a whole number of weight periods: one weight tensor serves every chunk);
# each chunk's sums stay exact in int64 (< 2**15 * 2**16 * 2**22 = 2**53)


@torch.no_grad()
def param_digest(p: torch.Tensor) -> list[int]:
    """Two sums of the bits of a param's values as fp32 (as int16s: plain, and weighted by position), exact and the
    same on any device and in any float dtype that holds those values (a bf16 run's weights loaded into an fp32 model
    resuming it: the same digest): a load after which they differ from the saved moment's is a write, not the saved
    weights loaded back. (A pass over the param on its device, only where a delayed step is in flight at a save, or
    at the publish after such a load.)"""
    values = p.detach().reshape(-1)
    weights = torch.arange(min(_CHUNK, 2 * values.numel()), device=values.device).remainder_(_M).add_(1)
    half = _CHUNK // 2  # fp32 values per pass: two int16s each
    sums = [torch.stack([(x * weights[:x.numel()]).sum(), x.sum()]) for a in range(0, values.numel(), half)
            for x in [values[a:a + half].float().view(torch.int16).long()]]
    return [sum(col) for col in zip(*torch.stack(sums).cpu().tolist())] if sums else [0, 0]


def check_digests(meta: dict, count: int, where: str) -> None:
    """A saved ``DIGESTS_KEY``: one [int, int] per param, refused by name before the load's first write."""
    saved = meta.get(DIGESTS_KEY)
    if saved is not None and not (isinstance(saved, list) and len(saved) == count and all(
            isinstance(d, list) and len(d) == 2 and all(type(v) is int for v in d) for d in saved)):
        raise StateFileError(f"{where}: {DIGESTS_KEY} must be a list of {count} [int, int] (one per param), got "
                             f"{str(saved)[:80]}; this state was not written by hf_zero_offload (or is damaged)")


class WrittenParams:
    _param_marks: list | None = None  # per param (version counter, storage) when this engine last set or took it
    # a state loaded with a delayed step in flight: each param's digest at the saved moment, until the next mark (the
    # publish): a param written since the load that holds those values again is that moment's weights loaded back
    _saved_digests: list | None = None

    def _mark_params(self) -> None:
        self._param_marks = [(p._version, p.data_ptr()) for p, _, _ in self._flat]
        self._saved_digests = None

    def _digests_meta(self) -> dict:
        """What a save adds to its meta with a delayed step in flight: the model's params as they are now (as the
        model's weights saved beside this state hold them), one digest each (``param_digest``)."""
        return {DIGESTS_KEY: [param_digest(p) for p, _, _ in self._flat]} if self.needs_publish else {}

    def _adopt_written_params(self) -> None:
        """At each step: a parameter written since this engine last set it, in place (``load_state_dict``, an
        edit under ``no_grad``) or rebound (``p.data = t``), is what this step starts from, as with torch.optim
        (the stale master was published over it). A look at each param's version counter and storage (no pass
        over the values unless one moved). A write through ``p.data.<op>_()`` moves neither: call
        ``adopt_changed_params()`` after such a write. One rebound to another device is refused by name."""
        written = self._written_params()
        self._refuse_moved(written)  # (a delayed step in flight too: its publish would write across devices)
        if self.needs_publish:
            return  # a delayed step is in flight: its publish, in this step, looks for writes and keeps them (_publish)
        if not written:
            return
        if n := self.adopt_changed_params():
            logger.info("hf_zero_offload: %d parameter(s) written since the last step; the step starts from them", n)
        self._mark_params()

    def _written_params(self) -> list[torch.nn.Parameter]:
        """The params whose version counter or storage moved since this engine last set them (refused by name
        when one was resized: its masters and moments are laid out for the old size)."""
        marks = self._param_marks
        if marks is None:
            return []
        written = [p for m, (p, _, _) in zip(marks, self._flat) if m != (p._version, p.data_ptr())]
        for p, _, numel in self._flat if written else ():
            if p.numel() != numel:
                raise ValueError(size_changed(p, numel))
        if written and self._saved_digests is not None:  # the saved moment's weights loaded back are no write
            saved = {id(p): d for (p, _, _), d in zip(self._flat, self._saved_digests)}
            written = [p for p in written if param_digest(p) != saved[id(p)]]
        return written

    def _refuse_moved(self, params) -> None:
        """A param now on another device than the engine's (the model moved after the build: ``model.to("cuda")``,
        ``accelerator.prepare``, a plain Trainer placing it) is refused by name (``grad_hooks.device_moved``); a
        move within the engine's device (a cast, ``.to(memory_format=...)``, CPU to CPU) is a rebind it adopts."""
        built = getattr(self, "_params_on", None)  # (None: not built yet)
        for p in params if built is not None else ():
            if p.device != built:
                raise RuntimeError(device_moved(type(self).__name__, self._param_label(p), built, p.device))

    @torch.no_grad()
    def adopt_changed_params(self) -> int:
        """Parameters written since this engine last set them (another optimizer trained the model, or
        ``load_state_dict`` between two ``train()`` calls), found by comparing this slice of the model with its
        masters rounded as the kernel rounds them: their masters take the model's values (the moments stay, as
        CPUAdam and torch.optim keep theirs). Without this the next step published the stale masters over them,
        without a word. Returns how many params of this slice changed. A DPU state one step ahead is left as is."""
        self.check_open("adopt_changed_params()")
        self._refuse_moved([p for p, _, _ in self._flat])
        self._wait_worker()
        make_contiguous(self.param_groups)  # a rebind since (model.to(memory_format=...)) left one strided
        if self.needs_publish:
            return 0
        changed, lo = set(), self.lo
        for p, off, a, b in FlatIndex(self._flat).pieces(lo, self.hi):
            now = p.detach().reshape(-1)[a - off:b - off]
            master = self.master[a - lo:b - lo]
            held = master.to(device=now.device, dtype=now.dtype)
            if not bool(((now == held) | (now.isnan() & held.isnan())).all()):
                master.copy_(now)
                changed.add(id(p))
        if changed:
            self._sync_mirror()
        self._mark_params()
        return len(changed)
