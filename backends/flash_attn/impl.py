"""FlashAttention's attention: the chosen adapter's paged call, once per layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pagedkv.backend import AttentionImpl
from pagedkv.backends.flash_attn.adapters import PagedCall, require_adapter
from pagedkv.backends.flash_attn.builder import FlashAttnMetadata
from pagedkv.errors import UnsupportedError
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.split_kv import attend_sliced


class FlashAttnImpl(AttentionImpl[FlashAttnMetadata]):
    """Runs the adapter's paged call (the shared forward has written the new K/V: the
    pool is zero-filled and the shared writer stores only what it is given, fp8
    saturated, so rows past a sequence's end stay finite, as FA4's TMA page loads
    require). A step with sliced long decodes runs the call once over the slices and
    merges them (pagedkv.toolkit.split_kv)."""

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        sinks: torch.Tensor | None = None,
        impl: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(spec, sinks=sinks, **options)
        self.adapter = require_adapter(impl)
        self._kernel: Callable[..., Any] | None = None  # imported on the first call
        self._alibi = (
            None
            if spec.alibi_slopes is None
            else torch.tensor(spec.alibi_slopes, dtype=torch.float32)
        )

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
        output: torch.Tensor,
    ) -> None:
        sinks = None if self.sinks is None else self._sinks_on(query.device)
        if metadata.sliced is not None:
            sliced = metadata.sliced
            attend_sliced(self, sliced.slices, sliced.metadata, query, kv_cache, output, sinks)
            return
        if metadata.rows:
            out, _ = self._call(query, kv_cache, metadata, sinks, return_lse=False)
            output[: metadata.rows] = out

    def attend_with_lse(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend`` without the sinks, with each row's log-sum-exp (natural log),
        [T, num_heads] float32 (FA4's ``return_lse``). Returns FA4's own tensors when
        they cover every row (the sliced steps: no copy), else ``(output, lse)``."""
        if not self.adapter.returns_lse:
            raise UnsupportedError(
                f"flash_attn ({self.adapter.name}) does not return the log-sum-exp"
            )
        rows = metadata.rows
        if not rows:
            return output, lse
        out, row_lse = self._call(query, kv_cache, metadata, None, return_lse=True)
        assert row_lse is not None
        row_lse = row_lse.t()  # FA4's varlen LSE is [num_heads, rows]
        if rows == output.shape[0]:
            return out, row_lse
        output[:rows] = out
        lse[:rows] = row_lse
        return output, lse

    def _call(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
        sinks: torch.Tensor | None,
        *,
        return_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._kernel is None:
            self._kernel = self.adapter.load()
        common = metadata.common
        views = self.cache_views(kv_cache)
        key_cache, value_cache = views.k, views.v
        call = PagedCall(
            query=query[: metadata.rows],
            key_cache=key_cache,
            value_cache=value_cache,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            cu_seqlens_k=metadata.cu_seqlens_k,
            block_table=common.block_table,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            spec=self.spec,
            sinks=sinks,
            alibi_slopes=None if self._alibi is None else self._alibi_on(query.device),
            num_splits=metadata.num_splits,
            return_lse=return_lse,
        )
        return self.adapter.run(self._kernel, call)

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
