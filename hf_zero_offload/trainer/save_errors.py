"""What a failed checkpoint save says: one line naming the checkpoint, the file being written (where it can be told),
the cause, the free space left on that file system and the newest complete checkpoint, checked against its marker
(intact: a resume takes it). safetensors ("Error while serializing: I/O error"), torch.save ("unexpected pos 8384 vs
8278") and json (a bare "[Errno 28]") named no file. The error raised is a :class:`CheckpointSaveError` that is also
of the cause's own class (an ``OSError`` with its errno, a ``RuntimeError``, a ``SafetensorError``), chained to it.

The file: the one the cause names (our writers name theirs), else the one its traceback's innermost writer was given
(safetensors' Rust writer and torch.save raise errors without it)."""
from __future__ import annotations

import os
import shutil

from .. import resume
from ..engine.checkpoint import TMP_TAG
from ..resume import path_limits


class CheckpointSaveError(OSError):
    """A checkpoint's save failed (a full disk, a file too large): names the checkpoint, the file, the cause, the
    free space and the newest complete checkpoint."""

    _cause_class: type | None = None  # (the class made for a cause's class: that class)

    def __reduce__(self):  # the class made for a cause's class is found again by that class (pickle, multiprocessing)
        return _remake, (type(self)._cause_class, str(self), self.errno), dict(self.__dict__)


_CLASSES: dict[type, type] = {}


def _class_for(base: type | None) -> type:
    """:class:`CheckpointSaveError` that is also a ``base`` (one class per base)."""
    if base is None or issubclass(base, CheckpointSaveError):
        return CheckpointSaveError
    if base not in _CLASSES:
        try:
            _CLASSES[base] = type("CheckpointSaveError", (CheckpointSaveError, base),
                                  {"__module__": __name__, "_cause_class": base})
        except TypeError:  # a class that cannot be a base (a layout of its own): the OSError alone
            _CLASSES[base] = CheckpointSaveError
    return _CLASSES[base]


def _remake(base: type | None, message: str, errno: int | None) -> CheckpointSaveError:
    e = _class_for(base)(message)
    e.errno = errno
    return e


def file_written(e: BaseException, folder: str) -> str | None:
    """The file the failed save was writing: the one the error (or an error it chains) names, else the innermost
    frame of its traceback holding a path to a file under ``folder`` (safetensors' ``save_file(tensors, filename)``,
    torch.save's ``f``, trainer_state.json's ``json_path``; a temporary of ours as the file it replaces); None when
    nothing tells."""
    root = os.path.normpath(os.path.abspath(folder)) + os.sep
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and isinstance(x.filename, str) and _under(x.filename, root):
            return x.filename.split(TMP_TAG)[0]  # (a temporary of ours: the file it replaces)
        x = x.__cause__ or x.__context__
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        frames, tb = [], x.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):  # the innermost first: the writer's own argument
            for value in list(frame.f_locals.values()):
                if isinstance(value, (str, os.PathLike)):
                    path = os.fspath(value)
                    if isinstance(path, str) and _under(path, root) and not os.path.isdir(path):
                        return path.split(TMP_TAG)[0]
        x = x.__cause__ or x.__context__
    return None


def _under(path: str, root: str) -> bool:
    """Whether ``path`` names a file under ``root`` (a folder's path ending in os.sep): an error about another folder
    (an older checkpoint) names no file of this save."""
    return bool(path) and os.path.abspath(path).startswith(root)


def _free(folder: str) -> str:
    try:
        free = shutil.disk_usage(path_limits.existing_folder(folder)).free
    except OSError as e:
        return f"free space unknown ({e.strerror or e})"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if free < 1024 or unit == "TiB":
            return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
        free /= 1024
    return ""


def save_failed(e: BaseException, target: str, run_dir: str, file: str | None = None) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    errno = getattr(e, "errno", None)
    why = ("no space left on device" if errno == 28 or "No space left" in text or "os error 28" in text else
           "file too large for this process's limit (RLIMIT_FSIZE)" if errno == 27 or "os error 27" in text
           or "File too large" in text else "")
    try:
        newest = resume.newest_whole(run_dir)  # its files checked against its marker (sizes, small files' SHA-256)
        last = (f"the newest complete checkpoint is {newest}, intact (its files match its marker): a resume takes it"
                if newest else "no complete checkpoint exists yet")
    except Exception as looking:  # noqa: BLE001 - the save's own error is the one to report
        last = f"the newest complete checkpoint could not be looked for ({type(looking).__name__}: {looking})"
    return (f"saving {target} failed" + (f": {why}" if why else "") + (f" writing {file}" if file else "")
            + f" ({type(e).__name__}: {text[:300]}); {_free(target)} free on that file system; it is not complete and "
            f"a resume skips it; {last}")


def wrap(e: BaseException, target: str, run_dir: str) -> CheckpointSaveError:
    """``e`` as a :class:`CheckpointSaveError` of its own class too (its errno kept), chained to it. What the message
    needs (the file, the free space, the newest complete checkpoint) is looked up with care: a failure there (a
    folder not readable) is said in it, never raised in place of ``e``."""
    try:
        file = file_written(e, target)
    except Exception:  # noqa: BLE001 - the file is a detail; the cause is not
        file = None
    try:
        message = save_failed(e, target, run_dir, file)
    except Exception as looking:  # noqa: BLE001 - as above
        message = f"saving {target} failed ({type(e).__name__}: {e}; and describing it: {looking!r})"
    try:
        wrapped = _class_for(type(e))(message)
    except TypeError:  # a cause class whose constructor takes other arguments
        wrapped = CheckpointSaveError(message)
    if isinstance(getattr(e, "errno", None), int):
        wrapped.errno = e.errno
    wrapped.__cause__ = e
    return wrapped


def failed_on(target: str, elsewhere: str) -> str:
    """What a rank says of another rank's failed save (``elsewhere``: "rank R (host H): its message"): that rank's
    message, its "saving <target> failed" said once."""
    who, _, said = elsewhere.partition("): ")
    who, head = who + ")", f"saving {target} failed"
    if not said:
        return f"{head} on {elsewhere}; it is not complete"
    if said.startswith(head):
        return f"{head} on {who}{said[len(head):]}"
    return f"{head} on {who}: {said}; it is not complete and a resume skips it"
