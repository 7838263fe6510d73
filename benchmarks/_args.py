"""The benchmarks' argparse types: counts, sizes and paths checked before any work, each mistake one usage line
naming the flag and the value (0 rounds or a negative size failed deep in a run with a traceback, a rank's failure
left its peer waiting, an unwritable --json failed after the whole run)."""
from __future__ import annotations

import os
import tempfile


def _number(kind, least: float, what: str):
    """An argparse ``type``: a ``kind`` number >= ``least``, else a usage error naming the value (0 rounds or a
    negative size failed deep in a run with a traceback, and a rank's failure left its peer waiting)."""
    import argparse

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not {what}") from None
        if not value >= least:  # (NaN too)
            raise argparse.ArgumentTypeError(f"{text}: {what} expected")
        if value == float("inf"):  # (an OverflowError at int(), or a run without end)
            raise argparse.ArgumentTypeError(f"{text}: a finite number expected")
        return value

    parse.__name__ = what  # argparse names the type in its message
    return parse


def int_at_least(least: int):
    return _number(int, least, f"an integer >= {least}")


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
positive_float = _number(float, 1e-12, "a positive number")
nonnegative_float = _number(float, 0.0, "a number >= 0")


def items_of(text: str, expected: str) -> list[str]:
    """The comma-separated items of a list flag, empty ones (``a,,b``, a trailing comma) skipped; none at all is a
    usage error saying ``expected``."""
    import argparse

    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: {expected}")
    return items


def refuse_repeats(items: list[str]) -> None:
    """A usage error naming the items given twice (a repeated row or model ran twice)."""
    import argparse

    twice = sorted({x for x in items if items.count(x) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{','.join(twice)}: given twice")


def int_list(least: int = 1):
    """``--tensors 1000,4000``: comma-separated integers, each >= ``least``, as a list (a bad one failed later with
    a traceback, or a 0 ran a meaningless row)."""
    import argparse

    one, what = int_at_least(least), f"comma-separated integers >= {least}"

    def parse(text: str) -> list:
        items = items_of(text, f"{what} expected")
        try:
            return [one(x) for x in items]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} expected") from None

    parse.__name__ = what
    return parse


def name_list(names, what: str):
    """``--rows a,b``: comma-separated names, each one of ``names`` (a row, a dtype), none twice, as a list in the
    order given (a wrong one failed with a KeyError after the model was built, or its run failed and the rest went
    on; a repeated one ran twice). Empty items (``a,,b``, a trailing comma) are skipped, as ``int_list``'s."""
    import argparse

    allowed = tuple(names)

    def parse(text: str) -> list:
        items = items_of(text, f"one or more {what}s expected, of {','.join(allowed)}")
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{','.join(bad)}: not a {what}; {what}s are {','.join(allowed)}")
        refuse_repeats(items)
        return items

    parse.__name__ = f"list of {what}s"
    parse.allowed = allowed  # (the tests feed each list option a name outside it)
    return parse


def torch_device(text: str) -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N`` that this machine has (a typo or a missing GPU failed after the
    model was built, with a traceback from deep inside torch)."""
    import argparse

    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r}: not a device (cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: this benchmark runs on cpu or cuda, not {dev.type}")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device here (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s), cuda:0..{count - 1}")
    return text


def _writable(path: str, what: str, folder: bool = False) -> str:
    """``path`` if a ``what`` can be written there (the nearest existing folder, of it or of its parent, takes a
    file), else a usage error: an unwritable path failed only after the whole run, with a traceback."""
    import argparse

    probe = os.path.abspath(path) if folder else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(probe):  # the nearest existing folder decides whether the rest can be created
        probe = os.path.dirname(probe)
    try:
        if not os.path.isdir(probe) or (not folder and os.path.isdir(path)):
            raise OSError("not a folder" if folder else "not a file path")
        with tempfile.TemporaryFile(dir=probe):  # (os.access says yes to root, and to /proc)
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path}: cannot write {what} there ({e.strerror or e})") from None
    return path


def json_target(path: str) -> str:
    """``--json PATH`` (or ``-``, stdout) checked before the run."""
    return path if path == "-" else _writable(path, "a JSON file")


def output_file(path: str) -> str:
    """An output file's path (``--png``) checked before the run, as ``--json``'s."""
    return _writable(path, "a file")


def output_dir(path: str) -> str:
    """An output folder (``--out_dir``), created by the run: it, or its nearest existing parent, must take files."""
    return _writable(path, "files", folder=True)


def existing_dir(path: str) -> str:
    """An input folder (``--data_dir``, ``--dir``) that must exist before any work."""
    import argparse

    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path}: no such folder")
    return path
