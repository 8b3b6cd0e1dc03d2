"""Where a step's device time goes: every GPU kernel it launches, summed per name
(``pagedkv bench --profile`` and the serving benchmark's ``--kernel-profile``).

    with KernelProfile(device) as prof:
        for _ in range(steps):
            step()
    prof.per_step(steps)  # [KernelTime(name, calls per step, us per step), ...]

On a CPU (no kernels) it sums each operator's self time instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch


@dataclass(frozen=True)
class KernelTime:
    name: str
    calls: float  # launches per step
    us: float  # device microseconds per step (CPU: the operator's self time)


class KernelProfile:
    """torch.profiler around a block of steps; ``per_step`` sums what ran, per name."""

    def __init__(self, device: torch.device | str) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        activity = ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU
        self._profile = profile(activities=[activity])
        self._totals: dict[str, list[float]] | None = None

    def __enter__(self) -> KernelProfile:
        self._profile.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # every launched kernel done in the window
        self._profile.__exit__(exc_type, exc, traceback)

    def totals(self) -> dict[str, list[float]]:
        """{name: [launches, microseconds]} over the whole block."""
        if self._totals is None:
            totals: dict[str, list[float]] = {}
            if self.cuda:
                for event in self._profile.events():
                    if event.device_type == torch.autograd.DeviceType.CUDA:
                        entry = totals.setdefault(event.name, [0, 0.0])
                        entry[0] += 1
                        entry[1] += event.time_range.elapsed_us()
            else:
                for avg in self._profile.key_averages():
                    if avg.self_cpu_time_total > 0:
                        totals[avg.key] = [avg.count, avg.self_cpu_time_total]
            self._totals = totals
        return self._totals

    def per_launch(self, steps: int) -> list[KernelTime]:
        """On a GPU, each launch of a step in launch order (the steps launching the same
        kernels), so that two launches of one kernel stay apart; else ``per_step``."""
        events = []
        if self.cuda:
            events = sorted(
                (e for e in self._profile.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start,
            )  # fmt: skip
        if not events or len(events) % max(1, steps):
            return self.per_step(steps)
        per = len(events) // steps
        launches = []
        for position in range(per):
            same = events[position::per]
            if len({e.name for e in same}) != 1:  # the steps differ: no order to keep
                return self.per_step(steps)
            us = sum(e.time_range.elapsed_us() for e in same) / steps
            launches.append(KernelTime(same[0].name, 1, us))
        return launches

    def per_step(self, steps: int) -> list[KernelTime]:
        """Each kernel's launches and time per step, the longest first."""
        steps = max(1, steps)
        ranked = sorted(self.totals().items(), key=lambda kv: -kv[1][1])
        return [KernelTime(name, count / steps, us / steps) for name, (count, us) in ranked]


def host_functions(fn: Callable[[], Any], calls: int, top: int = 8) -> list[KernelTime]:
    """The Python functions ``calls`` calls of ``fn`` spend their host time in, by own
    time (cProfile), per call, the ``top`` longest."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        KernelTime(f"{func} ({file.rsplit('/', 1)[-1]}:{line})", n / calls, 1e6 * own / calls)
        for (file, line, func), (_, n, own, _, _) in ranked
    ]


def describe_kernels(kernels: list[KernelTime], top: int = 12, width: int = 60) -> list[str]:
    """One line per kernel, the ``top`` longest: microseconds and launches per step, name."""
    lines = [f"{k.us:9.1f} us  {k.calls:4.0f}x  {k.name[:width]}" for k in kernels[:top]]
    if len(kernels) > top:
        rest = kernels[top:]
        lines.append(f"{sum(k.us for k in rest):9.1f} us  {len(rest):4d} other names")
    return lines
