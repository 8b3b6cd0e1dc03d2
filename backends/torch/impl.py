"""The torch backend's attention: gather each request's blocks through the layout's
logical views, then masked softmax attention in fp32."""

from __future__ import annotations

import torch
from pagedkv.backend import AttentionImpl
from pagedkv.backends.torch.builder import TorchMetadata, TorchMetadataBuilder
from pagedkv.intmath import cdiv
from pagedkv.toolkit.kv_write import dequantize_from_cache

# TorchMetadataBuilder is re-exported: plugins made from the first contract's template
# import both parts from here
__all__ = ["TorchAttentionImpl", "TorchMetadataBuilder"]

# Scores of one query chunk stay under this many fp32 elements (~256 MiB).
_MAX_SCORE_ELEMENTS = 1 << 26


class TorchAttentionImpl(AttentionImpl[TorchMetadata]):
    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchMetadata,
        output: torch.Tensor,
    ) -> None:
        self._attend_requests(query, kv_cache, metadata, output, None)

    def attend_with_lse(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend`` without the sinks, also writing each row's log-sum-exp of its scaled
        scores (natural log) into ``lse`` [T, num_heads] float32 (what the split-KV
        combinator of pagedkv.toolkit.split_kv merges by; it adds the sinks once).
        Returns ``(output, lse)``."""
        lse[metadata.common.num_actual_tokens :] = float("-inf")
        self._attend_requests(query, kv_cache, metadata, output, lse)
        return output, lse

    def _attend_requests(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchMetadata,
        output: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> None:
        common = metadata.common
        output[common.num_actual_tokens :] = 0
        views = self.cache_views(kv_cache)
        k_cache, v_cache = views.k, views.v
        for i, seq_len in enumerate(metadata.seq_lens):
            q_start, q_end = metadata.query_starts[i], metadata.query_starts[i + 1]
            if q_end > q_start:
                k, v = self._gather(k_cache, v_cache, common.block_table[i], seq_len)
                rows = slice(q_start, q_end)
                # lse only when asked: subclasses may override _attend without it
                extra = {} if lse is None else {"lse": lse[rows]}
                self._attend(query[rows], k, v, seq_len, output[rows], **extra)

    def _gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, table_row: torch.Tensor, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This request's K and V as dense fp32 [seq_len, num_kv_heads, head_size(_v)],
        gathered through the logical views (so any layout works)."""
        ids = table_row[: cdiv(seq_len, self.spec.block_size)].long()
        k = k_cache.index_select(0, ids).flatten(0, 1)[:seq_len]
        v = v_cache.index_select(0, ids).flatten(0, 1)[:seq_len]
        return dequantize_from_cache(k, self.spec.k_scale), dequantize_from_cache(
            v, self.spec.v_scale
        )

    def _attend(
        self,
        query: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_len: int,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """One request's rows; with ``lse`` [q_len, num_heads] the sinks are left out and
        the log-sum-exp is written there."""
        s = self.spec
        q_len, hkv, group = query.shape[0], s.num_kv_heads, s.num_queries_per_kv
        device = query.device
        k_pos = torch.arange(seq_len, device=device)
        slopes = sinks = None
        if s.alibi_slopes is not None:
            slopes = torch.tensor(s.alibi_slopes, device=device).view(hkv, group, 1, 1)
        if self.sinks is not None and lse is None:
            sinks = self.sinks.to(device).view(hkv, group, 1, 1)
        chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, s.num_heads * seq_len))
        for c0 in range(0, q_len, chunk):
            c1 = min(q_len, c0 + chunk)
            q = query[c0:c1].float().view(c1 - c0, hkv, group, s.head_size)
            # [kv_head, group, query, key]
            scores = torch.einsum("qkgd,skd->kgqs", q, k) * s.scale
            if s.logits_soft_cap is not None:
                scores = torch.tanh(scores / s.logits_soft_cap) * s.logits_soft_cap
            q_pos = torch.arange(seq_len - q_len + c0, seq_len - q_len + c1, device=device)[:, None]
            visible = torch.ones(c1 - c0, seq_len, dtype=torch.bool, device=device)
            if s.causal:
                visible &= k_pos[None] <= q_pos
            if s.sliding_window is not None:
                visible &= (q_pos - k_pos[None]) < s.sliding_window
                if not s.causal:
                    visible &= (k_pos[None] - q_pos) < s.sliding_window
            if slopes is not None:
                scores += slopes * (k_pos[None] - q_pos).float()
            scores.masked_fill_(~visible, float("-inf"))
            row_max = scores.amax(dim=-1, keepdim=True)
            if sinks is not None:
                row_max = torch.maximum(row_max, sinks)
            row_max = row_max.clamp_min(torch.finfo(torch.float32).min)
            probs = torch.exp(scores - row_max)
            denom = probs.sum(dim=-1, keepdim=True)
            if sinks is not None:
                denom += torch.exp(sinks - row_max)
            result = torch.einsum("kgqs,skd->qkgd", probs, v) / denom.permute(2, 0, 1, 3).clamp_min(
                1e-30
            )
            out[c0:c1] = result.reshape(c1 - c0, s.num_heads, s.head_size_v).to(out.dtype)
            if lse is not None:
                lse[c0:c1] = (row_max + torch.log(denom)).reshape(s.num_heads, c1 - c0).t()
