"""Paged-attention benchmarks: pagedkv backends through the contract, raw libraries as baselines.

    python benchmarks/attention.py --backends triton --workloads decode-64x4096,prefill-8x2048 \\
        --json results.json

Every backend gets the same problem: the same random logical K/V (never zeros)
copied into its own physical layout, the same shuffled block tables and queries.
``builder.build`` runs once; the timed call is ``impl.forward(q, None, None, cache,
metadata, out)``, so the KV write is excluded from the attention time and timed on
its own ("write us": the step's new K/V through ``impl.write_kv``). Times are
medians of ``triton.testing.do_bench`` (L2 flushed before each call) and, where the
call can be captured, of ``triton.testing.do_bench_cudagraph`` (launch overhead
removed). Bytes counted: K/V read once + Q read + O written; FLOPs count only the
visible (causal) query-key pairs. The copy bandwidth (device-to-device, read +
write) is measured in the same run, and each backend's output is compared with
the torch backend's.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import pagedkv
import torch
from pagedkv import AttentionSpec, CommonAttentionMetadata
from pagedkv.toolkit.kv_write import quantize_for_cache


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    seq_len: int  # context + query tokens of every request
    query_len: int

    @property
    def kind(self) -> str:
        return "decode" if self.query_len == 1 else "prefill"


WORKLOADS = {
    w.name: w
    for w in (
        Workload("decode-64x4096", 64, 4096, 1),
        Workload("decode-256x1024", 256, 1024, 1),
        Workload("decode-4x32k", 4, 32768, 1),
        Workload("decode-1x32k", 1, 32768, 1),
        Workload("prefill-8x2048", 8, 2048, 2048),
    )
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Problem:
    """One workload on one device: logical K/V, block tables, queries, new K/V."""

    workload: Workload
    spec: AttentionSpec
    num_blocks: int
    block_ids: list[list[int]]
    common: CommonAttentionMetadata
    key_blocks: torch.Tensor  # [num_blocks, block_size, Hkv, D], real values
    value_blocks: torch.Tensor
    query: torch.Tensor  # [T, Hq, D]
    new_key: torch.Tensor  # [T, Hkv, D]: the step's new K/V (for the write timing)
    new_value: torch.Tensor

    @property
    def seq_lens(self) -> list[int]:
        return [self.workload.seq_len] * self.workload.batch

    def kv_bytes(self) -> int:
        """K and V of every request, read once."""
        s = self.spec
        per_token = 2 * s.num_kv_heads * s.head_size * s.cache_dtype.itemsize
        return sum(self.seq_lens) * per_token

    def io_bytes(self) -> int:
        q = self.query
        return self.kv_bytes() + 2 * q.numel() * q.element_size()

    def flops(self) -> float:
        """QK^T and PV over the visible pairs: 4 * Hq * D per pair."""
        s, w = self.spec, self.workload
        context = w.seq_len - w.query_len
        pairs = w.query_len * context + w.query_len * (w.query_len + 1) // 2
        return 4.0 * s.num_heads * s.head_size * pairs * w.batch


def build_problem(
    workload: Workload,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_size: int = 128,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    device: str = "cuda",
    seed: int = 0,
) -> Problem:
    spec = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    needed = -(-workload.seq_len // block_size)
    num_blocks = 1 + needed * workload.batch  # block 0 is the null block
    order = torch.randperm(num_blocks - 1, generator=gen, device=device).add_(1).tolist()
    block_ids = [order[i * needed : (i + 1) * needed] for i in range(workload.batch)]
    common = CommonAttentionMetadata.from_requests(
        [workload.seq_len] * workload.batch,
        [workload.query_len] * workload.batch,
        block_ids,
        block_size,
        device,
    )
    kv_shape = (num_blocks, block_size, num_kv_heads, head_size)
    tokens = workload.batch * workload.query_len

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    return Problem(
        workload=workload,
        spec=spec,
        num_blocks=num_blocks,
        block_ids=block_ids,
        common=common,
        key_blocks=randn(*kv_shape),
        value_blocks=randn(*kv_shape),
        query=randn(tokens, num_heads, head_size),
        new_key=randn(tokens, num_kv_heads, head_size),
        new_value=randn(tokens, num_kv_heads, head_size),
    )


def fill_cache(backend: pagedkv.AttentionBackend, kv_cache: torch.Tensor, problem: Problem) -> None:
    """Copy the problem's logical K/V into ``backend``'s physical layout."""
    s = problem.spec
    k_view, v_view = backend.kv_cache_to_logical(kv_cache, s)
    k_view.copy_(quantize_for_cache(problem.key_blocks, kv_cache.dtype, s.k_scale))
    v_view.copy_(quantize_for_cache(problem.value_blocks, kv_cache.dtype, s.v_scale))


# -- timing ---------------------------------------------------------------------------------


def time_eager_us(fn: Callable[[], Any]) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def time_graph_us(fn: Callable[[], Any]) -> float | None:
    """Median per call, replayed from a CUDA graph; None when ``fn`` cannot be captured."""
    import triton.testing

    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # a library whose call syncs or allocates by data
        print(f"    (no CUDA-graph timing: {type(exc).__name__}: {exc})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: str, gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    us = time_eager_us(lambda: dst.copy_(src))
    return 2 * n / (us * 1e-6)


# -- one implementation ---------------------------------------------------------------------


@dataclass
class Row:
    workload: str
    impl: str  # a pagedkv backend config, or "raw:<library>"
    eager_us: float | None = None
    graph_us: float | None = None
    write_us: float | None = None  # pagedkv only: impl.write_kv of the step's new K/V
    gbps: float | None = None  # io bytes / best time
    pct_copy: float | None = None  # of the measured copy bandwidth
    tflops: float | None = None
    max_abs_diff: float | None = None  # against the torch backend's output
    config: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    @property
    def best_us(self) -> float | None:
        times = [t for t in (self.eager_us, self.graph_us) if t is not None]
        return min(times) if times else None


def fill_metrics(row: Row, problem: Problem, copy_bw: float) -> None:
    best = row.best_us
    if best is None:
        return
    seconds = best * 1e-6
    row.gbps = problem.io_bytes() / seconds / 1e9
    row.pct_copy = 100.0 * problem.io_bytes() / seconds / copy_bw
    row.tflops = problem.flops() / seconds / 1e12


def run_pagedkv(
    config: str, problem: Problem, *, graph: bool = True, build_kwargs: dict | None = None
) -> tuple[Row, torch.Tensor | None]:
    """Time one pagedkv backend through the contract; returns the row and its output."""
    row = Row(problem.workload.name, config)
    try:
        choice = pagedkv.parse_config(config)[0]
        backend = pagedkv.get_backend(choice.name, **choice.options)
        spec, device = problem.spec, problem.query.device
        kv_cache = backend.allocate_kv_cache(problem.num_blocks, spec, device)
        fill_cache(backend, kv_cache, problem)
        builder = backend.make_builder(spec, device)
        impl = backend.make_impl(spec)
        metadata = builder.build(problem.common, **(build_kwargs or {}))
        for name in ("tile", "num_splits"):
            if hasattr(metadata, name):
                row.config[name] = str(getattr(metadata, name))
        out = torch.empty_like(problem.query)

        def attend() -> None:
            impl.forward(problem.query, None, None, kv_cache, metadata, out)

        attend()
        _sync(device)
        result = out.clone()
        row.eager_us = time_eager_us(attend)
        # a capture attempt on a backend that does not declare CUDA graphs can leave the
        # CUDA context broken (seen: JAX's stream under capture), so only declared ones
        if graph and pagedkv.Feature.CUDA_GRAPH in backend.capabilities.features:
            row.graph_us = time_graph_us(attend)
        # the write goes to a scratch copy: the timed cache keeps the problem's values
        scratch = kv_cache.clone()
        row.write_us = time_eager_us(
            lambda: impl.write_kv(problem.new_key, problem.new_value, scratch, metadata)
        )
        return row, result
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}"
        return row, None


def run_baseline(
    name: str, problem: Problem, *, graph: bool = True
) -> tuple[Row, torch.Tensor | None]:
    from baselines import BASELINES

    row = Row(problem.workload.name, f"raw:{name}")
    try:
        runner = BASELINES[name](problem)
        result = runner().clone()
        _sync(problem.query.device)
        row.eager_us = time_eager_us(runner)
        if graph:
            row.graph_us = time_graph_us(runner)
        return row, result
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}"
        return row, None


def reference_output(problem: Problem) -> torch.Tensor | None:
    """The torch backend's output (fp32 maths), the yardstick for every other row."""
    backend = pagedkv.get_backend("torch")
    spec, device = problem.spec, problem.query.device
    kv_cache = backend.allocate_kv_cache(problem.num_blocks, spec, device)
    fill_cache(backend, kv_cache, problem)
    metadata = backend.make_builder(spec, device).build(problem.common)
    return backend.make_impl(spec).forward(problem.query, None, None, kv_cache, metadata)


