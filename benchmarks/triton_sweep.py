"""Tune the Triton backend's tile rule: time many tile / warp / stage / split variants.

    python benchmarks/triton_sweep.py                     # every workload of attention.py
    python benchmarks/triton_sweep.py --workloads decode-64x4096 --quick --json sweep.json
    python benchmarks/triton_sweep.py --num-heads 64 --head-size 256 --block-size 32
    python benchmarks/triton_sweep.py --quick --all-splits --workloads decode-4x32k,ragged-decode-128
    python benchmarks/triton_sweep.py --key-ranges --workloads 'ragged-decode-128,gqa8-ragged-decode'

For each workload it times the unified kernel (and the reduction, when split)
through the backend's own builder and impl, overriding the tiles and the split
count: first every candidate tile (the rule's rows and their neighbours) at the
split count the rule chooses, then every split count with the best tile. All
variants are compiled up front in parallel processes (into Triton's on-disk cache),
so the timing loop only loads them (``--all-splits``: every tile at every split count;
``--key-ranges``: the rule's tile at fixed key ranges of 1, 1.25, 1.5 and 1.75 times each
power of two of its key step, the data to fit the makespan rule's ranges to).
Each trial also records the compiled attention kernel's registers (ptxas) and the
programs an SM holds of it, which the rule's register estimate stands for. Prints one
table per workload (best first), how
far the rule's choice is from the best, and the rule's view of the workload (rows,
memory- or compute-bound): what the constants of ``backends/triton/configs.py`` are
calibrated against (docs/triton.md lists them).

The host side of a forward (launches stubbed, on a CPU too) is
``benchmarks/build_overhead.py --forward``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
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
from pagedkv.backends.triton.configs import (
    BLOCK_M_CHOICES,
    EAGER_RANGE_MULTIPLES,
    SPLIT_POLICY,
    TILE_N_CHOICES,
    LayerShape,
    StepShape,
    TileConfig,
    choose_block_m,
    key_range_estimates,
)
from pagedkv.bench.problem import BenchProblem as Problem
from pagedkv.bench.problem import build_problem as build_bench_problem
from pagedkv.bench.problem import fill_cache
from pagedkv.bench.timing import copy_bandwidth, time_us
from pagedkv.bench.workloads import DTYPES, MATRICES
from pagedkv.intmath import cdiv
from pagedkv.toolkit.launch import kernel_fit

SPLITS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class Trial:
    workload: str
    tile: str
    num_splits: int
    us: float | None = None
    pct_copy: float | None = None
    tflops: float | None = None
    chosen: bool = False  # what the rule picks
    keys_per_split: int = 0  # fixed key ranges of this many keys (0: even shares)
    # the makespan rule's estimate of those ranges, in keys (configs.key_range_estimates)
    estimate_keys: float | None = None
    error: str = ""
    # the compiled attention kernel: registers per thread (ptxas) and the programs one SM
    # holds of it, by registers and shared memory (what the rule's estimate stands for)
    registers: int | None = None
    programs_per_sm: int | None = None


# the rows of `pagedkv bench --matrix standard`
WORKLOADS = {w.name: w for w in MATRICES["standard"]}


def build_problem(workload, *, device: str = "cuda", **layer) -> Problem:
    """``workload`` with its layer changed where ``layer`` gives a value."""
    changes = {k: v for k, v in layer.items() if v is not None}
    layer_shape = dataclasses.replace(workload.layer, **changes)
    return build_bench_problem(dataclasses.replace(workload, layer=layer_shape), device)


def select_workloads(patterns: str) -> list[str]:
    """The rows named or matched (``ragged-*``) by comma-separated ``patterns``, in the
    matrix's order."""
    names = [n for n in WORKLOADS if any(fnmatch.fnmatch(n, p) for p in patterns.split(","))]
    if not names:
        sys.exit(f"no workload matches {patterns!r}; known: {', '.join(WORKLOADS)}")
    return names


