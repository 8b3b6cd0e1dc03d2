"""Prefill: the Triton backend's Gluon sm_90 kernel against its portable kernel and
FlashInfer's BatchPrefillWithPagedKVCacheWrapper, on the same cache and block table.

The workloads are ``pagedkv bench``'s prefill rows (Hq 32, Hkv 8, D 128, bf16, block
16, shuffled blocks): causal 8 x 2048, 2 x 8192, and 4 chunks of 2048 after 8192
tokens of context. Each kernel is timed as its bare launches with
``triton.testing.do_bench`` (median, L2 flushed between runs); FlashInfer (if
importable) as its planned ``run``. Prints microseconds, TFLOP/s over the visible
(causal) pairs, the ratio to FlashInfer, and each output's largest difference from
the portable kernel's.

    python benchmarks/gluon_prefill.py
    python benchmarks/gluon_prefill.py --stages 3            # another ring depth
    python benchmarks/gluon_prefill.py --workloads prefill-8x2048 --tile-n 64
"""

from __future__ import annotations

import argparse
import functools
import sys

import pagedkv
import torch
from pagedkv.bench.problem import build_problem, fill_cache
from pagedkv.bench.runners import BASELINES
from pagedkv.bench.timing import time_us
from pagedkv.bench.workloads import MATRICES
from pagedkv.toolkit.launch import run_launches

WORKLOADS = ("prefill-8x2048", "prefill-2x8192", "chunked-prefill-4x2048+8k")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--tile-n", type=int, default=None, help="keys per tile (default: by D)")
    parser.add_argument("--stages", type=int, default=None, help="K/V ring slots (default: by D)")
    parser.add_argument("--no-flashinfer", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (an H100/H200: the Gluon kernel is sm_90 only)")

    from pagedkv.backends.triton.gluon_plan import (
        gluon_cache_args,
        gluon_layer_args,
        gluon_prefill_problem,
        plan_gluon_prefill,
    )

    device = torch.device("cuda")
    by_name = {w.name: w for w in MATRICES["standard"]}
    backend = pagedkv.get_backend("triton")
    print(f"{torch.cuda.get_device_name(device)}; timings: do_bench median, L2 flushed")
    print(f"{'workload':28} {'kernel':10} {'us':>9} {'TFLOP/s':>8} {'vs FI':>6} {'max diff':>9}")
    for name in args.workloads:
        problem = build_problem(by_name[name], "cuda")
        spec = problem.spec
        why = gluon_prefill_problem(spec, device)
        if why is not None:
            sys.exit(f"{name}: the Gluon kernel does not apply: {why}")
        cache = backend.allocate_kv_cache(problem.num_blocks, spec, device)
        fill_cache(backend, cache, problem)
        k_view, v_view = backend.kv_cache_to_logical(cache, spec)

        # the portable kernel, through the backend's own plan
        metadata = backend.make_builder(spec, device).build(problem.common)
        portable_out = torch.empty_like(problem.query)
        portable = backend.make_impl(spec).plan(problem.query, cache, metadata, portable_out)
        # the Gluon kernel
        gluon_out = torch.empty_like(problem.query)
        step = plan_gluon_prefill(spec, problem.common, tile_n=args.tile_n, stages=args.stages)
        cache_args = gluon_cache_args(spec, k_view, v_view, tile_n=args.tile_n)
        gluon = step.launch(problem.query, gluon_out, gluon_layer_args(spec), cache_args)

        runs = {
            "gluon": (gluon, gluon_out),
            "portable": (functools.partial(run_launches, portable), portable_out),
        }
        if not args.no_flashinfer:
            try:
                flashinfer = BASELINES["flashinfer"](problem)
                runs["flashinfer"] = (flashinfer, None)
            except ImportError as exc:
                print(f"  (no FlashInfer: {exc})")
        outputs, times = {}, {}
        for kernel, (run, out) in runs.items():
            result = run()
            torch.cuda.synchronize()
            outputs[kernel] = out if out is not None else result
            times[kernel] = time_us(run, device)
        n = problem.common.num_actual_tokens
        for kernel, us in times.items():
            diff = (outputs[kernel][:n].float() - portable_out[:n].float()).abs().max().item()
            ratio = f"{times['flashinfer'] / us:6.2f}" if "flashinfer" in times else "     -"
            tflops = problem.flops() / us / 1e6
            print(f"{name:28} {kernel:10} {us:9.1f} {tflops:8.1f} {ratio} {diff:9.2e}")
        tiles = f"tile_n {step.kwargs['TILE_N']}, stages {step.kwargs['STAGES']}"
        print(f"  gluon: {tiles}, grid {step.grid}; portable: {metadata.tile}")


if __name__ == "__main__":
    main()
