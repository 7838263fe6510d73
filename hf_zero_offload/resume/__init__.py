"""Checkpoint completeness and the choice of where to resume (the marker written last into ``checkpoint-N/`` is
``marker``'s).

transformers writes ``checkpoint-N/`` piece by piece (model, optimizer state, scheduler, RNG, trainer state) and
``get_last_checkpoint`` picks the highest N whether or not the writer lived to finish it. The Trainer integration
writes :data:`MARKER` after every piece and every rank's optimizer state (rank 0, after a barrier), so a directory
with the marker is whole and one without it may not be. Without one, a directory is accepted when it holds
``trainer_state.json`` (transformers' last file) and either a plain Trainer's ``optimizer.pt`` (taken over) or our
state without a save id with no older sibling marked (written before markers existed; a save id or an older marked
sibling proves the writer knew the marker, so it was cut short). ``resume_from_checkpoint=True`` refuses a highest
step written before a lower step's (two runs in one output_dir). Nothing here imports transformers.

The package's other modules: ``marker`` (the completion marker) and ``manifest`` (the files it vouches for),
``foreign`` (other tools' optimizer state in a checkpoint), ``schedule`` (a saved LR schedule into this run's),
``folders`` (checkpoint-N names in an output_dir) and ``report`` (what a resume says).
"""
from __future__ import annotations

import json
import logging
import os

from ..config import ConfigError
from ..engine.checkpoint import read_header, remove_durably, remove_stale_temporaries
# the marker itself (resume.MARKER, resume.read_marker, ... stay importable from here)
from .marker import (MARKER, changed_files, load_marker, marker_problem, read_marker,  # noqa: F401
                     recorded_save_id, write_marker)
from .foreign import (FRESH_START, TORCH_OPTIMIZER_FILES, deepspeed_state,  # noqa: F401 (resume API)
                                 foreign_state, missing_state_message, plain_checkpoint)
from .schedule import DamagedFile, OtherSchedule, load_scheduler  # noqa: F401 (the resume API)
from .missing import where_to_look
from . import path_limits  # noqa: F401 (resume.path_limits: the Trainer checks the paths at init)
# checkpoint-N folder names (resume.checkpoints, resume.output_dir_problem, ... stay importable from here)
from .folders import (TRAINER_STATE, _in_the_way, checkpoint_step, checkpoints,  # noqa: F401
                      output_dir_problem)

class IncompleteCheckpoint(ConfigError):
    """A checkpoint that was not written to the end; the message names the newest whole one, if any."""


def clear_marker(checkpoint: str) -> None:
    """Before ``checkpoint`` is written (again): it reads as incomplete until its new marker. The old
    trainer_state.json goes too, else a marker-less directory holding it would pass for a legacy (whole) one."""
    if os.path.lexists(checkpoint) and not os.path.isdir(checkpoint):
        # else "Not a directory: .../hzo_complete.json", naming our marker rather than the file in the way
        raise NotADirectoryError(_in_the_way(checkpoint))
    # trainer_state.json first, durably: cut before the marker goes, it reads incomplete (a file it records is
    # missing), never as a plain Trainer's finished --save_only_model checkpoint (trainer_state.json, no marker)
    remove_durably(checkpoint, (TRAINER_STATE,))
    remove_durably(checkpoint, (MARKER,))


def not_whole(checkpoint: str) -> str:
    """Why ``checkpoint`` is not whole: "incomplete (what: why)" or "damaged (what: why)"; or, for a complete
    checkpoint of a plain (or DeepSpeed) Trainer among ours, what it is ("written without --zero_offload ...")."""
    found = load_marker(checkpoint)  # (read once: below, one marker's answers)
    changed, marker = changed_files(checkpoint, marker_read=found), read_marker(checkpoint, found)
    foreign = foreign_state(checkpoint)
    if changed and foreign is not None and foreign not in (marker or {}).get("files", {}):
        return (f"saved again by a run without --zero_offload ({foreign}, which our save did not write, beside our "
                "state of an earlier step: the model and trainer state are that run's now)")
    if changed:
        shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
        what = "its marker" if all(c.startswith("its entry in the marker") for c in changed) else "it"
        return f"damaged ({shown}: {what} no longer holds what its save wrote)"
    if foreign is not None and marker is None and os.path.isfile(os.path.join(checkpoint, TRAINER_STATE)):
        return (f"written without --zero_offload ({foreign}) among checkpoints of ours (the steps after the "
                "checkpoint chosen are trained again)")
    problem = marker_problem(checkpoint, found)
    if problem is None and looks_plain(checkpoint):
        return (f"incomplete (no {MARKER}: {TRAINER_STATE} and the weights without optimizer state, as a Trainer "
                "without --zero_offload saves with --save_only_model, among checkpoints of ours; or a save of ours "
                "with --save_only_model stopped just before its marker)")
    what = f"{problem}, nothing else proves it whole" if problem else f"no {MARKER}"
    return f"incomplete ({what}: {_WHY})"


