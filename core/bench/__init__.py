"""``pagedkv bench``: time any backend config on a matrix of realistic serving steps.

Every backend gets the same step (the same random logical K/V written into its own
layout, the same shuffled block tables and queries) in the same process, next to a
raw library baseline (FlashInfer, where installed) and the copy bandwidth measured
in the same run; every output is checked against the torch backend's (an MLA layer's against
the float64 reference over its latent rows).

    from pagedkv.bench import run_bench
    rows = run_bench(["triton", "flashinfer"], matrix="standard")
"""

from __future__ import annotations

import fnmatch
import importlib.util
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pagedkv.bench.problem import build_problem
from pagedkv.bench.profile import describe_kernels
from pagedkv.bench.runners import Row, reference_output, run_baseline, run_pagedkv
from pagedkv.bench.timing import copy_bandwidth, host_floor_us
from pagedkv.bench.workloads import MATRICES, Workload
from pagedkv.errors import ConfigError

__all__ = ["MATRICES", "Row", "Workload", "environment", "run_bench", "select_workloads"]


def select_workloads(matrix: str, patterns: Sequence[str] = ()) -> list[Workload]:
    """The matrix's workloads whose names match any of ``patterns`` (globs; none: all)."""
    if matrix not in MATRICES:
        raise ConfigError(f"unknown matrix {matrix!r}: expected one of {', '.join(MATRICES)}")
    chosen = [
        w
        for w in MATRICES[matrix]
        if not patterns or any(fnmatch.fnmatch(w.name, p) for p in patterns)
    ]
    if not chosen:
        names = ", ".join(w.name for w in MATRICES[matrix])
        raise ConfigError(
            f"no workload of {matrix!r} matches {', '.join(patterns)} (have: {names})"
        )
    return chosen


def environment(
    device: torch.device, copy_bw: float, host_floor: float | None = None
) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "sms": (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else None
        ),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join(["pagedkv", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "copy_bandwidth": copy_bw,
        "host_floor_us": host_floor,
    }
    for lib in ("triton", "flashinfer", "jax"):
        env[lib] = None
        if importlib.util.find_spec(lib) is not None:
            try:
                env[lib] = importlib.import_module(lib).__version__
            except Exception as exc:  # a broken install is reported, not fatal
                env[lib] = f"import failed: {type(exc).__name__}"
    import pagedkv

    env["pagedkv"] = pagedkv.__version__
    return env


def run_bench(
    configs: Sequence[str],
    workloads: Sequence[Workload],
    *,
    device: str | torch.device = "cuda",
    baseline: str | None = "flashinfer",
    graph: bool = True,
    check: bool = True,
    seed: int = 0,
    profile: int = 0,
    graph_context: int | None = None,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> tuple[list[Row], dict[str, Any]]:
    """Time every config (and the baseline) on every workload; (rows, environment).
    ``profile``: also run this many eager calls under the profiler (``Row.kernels``).
    ``graph_context``: reserve each config's CUDA graph for contexts of this many tokens
    (default: the step's longest), as a serving engine sizes its graphs."""
    device = torch.device(device)
    copy_bw = copy_bandwidth(device)
    env = environment(device, copy_bw, host_floor_us(device))
    rows: list[Row] = []
    for i, workload in enumerate(workloads):
        problem = build_problem(workload, str(device), seed)
        progress(
            f"[{i + 1}/{len(workloads)}] {workload.name}: {workload.describe()}; "
            f"{workload.layer.describe()}; {problem.kv_bytes() / 1e9:.3f} GB of K/V"
        )
        reference = reference_output(problem) if check else None
        runs: list[tuple[str, Any]] = [(c, run_pagedkv) for c in configs]
        if baseline:
            runs.append((baseline, run_baseline))
        batch: list[Row] = []
        for label, run in runs:
            row, out = run(
                label, problem, graph=graph, profile=profile, graph_context=graph_context
            )
            if out is not None and reference is not None:
                n = reference.shape[0]
                row.max_abs_diff = float((out[:n].float() - reference.float()).abs().max())
            best = row.best_us
            if best:
                seconds = best * 1e-6
                row.gbps = problem.io_bytes() / seconds / 1e9
                row.pct_copy = 100.0 * problem.io_bytes() / seconds / copy_bw
                row.tflops = problem.flops() / seconds / 1e12
            graph = "-" if row.graph_us is None else f"{row.graph_us:.1f}"
            flushed = "-" if row.graph_flushed_us is None else f"{row.graph_flushed_us:.1f}"
            progress(
                f"    {row.impl}: eager {row.eager_us or 0:.1f} us, graph {graph} "
                f"(L2 flushed: {flushed}) {row.error}"
            )
            if row.launch_us is not None:
                steady = "-" if row.steady_us is None else f"{row.steady_us:.1f}"
                progress(
                    f"      host time to enqueue one call: {row.launch_us:.1f} us; back to "
                    f"back: {steady} us a call"
                )
            for line in describe_kernels(row.kernels):
                progress(f"      {line}")
            if row.host_functions:
                progress("      host, by own time:")
            for line in describe_kernels(row.host_functions):
                progress(f"      {line}")
            batch.append(row)
        base = next((r for r in batch if r.impl == f"raw:{baseline}" and r.best_us), None)
        for row in batch:
            if base is not None and row.best_us:
                row.vs_baseline = base.best_us / row.best_us
        rows += batch
        del problem, reference
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next workload's caches may be larger
    return rows, env
