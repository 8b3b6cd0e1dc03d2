"""FlashAttention's metadata builder and attention: one varlen paged call per layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pagedkv.backend import AttentionImpl, AttentionMetadataBuilder
from pagedkv.backends.flash_attn.adapters import Adapter, PagedCall
from pagedkv.errors import MetadataError, UnsupportedError
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.kv_write import write_kv_by_slot


@dataclass(frozen=True)
class FlashAttnMetadata:
    common: CommonAttentionMetadata
    cu_seqlens_k: torch.Tensor  # [B+1] int32, device: cumulative seq_lens (FA2's varlen K)
    block_table: torch.Tensor  # [B, max_blocks] int32, device, contiguous rows


class FlashAttnMetadataBuilder(AttentionMetadataBuilder[FlashAttnMetadata]):
    """Adds what the FlashAttention calls need beyond the common metadata; mixed
    decode and prefill rows go into one varlen call, in the caller's order."""

    def build(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        if common.block_size != self.spec.block_size:
            raise MetadataError(
                f"block_size: metadata uses {common.block_size}, the layer's spec "
                f"{self.spec.block_size}"
            )
        cu = torch.zeros(common.num_reqs + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(common.seq_lens_cpu, 0)
        return FlashAttnMetadata(
            common=common,
            cu_seqlens_k=cu.to(common.device, non_blocking=True),
            block_table=common.block_table.contiguous(),
        )


class FlashAttnImpl(AttentionImpl[FlashAttnMetadata]):
    """Writes new K/V by slot mapping, then runs the chosen adapter's paged call."""

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        sinks: torch.Tensor | None = None,
        adapter: Adapter,
        **options: Any,
    ) -> None:
        super().__init__(spec, sinks=sinks, **options)
        self.adapter = adapter
        self._kernel: Callable[..., Any] | None = None  # imported on the first forward
        self._alibi = (
            None
            if spec.alibi_slopes is None
            else torch.tensor(spec.alibi_slopes, dtype=torch.float32)
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
    ) -> None:
        if value is None:
            raise UnsupportedError("value: expected a tensor, got None")
        # the pool is zero-filled and this writer stores only what it is given (fp8
        # saturates), so rows past a sequence's end stay finite, as FA4's TMA page
        # loads require
        slots = metadata.common.slot_mapping
        write_kv_by_slot(
            key, value, kv_cache[0], kv_cache[1], slots, self.spec.k_scale, self.spec.v_scale
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        common = metadata.common
        self.check_forward_args(query, key, value, common.num_tokens, output)
        self._check_cache(kv_cache)
        if key is not None:
            self.write_kv(key, value, kv_cache, metadata)
        out = self.new_output(query, output)
        n = common.num_actual_tokens
        if n == 0:
            return out
        if self._kernel is None:
            self._kernel = self.adapter.load()
        call = PagedCall(
            query=query[:n],
            key_cache=kv_cache[0],
            value_cache=kv_cache[1],
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            cu_seqlens_k=metadata.cu_seqlens_k,
            block_table=metadata.block_table,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            spec=self.spec,
            sinks=None if self.sinks is None else self._sinks_on(query.device),
            alibi_slopes=None if self._alibi is None else self._alibi_on(query.device),
        )
        out[:n] = self.adapter.run(self._kernel, call)
        return out

    # per-head vectors move to the query's device once, not on every layer call

    def _sinks_on(self, device: torch.device) -> torch.Tensor:
        assert self.sinks is not None
        if self.sinks.device != device:
            self.sinks = self.sinks.to(device)
        return self.sinks

    def _alibi_on(self, device: torch.device) -> torch.Tensor:
        assert self._alibi is not None
        if self._alibi.device != device:
            self._alibi = self._alibi.to(device)
        return self._alibi

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        s = self.spec
        per_block = (s.block_size, s.num_kv_heads, s.head_size)
        if (
            not isinstance(kv_cache, torch.Tensor)
            or kv_cache.dim() != 5
            or kv_cache.shape[0] != 2
            or tuple(kv_cache.shape[2:]) != per_block
        ):
            got = list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache)
            raise UnsupportedError(
                f"kv_cache: expected shape [2, num_blocks, {', '.join(map(str, per_block))}], got {got}"
            )
        if kv_cache.dtype != s.cache_dtype:
            raise UnsupportedError(
                f"kv_cache: expected dtype {s.cache_dtype}, got {kv_cache.dtype}"
            )
