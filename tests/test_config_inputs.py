"""What --zero_offload (or ``zero_offload=`` in code, or an arguments file) may hold besides a well-formed file: each
mistake one ConfigError naming the input, before any model work."""
from __future__ import annotations

import pathlib

import pytest

from hf_zero_offload.config import ConfigError, resolve


@pytest.mark.parametrize("path", ["/tmp/ds\0config.json", "ds\0config.json", "zero2\0",
                                  pathlib.Path("/tmp/ds\0config.json")])
def test_a_path_holding_a_nul_character_is_named(path):
    """A NUL (from code or a JSON arguments file; no command line carries one) failed in open() with a bare
    "ValueError: embedded null byte" naming no file, or printed the name with the NUL raw in it."""
    with pytest.raises(ConfigError) as e:
        resolve(path)
    assert "\0" not in str(e.value) and "\\x00" in str(e.value) and "NUL" in str(e.value)