# -- report ----------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def print_table(rows: list[Row], copy_bw: float) -> None:
    print(f"\ncopy bandwidth (read+write, measured now): {copy_bw / 1e12:.3f} TB/s")
    print("attention times exclude the KV write (write us: impl.write_kv of the step's K/V)\n")
    head = (
        f"{'workload':<17} {'impl':<26} {'eager us':>9} {'graph us':>9} {'write us':>9} "
        f"{'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'max|diff|':>9}  config"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.error:
            print(f"{r.workload:<17} {r.impl:<26} ERROR {r.error[:120]}")
            continue
        config = " ".join(f"{k}={v}" for k, v in r.config.items())
        print(
            f"{r.workload:<17} {r.impl:<26} {_fmt(r.eager_us, '9.1f')} {_fmt(r.graph_us, '9.1f')} "
            f"{_fmt(r.write_us, '9.1f')} {_fmt(r.gbps, '7.0f')} {_fmt(r.pct_copy, '6.1f')} "
            f"{_fmt(r.tflops, '8.1f')} {_fmt(r.max_abs_diff, '9.2e')}  {config}"
        )


def environment() -> dict[str, Any]:
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "pagedkv": pagedkv.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except Exception:
        env["flashinfer"] = None
    return env


def compare(out: torch.Tensor | None, reference: torch.Tensor | None) -> float | None:
    if out is None or reference is None:
        return None
    return float((out.float() - reference.float()).abs().max())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="triton", help="pagedkv backend configs, comma-separated")
    p.add_argument(
        "--baselines", default="flashinfer", help="raw libraries (baselines.py), or 'none'"
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated names")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    p.add_argument("--no-check", action="store_true", help="skip the torch-backend comparison")
    p.add_argument("--json", help="write every row and the environment here")
    return p.parse_args(argv)


def split_configs(text: str) -> list[str]:
    """Split "a,b(x=1,y=2),c" on the commas outside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [c.strip() for c in out if c.strip() and c.strip() != "none"]


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks need a CUDA device")
    device = "cuda"
    env = environment()
    print(json.dumps(env))
    copy_bw = measure_copy_bandwidth(device)
    rows: list[Row] = []
    for name in split_configs(args.workloads):
        if name not in WORKLOADS:
            sys.exit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        problem = build_problem(
            WORKLOADS[name],
            dtype=DTYPES[args.dtype],
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_size=args.head_size,
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        reference = None if args.no_check else reference_output(problem)
        print(f"[{name}] {problem.kv_bytes() / 1e9:.3f} GB of K/V", flush=True)
        runs = [(c, run_pagedkv) for c in split_configs(args.backends)]
        runs += [(b, run_baseline) for b in split_configs(args.baselines)]
        for label, run in runs:
            row, out = run(label, problem, graph=not args.no_graph)
            row.max_abs_diff = compare(out, reference)
            fill_metrics(row, problem, copy_bw)
            rows.append(row)
            print(f"  {row.impl}: eager {_fmt(row.eager_us, '.1f')} us, graph "
                  f"{_fmt(row.graph_us, '.1f')} us {row.error}", flush=True)  # fmt: skip
        del problem, reference
        torch.cuda.empty_cache()  # the next workload's caches may be larger
    print_table(rows, copy_bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": env, "copy_bandwidth": copy_bw, "rows": [asdict(r) for r in rows]},
                f,
                indent=1,
            )
    return rows


if __name__ == "__main__":
    main()
