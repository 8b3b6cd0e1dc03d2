"""What the always-on step checks cost: CPU time of ``check_step`` and of a whole
``builder.build()`` for 1, 64 and 512 requests (decode steps, 4k-token contexts),
eager and under a CUDA-graph reservation that holds the step; with
``--forward``, the Python of one triton ``forward`` (checks, planning, the direct launch
path of ``pagedkv.toolkit.dispatch``) with Triton's launcher stubbed, on a CPU: one
layer's repeated, a step's first, and a step's through 16 layers (what an eager engine
pays per layer), the Triton KV write of the step's rows, and one layer's forward with
that write (what an eager engine's mixed step runs).

    python benchmarks/build_overhead.py [--backends torch,triton] [--device cpu|cuda] [--sms N]
    TRITON_INTERPRET=1 python benchmarks/build_overhead.py --layer mla --backends mla [--sms N]
    TRITON_INTERPRET=1 python benchmarks/build_overhead.py --forward [--sms N]

Host time only: the checks read the metadata's CPU copies and never sync the device.
Medians of repeated calls (``time.thread_time``, so other processes on the machine
count less); the figure to compare with is a model step's time, milliseconds.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import pagedkv
import torch
from pagedkv import AttentionSpec, CommonAttentionMetadata
from pagedkv.errors import UnsupportedError
from pagedkv.graph import GraphBounds
from pagedkv.step_check import check_step

SPEC = AttentionSpec(
    num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.float16, block_size=16
)
# --layer mla: a DeepSeek-style latent layer (128 heads, 512 + 64, pages of 64)
MLA_SPEC = AttentionSpec(
    num_heads=128, num_kv_heads=1, head_size=576, dtype=torch.float16, block_size=64,
    scale=0.1, kv_lora_rank=512, qk_rope_head_dim=64,
)  # fmt: skip


def step(num_reqs: int, device: str, block_size: int = 16) -> CommonAttentionMetadata:
    blocks_per_req = 4096 // block_size + 1
    blocks = [
        list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req)) for i in range(num_reqs)
    ]
    return CommonAttentionMetadata.from_requests(
        [4096] * num_reqs, [1] * num_reqs, blocks, block_size, device
    )


def median_us(fn, repeats: int = 2000) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(repeats // 100):
        start = time.thread_time()
        for _ in range(100):
            fn()
        samples.append((time.thread_time() - start) / 100)
    return 1e6 * statistics.median(samples)


def stub_launcher() -> None:
    """Direct launches without a GPU: the kernels' parameters read from their source
    (Triton's interpreter compiles nothing), a variant that launches nothing."""
    import inspect

    from pagedkv.toolkit import dispatch

    class Variant:
        function = packed_metadata = 0

        def run(self, *args: object) -> None:
            pass

        def launch_metadata(self, *args: object) -> None:
            return None

    def params(kernel):
        signature = inspect.signature(kernel.fn).parameters
        names = tuple(signature)
        return dispatch._Params(
            names,
            {n: i for i, n in enumerate(names)},
            frozenset(n for n, p in signature.items() if "constexpr" in str(p.annotation)),
            tuple(None if p.default is p.empty else p.default for p in signature.values()),
        )  # fmt: skip

    dispatch._params = functools.cache(params)
    dispatch._dispatch = lambda *args, **kwargs: Variant()
    dispatch.current_stream = lambda: 0


LAYERS = 16  # a step's forwards through this many layers (``step_forward_us``)


def step_forward_us(builder, common, layers, repeats: int = 200) -> tuple[float, float]:
    """(a step's first forward, its forwards through every layer per layer), medians
    over new builds: ``layers`` runs each one layer's forward of the step's metadata.
    An eager engine's forwards: the first specialises the step's launch arguments once
    for every layer, and each layer launches with the step's arguments and its own."""
    first, per_layer = [], []
    for _ in range(repeats):
        metadata = builder.build(common)
        start = time.thread_time()
        layers[0](metadata)
        after_first = time.thread_time()
        for run in layers[1:]:
            run(metadata)
        end = time.thread_time()
        first.append(after_first - start)
        per_layer.append((end - start) / len(layers))
    return 1e6 * statistics.median(first), 1e6 * statistics.median(per_layer)


def forward_overhead() -> None:
    """One triton forward's Python (launcher stubbed): a 1 x 32k decode (attention and
    reduction) and a mixed step of 16 decodes and a 256-token chunk (two parts)."""
    stub_launcher()
    backend = pagedkv.get_backend("triton")
    steps = {
        "decode 1x32k": ([32768], [1]),
        "mixed 16+1": ([4000] * 16 + [31621], [1] * 16 + [256]),
    }
    from pagedkv.toolkit.triton_kv_write import CacheWriter

    print(
        f"{'step':>14}  {'launches':>8}  {'forward us':>10}  {'first forward us':>16}  "
        f"{f'a step of {LAYERS} layers, us per layer':>32}  {'KV write us':>11}  "
        f"{'forward with its write us':>25}"
    )
    for name, (seq_lens, query_lens) in steps.items():
        tables, first = [], 1
        for n in seq_lens:
            tables.append(list(range(first, first - (-n // 16))))
            first += len(tables[-1])
        common = CommonAttentionMetadata.from_requests(seq_lens, query_lens, tables, 16)
        caches = [backend.allocate_kv_cache(first, SPEC, "cpu") for _ in range(LAYERS)]
        impls = [backend.make_impl(SPEC) for _ in range(LAYERS)]
        builder = backend.make_builder(SPEC, "cpu")
        metadata = builder.build(common)
        impl, cache = impls[0], caches[0]
        query = torch.randn(sum(query_lens), SPEC.num_heads, SPEC.head_size).to(SPEC.dtype)
        out = torch.empty_like(query)
        launches = len(impl.plan(query, cache, metadata, out))
        # one layer's forward repeated over one step's metadata (the bench's eager call)
        forward = functools.partial(impl.forward, query, None, None, cache, metadata, out)
        us = median_us(forward, 4000)
        layers = [
            functools.partial(i.forward, query, None, None, c, output=out)
            for i, c in zip(impls, caches, strict=True)
        ]
        first_us, layer_us = step_forward_us(builder, common, layers)
        # the step's K/V rows into the layer's cache, as a GPU's forward writes them (the
        # writer kept per cache, as ``AttentionImpl.cache_writer`` keeps it)
        rows = torch.randn(query.shape[0], SPEC.num_kv_heads, SPEC.head_size).to(SPEC.dtype)
        views = impl.cache_views(cache)
        writer = CacheWriter(views.k, views.v)
        write_us = median_us(functools.partial(writer, rows, rows, common.slot_mapping), 4000)
        # an eager engine's forward (a mixed step's): the write, then the attention (the
        # Triton writer made the cache's, as on a GPU; a CPU cache's is the torch path)
        views.derived["writer"] = writer
        write_forward = functools.partial(impl.forward, query, rows, rows, cache, metadata, out)
        with_write_us = median_us(write_forward, 4000)
        print(
            f"{name:>14}  {launches:>8}  {us:>10.1f}  {first_us:>16.1f}  {layer_us:>32.1f}  "
            f"{write_us:>11.1f}  {with_write_us:>25.1f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="torch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--forward", action="store_true", help="a triton forward's Python instead")
    p.add_argument(
        "--sms", type=int, help="the triton and MLA builders plan for this many SMs (an H200: 132)"
    )
    p.add_argument(
        "--layer", choices=("gqa", "mla"), default="gqa",
        help="the build's layer: GQA (Hq 32 / Hkv 8 / D 128) or MLA (--backends mla)",
    )  # fmt: skip
    args = p.parse_args()
    if args.sms:  # the CPU stands in 4 SMs, under which few steps split
        import pagedkv.backends.mla.builder as mla_builder
        import pagedkv.backends.triton.builder as triton_builder

        triton_builder.num_sms = mla_builder.num_sms = lambda device: args.sms
    if args.forward:
        forward_overhead()
        return
    configs = args.backends.split(",")
    print(
        f"{'requests':>8}  {'check_step us':>13}  "
        + "  ".join(f"{c + ' build us':>16}  {'(graph)':>8}" for c in configs)
    )
    spec = MLA_SPEC if args.layer == "mla" else SPEC
    bs = spec.block_size
    for n in (1, 64, 512):
        common = step(n, args.device, bs)
        row = [f"{n:>8}", f"{median_us(lambda c=common: check_step(c, bs)):>13.1f}"]
        for config in configs:
            backend = pagedkv.select_backend(config, spec, args.device)
            eager = backend.make_builder(spec, args.device)
            row.append(f"{median_us(lambda c=common, b=eager: b.build(c), 500):>16.1f}")
            # under a CUDA-graph reservation that holds the step: what a captured
            # decode pays each step (the step staged into the graph's buffers)
            graph = backend.make_builder(spec, args.device)
            try:
                graph.reserve_cuda_graph(GraphBounds(n, n, common.block_table.shape[1]))
            except UnsupportedError:  # no graph support declared
                row.append(f"{'-':>8}")
                continue
            row.append(f"{median_us(lambda c=common, b=graph: b.build(c), 500):>8.1f}")
        print("  ".join(row))


if __name__ == "__main__":
    main()