_WHY = "its writer may have stopped before finishing it, e.g. killed during the save"


def looks_plain(checkpoint: str) -> bool:
    """No marker (not even a damaged one), no optimizer state of ours, and ``trainer_state.json``, which transformers
    writes last: what a Trainer without --zero_offload leaves with --save_only_model. Our own save clears
    trainer_state.json first and writes zero_offload/ before it (but with --save_only_model: cut short after
    trainer_state.json, such a save of ours looks the same)."""
    held = os.path.join(checkpoint, MARKER), os.path.join(checkpoint, TRAINER_STATE)
    return (not os.path.lexists(held[0]) and os.path.isfile(held[1])
            and not os.path.lexists(os.path.join(checkpoint, "zero_offload")))


def recorded_step(checkpoint: str) -> int | None:
    """The step its marker records (the folder's name when there is none): a checkpoint-3 renamed checkpoint-6 was
    said to be at step 6, and to leave nothing to train in a 6-step run."""
    step = (read_marker(checkpoint) or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else checkpoint_step(checkpoint)


def status(checkpoint: str) -> str:
    """"complete" (marker), "legacy" (no marker, written before markers existed) or "incomplete"."""
    # a marker that reads but is damaged (a field of another type: "files": 5) proves nothing either: judged below as
    # an unreadable one is (taken was a newer checkpoint whose file checks it skipped, where an unreadable one was not).
    # What it still records is checked all the same: the oldest such checkpoint resumed as legacy with a file its save
    # wrote deleted or cut short (rng_state.pth gone: another dropout and data order), where it was refused before.
    # The marker is read once: read three times, a marker replaced meanwhile was judged whole and damaged at once
    if read_marker(checkpoint, found := load_marker(checkpoint)) is not None:
        if changed_files(checkpoint, marker_read=found):
            return "incomplete"
        if marker_problem(checkpoint, found) is None:
            return "complete"
    if not os.path.isfile(os.path.join(checkpoint, TRAINER_STATE)):
        return "incomplete"
    # no marker at all (a damaged one is judged below): a run's first checkpoint had no older marker to tell it by,
    # and 2 ranks killed mid-save (rank 1's RNG file not written yet) resumed as legacy, 0.109 off
    if not found.present and _saved_with_markers(checkpoint):
        return "incomplete"
    if plain_checkpoint(checkpoint):  # a plain Trainer's (trainer_state.json written after optimizer.pt): taken over
        return "legacy"
    step = checkpoint_step(checkpoint)
    older = [c for c in checkpoints(os.path.dirname(os.path.normpath(checkpoint)))
             if step is not None and (checkpoint_step(c) or 0) < step]
    return "incomplete" if any(read_marker(c) is not None for c in older) else "legacy"


def _state_headers(checkpoint: str):
    """(file name, header) of each readable rank file of its optimizer state, in name order (a file cut short or
    damaged is passed over: the next one may tell)."""
    folder = os.path.join(checkpoint, "zero_offload")
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".hzo"))
    except OSError:
        return
    for name in names:
        try:
            header = read_header(os.path.join(folder, name))[0]
        except (OSError, ValueError):
            continue
        yield name, header


def _saved_with_markers(checkpoint: str) -> bool:
    """Whether its optimizer state carries a save id (written since markers exist): then no marker means cut short."""
    return next(("save_id" in header for _, header in _state_headers(checkpoint)), False)


def newest_whole(folder: str, below: int | None = None, holding=None) -> str | None:
    """The newest checkpoint of ``folder`` (with a step < ``below``; for which ``holding(c)`` is true) that is
    complete or legacy."""
    for c in reversed(checkpoints(folder)):
        if (below is None or checkpoint_step(c) < below) and status(c) != "incomplete" and (
                holding is None or holding(c)):
            return c
    return None


