"""Timers of ``pagedkv bench``: medians after warm-up, L2 flushed on the GPU."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def time_us(fn: Callable[[], Any], device: torch.device) -> float:
    """Median time of one call. CUDA: ``triton.testing.do_bench`` (L2 flushed before each
    call); CPU: wall-clock median of repeated calls."""
    if device.type == "cuda":
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()  # warm-up
    times = []
    deadline = time.perf_counter() + 0.5
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def time_graph_us(fn: Callable[[], Any]) -> float | None:
    """Median per call replayed from a CUDA graph (``do_bench_cudagraph``: no launch
    overhead); None, with the reason on stderr, when ``fn`` cannot be captured."""
    import triton.testing

    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:
        print(f"    (no CUDA-graph timing: {type(exc).__name__}: {exc})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


# what ``triton.testing.do_bench`` zeroes before each call to flush the L2 cache
_FLUSH_BYTES = 256 << 20


def time_graph_flushed_us(fn: Callable[[], Any], reps: int = 100) -> float | None:
    """Median per replay of ``fn`` captured in a CUDA graph, the L2 flushed before each
    replay as ``time_us`` flushes it before each eager call (``time_graph_us`` replays
    back to back, with what the previous replay left in L2). Not the eager call's time
    less the host's: on the H200 a triton graph queued right behind the flush ran up to
    45 us slower than its eager call (docs/benchmarks.md, twelfth session). None, with
    the reason on stderr, when ``fn`` cannot be captured."""
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a warm-up off the capture, as torch asks
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            fn()
        flush = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for _ in range(5):
            flush.zero_()
            graph.replay()
        for start, end in zip(starts, ends, strict=True):
            flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    except Exception as exc:
        print(f"    (no flushed CUDA-graph timing: {type(exc).__name__}: {exc})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def launch_us(fn: Callable[[], Any], device: torch.device, calls: int = 50) -> float:
    """Host time to enqueue one call (median of 5 runs of ``calls`` back-to-back calls,
    no sync between them): what a CUDA graph saves per call. Fewer launches than the
    GPU's queue holds, so the host never waits for the GPU; on a CPU, the whole call."""
    fn()
    samples = []
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    synchronize(device)
    return 1e6 * statistics.median(samples)


def layer_us(
    build: Callable[[], Any],
    layers: Sequence[Callable[[Any], Any]],
    device: torch.device,
    steps: int = 5,
) -> float:
    """Host time to enqueue one layer's eager call in a step of ``len(layers)`` layers
    (median of ``steps`` steps, per layer): each step a new ``build()``, then every
    layer's call over its metadata, back to back without a sync. What an eager engine
    pays a layer, where ``launch_us`` repeats one layer's call over one step (a step's
    first call, and each layer's first of the step, may do what a repeat finds done)."""
    for run in layers:  # the variants compiled, every layer's arguments found
        run(build())
    samples = []
    for _ in range(steps):
        metadata = build()
        synchronize(device)
        start = time.perf_counter()
        for run in layers:
            run(metadata)
        samples.append((time.perf_counter() - start) / len(layers))
    synchronize(device)
    return 1e6 * statistics.median(samples)


def steady_us(fn: Callable[[], Any], device: torch.device, calls: int = 100) -> float | None:
    """Per call, ``calls`` eager calls back to back, without an L2 flush or a sync between
    them (CUDA events around them; the least of 3 runs): the longer of the host's enqueue
    and the GPU's work. Beside ``graph`` (replays back to back) it tells an eager row's
    extra time apart: steady near graph, the host (``launch`` then near steady); steady
    above graph with ``launch`` below it, the eager plan's GPU work (on the H200 the
    mixed 16+1 step took 153.5 us steady, 108.9 of launch, against a graph of 117.3:
    its chunk's kernel differed, docs/benchmarks.md, fourteenth session). None off a GPU."""
    if device.type != "cuda":
        return None
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runs = []
    for _ in range(3):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        runs.append(1e3 * start.elapsed_time(end) / calls)
    return min(runs)


def host_floor_us(device: torch.device) -> float:
    """Host time to enqueue one trivial torch op (an in-place add on one element), as
    ``launch_us`` times a row: the host's own speed, measured in the same run, so that
    host-bound figures (``launch``, eager rows shorter than it) can be compared across
    runs and machines. On the H200 hosts the triton backend's ``launch`` column moved
    by up to 2x between sessions with nothing changed in its path."""
    one = torch.zeros(1, device=device)
    return launch_us(lambda: one.add_(1.0), device, calls=200)


def copy_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), measured now."""
    n = int(gib * (1 << 30)) if device.type == "cuda" else 1 << 26
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * n / (time_us(lambda: dst.copy_(src), device) * 1e-6)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
