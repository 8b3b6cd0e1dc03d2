"""MLA decode: our kernels (Gluon on sm_90, Triton elsewhere) against FlashInfer's BatchMLAPagedAttentionWrapper.

Both run in this process on the same latent cache, block table and absorbed query,
timed with ``triton.testing.do_bench`` (median, L2 flushed between runs), and both are
checked against a float32 reference. The headline shape is DeepSeek's decode: 128
heads, latent 512 + 64, page 64, bf16, 64 requests x 4096 tokens. Ours is timed three
ways: eager ``forward_mla`` (metadata built once), its planned kernel launches alone
(``launches``), and replayed from a CUDA graph through the contract's graph path
(``graph``: ``reserve_cuda_graph`` with the shape as bounds, build, capture one
``forward_mla``, replay).

    python benchmarks/mla.py                 # headline + a few decode shapes
    python benchmarks/mla.py --sweep         # tile/warps/stages/splits variants, one table
    python benchmarks/mla.py --batch 4 --context 32768 --heads 16
    python benchmarks/mla.py --batch 256 --context 1024 --ragged   # lognormal lengths, mean 1024

With ``$OUT`` set, results also go to ``$OUT/mla_bench.json`` and ``$OUT/mla_bench.txt``.
The sweep prints the best variant as a ``CONFIGS`` line for backends/mla/configs.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

LORA, ROPE, NOPE = 512, 64, 128  # DeepSeek V2/V3 latent, rope and no-PE query dims


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    heads: int = 128
    page: int = 64
    dtype: str = "bfloat16"
    ragged: bool = False  # long-tailed context lengths of mean ``context``

    def __str__(self) -> str:
        ragged = " ragged" if self.ragged else ""
        return f"{self.batch}x{self.context}{ragged} H{self.heads} page{self.page} {self.dtype}"

    @property
    def seq_lens(self) -> list[int]:
        """Each request's context: ``context``, or (ragged) lognormal lengths (sigma 0.8,
        a fixed seed) scaled to that mean, at least one page."""
        if not self.ragged:
            return [self.context] * self.batch
        import numpy as np

        draw = np.random.default_rng(self.batch).lognormal(0.0, 0.8, self.batch)
        return [max(self.page, int(x)) for x in draw * self.context / draw.mean()]

    @property
    def flops(self) -> float:
        # scores over the whole latent row (L + R), values over its first L entries
        return 2.0 * sum(self.seq_lens) * self.heads * (LORA + ROPE + LORA)

    @property
    def bytes(self) -> float:
        item = getattr(torch, self.dtype).itemsize
        latent = sum(self.seq_lens) * (LORA + ROPE) * item
        q_out = self.batch * self.heads * (LORA + ROPE + LORA) * item
        return float(latent + q_out)


HEADLINE = Shape(64, 4096)
MORE = [Shape(1, 32768), Shape(4, 32768), Shape(256, 1024), Shape(64, 4096, heads=16)]


# -- the problem ---------------------------------------------------------------------------


@dataclass
class Problem:
    shape: Shape
    cache: torch.Tensor  # [num_blocks, page, L + R]
    block_table: torch.Tensor  # [B, pages_per_req] int32
    query: torch.Tensor  # [B, H, L + R] absorbed
    scale: float


def make_problem(shape: Shape, seed: int = 0) -> Problem:
    dtype = getattr(torch, shape.dtype)
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-max(shape.seq_lens) // shape.page)  # the block table's width
    num_blocks = 1 + shape.batch * pages
    # random data: timing zeros flatters some kernels
    cache = torch.randn(
        (num_blocks, shape.page, LORA + ROPE), generator=g, device="cuda", dtype=torch.float32
    ).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=g, device="cuda") + 1  # block 0: null
    block_table = order[: shape.batch * pages].view(shape.batch, pages).to(torch.int32)
    query = (
        torch.randn((shape.batch, shape.heads, LORA + ROPE), generator=g, device="cuda") * 0.5
    ).to(dtype)
    return Problem(shape, cache, block_table, query, (NOPE + ROPE) ** -0.5)


def reference(p: Problem) -> torch.Tensor:
    """float32 attention of each request over its gathered latent, [B, H, L]."""
    b = p.shape.batch
    latent = p.cache[p.block_table.long()].flatten(1, 2).float()  # [B, pages * page, L+R]
    scores = torch.bmm(p.query.float(), latent.transpose(1, 2)) * p.scale
    lens = torch.tensor(p.shape.seq_lens, device=scores.device)
    past = torch.arange(latent.shape[1], device=scores.device)[None, None, :] >= lens[:, None, None]
    scores = scores.masked_fill(past, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), latent[..., :LORA]).view(b, -1, LORA)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


# -- ours ----------------------------------------------------------------------------------


def _step(p: Problem, options: dict | None):
    """(backend, spec, the decode step) of the problem through the public API."""
    import pagedkv
    from pagedkv.backends.mla import MLABackend

    s = p.shape
    spec = pagedkv.AttentionSpec(
        num_heads=s.heads,
        num_kv_heads=1,
        head_size=LORA + ROPE,
        dtype=getattr(torch, s.dtype),
        block_size=s.page,
        scale=p.scale,
        kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE,
    )
    common = pagedkv.CommonAttentionMetadata.from_requests(
        s.seq_lens,
        [1] * s.batch,
        p.block_table.cpu().tolist(),
        s.page,
        "cuda",
    )
    return MLABackend(**(options or {})), spec, common


def ours(p: Problem, options: dict | None = None):
    """(callable running one decode step, metadata, impl) through the public backend path:
    metadata is built once (FlashInfer's plan), the callable only launches kernels."""
    backend, spec, common = _step(p, options)
    metadata = backend.make_builder(spec, "cuda").build(common)
    impl = backend.make_impl(spec)
    q_nope, q_pe = p.query[..., :LORA], p.query[..., LORA:]
    out = torch.empty(p.shape.batch, p.shape.heads, LORA, dtype=p.query.dtype, device="cuda")

    def run():
        return impl.forward_mla(q_nope, q_pe, None, None, p.cache, metadata, out)

    return run, metadata, impl


def graphed(p: Problem, options: dict | None = None):
    """(callable replaying one decode step from a CUDA graph, metadata) through the
    contract's graph path: the shape reserved as bounds, the step built into the
    persistent buffers, one ``forward_mla`` captured."""
    import pagedkv

    backend, spec, common = _step(p, options)
    builder = backend.make_builder(spec, "cuda")
    builder.reserve_cuda_graph(
        pagedkv.GraphBounds(
            max_num_reqs=p.shape.batch,
            max_num_tokens=p.shape.batch,
            max_blocks_per_req=p.block_table.shape[1],
        )
    )
    metadata = builder.build(common)
    impl = backend.make_impl(spec)
    q_nope, q_pe = p.query[..., :LORA], p.query[..., LORA:]
    out = torch.empty(p.shape.batch, p.shape.heads, LORA, dtype=p.query.dtype, device="cuda")

    def forward():
        impl.forward_mla(q_nope, q_pe, None, None, p.cache, metadata, out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    def run():
        graph.replay()
        return out

    return run, metadata


def compiled_stats(p: Problem, options: dict) -> str:
    """Registers / spills of the attention kernel for these options."""
    from pagedkv.toolkit.launch import run_launches

    _, md, impl = ours(p, options)
    out = torch.empty(p.shape.batch, p.shape.heads, LORA, dtype=p.query.dtype, device="cuda")
    q = p.query
    handle = run_launches(impl.plan_attention(q[..., :LORA], q[..., LORA:], p.cache, md, out))
    try:
        return f"{handle.n_regs} regs, {handle.n_spills} spills"
    except AttributeError:
        return ""


# -- FlashInfer ----------------------------------------------------------------------------


def flashinfer_mla(p: Problem):
    """(callable, None) for FlashInfer's MLA wrapper on the same cache, or (None, why)."""
    try:
        import flashinfer.mla
    except Exception as exc:  # not installed here: report, keep benchmarking ours
        return None, f"flashinfer unavailable: {type(exc).__name__}: {exc}"
    s = p.shape
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device="cuda")
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    arange = torch.arange(s.batch + 1, dtype=torch.int32, device="cuda")
    # each request's own pages (FlashInfer checks the counts against kv_len_arr)
    used = [-(-n // s.page) for n in s.seq_lens]
    kv_indptr = torch.tensor([0, *itertools.accumulate(used)], dtype=torch.int32, device="cuda")
    kv_indices = torch.cat([p.block_table[i, :n] for i, n in enumerate(used)]).contiguous()
    dtype = p.query.dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        wrapper.plan(
            qo_indptr=arange,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_len_arr=torch.tensor(s.seq_lens, dtype=torch.int32, device="cuda"),
            num_heads=s.heads,
            head_dim_ckv=LORA,
            head_dim_kpe=ROPE,
            page_size=s.page,
            causal=False,
            sm_scale=p.scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
    q_nope, q_pe = p.query[..., :LORA], p.query[..., LORA:]
    out = torch.empty(s.batch, s.heads, LORA, dtype=dtype, device="cuda")
    # views of our latent cache: the same bytes for both kernels
    caches = {"ckv": p.cache[..., :LORA], "kpe": p.cache[..., LORA:]}

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return wrapper.run(
                q_nope=q_nope, q_pe=q_pe, ckv_cache=caches["ckv"], kpe_cache=caches["kpe"], out=out
            )

    try:
        run()
    except Exception as exc:  # a build that wants dense ckv/kpe caches: same bytes, copied
        print(f"flashinfer refused strided ckv/kpe views ({type(exc).__name__}); using copies")
        caches = {name: t.contiguous() for name, t in caches.items()}
    return run, None


# -- timing ------------------------------------------------------------------------------


def bench(fn) -> float:
    """Median microseconds of fn (triton.testing.do_bench flushes L2 between runs)."""
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


@dataclass
class Row:
    shape: str
    impl: str
    us: float
    tflops: float
    gbps: float
    rel_err: float
    vs_flashinfer: float | None = None  # FlashInfer time / ours (> 1: we are faster)
    note: str = ""


def measure(label: str, shape: Shape, fn, ref: torch.Tensor, note: str = "") -> Row:
    out = fn()
    torch.cuda.synchronize()
    err = rel_error(out, ref)
    us = bench(fn)
    return Row(
        str(shape), label, us, shape.flops / us / 1e6, shape.bytes / us / 1e3, err, None, note
    )


def compare(shape: Shape, options: dict | None = None) -> list[Row]:
    p = make_problem(shape)
    ref = reference(p)
    rows = []
    fi, why = flashinfer_mla(p)
    if fi is not None:
        rows.append(measure("flashinfer", shape, fi, ref))
    variants = [options or {}]
    if not options:  # the default kernel, and the Triton one where that is the Gluon one
        variants.append({"use_gluon": False})
    for opts in variants:
        run, md, impl = ours(p, opts)
        kernel = md.plan.kind
        kernel = "gluon" if kernel == "gluon" else f"triton {kernel}"
        note = f"{md.config} splits={md.num_splits}"
        rows.append(measure(f"pagedkv mla ({kernel})", shape, run, ref, note))
        # the same kernels without forward_mla's Python: launches planned once, so a
        # kernel shorter than that Python is timed as a kernel, not as the host
        rows.append(measure(f"pagedkv mla ({kernel}, launches)", shape, launches_only(p, md, impl), ref, note))  # fmt: skip
        replay, graph_md = graphed(p, opts)
        graph_note = f"{graph_md.config} splits={graph_md.num_splits}"
        rows.append(measure(f"pagedkv mla ({kernel}, graph)", shape, replay, ref, graph_note))
        for row in rows[-3:]:
            if fi is not None:
                row.vs_flashinfer = rows[0].us / row.us
            else:
                row.note += f" ({why})"
        if md.plan.kind != "gluon":
            break  # the default already was the Triton kernel
    return rows


def launches_only(p: Problem, md, impl):
    """A callable replaying the attention's planned kernel launches (no write)."""
    from pagedkv.toolkit.launch import run_launches

    s = p.shape
    out = torch.empty(s.batch, s.heads, LORA, dtype=p.query.dtype, device="cuda")
    planned = impl.plan_attention(p.query[..., :LORA], p.query[..., LORA:], p.cache, md, out)

    def run():
        run_launches(planned)
        return out

    return run


# -- sweep -------------------------------------------------------------------------------


def sweep_variants(args) -> list[dict]:
    out = []
    for block_m, block_n, warps, stages, lazy, tma in itertools.product(
        args.block_m, args.block_n, args.num_warps, args.num_stages, (True, False), (True, False)
    ):
        # registers: the [block_m, 512] float32 accumulator over the warps' threads
        if block_m * LORA // (32 * warps) > 128:
            continue
        # shared memory: the query plus num_stages latent tiles (H100/H200: 227 KiB)
        if (block_m + stages * block_n) * (LORA + ROPE) * 2 > 227 * 1024:
            continue
        out.append(
            dict(
                block_m=block_m,
                block_n=block_n,
                num_warps=warps,
                num_stages=stages,
                lazy_rescale=lazy,
                use_tma=tma,
            )
        )
    return out


def _compile_one(job: tuple[Shape, dict]) -> str:
    """Worker: compile one variant into Triton's on-disk cache by running it once."""
    shape, options = job
    try:
        p = make_problem(shape)
        run, _, _ = ours(p, options)
        run()
        torch.cuda.synchronize()
        return ""
    except Exception as exc:
        return f"{options}: {type(exc).__name__}: {str(exc)[:200]}"


def start_precompile(shape: Shape, variants: list[dict], jobs: int):
    """Triton compiles serially in one process (~5 s a variant): compile the variants in
    parallel processes so that the timed process finds them in Triton's cache. Returns
    a function that waits for them (and reports), to call after other warm-up work."""
    if jobs <= 1 or not variants:
        return lambda: None
    t0 = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)
    futures = [pool.submit(_compile_one, (shape, v)) for v in variants]

    def wait() -> None:
        failures = [f for f in (fut.result() for fut in futures) if f]
        pool.shutdown()
        print(
            f"precompiled {len(variants)} variants in {time.time() - t0:.0f} s ({jobs} processes)"
        )
        for f in failures:
            print("  compile failed:", f)

    return wait


def sweep(shape: Shape, args) -> tuple[list[Row], dict | None]:
    variants = [dict(v, num_splits=s) for v in sweep_variants(args) for s in args.splits]
    wait = start_precompile(shape, variants, args.jobs)
    p = make_problem(shape)
    ref = reference(p)
    rows = []
    fi, why = flashinfer_mla(p)  # FlashInfer's JIT build overlaps our compiles
    fi_us = None
    if fi is not None:
        rows.append(measure("flashinfer", shape, fi, ref))
        fi_us = rows[0].us
    else:
        print(why)
    wait()
    best, best_us = None, math.inf
    for options in variants:
        label = (
            f"m{options['block_m']} n{options['block_n']} w{options['num_warps']} "
            f"s{options['num_stages']} {'lazy' if options['lazy_rescale'] else 'eager'} "
            f"{'tma' if options['use_tma'] else 'ptr'} x{options['num_splits']}"
        )
        try:
            run, _, _ = ours(p, options)
            row = measure(label, shape, run, ref, compiled_stats(p, options))
        except Exception as exc:  # e.g. out of shared memory: a row, not a crash
            note = f"{type(exc).__name__}: {str(exc)[:80]}"
            rows.append(Row(str(shape), label, math.nan, math.nan, math.nan, math.nan, None, note))
            continue
        if fi_us is not None:
            row.vs_flashinfer = fi_us / row.us
        rows.append(row)
        if row.rel_err < 2e-2 and row.us < best_us:
            best, best_us = options, row.us
    return rows, best


# -- output ------------------------------------------------------------------------------


def table(rows: list[Row], copy_bw: float | None = None) -> str:
    """The rows; with copy_bw (bytes/s), each row's bytes/s as a share of it too."""
    head = (
        f"{'shape':<26} {'impl':<40} {'us':>8} {'TFLOP/s':>8} {'GB/s':>7} {'%copy':>6} "
        f"{'rel err':>8} {'vs FI':>6}  note"
    )
    lines = [head, "-" * len(head)]
    if copy_bw:
        lines.insert(0, f"copy bandwidth (read+write, measured now): {copy_bw / 1e12:.3f} TB/s")
    for r in rows:
        vs = f"{r.vs_flashinfer:.2f}x" if r.vs_flashinfer else ""
        pct = f"{100.0 * r.gbps * 1e9 / copy_bw:6.1f}" if copy_bw else f"{'':6}"
        lines.append(
            f"{r.shape:<26} {r.impl:<40} {r.us:8.1f} {r.tflops:8.1f} {r.gbps:7.0f} {pct} "
            f"{r.rel_err:8.1e} {vs:>6}  {r.note}"
        )
    return "\n".join(lines)


def save(rows: list[Row], text: str, extra: dict) -> None:
    out_dir = os.environ.get("OUT")
    if not out_dir:
        return
    with open(os.path.join(out_dir, "mla_bench.json"), "w") as f:
        json.dump({"rows": [dataclasses.asdict(r) for r in rows], **extra}, f, indent=1)
    with open(os.path.join(out_dir, "mla_bench.txt"), "w") as f:
        f.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time many kernel variants")
    parser.add_argument("--batch", type=int, help="requests (default: the headline shapes)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument(
        "--ragged", action="store_true", help="long-tailed context lengths of mean --context"
    )
    parser.add_argument("--block-m", type=int, nargs="+", default=[64])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[8])
    parser.add_argument("--num-stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/mla.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    custom = (
        Shape(args.batch, args.context, args.heads, args.page, args.dtype, args.ragged)
        if args.batch
        else None
    )
    extra: dict = {"device": torch.cuda.get_device_name()}
    if args.sweep:
        shape = custom or HEADLINE
        rows, best = sweep(shape, args)
        text = table(rows)
        if best is not None:
            splits = best.pop("num_splits")
            cfg = ", ".join(f"{k}={v}" for k, v in best.items())
            text += (
                f"\n\nbest (num_splits={splits}): "
                f'("sm{"".join(map(str, torch.cuda.get_device_capability()))}", 2, {LORA}): '
                f"KernelConfig({cfg}),"
            )
            extra["best"] = dict(best, num_splits=splits)
    else:
        from pagedkv.bench.timing import copy_bandwidth  # the measure of pagedkv bench

        copy_bw = copy_bandwidth(torch.device("cuda"))
        extra["copy_bandwidth"] = copy_bw
        rows = []
        for shape in [custom] if custom else [HEADLINE, *MORE]:
            rows += compare(shape)
        text = table(rows, copy_bw)
    print(text)
    save(rows, text, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
