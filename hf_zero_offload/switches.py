"""On/off environment variables (``HF_ZERO_OFFLOAD_DEBUG``, ``..._SIMULATE_STREAMS``, ``..._BLOCKING_WAITS``), read
one way everywhere: "off" or "disable" read as on when anything but a few off words was on."""
from __future__ import annotations

import os

ON_WORDS = ("1", "true", "yes", "y", "on", "enable", "enabled")
OFF_WORDS = ("", "0", "false", "no", "n", "off", "disable", "disabled")


def env_switch(name: str) -> bool:
    """Whether the variable ``name`` is on (unset: off). A value that is neither an on nor an off word is a
    ValueError naming the variable: a typo must not pick a side."""
    raw = os.environ.get(name, "")
    word = raw.strip().lower()
    if word in ON_WORDS:
        return True
    if word in OFF_WORDS:
        return False
    raise ValueError(f"{name}={raw!r} is not an on/off value: on is one of {', '.join(ON_WORDS)}; off is one of "
                     f"{', '.join(w for w in OFF_WORDS if w)} (or unset)")


#: Every on/off variable this package reads (the engine reads the last two when it builds its streams, at train()).
SWITCHES = ("HF_ZERO_OFFLOAD_DEBUG", "HF_ZERO_OFFLOAD_SIMULATE_STREAMS", "HF_ZERO_OFFLOAD_BLOCKING_WAITS")


def switch_problems() -> list[str]:
    """Each switch whose value is neither on nor off, one line each: checked with the arguments, a typo in one the
    engine reads at train() was found only after the model and the data were loaded."""
    problems = []
    for name in SWITCHES:
        try:
            env_switch(name)
        except ValueError as e:
            problems.append(str(e))
    return problems
