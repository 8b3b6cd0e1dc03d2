"""Tune the Triton backend: time many tile / warp / stage / split variants in one process.

    python benchmarks/triton_sweep.py                     # every workload of attention.py
    python benchmarks/triton_sweep.py --workloads decode-64x4096 --quick --json sweep.json

For each workload it times the unified kernel (and the reduction, when split)
through the backend's own builder and impl, overriding the tiles and the split
count: first every candidate tile at the split count the builder chooses, then
every split count with the best tile. All variants are compiled up front in
parallel processes (into Triton's on-disk cache), so the timing loop only loads
them. Prints one table per workload (best first) and the rows to paste into
``backends/triton/configs.py`` (TILES, and the split counts next to the policy's).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import pagedkv
import torch
from attention import (
    DTYPES,
    WORKLOADS,
    Problem,
    build_problem,
    fill_cache,
    measure_copy_bandwidth,
    time_eager_us,
)
from pagedkv.backends.triton.configs import (
    TileConfig,
    dot_inputs,
    head_pad,
    select_tile,
    tile_kind,
)

DECODE_TILES = [
    TileConfig(16, n, w, s)
    for n, w, s in itertools.product((16, 32, 64, 128), (4, 8), (2, 3, 4, 5))
]
PREFILL_TILES = [
    TileConfig(m, n, w, s)
    for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
]
QUICK_DECODE_TILES = [
    TileConfig(16, n, 4, s) for n, s in itertools.product((32, 64, 128), (2, 3, 4))
]
QUICK_PREFILL_TILES = [
    TileConfig(m, n, 8, s) for m, n, s in itertools.product((64, 128), (64, 128), (2, 3))
]
SPLITS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class Trial:
    workload: str
    tile: str
    num_splits: int
    us: float | None = None
    pct_copy: float | None = None
    tflops: float | None = None
    chosen: bool = False  # what the builder picks today
    error: str = ""


class Bench:
    """One workload's cache, builder and impl; times any (tile, splits)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        spec, device = problem.spec, problem.query.device
        self.backend = pagedkv.get_backend("triton")
        self.cache = self.backend.allocate_kv_cache(problem.num_blocks, spec, device)
        fill_cache(self.backend, self.cache, problem)
        self.builder = self.backend.make_builder(spec, device)
        self.impl = self.backend.make_impl(spec)
        self.out = torch.empty_like(problem.query)
        default = self.builder.build(problem.common)
        self.default = (default.tile, default.num_splits)

    def launches(self, tile: TileConfig, splits: int) -> list:
        md = self.builder.build(self.problem.common, tile=tile, num_splits=splits)
        return self.impl.plan(self.problem.query, self.cache, md, self.out)

    def time(self, tile: TileConfig, splits: int) -> float:
        launches = self.launches(tile, splits)

        def run() -> None:
            for launch in launches:
                launch()

        return time_eager_us(run)


def _warm(job: tuple) -> str:
    """Compile one launch into Triton's on-disk cache (a worker process)."""
    module, name, args, kwargs = job
    kernel = getattr(importlib.import_module(module), name)
    try:
        kernel.warmup(*args, grid=(1,), **kwargs)
    except Exception as exc:  # e.g. out of shared memory: reported when timed
        return f"{name}: {type(exc).__name__}: {str(exc)[:200]}"
    return ""


def compile_job(launch) -> tuple:
    """What a worker needs to compile ``launch``: tensors reduced to their dtypes."""
    fn = launch.kernel.fn
    args = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in launch.args)
    return fn.__module__, fn.__name__, args, launch.kwargs


def precompile(jobs: list[tuple], processes: int) -> None:
    """Compile every distinct job in parallel processes before anything is timed."""
    distinct = {}
    for job in jobs:
        _, name, args, kwargs = job
        kinds = tuple(
            repr(a) if not isinstance(a, int) or isinstance(a, bool)
            else ("one" if a == 1 else "d16" if a % 16 == 0 else "int")
            for a in args
        )  # fmt: skip
        distinct.setdefault((name, repr(sorted(kwargs.items())), kinds), job)
    print(f"compiling {len(distinct)} kernel variants in {processes} processes", flush=True)
    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(processes, mp_context=context) as pool:
            for error in pool.map(_warm, distinct.values()):
                if error:
                    print("  " + error, flush=True)
    except Exception as exc:  # the timing loop then compiles each variant itself
        print(f"  parallel compile failed ({type(exc).__name__}: {exc}); continuing", flush=True)


def candidate_tiles(problem: Problem, quick: bool) -> list[TileConfig]:
    w, s = problem.workload, problem.spec
    decode = tile_kind(w.query_len, s.num_queries_per_kv) == "decode"
    if decode:
        tiles = QUICK_DECODE_TILES if quick else DECODE_TILES
    else:
        tiles = QUICK_PREFILL_TILES if quick else PREFILL_TILES
    group = 1 << (s.num_queries_per_kv - 1).bit_length()
    return [t for t in tiles if t.block_m >= group]


