"""Argument types of the command line, written once for every subcommand.

Each is an argparse ``type=``: it returns the converted value or raises
``argparse.ArgumentTypeError`` saying what was expected, which the parser reports
as ``pagedkv: error: argument --x: expected ..., got '...'`` with exit status 2.
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from pagedkv.errors import UsageError


def _int(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _float(minimum: float, inclusive: bool, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


def fraction(text: str) -> float:
    """A number in (0, 1], e.g. a probability mass."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


positive_int = _int(1, "a positive integer")
non_negative_int = _int(0, "an integer >= 0")
positive_float = _float(0.0, False, "a finite number > 0")
non_negative_float = _float(0.0, True, "a finite number >= 0")


def positive_int_list(text: str) -> list[int]:
    """``"8,16,32"``: one or more positive integers, comma-separated."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    return values


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"expected an existing file, got {text!r}")
    return text


def device(text: str) -> str:
    """A torch device string (cpu, cuda, cuda:1); torch is imported only when given."""
    import torch

    try:
        return str(torch.device(text))
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as cpu, cuda or cuda:1, got {text!r}"
        ) from None


def backend_config(text: str) -> str:
    """A backend config string, checked against the grammar (not against the registry)."""
    from pagedkv.config import parse_config
    from pagedkv.errors import ConfigError

    try:
        parse_config(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def check_writable(option: str, paths: Iterable[Path]) -> None:
    """Raise UsageError unless every path in ``paths`` can be written (their directories
    are created); checked before the work whose results they will hold."""
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path.parent):
                pass
        except OSError as exc:
            raise UsageError(
                f"{option}: cannot write to {str(path.parent)!r} ({exc.strerror or exc}), "
                "expected a writable location"
            ) from None
        if path.is_dir() or (path.exists() and not os.access(path, os.W_OK)):
            raise UsageError(f"{option}: cannot write {str(path)!r}, expected a writable file")
