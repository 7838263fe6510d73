"""A user's mistake costs one line, not a traceback: the error reporting of our command lines.

``hf-zero-offload`` and ``examples/seq2seq/finetune_trainer.py`` run their work through :func:`run_reporting`:
a bad value (``ValueError``, which ``ConfigError`` is), a missing or unreadable file (``OSError``) or a missing
package (``ImportError``) prints ``PROG: error: MESSAGE`` on stderr and exits 2, the exit status argparse uses for
bad arguments. Ctrl-C prints ``PROG: interrupted`` (and, from ``interrupted()``, where to go on from) and exits
130, as a shell reports SIGINT, instead of a traceback through the model's forward (under torchrun, which
passes Ctrl-C to every rank, only each node's local rank 0 prints it). Anything else is a bug and
keeps its traceback. ``--debug`` (a bare flag) or ``HF_ZERO_OFFLOAD_DEBUG=1`` brings the traceback back for the
user's errors too.
"""
from __future__ import annotations

import codecs
import os
import re
import signal
import sys
from typing import Callable, Sequence

from . import extras
from .switches import env_switch

DEBUG_ENV = "HF_ZERO_OFFLOAD_DEBUG"
USER_ERRORS = (ValueError, OSError, ImportError)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT


def take_debug_flag(argv: Sequence[str], *, shared_with_trainer: bool = False) -> tuple[bool, list[str]]:
    """(debug wanted, argv without our ``--debug``). With ``shared_with_trainer`` only a bare ``--debug`` is ours:
    one followed by a value is transformers' TrainingArguments ``--debug MODE`` and is left alone."""
    argv = list(argv)
    try:
        debug = env_switch(DEBUG_ENV)
    except ValueError as e:  # read before errors are reported: said, and taken as on (it only adds tracebacks)
        print(f"warning: {e}; taken as on", file=sys.stderr)
        debug = True
    out = []
    for i, arg in enumerate(argv):
        bare = arg == "--debug" and (not shared_with_trainer or i + 1 == len(argv) or argv[i + 1].startswith("-"))
        debug |= bare
        if not bare:
            out.append(arg)
    return debug, out


def _exit_at_once(signum, frame) -> None:
    os._exit(EXIT_INTERRUPTED)  # the interrupt was reported and the state is what the last save wrote


def _close_progress_bars() -> None:
    """tqdm's bars still open end their line first (an outside probe: the interrupted line was printed on the end of a
    save's "Writing model shards:   0%|" bar, and a bar closed at exit came after it)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        try:
            bar.close()
        except Exception:  # (a courtesy to the terminal: never in the way of the message)
            pass


def run_reporting(prog: str, fn: Callable[[], object], *, debug: bool,
                  interrupted: Callable[[], str | None] | None = None) -> object:
    """``fn()``; a user error becomes one line on stderr and ``SystemExit(2)`` (unless ``debug``); Ctrl-C one
    line (with ``interrupted()``'s hint) and ``SystemExit(130)``."""
    try:
        return fn()
    except KeyboardInterrupt:
        if debug:
            raise
        try:
            hint = interrupted() if interrupted is not None else None
        except Exception:  # the hint is a courtesy: a failure in it must not bring the traceback back
            hint = None
        _close_progress_bars()
        # torchrun sends Ctrl-C to every rank: one line per node (its local rank 0), not one per rank
        if os.environ.get("LOCAL_RANK", "0").strip() in ("", "0"):
            print(f"{prog}: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        try:  # a second Ctrl-C while Python shuts down landed in an exit hook (torch's): a traceback after the line
            signal.signal(signal.SIGINT, _exit_at_once)
        except ValueError:  # not the main thread: signals are not ours to set
            pass
        raise SystemExit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:  # the reader left (``... --json | head``): not the user's mistake, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush must not fail again
        raise SystemExit(1) from None
    except USER_ERRORS as e:
        if debug:
            raise
        # one line, whatever the library wrote (transformers' offline error spans two)
        message = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or type(e).__name__
        extra = extras.extra_of(e)
        if extra and "optional dependency" not in message:  # it said only "No module named 'transformers'"
            message += f": {extras.hint(extra)}"
        elif isinstance(e, ImportError) and (getattr(e, "name", None) or "").split(".")[0] == "hf_zero_offload":
            # an example from a newer checkout than the installed package (a non-editable install, then git pull)
            message += (": the installed hf_zero_offload lacks it: older than this script? Reinstall it from this "
                        "checkout (make install, or pip install .)")
        elif isinstance(e, UnicodeEncodeError) and "surrogates not allowed" in message:
            # a non-ASCII path under a non-UTF-8 locale (LANG=C): Python decoded it to surrogates, and a library
            # writing it as UTF-8 said only this
            message += (": a file name with non-ASCII characters under a non-UTF-8 locale "
                        f"(LC_ALL/LANG={os.environ.get('LC_ALL') or os.environ.get('LANG') or 'unset'}); run with "
                        "PYTHONUTF8=1 or a UTF-8 locale (e.g. LANG=C.UTF-8)")
        hint = f" (traceback: --debug or {DEBUG_ENV}=1)"
        print(f"{prog}: error: {message}{hint}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def first_bad_utf8(data: bytes) -> tuple[int, int]:
    """(line, byte offset) of the first byte of a file's ``data`` that is not UTF-8, for the one-line error naming
    it: counted in the file, a byte-order mark included (a ``utf-8-sig`` decoder's offset is counted after it), lines
    ending at \\n, \\r\\n or \\r as Python's text reader ends them."""
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    bad = bom
    try:
        data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:  # its position is the file's (a text reader's is within a chunk)
        bad += e.start
    return len(re.split(rb"\r\n|\r|\n", data[:bad])), bad


def relative_path_hint(path: str) -> str:
    """What to add to "not found" for a path: where a relative one was looked up ("" for an absolute one). A path
    typed for another directory (``output/checkpoint-500``, the blog's ``--data_dir wmt_en_ro``) was said missing
    without the directory it was read from."""
    return "" if os.path.isabs(path) else f" (a relative path is read from the current directory, {os.getcwd()})"


def not_utf8_text(source: str, data: bytes, what: str) -> str:
    """The one-line error for a file ``source`` whose ``data`` is not UTF-8: its line and byte, then ``what`` the file
    should be."""
    line, bad = first_bad_utf8(data)
    return f"{source}: not a UTF-8 text file (line {line}: byte {bad} is 0x{data[bad]:02x}); {what}"