def time_eager_us(fn) -> float:
    return time_us(fn, torch.device("cuda"))


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
        # the sweep times one launch per step: a two-part step's default is its
        # largest part's (the other keeps its own plan in the backend)
        part = max(default.parts, key=lambda p: p.end - p.first)
        self.default = (part.plan.tile, part.plan.num_splits)
        self.default_keys = part.plan.tiles_per_split * part.plan.tile.tile_n
        # the rule's view of the workload
        layer = LayerShape.of(spec)
        self.block_m, self.memory_bound = choose_block_m(layer, StepShape.of(problem.common))

    def rule_keys(self, tile: TileConfig, splits: int) -> int:
        """The rule's fixed key range where it chose ranges, ``splits`` is their count and
        ``tile``'s key step divides it (so other tiles are compared on the rule's ranges);
        else 0, even shares."""
        keys = self.default_keys
        same = keys and splits == self.default[1] and keys % tile.tile_n == 0
        return keys if same else 0

    def launches(self, tile: TileConfig, splits: int, keys: int = 0) -> list:
        """The step's launches with ``tile`` and ``splits`` even shares, or with fixed
        ranges of ``keys`` keys."""
        common = self.problem.common
        if keys:
            md = self.builder.build(common, tile=tile, keys_per_split=keys)
        else:
            md = self.builder.build(common, tile=tile, num_splits=splits)
        return self.impl.plan(self.problem.query, self.cache, md, self.out)

    def time(
        self, tile: TileConfig, splits: int, keys: int = 0
    ) -> tuple[float, int | None, int | None]:
        """Microseconds, and the attention kernel's registers and programs per SM."""
        launches = self.launches(tile, splits, keys)
        compiled = launches[0]()  # the attention kernel (Triton returns the compiled one)
        registers, per_sm = occupancy(compiled, tile.num_warps)

        def run() -> None:
            for launch in launches:
                launch()

        return time_eager_us(run), registers, per_sm


def occupancy(compiled, num_warps: int) -> tuple[int | None, int | None]:
    """(registers per thread, programs per SM) of a launched Triton kernel on this GPU."""
    if not getattr(compiled, "n_regs", None):
        return None, None
    fit = kernel_fit(compiled, num_warps, torch.cuda.get_device_properties())
    return fit.registers, fit.programs_per_sm


def _warm(job: tuple) -> str:
    """Compile one launch into Triton's on-disk cache (a worker process)."""
    module, name, args, kwargs = job
    kernel = getattr(importlib.import_module(module), name)
    # Triton specialises a tensor argument by its dtype (and an assumed 16-byte
    # alignment) when given a MockTensor; a bare dtype it refuses
    from triton.runtime.jit import MockTensor

    kwargs = {k: MockTensor.wrap_dtype(v) for k, v in kwargs.items()}
    try:
        kernel.warmup(*args, grid=(1,), **kwargs)
    except Exception as exc:  # e.g. out of shared memory: reported when timed
        return f"{name}: {type(exc).__name__}: {str(exc)[:200]}"
    return ""


def compile_job(launch) -> tuple:
    """What a worker needs to compile ``launch``: tensors reduced to their dtypes."""
    fn = launch.kernel.fn
    kwargs = {k: v.dtype if isinstance(v, torch.Tensor) else v for k, v in launch.kwargs.items()}
    return fn.__module__, fn.__name__, (), kwargs


def precompile(jobs: list[tuple], processes: int) -> None:
    """Compile every distinct job in parallel processes before anything is timed."""
    distinct = {}
    for job in jobs:
        _, name, _, kwargs = job
        kinds = tuple(
            (k, repr(a) if not isinstance(a, int) or isinstance(a, bool)
             else ("one" if a == 1 else "d16" if a % 16 == 0 else "int"))
            for k, a in sorted(kwargs.items())
        )  # fmt: skip
        distinct.setdefault((name, kinds), job)
    print(f"compiling {len(distinct)} kernel variants in {processes} processes", flush=True)
    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(processes, mp_context=context) as pool:
            for error in pool.map(_warm, distinct.values()):
                if error:
                    print("  " + error, flush=True)
    except Exception as exc:  # the timing loop then compiles each variant itself
        print(f"  parallel compile failed ({type(exc).__name__}: {exc}); continuing", flush=True)


