"""The build tools a test runs (cmake, nm, objdump): the venv's (the Makefile installs cmake there), else the PATH's;
the test is skipped where neither has it."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest


def tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found")
    return found
