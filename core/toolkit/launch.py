"""A planned kernel launch: decided by the builder or the impl's planning, run later."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch


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


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def programmatic_launch(device: torch.device | str) -> bool:
    """Whether Triton kernels on ``device`` may be launched as programmatic dependents
    (``launch_pdl=True``): compiled (not interpreted) on an sm_90 or newer GPU. Such a
    launch may start while the kernel before it finishes its last programs, so it must
    call ``tl.extra.cuda.gdc_wait()`` before reading what that kernel wrote; the kernel
    before it lets it start early with ``gdc_launch_dependents()``."""
    from pagedkv.toolkit.interpreter import interpreting

    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9
