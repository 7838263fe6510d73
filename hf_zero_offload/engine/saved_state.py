"""``SavedState``: the state half of ``AdamCore`` (core.py), the part that leaves and re-enters the process:
``state_meta``/``state_tensors``/``state_dict``, checkpoints (``checkpoint.folder``, one file format for every engine
and world size) and the loads of both.

A load checks everything it can before its first write (``contents.check_meta`` / ``check_tensors``, the params'
names, the loss scaler's values, the int8 code map), so a refused state leaves the optimizer as it was. A checkpoint's
tensors then stream straight into the arena (no second copy of the state); should a chunk fail its checksum part way,
``_load_failed`` stays set and ``step``, ``state_meta`` (hence every save) refuse until a load succeeds.

A mixin of the same object, not a helper of another: its methods read the core's fields (``lo``, ``hi``, ``master``,
``moments``, ``param_groups``, ``_param_steps``, ``scaler``...) as its own.
"""
from __future__ import annotations

import logging
import os

import torch

from .. import ops
from ..ops.moments import check_code_range
from . import param_names
from .checkpoint import contents, folder
from .checkpoint import StateFileError
from .moments import SCALES, Q
from .written_params import DIGESTS_KEY, WrittenParams, check_digests

STATE_FORMAT = "hf_zero_offload.state/2"
_OWN_KEYS = ("params", param_names.KEY)  # a group's keys a load keeps (its params, and their names)
logger = logging.getLogger("hf_zero_offload")


