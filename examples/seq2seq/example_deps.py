"""The example scripts' first check: can this Python import what the script needs?

The usual cause when it cannot is a Python other than the checkout's `.venv` (the system's `python3`, with no torch:
the README says to `source .venv/bin/activate` first, and a new user forgets). Without the check, `run_demo.py`
wrote its data and then died in a traceback from inside its command builder, and `plot_curves.py` died in one at
its first import. Uses only the standard library (it runs before any dependency is known to be there).
"""
from __future__ import annotations

import importlib.util
import os
import sys


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
    """Exit 2 with one line naming what is missing and how to get it, before the script does any work."""
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