# What transformers writes into every checkpoint besides trainer_state.json: a directory holding none of these
# (nor trainer_state.json, nor a marker) was never a checkpoint, as opposed to one whose writer was cut short.
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
            "adapter_model.safetensors", "adapter_model.bin")
_TRAINING_PIECES = ("optimizer.pt", "optimizer.bin", "scheduler.pt", "rng_state.pth", "zero_offload")


class NotACheckpoint(IncompleteCheckpoint):
    """resume_from_checkpoint names something that is no Trainer checkpoint (a run folder, a saved model, an empty
    or missing path): the message says what it is and what to pass instead."""


def _not_a_checkpoint(path: str, output_dir: str | None = None) -> str | None:
    """Why ``path`` is not a Trainer checkpoint at all, or None when it is one (whole or cut short). A directory named
    ``checkpoint-N`` is one even when empty: its writer may have been stopped before the first file."""
    if not os.path.exists(path):
        return f"resume_from_checkpoint: {path} does not exist{where_to_look(path, output_dir)}"
    if not os.path.isdir(path):
        return f"resume_from_checkpoint: {path} is a file, not a checkpoint directory (checkpoint-N)"
    if checkpoint_step(path) is not None or read_marker(path) is not None:
        return None
    inside = checkpoints(path)
    # checkpoint-N folders inside: a run's output_dir, even when it holds trainer_state.json and the final model
    # too (a finished run saves both there), which is not a checkpoint of its own
    if inside:
        whole = newest_whole(path)
        use = f"the newest complete one is {whole}" if whole else "none of them is complete"
        return (f"resume_from_checkpoint: {path} is a run folder, not a checkpoint: it holds "
                f"{', '.join(os.path.basename(c) for c in inside)} ({use}); pass one of them, or "
                f"resume_from_checkpoint=True (--resume_from_checkpoint true) with {path} as output_dir")
    held = set(os.listdir(path))
    training = any(n in _TRAINING_PIECES or n.startswith("rng_state") for n in held)
    if TRAINER_STATE in held and not training and held & {"config.json", "adapter_config.json"}:
        # a finished run's output_dir (save_model and its trainer_state.json): resumed as a legacy checkpoint, with
        # a fresh optimizer and schedule, without a word (an outside probe)
        return (f"resume_from_checkpoint: {path} holds a model and {TRAINER_STATE} but no optimizer, scheduler or "
                "RNG state: a run's final save (save_model), not a Trainer checkpoint. Pass one of its checkpoint-N "
                "folders, or start a new run from these weights (from_pretrained) without resume_from_checkpoint")
    if status(path) != "incomplete":
        return None
    if training:
        return None  # training state without trainer_state.json: cut short, whatever the folder is called
    if held & {"config.json", "adapter_config.json"}:  # (its weights beside it: save_model's folder, which was
        # taken for a checkpoint cut short; not named checkpoint-N, so not one whose save stopped after the weights)
        return (f"resume_from_checkpoint: {path} holds a model (config.json) but no {TRAINER_STATE}, optimizer or "
                "scheduler state: a saved model (save_model / save_pretrained), not a Trainer checkpoint. To start "
                "a new run from these weights, load them with from_pretrained and train without "
                "resume_from_checkpoint")
    if held & set(_WEIGHTS):
        return None  # weights alone: a save cut short before its config
    return (f"resume_from_checkpoint: {path} is not a Trainer checkpoint (no {TRAINER_STATE}, model weights or "
            "optimizer state in it); pass a checkpoint-N folder of a run's output_dir")


