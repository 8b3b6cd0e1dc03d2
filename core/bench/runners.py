"""What ``pagedkv bench`` times: a pagedkv backend through the contract (eager, and
CUDA graphs through ``reserve_cuda_graph``), or a raw library call on the same data."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pagedkv.bench.problem import BenchProblem, fill_cache
from pagedkv.bench.profile import KernelProfile, KernelTime, host_functions
from pagedkv.bench.timing import (
    launch_us,
    layer_us,
    steady_us,
    synchronize,
    time_graph_flushed_us,
    time_graph_us,
    time_us,
)
from pagedkv.graph import GraphBounds
from pagedkv.intmath import cdiv
from pagedkv.selection import select_backend
from pagedkv.toolkit.kv_write import quantize_for_cache


@dataclass
class Row:
    workload: str
    impl: str  # a pagedkv backend config, or "raw:<library>"
    eager_us: float | None = None
    # GPU: eager calls back to back, no flush or sync (the longer of host and GPU work)
    steady_us: float | None = None
    graph_us: float | None = None
    # the graph's replay with the L2 flushed before each, as eager calls are timed
    graph_flushed_us: float | None = None
    launch_us: float | None = None  # GPU: host time to enqueue one eager call
    # pagedkv only, GPU: the host's time to enqueue a layer's eager call in a step of
    # ``STEP_LAYERS`` layers (a new build each step, each layer its own impl)
    layer_us: float | None = None
    write_us: float | None = None  # pagedkv only: impl.write_kv of the step's new K/V
    # pagedkv only: the host's time of builder.build for the step (once a step for all
    # the layers of a KV-cache group; ``launch_us``'s method: calls back to back)
    build_us: float | None = None
    gbps: float | None = None  # io bytes / best time
    pct_copy: float | None = None  # of the copy bandwidth measured in the same run
    tflops: float | None = None
    vs_baseline: float | None = None  # baseline best time / this best time (> 1: faster)
    max_abs_diff: float | None = None  # against the torch backend's output (MLA: the reference)
    graph_diff: float | None = None  # graph replay vs the eager output
    config: dict[str, Any] = field(default_factory=dict)
    # --profile: the eager call's kernels (device time per call; on a GPU in launch order)
    kernels: list[KernelTime] = field(default_factory=list)
    # --profile: the Python functions of one eager call, by own host time
    host_functions: list[KernelTime] = field(default_factory=list)
    error: str = ""

    @property
    def best_us(self) -> float | None:
        times = [t for t in (self.eager_us, self.graph_us) if t is not None]
        return min(times) if times else None

    @property
    def host_us(self) -> float | None:
        """Eager minus graph: what a CUDA graph saves per call (the host's work, plus
        what L2 keeps between back-to-back replays). Not eager minus ``flushed``: on the
        H200 a replay right after the flush ran up to 45 us slower than an eager call
        after it (docs/benchmarks.md, twelfth session), so that difference is no host time."""
        if self.eager_us is None or self.graph_us is None:
            return None
        return self.eager_us - self.graph_us


# the layers of the step ``Row.layer_us`` times (a model's, e.g. an 8B's 32)
STEP_LAYERS = 32


def _bounds(problem: BenchProblem, graph_context: int | None = None) -> GraphBounds:
    """The CUDA-graph reservation of a row: the step's own requests and tokens, and its
    longest context or ``graph_context`` tokens if longer (as an engine reserves its
    graphs for the model's longest context and replays them on shorter steps)."""
    w = problem.workload
    context = max(max(w.seq_lens), graph_context or 0)
    return GraphBounds(
        max_num_reqs=w.num_reqs,
        max_num_tokens=w.num_tokens,
        max_blocks_per_req=cdiv(context, problem.spec.block_size),
        max_query_len=max(w.query_lens),
    )


def time_eager(row: Row, fn: Callable[[], Any], device: torch.device, profile: int) -> None:
    """``row``'s eager figures: the median call, on a GPU the host's enqueue time, and
    with ``profile`` > 0 that many calls' kernels and Python functions, per call."""
    row.eager_us = time_us(fn, device)
    if device.type == "cuda":
        row.launch_us = launch_us(fn, device)
        row.steady_us = steady_us(fn, device)
    if profile > 0:
        with KernelProfile(device) as prof:
            for _ in range(profile):
                fn()
        row.kernels = prof.per_launch(profile)
        row.host_functions = host_functions(fn, profile)


def run_pagedkv(
    config: str,
    problem: BenchProblem,
    *,
    graph: bool = True,
    profile: int = 0,
    graph_context: int | None = None,
) -> tuple[Row, torch.Tensor | None]:
    """Time one backend config (selected as an engine would, so composite configs work);
    its CUDA graph reserved for contexts of up to ``graph_context`` tokens (``_bounds``)."""
    row = Row(problem.workload.name, config)
    spec, device = problem.spec, problem.query.device
    try:
        backend = select_backend(config, spec, device)
        row.config["backend"] = repr(backend)
        kv_cache = backend.allocate_kv_cache(problem.num_blocks, spec, device)
        fill_cache(backend, kv_cache, problem)
        impl = backend.make_impl(spec)
        metadata = backend.make_builder(spec, device).build(problem.common)
        # its own builder: a build may reuse the buffers of the builder's last metadata
        timed_builder = backend.make_builder(spec, device)
        row.build_us = launch_us(lambda: timed_builder.build(problem.common), device, calls=20)
        if callable(getattr(type(metadata), "describe", None)):
            row.config["plan"] = metadata.describe()  # e.g. the triton backend's launches
        else:
            for name in ("tile", "num_splits"):
                if hasattr(metadata, name):
                    row.config[name] = str(getattr(metadata, name))
        out = problem.query.new_empty(problem.query.shape[0], spec.num_heads, spec.head_size_v)

        def attend() -> None:
            impl.forward(problem.query, None, None, kv_cache, metadata, out)

        attend()
        synchronize(device)
        result = out.clone()
        time_eager(row, attend, device, profile)
        if device.type == "cuda":  # (a CPU's interpreted kernels would take minutes)
            # a model's layers over one cache (their host time only: every layer reads it)
            impls = [impl, *(backend.make_impl(spec) for _ in range(STEP_LAYERS - 1))]
            row.layer_us = layer_us(
                lambda: timed_builder.build(problem.common),
                [functools.partial(i.forward, problem.query, None, None, kv_cache, output=out)
                 for i in impls],
                device,
            )  # fmt: skip
        support = backend.capabilities.graph_support
        if graph and device.type == "cuda" and support.allows(max(problem.workload.query_lens)):
            builder = backend.make_builder(spec, device)
            builder.reserve_cuda_graph(_bounds(problem, graph_context))
            graph_md = builder.build(problem.common)
            graph_out = torch.empty_like(out)

            def replay() -> None:
                impl.forward(problem.query, None, None, kv_cache, graph_md, graph_out)

            row.graph_us = time_graph_us(replay)
            if row.graph_us is not None:
                row.graph_flushed_us = time_graph_flushed_us(replay)
                n = problem.common.num_actual_tokens
                row.graph_diff = float((graph_out[:n].float() - result[:n].float()).abs().max())
        # the write goes to a scratch copy: the timed cache keeps the problem's values
        scratch = kv_cache.clone()
        row.write_us = time_us(
            lambda: impl.write_kv(problem.new_key, problem.new_value, scratch, metadata), device
        )
        return row, result
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}"
        return row, None