class SavedState(WrittenParams):
    _load_failed: str | None = None  # what a load that failed after its first write was loading
    _step_failed: str | None = None  # a step (or delayed step) that stopped part way: AdamCore.step, _wait_worker

    def _slot_meta(self) -> list:
        return [[[off, n, list(p.shape)] for p, off, n in g] for g in self._slots]

    def state_meta(self) -> dict:
        """Everything but the big tensors (JSON-serialisable; the state file's header)."""
        self.check_open("state_meta()")
        self._check_intact()
        self._wait_worker()  # the masters must be final; the device may stay one step behind (DPU)
        return {
            "format": STATE_FORMAT, "numel": self.numel, "world_size": self.world_size, "rank": self.rank,
            "shard_start": self.lo, "shard_end": self.hi, "stage": self.stage, "offload": self.offload,
            "param_dtype": str(self.param_dtype).replace("torch.", ""),
            "state_dtype": self.moments.state_dtype,
            **({"int8_codes": ops.INT8_CODES} if self.moments.state_dtype == "int8" else {}),
            "param_groups": [{k: contents.json_value(v, f"param_groups[{i}].{k}") for k, v in g.items()
                              if k != "params"} for i, g in enumerate(self.param_groups)],
            "slots": self._slot_meta(),
            **({param_names.META_KEY: names} if (names := param_names.slot_names(self.param_groups, self._slots))
               else {}),
            "param_steps": self._param_steps.tolist(),
            "loss_scaler": self.scaler.state_dict(),
            "global_steps": self.global_steps,
            "needs_publish": self.needs_publish,
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Views of this slice's state (no copy, no padding): the checkpoint writer streams them."""
        self.check_open("state_tensors()")
        self._wait_worker()
        self._masters_with_writes()
        n = self.hi - self.lo
        return {"master": self.master[:n], **self.moments.tensors(n)}

    def _refuse_copy(self, what: str):
        raise TypeError(f"{type(self).__name__} cannot be {what}: its state lives in a host arena (and on other ranks), "
                        "with gradient hooks on the model's parameters; save it with state_dict() or "
                        "save_checkpoint() and load that into an engine built on the new model")

    def __getstate__(self):  # pickle, torch.save(engine), copy.copy: torch's kept group settings alone
        self._refuse_copy("pickled or copied")

    def __deepcopy__(self, memo):  # a copy without masters or moments, which failed at its first step
        self._refuse_copy("deep-copied")

    def state_dict(self) -> dict:
        """This slice's state (``state_meta`` and clones of its tensors), through torch.optim's state_dict
        hooks in torch's order: the pre hooks see the optimizer, the post hooks the dict (and may replace it)."""
        self.check_open("state_dict()")
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        # Clones: torch.save of a view would write the whole arena (gradient stores included).
        state = {**self.state_meta(), **self._digests_meta(), **{k: v.clone() for k, v in self.state_tensors().items()}}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            state = state if result is None else result
        return state

    def load_state_dict(self, state: dict) -> None:
        """A state of this same slice (``load_checkpoint`` re-cuts a directory for any world size). All is checked
        before the first write: a refused state changes nothing (on any rank). torch.optim's hooks run as in torch:
        the pre hooks see (and may replace) the dict, the post hooks the optimizer as loaded."""
        self.check_open("load_state_dict()")
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state)
            state = state if result is None else result
        self._load_state_dict(state)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _load_state_dict(self, state: dict) -> None:
        where = "state dict"

        def checked() -> tuple[dict, int]:
            if not isinstance(state, dict) or ({"state", "param_groups"} <= set(state) and "format" not in state):
                got = ("a torch optimizer state_dict: load an AdamW's with load_torch_state_dict (each rank takes "
                       "its shard of the moments)") if isinstance(state, dict) else type(state)
                raise TypeError(f"{type(self).__name__}.load_state_dict: expected the dict its state_dict() returns, "
                                f"got {getattr(got, '__name__', got)}")
            meta = self._check_saved(state, where)
            lo, hi = meta.get("shard_start", 0), meta.get("shard_end", meta.get("numel"))
            if (lo, hi) != (self.lo, self.hi):  # int8 shards are cut on 256-element blocks, fp32/bf16 ones are not
                raise ValueError(f"this state (rank {meta.get('rank', 0)} of {meta.get('world_size', 1)}, "
                                 f"{meta.get('state_dtype', 'fp32')}) holds elements [{lo}, {hi}); this engine (rank "
                                 f"{self.rank} of {self.world_size}, {self.moments.state_dtype}) holds [{self.lo}, "
                                 f"{self.hi}): load_checkpoint re-cuts a save_checkpoint for any world size or "
                                 "state_dtype")
            contents.check_tensors(meta, self.hi - self.lo, where)
            return meta, self._saved_codes(meta, where)

        # a refusal on one rank only left its peers in the collective below until the timeout: all hear of it
        (state, codes), failed = self._on_every_rank(checked)
        if failed:
            raise ValueError(f"load_state_dict: refused on rank(s) {failed} (their error says why); no rank loaded")
        # Accelerate (a plain Trainer given an engine) loads the engine's own state_dict() back at every train():
        # publishing those masters wrote stale values over weights loaded since (a resume's). Unchanged masters
        # publish nothing; a param written since is taken at the next step. (Agreed: the publish is a collective.)
        same = not self._ranks_that_failed(not self._same_masters(state))
        self._load_failed = where
        self._apply_meta(state)
        # the state holds this very slice (checked above): ``lo`` is its start
        self._load_tensors(state, codes, lambda lo, dst: [dst[k].copy_(state[k].reshape(-1)[:dst[k].numel()])
                                                           for k in dst], where=where)
        if same:
            self._sync_mirror()
        else:
            self._finish_load(state)
        self._load_failed = self._step_failed = None

    def _same_masters(self, state: dict) -> bool:
        self._wait_worker()
        n = self.hi - self.lo
        saved = state["master"].reshape(-1)[:n]
        return saved.dtype == self.master.dtype and torch.equal(saved.to(self.master.device), self.master[:n])

    def _check_saved(self, meta: dict, where: str, names: bool = True) -> dict:
        """``meta`` checked (refused by name), and returned as this engine's groups hold it. ``names``: compare the
        params' names too (``param_names.check_names``)."""
        meta = contents.with_empty_groups(meta, self._slot_meta(), self.param_groups)
        contents.check_meta(meta, where, numel=self.numel, slots=self._slot_meta(), groups=len(self.param_groups),
                             steps=self._param_steps.numel(), own_groups=self.param_groups)
        if names:
            param_names.check_names(meta, self.param_groups, self._slots, where)
        check_digests(meta, len(self._flat), where)
        try:
            self.scaler.check_state_dict(meta.get("loss_scaler"))
        except ValueError as e:
            raise StateFileError(f"{where}: {e}") from None
        return meta

    def _check_intact(self) -> None:
        if self._load_failed is not None:
            raise RuntimeError(f"loading the {self._load_failed} failed part way, so this optimizer holds part of "
                               "it: load a state that loads (or start afresh) before stepping or saving")
        if self._step_failed is not None:
            raise RuntimeError(f"{self._step_failed}, so some params hold its update and some do not: load a state "
                               "(a checkpoint: resume from it) or build a new engine before stepping or saving")

    def load_state_meta(self, meta: dict) -> None:
        """The small state (hyper-parameters, step counts, loss scaler), after checking it all."""
        self.check_open("load_state_meta()")
        meta = self._check_saved(meta, "state meta")
        self._apply_meta(meta)

    def _apply_meta(self, meta: dict) -> None:
        """load_state_meta's writes, for a meta its caller has checked (``_check_saved``)."""
        self._wait_worker()
        self._prepared = None
        contents.say_taken_values(self.param_groups, meta["param_groups"])
        for group, saved in zip(self.param_groups, meta["param_groups"]):
            # never "params" (torch.optim's state dicts list param ids there) nor their names: the engine's own stay
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k not in _OWN_KEYS})
        self._param_steps.copy_(torch.tensor(meta["param_steps"], dtype=torch.int64))
        saved = meta["loss_scaler"]
        if (saved.get("enabled"), saved.get("dynamic")) != (self.scaler.enabled, self.scaler.dynamic):
            logger.info("hf_zero_offload: the saved state ran %s; this run's config applies: %s",
                        "fp16 loss scaling" if saved.get("enabled") else "without loss scaling",
                        self.scaler.describe())
        self.scaler.load_state_dict(saved)
        self.global_steps = meta["global_steps"]

    def _finish_load(self, meta: dict) -> None:
        """After the tensors are in place: rebuild what a checkpoint does not store, and set the model's
        parameters from the masters (DeepSpeed's ``load_from_fp32_weights``): saved by a run of a lower
        precision (bf16 -> fp32), the model read from the checkpoint holds rounded weights, and the first
        resumed steps ran on those, not on the masters the optimizer goes on from. Same precision: the
        same values. A DPU state's masters are one step ahead of the saved parameters: with DPU on, the
        next step publishes them (the schedule of an uninterrupted run); without, they are published now."""
        self._sync_mirror()
        self.needs_publish, self._uploaded, self._step_unpublished = False, None, False
        if meta.get("needs_publish") and self.options.dpu:
            self.needs_publish = True
            self._mark_params()
            # A param written after this load keeps its values at that publish (``_publish``), as a torch optimizer's
            # next step starts from a write (an edit by hand), except the model's weights of the saved moment loaded
            # after the engine's state (engine first, then model): told apart by their digests, saved with the state;
            # counted as a write, they dropped the step's update (the resumed run one update short, without a word)
            self._saved_digests = meta.get(DIGESTS_KEY)
            if self._saved_digests is None:  # saved before the digests were: that publish overwrites every write
                self._param_marks = None
        else:
            self._publish_masters()
            self._mark_params()

    last_save_id: str | None = None  # the save id of this engine's last save_checkpoint
    def save_checkpoint(self, directory: str) -> str:
        """Every rank writes ``rank{r}_of_{W}.hzo`` atomically (``folder.save``). Returns the save's id, a
        token every file of this save holds (and ``meta.json``): a load refuses a directory whose files
        disagree on it, and one whose id is not the ``expected_save_id`` its caller recorded for it."""
        self.check_open("save_checkpoint()")
        if any(self._window_received()):  # torch.optim's state holds no .grad either: said, not silent
            logger.warning("hf_zero_offload: save_checkpoint between two steps: the gradients taken since the last "
                           "step() are not saved (a resume starts that window afresh)")
        meta = {**self.state_meta(), **self._digests_meta(), "save_id": self._shared_token()}
        folder.save(directory, self.rank, self.world_size, meta, self.state_tensors(),
                       barrier=self._barrier, partition=self._partition_ranges(), agree=self._ranks_that_failed)
        self.last_save_id = meta["save_id"]
        return self.last_save_id

    def _shared_token(self) -> str:  # a random token, the same on every rank (one process: its own)
        return os.urandom(8).hex()

    def load_checkpoint(self, directory: str, expected_save_id: str | None = None, *,
                        names_checked: bool = False) -> dict:
        """Load a checkpoint of any engine and world size: this slice's part of every saved file, straight into the
        arena. Returns what was restored (format, world size saved, stage, ...).
        ``expected_save_id``: what ``save_checkpoint`` returned for this directory (the Trainer records it in
        the checkpoint's completion marker); a state of another save (a zero_offload/ copied or linked from
        another checkpoint) is refused before the first write. ``names_checked``: the caller compared every alias
        of each param already (the Trainer's resume, ``param_names.json``), so the engine's own comparison by one
        name per param (a tied param's may differ: an alias added) is skipped.

        Every rank calls it; all succeed or all raise (``_on_every_rank``): a failure one rank alone sees (a
        damaged chunk only it reads) left its peers training on, to wait for it in their next collective."""
        self.check_open("load_checkpoint()")
        # the agreement comes before _finish_load, whose publish is a collective a failed rank never joins
        (meta, files), failed = self._on_every_rank(lambda: self._read_checkpoint(directory, expected_save_id,
                                                                                 names_checked))
        if failed:
            self._load_failed = f"checkpoint {directory} (rank(s) {failed} failed to load their part)"
            raise StateFileError(f"loading the optimizer state in {directory} failed on rank(s) {failed} (their "
                                 "error names the file); this rank loaded its part, but the ranks no longer hold "
                                 "one state: resume from an earlier checkpoint")
        self._finish_load(meta)
        self._load_failed = self._step_failed = None
        self.restored = folder.summary(meta, files)
        return self.restored

    def _on_every_rank(self, work):
        """(``work()``, the ranks whose ``work`` raised), once every rank has said whether its own did (a collective
        for sharded engines: a rank that raised alone left its peers in their next one until the timeout)."""
        error, result = None, None
        try:
            result = work()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the peers have heard of it
            error = e
        failed = self._ranks_that_failed(error is not None)
        if error is not None:
            raise error
        return result, failed

    def _ranks_that_failed(self, failed: bool) -> list[int]:  # (a collective for sharded engines)
        return [self.rank] if failed else []

    def _read_checkpoint(self, directory: str, expected_save_id: str | None,
                         names_checked: bool) -> tuple[dict, int]:
        """This rank's part of the checkpoint into the state (no collective); (the saved meta, files)."""
        srcs, meta = folder.sources(directory)
        folder.check_save_id(meta, expected_save_id, directory)
        meta = self._check_saved(meta, directory, names=not names_checked)
        codes = self._saved_codes(meta, directory)
        folder.check_sources(srcs, meta.get("state_dtype", "fp32"), self.lo, self.hi)
        # the tensors stream into the arena (no second copy of the state): from here a damaged file
        # leaves a mix of old and new state, which step and save then refuse
        self._load_failed = f"checkpoint {directory}"
        self._apply_meta(meta)
        if self.hi > self.lo:
            self._load_tensors(meta, codes, lambda lo, dst: folder.read_range(srcs, lo, dst), where=directory,
                               files=srcs)
        return meta, len(srcs)

    @staticmethod
    def _saved_codes(meta: dict, where: str) -> int:
        """The code map of saved int8 moments (``ops.INT8_CODES``; none saved means 1), checked before any load."""
        codes = meta.get("int8_codes", 1) if meta.get("state_dtype", "fp32") == "int8" else ops.INT8_CODES
        try:
            ops.check_int8_codes(codes)
        except ValueError as e:
            raise StateFileError(f"{where}: {e}") from None
        return codes

    def _load_tensors(self, meta: dict, codes: int, read, where: str, files: list | None = None) -> None:
        """``read(lo, dst)`` fills ``dst`` (flat tensors of the saved state dtype from element ``lo``, block-aligned
        for int8). Moments saved with another ``state_dtype`` (or int8 ones with an earlier code map ``codes``) are
        converted through fp32 (a one-time copy of the slice's moments), with one log line. ``files``: a
        checkpoint's (path, start, end), to name in errors; None for a state dict."""
        saved = meta.get("state_dtype", "fp32")
        if saved == self.moments.state_dtype and codes == ops.INT8_CODES:
            read(self.lo, self.state_tensors())
        else:
            self._convert_loaded(saved, codes, read, where, files)
        if files is None:  # a state dict: its values were checked before the first write (contents.check_tensors)
            return
        if self.moments.state_dtype == "int8":  # absmax scales, as the kernels rely on (a conversion's: our codes)
            self._check_int8(self.moments.state, where, self.lo, files if (saved, codes) == ("int8", ops.INT8_CODES)
                             else None)
        elif saved == self.moments.state_dtype:  # streamed, so checked once loaded (conversions: _convert_loaded)
            contents.check_second_moments(self.moments.tensors(self.hi - self.lo)["exp_avg_sq"], where)

    @staticmethod
    def _check_int8(state: dict, where: str, first: int = 0, files: list | None = None) -> None:
        """Loaded int8 moments: absmax scales, codes in the range the kernel writes (a larger one decodes above
        its block's absmax). Read once loaded (they stream into the arena; reading them twice adds a third to a
        resume's reads), so a refusal comes after the first write: ``_load_failed`` keeps step and save refused.
        ``files`` (a checkpoint's (path, start, end); ``first``: the flat index of element 0): each file's codes are
        checked apart, so the error names the rank file that holds the bad code (the same one pass)."""
        n = state["exp_avg"].numel()
        parts = [(where, 0, n)] if files is None else [
            (path, max(a0, first) - first, min(b0, first + n) - first) for path, a0, b0 in files
            if min(b0, first + n) > max(a0, first)]
        name = where
        try:
            ops.check_scales(*(state[k] for k in SCALES))
            for name, a, b in parts:
                for k in ("exp_avg", "exp_avg_sq"):
                    check_code_range(f"{k} codes", state[k][a:b])
        except ValueError as e:
            raise StateFileError(f"{name}: {e}; use an earlier checkpoint") from None

    def _convert_loaded(self, saved: str, codes: int, read, where: str, files: list | None) -> None:
        own, n = self.moments.state_dtype, self.hi - self.lo
        read(self.lo, {"master": self.master[:n]})
        # the saved int8 blocks that cover this slice (its start need not be a block start then)
        la = self.lo // Q * Q if saved == "int8" else self.lo
        ha = min(self.numel, -(-self.hi // Q) * Q) if saved == "int8" else self.hi
        tmp = ops.make_state(ha - la, saved)
        read(la, tmp)
        if saved == "int8":
            self._check_int8(tmp, where, la, files)
        elif files is not None:  # (a state dict's: checked already) a negative one would encode as its magnitude
            contents.check_second_moments(tmp["exp_avg_sq"], where)
        m, v = (t[self.lo - la:self.hi - la] for t in ops.state_to_fp32(tmp, codes))
        for k, t in ops.state_from_fp32(m.contiguous(), v.contiguous(), own).items():
            self.moments.tensors(n)[k].copy_(t)
        what = f"{saved} (code map {codes})" if saved == "int8" else saved
        logger.info("hf_zero_offload: optimizer moments saved as %s converted to state_dtype=%s", what, own)