def check(checkpoint: str, output_dir: str | None = None) -> tuple[str, dict | None]:
    """(status, marker) of a checkpoint about to be resumed; an incomplete one is an :class:`IncompleteCheckpoint`
    that names the newest whole checkpoint beside it, and a path that is no checkpoint at all a
    :class:`NotACheckpoint` saying what it is."""
    wrong = _not_a_checkpoint(checkpoint, output_dir)
    if wrong is not None:  # transformers' own words first: scripts (and its test suite) match them
        raise NotACheckpoint(f"Can't find a valid checkpoint at {checkpoint}. {wrong}")
    state = status(checkpoint)
    if state != "incomplete":
        _check_trainer_state(checkpoint)
        return state, read_marker(checkpoint)
    step, held = checkpoint_step(checkpoint), held_step(checkpoint)
    folder = os.path.dirname(os.path.normpath(checkpoint))
    below = step if held is None or held[0] == step else held[0]
    fallback = newest_whole(folder, below=below)
    hint = (f"the newest complete checkpoint is {fallback}: resume from it" if fallback else
            "no complete checkpoint was found beside it")
    if held is not None and held[0] != step:  # renamed (checkpoint-500-old, ckpt500): the name tells no step
        later = newest_whole(folder) if fallback is None else None
        hint = (f"{checkpoint} holds step {held[0]} (by its {held[1]}; a renamed checkpoint-{held[0]}); "
                + (f"no complete checkpoint of an earlier step is beside it (the newest complete one, {later}, is "
                   "later): resume from it or start without resume_from_checkpoint" if later else hint))
    elif held is None and step is None:
        hint = f"{checkpoint} records no step ({MARKER}, {TRAINER_STATE} and optimizer state missing); {hint}"
    raise IncompleteCheckpoint(f"{checkpoint} is {not_whole(checkpoint)}; {hint}")


def held_step(checkpoint: str) -> tuple[int, str] | None:
    """(step, what says so) of a checkpoint folder whatever its name: its marker's step, else its trainer_state.json's
    global_step, else its optimizer state's step count (a save cut short before trainer_state.json); None if none."""
    marked = (read_marker(checkpoint) or {}).get("step")
    if isinstance(marked, int) and not isinstance(marked, bool):
        return marked, MARKER
    try:
        with open(os.path.join(checkpoint, TRAINER_STATE), encoding="utf-8") as f:
            said = json.load(f).get("global_step")
        if isinstance(said, int) and not isinstance(said, bool):
            return said, TRAINER_STATE
    except (OSError, ValueError, AttributeError):
        pass
    for name, header in _state_headers(checkpoint):
        steps = header.get("global_steps")
        if isinstance(steps, int) and not isinstance(steps, bool):
            return steps, f"optimizer state zero_offload/{name}"
    return None


def _check_trainer_state(checkpoint: str) -> None:
    """Read before anything loads (transformers read it last and failed with json's error, naming no file)."""
    path = os.path.join(checkpoint, TRAINER_STATE)
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError) as e:
        raise DamagedFile(f"{path} cannot be read ({type(e).__name__}: {e}); resume from an earlier checkpoint") from e
    if not isinstance(content, dict):
        raise DamagedFile(f"{path} is damaged: a JSON {type(content).__name__}, not the object transformers writes; "
                          "resume from an earlier checkpoint")
    # one save wrote both: a step edited into either resumed the engine under the Trainer's other count (0.011 off)
    marked, said = (read_marker(checkpoint) or {}).get("step"), content.get("global_step")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in (marked, said)) and said != marked:
        raise DamagedFile(f"{path} says global_step {said}, while its save recorded step {marked} in {MARKER}: the "
                          "files are not one save's; resume from an earlier checkpoint")


def choose(folder: str) -> tuple[str, list[str]]:
    """For ``resume_from_checkpoint=True``: the newest whole checkpoint of ``folder`` and the incomplete newer
    ones it skips. Raises when there is none."""
    found = checkpoints(folder)
    chosen = newest_whole(folder)
    if chosen is None:
        # transformers' own words first: scripts (and its test suite) match them
        raise IncompleteCheckpoint(f"No valid checkpoint found in output directory ({folder}): "
                                   "resume_from_checkpoint=True found no complete checkpoint there"
                                   + (f" (incomplete: {', '.join(os.path.basename(c) for c in found)})"
                                      if found else ""))
    return chosen, [c for c in found if checkpoint_step(c) > checkpoint_step(chosen)]


def no_resume_word(value):
    """The command line's ``false``/``no``/``none`` for ``resume_from_checkpoint`` (unless a path has that name):
    None, no resume. Anything else unchanged."""
    if isinstance(value, str) and value.strip().lower() in ("false", "no", "none") and not os.path.exists(value):
        return None
    return value


