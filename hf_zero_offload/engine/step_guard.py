"""Ctrl-C during the part of a step that writes the optimizer state lands right after it.

The Adam pass runs tile by tile (a C++ call per tile, the GIL released), with the step counts already advanced: a
``KeyboardInterrupt`` between two tiles left some params with the step's update and the rest without, and the
training went on from that mix without a word (an outside probe: 26% of the masters at step 3, 74% still at step 2,
the counts all at 3; 1.6e-2 to 3.9e-2 off every reference 3 steps later). Inside :class:`DeferredSigint`, a first
SIGINT is held and delivered (to the handler that was there, so Python's KeyboardInterrupt as usual) once the block
has finished; a second one interrupts at once, for a step stuck in a collective whose peer is gone. Any exception
that does escape the block is the caller's to record (``AdamCore`` refuses to step or save after it).

Only the main thread can set signal handlers, and only a handler installed from Python is held back (SIG_IGN and
SIG_DFL are left as they are): elsewhere the block runs as it is.
"""
from __future__ import annotations

import signal
import threading


class DeferredSigint:
    def __init__(self):
        self._old = None
        self._pending = False

    def __enter__(self) -> "DeferredSigint":
        # a Python handler only (Python's KeyboardInterrupt, or the script's own): SIG_IGN stays ignored, SIG_DFL
        # (the process ends at once) is the process's choice, and a handler set outside Python cannot be put back
        if threading.current_thread() is threading.main_thread() and callable(signal.getsignal(signal.SIGINT)):
            self._old = signal.signal(signal.SIGINT, self._held)
        return self

    def _held(self, signum, frame) -> None:
        if self._pending:  # the second Ctrl-C: now, with the old handler back
            self._restore()
            raise KeyboardInterrupt
        self._pending = True

    def _restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._restore()
        if self._pending and exc_type is None:
            self._pending = False
            signal.raise_signal(signal.SIGINT)  # the state is whole now: the handler that was there takes it
        return False