def candidate_tiles(
    bench: Bench,
    quick: bool,
    stages: tuple[int, ...] | None = None,
    tile_ns: tuple[int, ...] = TILE_N_CHOICES,
) -> list[TileConfig]:
    """The rule's rows and their neighbours, every key step, warps and stages.

    ``stages`` (default 2 with ``quick``, else 1-3): Triton's pipeliner divides the
    stages among the chain of loads (page-table entry, then K/V), so the gathered K/V
    tiles get two buffers only from 5 stages on, three from 7."""
    group = bench.problem.spec.num_queries_per_kv
    i = BLOCK_M_CHOICES.index(bench.block_m)
    rows = [m for m in BLOCK_M_CHOICES[max(0, i - 1) : i + 2] if m >= group]
    if quick:
        rows = [bench.block_m]
    if stages is None:
        stages = (2,) if quick else (1, 2, 3)
    return [
        TileConfig(m, n, w, st)
        for m, n, w, st in itertools.product(rows, tile_ns, (4, 8), stages)
        if w == 4 or m >= 64
    ]


def candidate_splits(problem: Problem) -> list[int]:
    w = problem.workload
    if max(w.query_lens) != 1:
        return [1]
    return [n for n in SPLITS if n == 1 or max(w.seq_lens) // n >= 256]


def candidate_key_ranges(problem: Problem, tile_n: int) -> list[int]:
    """Fixed key ranges for ``--key-ranges``: those the eager rule compares for the
    longest sequence (``SplitPolicy.key_range_candidates`` with
    ``EAGER_RANGE_MULTIPLES``); none for steps that are not decode-like."""
    w = problem.workload
    if max(w.query_lens) > SPLIT_POLICY.max_query_len:
        return []
    return SPLIT_POLICY.key_range_candidates(
        max(w.seq_lens), tile_n, SPLIT_POLICY.max_splits, EAGER_RANGE_MULTIPLES
    )


def sweep_key_ranges(bench: Bench, copy_bw: float) -> list[Trial]:
    """The rule's tile at each of ``candidate_key_ranges``, and at the rule's even shares
    when it chose those."""
    problem = bench.problem
    tile, splits = bench.default
    longest = max(problem.workload.seq_lens)
    trials = []
    if bench.default_keys == 0:
        trials.append(_trial(bench, copy_bw, tile, splits, 0, chosen=True))
    ranges = candidate_key_ranges(problem, tile.tile_n)
    builder = bench.builder
    estimates = key_range_estimates(
        LayerShape.of(problem.spec), StepShape.of(problem.common), tile, ranges,
        builder.num_sms, builder.fits, builder.listing,
    )  # fmt: skip
    for keys, estimate in zip(ranges, estimates, strict=True):
        chosen = keys == bench.default_keys
        trial = _trial(bench, copy_bw, tile, cdiv(longest, keys), keys, chosen)
        trial.estimate_keys = float(estimate)
        trials.append(trial)
    return trials


def _trial(
    bench: Bench, copy_bw: float, tile: TileConfig, splits: int, keys: int, chosen: bool
) -> Trial:
    """One timed variant: ``splits`` even shares, or fixed ranges of ``keys`` keys."""
    problem = bench.problem
    name = problem.workload.name
    t = Trial(name, str(tile), splits, chosen=chosen, keys_per_split=keys)
    try:
        t.us, t.registers, t.programs_per_sm = bench.time(tile, splits, keys)
        t.pct_copy = 100 * problem.io_bytes() / (t.us * 1e-6) / copy_bw
        t.tflops = problem.flops() / (t.us * 1e-6) / 1e12
    except Exception as exc:
        t.error = f"{type(exc).__name__}: {str(exc)[:160]}"
    ranges = f" ranges of {keys}" if keys else ""
    print(
        f"  {name} {t.tile} splits={splits}{ranges}: "
        + (f"{t.us:.1f} us" if t.us is not None else t.error),
        flush=True,
    )
    return t


def sweep(
    bench: Bench, tiles: list[TileConfig], copy_bw: float, all_splits: bool = False
) -> list[Trial]:
    problem = bench.problem
    default_tile, default_splits = bench.default

    def trial(tile: TileConfig, splits: int) -> Trial:
        chosen = (tile, splits) == bench.default
        return _trial(bench, copy_bw, tile, splits, bench.rule_keys(tile, splits), chosen)

    trials = []
    if all_splits:  # every tile at every split count (data to fit the split rule to)
        for tile in tiles:
            for splits in dict.fromkeys([default_splits, *candidate_splits(problem)]):
                trials.append(trial(tile, splits))
        if default_tile not in tiles:
            trials.append(trial(default_tile, default_splits))
        return trials
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


def print_report(trials: list[Trial], benches: dict[str, Bench]) -> None:
    print()
    for name in dict.fromkeys(t.workload for t in trials):
        rows = sorted((t for t in trials if t.workload == name), key=lambda t: t.us or 1e30)
        bench = benches[name]
        bound = "memory" if bench.memory_bound else "compute"
        print(f"== {name} (rule: {bench.block_m} rows, {bound}-bound)")
        print(
            f"{'tile':<18} {'splits':>6} {'keys':>6} {'us':>9} {'%copy':>6} {'TFLOP/s':>8}"
            f" {'regs':>5} {'/SM':>4} {'estimate':>9}"
        )
        for t in rows[:24]:
            keys = t.keys_per_split or "-"
            if t.us is None:
                print(f"{t.tile:<18} {t.num_splits:>6} {keys:>6} ERROR {t.error}")
                continue
            mark = "  <- the rule's choice" if t.chosen else ""
            estimate = f"{t.estimate_keys:9.0f}" if t.estimate_keys is not None else f"{'-':>9}"
            print(
                f"{t.tile:<18} {t.num_splits:>6} {keys:>6} {t.us:9.1f} {t.pct_copy:6.1f}"
                f" {t.tflops:8.1f} {t.registers or '-':>5} {t.programs_per_sm or '-':>4}"
                f" {estimate}{mark}"
            )
        chosen = [t for t in rows if t.chosen and t.us]
        if chosen and rows[0].us:
            print(f"the rule's choice is {chosen[0].us / rows[0].us:.2f}x the best")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(w.name for w in MATRICES["core"]))
    # unset: each workload's own layer (pagedkv bench's matrix)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--num-kv-heads", type=int, default=None)
    p.add_argument("--head-size", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--quick", action="store_true", help="the rule's rows only, 2 stages")
    p.add_argument(
        "--stages", help="pipeline stages to try, e.g. 2,5,7 (default: 2 with --quick, else 1,2,3)"
    )
    p.add_argument("--tile-n", help="keys per step to try, e.g. 32,64 (default: all)")
    p.add_argument(
        "--all-splits",
        action="store_true",
        help="every candidate tile at every split count (default: the splits with the best tile)",
    )
    p.add_argument(
        "--key-ranges",
        action="store_true",
        help="the rule's tile at fixed key ranges of 1-1.75x each power of two (decode-like steps)",
    )
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--json", help="write every trial here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(
            "the sweep needs a CUDA device (benchmarks/build_overhead.py --forward: the host side, on a CPU)"
        )
    names = select_workloads(args.workloads)
    stages = tuple(int(x) for x in args.stages.split(",")) if args.stages else None
    tile_ns = tuple(int(x) for x in args.tile_n.split(",")) if args.tile_n else TILE_N_CHOICES
    shape = dict(
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    dtype = args.dtype
    copy_bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth (read+write): {copy_bw / 1e12:.3f} TB/s", flush=True)
    problems = {n: build_problem(WORKLOADS[n], dtype=dtype, **shape) for n in names}
    benches = {n: Bench(p) for n, p in problems.items()}
    # --key-ranges times the rule's tile only
    tiles = {
        n: [] if args.key_ranges else candidate_tiles(b, args.quick, stages, tile_ns)
        for n, b in benches.items()
    }
    jobs = []
    for n, bench in benches.items():
        default_tile, default_splits = bench.default
        if args.key_ranges:  # the ranged launches' variants (trimmed, listed)
            ranges = candidate_key_ranges(bench.problem, default_tile.tile_n)
            variants = [(default_tile, default_splits, 0)] + [
                (default_tile, 0, keys) for keys in ranges
            ]
        else:
            variants = [
                (tile, splits, bench.rule_keys(tile, splits))
                for tile in [*tiles[n], default_tile]
                for splits in {default_splits, *candidate_splits(bench.problem)}
            ]
        for tile, splits, keys in variants:
            try:
                jobs += [compile_job(launch) for launch in bench.launches(tile, splits, keys)]
            except Exception as exc:
                print(f"  cannot plan {n} {tile} splits={splits} keys={keys}: {exc}")
    precompile(jobs, args.jobs)
    trials = []
    for n, bench in benches.items():
        if args.key_ranges:
            trials += sweep_key_ranges(bench, copy_bw)
        else:
            trials += sweep(bench, tiles[n], copy_bw, args.all_splits)
    print_report(trials, benches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"copy_bandwidth": copy_bw, "trials": [asdict(t) for t in trials]}, f, indent=1
            )


if __name__ == "__main__":
    main()