def target(requested, output_dir: str) -> tuple[str, str, list[tuple[int, str]]]:
    """``resume_from_checkpoint`` -> (checkpoint, its status, (logging level, message) pairs to log). ``True`` (or
    the command line's "true"/"last", unless a directory has that name): the newest complete checkpoint of
    ``output_dir`` (transformers' get_last_checkpoint would take a half-written one); a path:
    refused when incomplete, naming the checkpoint to use instead."""
    notes, word = [], None
    if isinstance(requested, str) and requested.strip().lower() in ("true", "last") and not os.path.exists(requested):
        # the command line gives a string: --resume_from_checkpoint true means what True means in code
        word, requested = requested, True
    if requested is True:
        requested, skipped = choose(output_dir)
        later = _written_after(requested, output_dir)
        if later:  # the highest step is another run's: a requeued job went on with it, the newer run's steps lost
            cut = status(later[-1]) != "complete"
            go = newest_whole(os.path.dirname(later[-1]), below=checkpoint_step(later[-1])) if cut else later[-1]
            raise ValueError(f"resume_from_checkpoint=True: {requested} has the highest step, but {later[-1]} was "
                             f"written after it{' (and cut short)' if cut else ''}: output_dir holds checkpoints of "
                             "more than one run (--overwrite_output_dir removes nothing; a run resumed from an earlier "
                             "step saves beside the later ones), and the highest step is the older run's. Pass the "
                             f"checkpoint to go on from (--resume_from_checkpoint {go or 'PATH'}), or remove the "
                             "other run's checkpoints")
        if skipped:  # one line, however many: each named with why
            notes.append((logging.WARNING, "hf_zero_offload: " + "; ".join(f"skipping {c}: {not_whole(c)}"
                                                                            for c in skipped)
                          + f"; resuming from {requested}"))
        if word is not None:  # what was asked for, not a problem: information, at the level of the resume's summary
            notes.append((logging.INFO, f"hf_zero_offload: --resume_from_checkpoint {word}: the newest complete "
                                        f"checkpoint of {output_dir}, {requested}"))
    state, _ = check(str(requested), output_dir)
    if state == "legacy" and not plain_checkpoint(str(requested)):  # (a plain Trainer's: said once its state loads)
        problem = marker_problem(str(requested))
        why = (f"{problem}" if problem else f"has no completion marker {MARKER} (written before markers existed, or "
               "by another Trainer)")
        notes.append((logging.WARNING, f"hf_zero_offload: {requested}: {why}; it holds {TRAINER_STATE} (and no older "
                                       "checkpoint beside it a marker), so it is resumed as is"))
    return str(requested), state, notes


def _written_after(chosen: str, folder: str) -> list[str]:
    """Checkpoints of a lower step than ``chosen`` written after it: complete ones by the markers' own clocks (which
    a copy keeps: file times it does not); a cut-short one of a run that knew markers (its files carry a save id: a
    newer run killed in its save) by its files' times against ``chosen``'s marker file (a checkpoint left part
    deleted by a rotation is older). A plain Trainer's ``chosen`` has no marker: its trainer_state.json's file time
    stands in (a copy that reset file times, or a clock skewed against the file server, can mislead that one)."""
    def when(c: str) -> tuple:
        m = read_marker(c) or {}
        return m.get("written_ns"), m.get("written")

    def newest_file(c: str) -> float:
        return max((os.path.getmtime(os.path.join(d, n)) for d, _, names in os.walk(c) for n in names), default=0.0)

    t = when(chosen)
    since = os.path.getmtime(os.path.join(chosen, MARKER)) if t[0] is not None else None
    if t[0] is None and plain_checkpoint(chosen):  # a plain Trainer's: no marker clock, its last file's time instead
        t = (os.stat(os.path.join(chosen, TRAINER_STATE)).st_mtime_ns, None)
    later = []
    for c in (c for c in checkpoints(folder) if checkpoint_step(c) < checkpoint_step(chosen)):
        # the cheap reads first (marker clocks, file times): a checkpoint's own check (its manifest) only if they tell
        newer = any(isinstance(a, type(b)) and b is not None and a > b for a, b in zip(when(c), t) if a is not None)
        state = status(c) if newer else None
        if state == "complete" or (since is not None and newest_file(c) > since and _saved_with_markers(c)
                                   and (state or status(c)) == "incomplete"):
            later.append(c)
    return later


def remove_stale_temp_files(output_dir: str) -> list[str]:
    """The temporaries of killed writers anywhere under ``output_dir`` (every checkpoint, not only the ones
    written again): :func:`engine.checkpoint.remove_stale_temporaries` on each directory."""
    return [path for root, _, _ in os.walk(output_dir) for path in remove_stale_temporaries(root)]