def candidate_splits(problem: Problem) -> list[int]:
    w = problem.workload
    if w.kind != "decode":
        return [1]
    return [n for n in SPLITS if n == 1 or w.seq_len // n >= 256]


def sweep(bench: Bench, tiles: list[TileConfig], copy_bw: float) -> list[Trial]:
    problem = bench.problem
    name = problem.workload.name
    default_tile, default_splits = bench.default
    trials = []

    def trial(tile: TileConfig, splits: int) -> Trial:
        t = Trial(name, str(tile), splits, chosen=(tile, splits) == bench.default)
        try:
            t.us = bench.time(tile, splits)
            t.pct_copy = 100 * problem.io_bytes() / (t.us * 1e-6) / copy_bw
            t.tflops = problem.flops() / (t.us * 1e-6) / 1e12
        except Exception as exc:
            t.error = f"{type(exc).__name__}: {str(exc)[:160]}"
        print(
            f"  {name} {t.tile} splits={splits}: "
            + (f"{t.us:.1f} us" if t.us is not None else t.error),
            flush=True,
        )
        return t

    for tile in tiles:
        trials.append(trial(tile, default_splits))
    timed = [t for t in trials if t.us is not None]
    best_tile = min(timed, key=lambda t: t.us).tile if timed else str(default_tile)
    best = next(x for x in tiles if str(x) == best_tile) if timed else default_tile
    for splits in candidate_splits(problem):
        if splits != default_splits:
            trials.append(trial(best, splits))
    if default_tile not in tiles:
        trials.append(trial(default_tile, default_splits))
    return trials


def print_report(trials: list[Trial], problems: dict[str, Problem]) -> None:
    print()
    for name in dict.fromkeys(t.workload for t in trials):
        rows = sorted((t for t in trials if t.workload == name), key=lambda t: t.us or 1e30)
        print(f"== {name}")
        print(f"{'tile':<18} {'splits':>6} {'us':>9} {'%copy':>6} {'TFLOP/s':>8}")
        for t in rows[:12]:
            if t.us is None:
                print(f"{t.tile:<18} {t.num_splits:>6} ERROR {t.error}")
                continue
            mark = "  <- builder's choice" if t.chosen else ""
            print(
                f"{t.tile:<18} {t.num_splits:>6} {t.us:9.1f} {t.pct_copy:6.1f} {t.tflops:8.1f}{mark}"
            )
        chosen = [t for t in rows if t.chosen and t.us]
        if chosen and rows[0].us:
            print(f"builder's choice is {chosen[0].us / rows[0].us:.2f}x the best")
    print("\n== suggested configs.py rows (best tile per workload)")
    for name, problem in problems.items():
        rows = [t for t in trials if t.workload == name and t.us is not None]
        if not rows:
            continue
        best = min(rows, key=lambda t: t.us)
        s = problem.spec
        kind = tile_kind(problem.workload.query_len, s.num_queries_per_kv)
        key = (kind, head_pad(s.head_size), dot_inputs(s.dtype, s.kv_cache_dtype))
        m, n, w, st = (int(x[1:]) for x in best.tile.split("-"))
        print(
            f"    {key!r}: TileConfig({m}, {n}, {w}, {st}),  # {name}: {best.us:.1f} us, "
            f"splits={best.num_splits} (current table: "
            f"{select_tile(kind, s.head_size, s.dtype, s.kv_cache_dtype)})"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--quick", action="store_true", help="fewer tile candidates")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--json", help="write every trial here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the sweep needs a CUDA device")
    copy_bw = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth (read+write): {copy_bw / 1e12:.3f} TB/s", flush=True)
    names = [n for n in args.workloads.split(",") if n]
    problems = {n: build_problem(WORKLOADS[n], dtype=DTYPES[args.dtype]) for n in names}
    benches = {n: Bench(p) for n, p in problems.items()}
    tiles = {n: candidate_tiles(p, args.quick) for n, p in problems.items()}
    jobs = []
    for n, bench in benches.items():
        default_tile, default_splits = bench.default
        for tile in [*tiles[n], default_tile]:
            for splits in {default_splits, *candidate_splits(bench.problem)}:
                try:
                    jobs += [compile_job(launch) for launch in bench.launches(tile, splits)]
                except Exception as exc:
                    print(f"  cannot plan {n} {tile} splits={splits}: {exc}")
    precompile(jobs, args.jobs)
    trials = []
    for n, bench in benches.items():
        trials += sweep(bench, tiles[n], copy_bw)
    print_report(trials, problems)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"copy_bandwidth": copy_bw, "trials": [asdict(t) for t in trials]}, f, indent=1
            )


if __name__ == "__main__":
    main()
