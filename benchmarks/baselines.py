"""Raw library calls for the workloads of attention.py, run in the same process.

Each baseline takes a ``Problem`` and returns a zero-argument callable that runs
one attention step (planning is done once, before timing) and returns the output.
The K/V live in the (2, num_blocks, block_size, Hkv, D) layout, the same bytes the
Triton backend reads; FlashInfer sees each half as an NHD paged cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attention import Problem

# FlashInfer's recommended workspace, with room for split-KV partials
_WORKSPACE_BYTES = 256 << 20


def _paged_kv_cache(problem: Problem) -> torch.Tensor:
    s = problem.spec
    cache = torch.empty(
        (2, problem.num_blocks, s.block_size, s.num_kv_heads, s.head_size),
        dtype=s.cache_dtype,
        device=problem.query.device,
    )
    cache[0].copy_(problem.key_blocks.to(s.cache_dtype))
    cache[1].copy_(problem.value_blocks.to(s.cache_dtype))
    return cache


def _page_arrays(problem: Problem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's indptr [B+1], indices [pages] and last_page_len [B], int32, on the
    device (the conversion the flashinfer backend uses; it imports no FlashInfer)."""
    from pagedkv.backends.flashinfer.metadata import paged_kv_csr

    device = problem.query.device
    csr = paged_kv_csr(problem.common.block_table, problem.seq_lens, problem.spec.block_size)
    return csr.indptr.to(device), csr.indices.to(device), csr.last_page_len.to(device)


def flashinfer(problem: Problem) -> Callable[[], torch.Tensor]:
    """BatchDecodeWithPagedKVCacheWrapper (tensor cores) for decode,
    BatchPrefillWithPagedKVCacheWrapper (causal) for prefill."""
    import flashinfer as fi

    s, device = problem.spec, problem.query.device
    cache = _paged_kv_cache(problem)
    kv = (cache[0], cache[1])
    indptr, indices, last = _page_arrays(problem)
    workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    out = torch.empty_like(problem.query)
    scales = {}
    if s.is_fp8_kv:
        scales = dict(k_scale=s.k_scale, v_scale=s.v_scale)
    if problem.workload.kind == "decode":
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        wrapper.plan(
            indptr,
            indices,
            last,
            s.num_heads,
            s.num_kv_heads,
            s.head_size,
            s.block_size,
            q_data_type=s.dtype,
            kv_data_type=s.cache_dtype,
            sm_scale=s.scale,
        )
    else:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(
            problem.common.query_start_loc,
            indptr,
            indices,
            last,
            s.num_heads,
            s.num_kv_heads,
            s.head_size,
            s.block_size,
            causal=True,
            sm_scale=s.scale,
            q_data_type=s.dtype,
            kv_data_type=s.cache_dtype,
        )

    def run() -> torch.Tensor:
        return wrapper.run(problem.query, kv, out=out, **scales)

    return run


BASELINES: dict[str, Callable[[Problem], Callable[[], torch.Tensor]]] = {
    "flashinfer": flashinfer,
}
