"""One benchmark step on one device: random logical K/V (never zeros), shuffled blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.bench.workloads import Workload
from pagedkv.intmath import cdiv
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.kv_write import quantize_for_cache


@dataclass
class BenchProblem:
    workload: Workload
    spec: AttentionSpec
    num_blocks: int
    common: CommonAttentionMetadata
    key_blocks: torch.Tensor  # [num_blocks, block_size, Hkv, D] real values, spec.dtype
    value_blocks: torch.Tensor  # (MLA: the latent rows' first kv_lora_rank values, a view)
    query: torch.Tensor  # [T, Hq, D]
    new_key: torch.Tensor  # [T, Hkv, D]: the step's K/V (for the write timing)
    new_value: torch.Tensor | None  # (MLA: None, the latent row is the key)

    def kv_bytes(self) -> int:
        """Every request's K and V, read once."""
        return sum(self.workload.seq_lens) * self.spec.kv_bytes_per_token()

    def io_bytes(self) -> int:
        q = self.query
        return self.kv_bytes() + 2 * q.numel() * q.element_size()

    def flops(self) -> float:
        """QK^T and PV over the visible (causal) pairs: 2 * Hq * (D + Dv) per pair (MLA:
        the absorbed widths, L + R and L)."""
        s, w = self.spec, self.workload
        pairs = sum(
            q * (n - q) + q * (q + 1) // 2 for n, q in zip(w.seq_lens, w.query_lens, strict=True)
        )
        return 2.0 * s.num_heads * (s.head_size + s.head_size_v) * pairs


def build_problem(workload: Workload, device: str, seed: int = 0) -> BenchProblem:
    layer = workload.layer
    spec = layer.spec()
    gen = torch.Generator(device=device).manual_seed(seed)
    needed = [cdiv(s, layer.block_size) for s in workload.seq_lens]
    num_blocks = 1 + sum(needed)  # block 0 is the null block
    order = torch.randperm(num_blocks - 1, generator=gen, device=device).add_(1).tolist()
    block_ids, taken = [], 0
    for n in needed:
        block_ids.append(order[taken : taken + n])
        taken += n
    common = CommonAttentionMetadata.from_requests(
        workload.seq_lens, workload.query_lens, block_ids, layer.block_size, device
    )

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=spec.dtype)

    kv_shape = (num_blocks, layer.block_size, layer.num_kv_heads, layer.head_size)
    tokens = workload.num_tokens
    key_blocks = randn(*kv_shape)
    # an MLA layer's values are its latent rows' prefix: the same bytes
    value_blocks = key_blocks[..., : spec.head_size_v] if spec.is_mla else randn(*kv_shape)
    return BenchProblem(
        workload=workload,
        spec=spec,
        num_blocks=num_blocks,
        common=common,
        key_blocks=key_blocks,
        value_blocks=value_blocks,
        query=randn(tokens, layer.num_heads, layer.head_size),
        new_key=randn(tokens, layer.num_kv_heads, layer.head_size),
        new_value=None if spec.is_mla else randn(tokens, layer.num_kv_heads, layer.head_size),
    )


def fill_cache(backend: AttentionBackend, kv_cache: torch.Tensor, problem: BenchProblem) -> None:
    """The problem's logical K/V, written into ``backend``'s physical layout."""
    s = problem.spec
    k_view, v_view = backend.kv_cache_to_logical(kv_cache, s)
    k_view.copy_(quantize_for_cache(problem.key_blocks, kv_cache.dtype, s.k_scale))
    if not s.is_mla:  # an MLA cache's V view is the prefix of the rows just written
        v_view.copy_(quantize_for_cache(problem.value_blocks, kv_cache.dtype, s.v_scale))
