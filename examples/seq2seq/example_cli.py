"""The small example scripts' command-line basics (run_demo.py, plot_curves.py, synthetic_data.py): a mistake on the
command line, and a Python that lacks what the script needs, are each one line (exit 2) before any work, as
finetune_trainer.py and ``hf-zero-offload`` say theirs. Standard library only: it runs before any dependency is
known to be there, and synthetic_data.py needs none.
"""
from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line naming the problem (it printed its usage block above it), with the nearest flag
    for an unknown one; and an unknown flag named before "the following arguments are required", which argparse
    reports first: ``synthetic_data.py --n-train 5`` said only that out_dir was required."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        args, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return args

    def error(self, message: str):
        known = list(self._option_string_actions)
        unknown = [a for a in getattr(self, "_argv", []) if a.startswith("--") and len(a) > 2
                   and not any(o.startswith(a.partition("=")[0]) for o in known)]
        named = " ".join(f"{a} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(a.partition("=")[0], known,
                                                                                           n=1)) else a
                         for a in unknown)
        if named and message.startswith("the following arguments are required"):
            message = f"unrecognized arguments: {named}; {message}"
        elif named and message.startswith("unrecognized arguments"):
            message = f"unrecognized arguments: {named}"
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def missing_modules(modules) -> list[str]:
    """The top-level ``modules`` this interpreter cannot find (``find_spec``: nothing is imported)."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken one: not importable
            found = False
        if not found:
            out.append(name)
    return out


def require(script: str, modules) -> None:
    """Exit 2 with one line naming what is missing and how to get it. The usual cause is a Python other than the
    checkout's ``.venv`` (the system's ``python3``: the README's ``source .venv/bin/activate`` forgotten); without
    this, run_demo.py wrote its data and died in a traceback, and plot_curves.py died in one at its first import."""
    missing = missing_modules(modules)
    if not missing:
        return
    venv = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".venv", "bin",
                        "python")
    names = ", ".join(repr(m) for m in missing)
    sys.stderr.write(
        f"{script}: error: this Python ({sys.executable}) has no module named {names}: run the script with the "
        f"checkout's environment ({venv}, after make install; or source .venv/bin/activate first), or install the "
        "example's dependencies into this one (pip install '<the checkout>[examples]')\n")
    raise SystemExit(2)
