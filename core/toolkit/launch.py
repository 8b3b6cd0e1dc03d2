"""A planned kernel launch: decided by the builder or the impl's planning, run later."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KernelLaunch:
    """``kernel[grid](**kwargs)``.

    Arguments are passed by keyword only, so that a swapped stride or a missing
    argument is a TypeError at launch instead of a numeric mismatch.
    """

    kernel: Any
    grid: tuple[int, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> Any:
        return self.kernel[self.grid](**self.kwargs)


def run_launches(launches: list[KernelLaunch]) -> Any:
    """Run in order; returns the first launch's compiled handle (or None)."""
    first = None
    for i, launch in enumerate(launches):
        handle = launch()
        if i == 0:
            first = handle
    return first
