"""``CheckpointSaving``: the save half of ``ZeroOffloadMixin`` (a mixin of the same Trainer, as the engines'
``SavedState`` is of theirs): each rank's optimizer state under ``checkpoint-N/zero_offload/``, the LR schedule, the
param names, and the completion marker written last (its rotation of old checkpoints waits for it). Its methods read
the Trainer's fields (``args``, ``state``, ``zero_engine``, ``_zo_raw``) as their own."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
import time

import torch
from safetensors import SafetensorError

from .. import resume
from ..resume import rotation
from ..saved_names import write_param_names
from ..engine.checkpoint import atomic_path, fsync_dir, fsync_tree, remove_durably
from ..run_lock import confirm_job_lock
from .shared_dir import distributed, failed_elsewhere, missing_rank_files
from .last_step import publish_for_final_save
from .peer_failure import failed_peer
from .progress import PROGRESS_KEY, parse_progress, progress_count, shared_store
from .save_errors import CheckpointSaveError, failed_on, wrap  # noqa: F401 (CheckpointSaveError: the API)

logger = logging.getLogger(__name__)

STATE_DIR = "zero_offload"
SCHEDULER_NAME = "scheduler.pt"


def _remove_checkpoint(folder: str) -> list[str]:
    """rmtree of an old checkpoint, its completion records first (our marker, then trainer_state.json, durably): a
    removal cut short (a crash, a file it cannot delete) leaves a folder that reads as cut short, which a resume
    skips, never one that looks finished with files missing. The errors, one line each (a folder gone meanwhile:
    none)."""
    failed: list[str] = []

    def said(_fn, path, exc):
        exc = exc if isinstance(exc, BaseException) else exc[1]
        # (a folder left non-empty by a file named already is that file's failure, not another)
        if not isinstance(exc, FileNotFoundError) and not (failed and getattr(exc, "errno", None) == errno.ENOTEMPTY):
            failed.append(f"{path}: {exc.strerror or exc}" if isinstance(exc, OSError) else f"{path}: {exc}")

    try:
        resume.clear_marker(folder)
    except FileNotFoundError:  # removed meanwhile
        return failed
    except OSError as e:
        said(None, folder, e)
    shutil.rmtree(folder, **({"onexc": said} if sys.version_info >= (3, 12) else {"onerror": said}))
    return failed


class CheckpointSaving:
    def _maybe_log_save_evaluate(self, *args, **kwargs):
        # each rank says when it has passed this point, saved or not, so that a save asked on some ranks only (a
        # callback's control.should_save on one rank) is told apart from a peer that is slower to get there
        self._zo_point = None
        if getattr(self, "_zo_own_end", False):  # (an epoch end at each rank's own step: same_run.SameBatches)
            return super()._maybe_log_save_evaluate(*args, **kwargs)
        count = self._zo_count()
        if count is not None:
            count[1] += 1
            self._zo_point = tuple(count)
        try:
            out = super()._maybe_log_save_evaluate(*args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # (the store gone with rank 0: the error in flight is the one to see)
                self._zo_passed()
            raise
        self._zo_passed()
        return out

    def _zo_count(self) -> list | None:
        return progress_count(self._zo_store(), self.args.process_index)

    def _zo_new_run(self) -> None:
        """At each train(): this rank's points counted from 0 again, in a new generation."""
        if (count := self._zo_count()) is not None:
            count[0], count[1] = count[0] + 1, 0

    def _zo_passed(self) -> None:
        if self._zo_point is not None:
            self._zo_say("passed")
        self._zo_point = None

    def _zo_say(self, state: str) -> None:
        g, n = self._zo_point
        self._zo_store().set(PROGRESS_KEY.format(self.args.process_index), f"{g}:{n}:{state}")

    def _zo_store(self):
        return shared_store(self.args.world_size)

    def _zo_agree_to_save(self, output_dir: str) -> None:
        """Every rank saves this checkpoint, or every saving rank raises before its first collective: one rank's save
        waited in its first collective for a peer that had gone on to the next step, until the 30-minute timeout (a
        plain DDP run fails there at once, in gloo's words).

        Kept beside the control flags' all-reduce (agreed_control.py), which it does not duplicate: only this one
        catches (1) a run of the mixin without the engine on several ranks, whose flags are not agreed (the plain
        Trainer's behaviour) while this save still gathers its outcome (``_zo_stop_if_failed``), so a callback's
        should_save on one rank, or a peer that failed before the save point, left the ranks in gloo until the
        collective timeout; (2) ``--save_strategy best``, where transformers sets should_save from each rank's
        ``_determine_best_metric`` after the last agreement (a metric an ``on_evaluate`` callback adds on each rank
        from rank-local figures). tests/test_trainer_dist_saves.py (``no_engine``, ``best``), test_trainer_dist_states.py
        (``before_save_no_engine``). A save outside the Trainer's log/evaluate/save point is not looked at."""
        point, store = getattr(self, "_zo_point", None), self._zo_store()
        if point is None or store is None:  # (a save from elsewhere than the Trainer's log/evaluate/save point)
            return
        me = self.args.process_index
        self._zo_say("saving")
        give_up = time.monotonic() + getattr(self.args, "ddp_timeout", 1800)
        waiting = [r for r in range(self.args.world_size) if r != me]
        not_saving, pause = [], 0.002
        while waiting:
            seen = store.read([PROGRESS_KEY.format(r) for r in waiting])  # (bounded: dist_store.StoreSilent)
            for r in list(waiting):
                line = seen.get(PROGRESS_KEY.format(r))
                there, state = parse_progress(line) if line is not None else ((0, 0), "passed")
                if there == point and state == "saving":
                    waiting.remove(r)
                elif there > point or (there == point and state == "passed"):
                    waiting.remove(r)
                    not_saving.append(r)
            if waiting and (gone := failed_peer(store, point[0], waiting)):  # it will never come (peer_failure.py)
                raise RuntimeError(f"{gone}; this rank waited for it to save {output_dir}, which it never will; "
                                   "nothing was written")
            if waiting and time.monotonic() > give_up:
                raise TimeoutError(f"rank(s) {', '.join(map(str, waiting))} did not reach the save of {output_dir} "
                                   f"within --ddp_timeout {getattr(self.args, 'ddp_timeout', 1800)} s")
            if waiting:  # backing off to 0.1 s: each look is a round trip to the store per rank still awaited
                time.sleep(pause)
                pause = min(0.1, pause * 2)
        if not_saving:
            raise RuntimeError(f"rank(s) {', '.join(map(str, sorted(not_saving)))} went on without saving "
                               f"{output_dir}, which this rank saves: every rank must save a checkpoint together (each "
                               "writes its shard of the optimizer state). A callback that sets control.should_save on "
                               "some ranks only, or ranks given different save settings (--save_steps, "
                               "--save_strategy), do this; nothing was written")

    def _save_checkpoint(self, model, trial) -> None:
        # transformers rotates old checkpoints at the end of its save: here that waits until this one is
        # marked complete, so a kill during the save never leaves only incomplete checkpoints behind.
        limit = self.args.save_total_limit
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        several = distributed(self.args.world_size)
        self._zo_agree_to_save(output_dir)  # before the first collective of the save
        if self._zo_lock is not None:  # deleted mid-run and another run since: stopped before writing over its files
            confirm_job_lock(self._zo_lock, self.args.process_index, self.args.world_size)
        if publish_for_final_save(self.args, self.state, self.control):  # (a stop a callback asked for, too)
            self._zo_publish_last()
        failed = None
        try:
            if self.args.should_save:
                # checkpoint-N written again (a restarted run, a second train()): its old marker would declare the
                # mix of new and old files complete should this save stop part way
                resume.clear_marker(output_dir)
                if self._zo_raw is not None and os.path.isdir(output_dir):
                    # and another run's optimizer state: a save cut short after trainer_state.json looked like that
                    # run's plain checkpoint, whose optimizer.pt a resume then took over onto these weights
                    self._zo_remove_foreign(output_dir)
        except Exception as e:  # noqa: BLE001 - every rank raises below, this one its own error
            failed = e
        self._zo_stop_if_failed(failed, output_dir, run_dir)  # no rank writes before its old marker is gone
        self.args.save_total_limit, self._zo_model_error, self._zo_in_save = None, None, several
        try:
            super()._save_checkpoint(model, trial)
        except Exception as e:  # noqa: BLE001 - a full disk: safetensors', torch.save's own words
            failed = e
        finally:
            self.args.save_total_limit, self._zo_in_save = limit, False
        failed = failed or self._zo_model_error
        # node-local output_dirs: each rank's shard in its own node's copy (only a save that wrote state is looked
        # at, not a leftover folder)
        if failed is None and several and self.args.should_save and self.zero_engine is not None and (
                not self.args.save_only_model) and (missing := missing_rank_files(
                    output_dir, STATE_DIR, self.args.world_size, bool(getattr(self.args, "save_on_each_node", 0)))):
            failed = CheckpointSaveError(missing)
        # every rank's optimizer state is written before rank 0 declares the whole complete
        self._zo_stop_if_failed(failed, output_dir, run_dir)
        try:
            if self.args.should_save:
                self._zo_mark_complete(output_dir)
        except Exception as e:  # noqa: BLE001 - said to every rank below
            failed = e
        self._zo_stop_if_failed(failed, output_dir, run_dir)  # rank 0's marker: the others learn how it went
        if self.args.should_save:  # the save is complete: what rotation meets (a folder gone) is no failure of it
            self._zo_rotate(run_dir, limit, output_dir)

    def _zo_mark_complete(self, output_dir: str) -> None:
        # (with an engine, another run's optimizer state went before this save wrote anything: _save_checkpoint)
        if self._zo_raw is None and os.path.isdir(os.path.join(output_dir, STATE_DIR)):
            # no engine here: an earlier save's state, which a resume with one loaded onto these weights
            shutil.rmtree(os.path.join(output_dir, STATE_DIR))
            fsync_dir(output_dir)
            logger.info("hf_zero_offload: removed %s/ from %s, left there by an earlier save of that checkpoint (this "
                        "run trains without an engine)", STATE_DIR, output_dir)
        fsync_tree(output_dir)  # transformers writes without fsync: on disk before the marker says complete
        saved = os.path.isdir(os.path.join(output_dir, STATE_DIR))  # not with --save_only_model
        resume.write_marker(output_dir, {"step": self.state.global_step, "world_size": self.args.world_size,
                                         "engine": self._zo_engine_info() if saved else None})

    def _zo_rotate(self, run_dir: str, limit, saved: str | None, keep_newest: bool = True) -> None:
        """save_total_limit over finished checkpoints only (``resume.rotation``): a folder cut short is neither
        counted nor removed, and named once per Trainer; each removal is logged. Never raises for the file system:
        the save it follows is complete (a warning says what kept it from looking)."""
        try:
            remove, left = rotation.plan(run_dir, limit, (saved, self.state.best_model_checkpoint), keep_newest)
        except OSError as e:
            logger.warning("hf_zero_offload: save_total_limit %s: could not go through the checkpoints of %s (%s: "
                           "%s); none removed this time", limit, run_dir, type(e).__name__, e)
            return
        said = self._zo_left_said
        for c, why in left:
            if c not in said:
                said.add(c)
                logger.warning("hf_zero_offload: save_total_limit %s: %s is %s; not counted and not removed (a resume "
                               "skips it): delete it yourself once you no longer need it", limit, c, why)
        for c in remove:
            # (finished: ours with its marker, or a plain Trainer's that looks finished; rotation.left_out)
            logger.info("hf_zero_offload: save_total_limit %s: removing %s, an older finished checkpoint", limit, c)
            failed = _remove_checkpoint(c)
            if failed:  # (a read-only file, a mount point): said, not ignored; the save itself stands
                logger.warning("hf_zero_offload: save_total_limit %s: could not remove all of %s (%s%s); what is "
                               "left reads as cut short: delete it yourself", limit, c, failed[0],
                               f", and {len(failed) - 1} more" if failed[1:] else "")

    def _zo_end_listing(self, run_dir: str, best: str | None) -> list[str]:
        """transformers' end of train() with save_total_limit=1 and a best checkpoint removes every ``checkpoint-*``
        folder its listing (``trainer.sort_checkpoints``, ours while our train() runs: ``end_rotation``) gives but
        the best: a user's checkpoint-1-old and a folder cut short went too. Our rule does it instead (every finished
        checkpoint but the best, each removal logged) and the listing holds the finished ones left, in its order."""
        if self.args.should_save and best is not None and self.args.save_total_limit == 1:
            self._zo_rotate(run_dir, 1, best, keep_newest=False)
        try:
            found = [c for c in resume.checkpoints(run_dir) if rotation.left_out(c) is None]
        except OSError:
            return []
        if best is not None and best in found and found[-1] != best:  # (transformers' order: the best next to last)
            found = [c for c in found if c != best] + [best]
            found[-2:] = found[-1:] + found[-2:-1]
        return found

    def save_model(self, output_dir=None, _internal_call=False):
        """Within a checkpoint save on several ranks, rank 0's failure to write the weights (a full disk) is kept,
        not raised: the optimizer state's save after it has collectives every rank must reach (the others waited
        in them until the timeout), and ``_save_checkpoint`` raises it on every rank afterwards. Any error, not
        only a file system's: a ValueError there (an invalid generation config that save_pretrained refuses, a
        non-contiguous tensor safetensors refuses) left the other ranks in the engine's save until the timeout."""
        if not getattr(self, "_zo_in_save", False):
            return super().save_model(output_dir, _internal_call)
        try:
            return super().save_model(output_dir, _internal_call)
        except Exception as e:  # noqa: BLE001 - raised on every rank by _save_checkpoint
            self._zo_model_error = e

    def _zo_stop_if_failed(self, failed, output_dir: str, run_dir: str) -> None:
        """Where the save had a barrier: every rank learns whether any failed (a collective on several ranks) and all
        raise, the failing rank its own error (one rank that raised alone left the others in the next collective)."""
        if isinstance(failed, (OSError, RuntimeError, SafetensorError)) and not isinstance(failed, CheckpointSaveError):
            failed = wrap(failed, output_dir, run_dir)
        elsewhere = failed_elsewhere(failed, self.args.world_size) if distributed(self.args.world_size) else None
        if failed is not None:
            raise failed
        if elsewhere is not None:
            raise CheckpointSaveError(failed_on(output_dir, elsewhere))

    def _zo_remove_foreign(self, output_dir: str) -> None:
        """checkpoint-N saved again over another run's save of it (a run without --zero_offload, or DeepSpeed, in
        this output_dir): what this save does not overwrite would stay, recorded by our marker, and a plain or
        DeepSpeed resume would load that run's optimizer state onto these weights. So its optimizer state goes
        (optimizer.pt/.bin; DeepSpeed's global_stepN/, latest, zero_to_fp32.py), and with --save_only_model, which
        writes no optimizer state or schedule, an earlier save's scheduler.pt and zero_offload/ too."""
        dirs, files = resume.deepspeed_state(output_dir)
        files += resume.TORCH_OPTIMIZER_FILES
        if self.args.save_only_model:
            files.append(SCHEDULER_NAME)
            dirs.append(STATE_DIR)
        files = sorted(n for n in files if os.path.isfile(os.path.join(output_dir, n)))
        dirs = sorted(n for n in dirs if os.path.isdir(os.path.join(output_dir, n)))
        if not files and not dirs:
            return
        for d in dirs:
            shutil.rmtree(os.path.join(output_dir, d))
        remove_durably(output_dir, files)  # syncs the directory when it removed a file
        if dirs and not files:
            fsync_dir(output_dir)
        logger.info("hf_zero_offload: removed %s from %s, left there by an earlier save of that checkpoint (another "
                    "run, or another tool)", ", ".join(files + [d + "/" for d in dirs]), output_dir)

    def _zo_engine_info(self) -> dict | None:
        eng = self.zero_engine
        if eng is None:
            return None
        return {"format": eng.state_meta().get("format"), "world_size": self.args.world_size,
                "stage": getattr(eng, "stage", "-"), "offload": getattr(eng, "offload", True),
                "dpu": eng.options.dpu, "dtype": str(eng.param_dtype).replace("torch.", ""),
                "save_id": eng.last_save_id}

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._zo_raw is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        state_dir = os.path.join(output_dir, STATE_DIR)
        self.zero_engine.save_checkpoint(state_dir)
        if self.args.should_save:
            write_param_names(state_dir, self._zo_slot_names())
            with atomic_path(os.path.join(output_dir, SCHEDULER_NAME)) as tmp:
                torch.save(self.lr_scheduler.state_dict(), tmp)

    def _zo_slot_names(self) -> list[list[str]]:
        aliases: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        return [aliases[id(p)] for g in self.zero_engine.slot_params() for p in g]