def run_baseline(
    name: str,
    problem: BenchProblem,
    *,
    graph: bool = True,
    profile: int = 0,
    graph_context: int | None = None,
) -> tuple[Row, torch.Tensor | None]:
    """Time a raw library (``BASELINES``); its graph captures its own plan of the step
    (``graph_context`` does not apply: a raw library has no reservation)."""
    row = Row(problem.workload.name, f"raw:{name}")
    device = problem.query.device
    try:
        runner = BASELINES[name](problem)
        result = runner().clone()
        synchronize(device)
        time_eager(row, runner, device, profile)
        if graph and device.type == "cuda":
            row.graph_us = time_graph_us(runner)
            if row.graph_us is not None:
                row.graph_flushed_us = time_graph_flushed_us(runner)
        return row, result
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}"
        return row, None


def reference_output(problem: BenchProblem) -> torch.Tensor:
    """The torch backend's output (fp32 maths), the yardstick for every row; for an MLA
    layer (which the torch backend does not run) the float64 reference over the latent
    rows (K the whole row, V its prefix, one KV head for every query head)."""
    if problem.spec.is_mla:
        return _latent_reference(problem)
    from pagedkv.backends.torch import TorchBackend

    backend = TorchBackend()
    spec, device = problem.spec, problem.query.device
    kv_cache = backend.allocate_kv_cache(problem.num_blocks, spec, device)
    fill_cache(backend, kv_cache, problem)
    metadata = backend.make_builder(spec, device).build(problem.common)
    out = backend.make_impl(spec).forward(problem.query, None, None, kv_cache, metadata)
    return out[: problem.common.num_actual_tokens]


def _latent_reference(problem: BenchProblem) -> torch.Tensor:
    from pagedkv.reference import reference_attention

    s, common = problem.spec, problem.common
    keys = []
    for i, seq_len in enumerate(common.seq_lens_cpu.tolist()):
        blocks = common.block_table[i, : cdiv(seq_len, s.block_size)].long()
        keys.append(problem.key_blocks[blocks].flatten(0, 1)[:seq_len])
    values = [k[..., : s.head_size_v] for k in keys]
    query_lens = common.query_start_loc_cpu.diff().tolist()
    n = common.num_actual_tokens
    return reference_attention(problem.query[:n], keys, values, query_lens, s)


# -- raw libraries ---------------------------------------------------------------------------

# FlashInfer's recommended workspace, with room for split-KV partials
_WORKSPACE_BYTES = 256 << 20


def flashinfer(problem: BenchProblem) -> Callable[[], torch.Tensor]:
    """FlashInfer, called directly on the same bytes ((2, N, B, H, D): each half an NHD
    paged cache): BatchDecodeWithPagedKVCacheWrapper (tensor cores) when every request
    decodes one token, else BatchPrefillWithPagedKVCacheWrapper (causal) over all rows.
    Planned once; the returned call runs one step. An MLA layer: ``flashinfer_mla``."""
    if problem.spec.is_mla:
        return flashinfer_mla(problem)
    import flashinfer as fi
    from pagedkv.backends.flashinfer.metadata import paged_kv_csr

    s, device = problem.spec, problem.query.device
    cache = torch.empty(
        (2, problem.num_blocks, s.block_size, s.num_kv_heads, s.head_size),
        dtype=s.cache_dtype,
        device=device,
    )
    cache[0].copy_(quantize_for_cache(problem.key_blocks, s.cache_dtype, s.k_scale))
    cache[1].copy_(quantize_for_cache(problem.value_blocks, s.cache_dtype, s.v_scale))
    kv = (cache[0], cache[1])
    csr = paged_kv_csr(
        problem.common.block_table, problem.common.seq_lens_cpu.numpy(), s.block_size
    )
    indptr, indices, last = (t.to(device) for t in (csr.indptr, csr.indices, csr.last_page_len))
    workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    out = torch.empty_like(problem.query)
    scales = dict(k_scale=s.k_scale, v_scale=s.v_scale) if s.is_fp8_kv else {}
    common = dict(q_data_type=s.dtype, kv_data_type=s.cache_dtype, sm_scale=s.scale)
    if max(problem.workload.query_lens) == 1:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        wrapper.plan(
            indptr, indices, last, s.num_heads, s.num_kv_heads, s.head_size, s.block_size, **common
        )
    else:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(
            problem.common.query_start_loc, indptr, indices, last, s.num_heads, s.num_kv_heads,
            s.head_size, s.block_size, causal=True, **common,
        )  # fmt: skip

    def run() -> torch.Tensor:
        return wrapper.run(problem.query, kv, out=out, **scales)

    return run


def flashinfer_mla(problem: BenchProblem) -> Callable[[], torch.Tensor]:
    """FlashInfer's MLA (BatchMLAPagedAttentionWrapper) on the same latent rows: the
    absorbed query's q_nope and q_pe parts, the cache's kv_c and k_pe parts as views of
    one ``[N, B, L + R]`` cache (copies where a build wants them dense). Planned once."""
    import warnings

    import flashinfer.mla
    from pagedkv.backends.flashinfer.metadata import paged_kv_csr

    s, common, device = problem.spec, problem.common, problem.query.device
    lora = s.kv_lora_rank
    assert lora is not None and s.qk_rope_head_dim is not None
    cache = quantize_for_cache(problem.key_blocks[:, :, 0], s.cache_dtype, s.k_scale)
    csr = paged_kv_csr(common.block_table, common.seq_lens_cpu.numpy(), s.block_size)
    workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        wrapper.plan(
            qo_indptr=common.query_start_loc, kv_indptr=csr.indptr.to(device),
            kv_indices=csr.indices.to(device), kv_len_arr=common.seq_lens,
            num_heads=s.num_heads, head_dim_ckv=lora, head_dim_kpe=s.qk_rope_head_dim,
            page_size=s.block_size, causal=max(problem.workload.query_lens) > 1,
            sm_scale=s.scale, q_data_type=s.dtype, kv_data_type=s.cache_dtype,
        )  # fmt: skip
    q_nope, q_pe = problem.query[..., :lora], problem.query[..., lora:]
    out = problem.query.new_empty(problem.query.shape[0], s.num_heads, lora)
    parts = [cache[..., :lora], cache[..., lora:]]

    def run() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return wrapper.run(q_nope, q_pe, parts[0], parts[1], out=out)

    try:
        run()
    except Exception:  # a build that wants dense kv_c / k_pe caches: the same bytes, copied
        parts[:] = [t.contiguous() for t in parts]
    return run


BASELINES: dict[str, Callable[[BenchProblem], Callable[[], torch.Tensor]]] = {
    "flashinfer": flashinfer,
}
