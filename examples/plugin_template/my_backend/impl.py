"""The per-layer implementation: the KV write and the attention.

The base class's ``forward`` checks the arguments and the cache, calls ``write_kv``
for the new rows, allocates the output and calls ``attend``. Both methods here are
plain torch; a real plugin puts its kernels in their place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagedkv import AttentionImpl
from pagedkv.toolkit.kv_write import quantize_for_cache

from my_backend.builder import MyMetadata


class MyAttentionImpl(AttentionImpl[MyMetadata]):
    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor | None,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # MY_LAYOUT
        metadata: MyMetadata,
    ) -> None:
        """Token t goes to slot s = slot_mapping[t]: block s // block_size, row
        s % block_size; negative slots are padding. (Omit this method and the base
        class writes through the layout's views with pagedkv's own writer.)"""
        assert value is not None
        slots = metadata.slot_mapping
        rows = (slots >= 0).nonzero().squeeze(1)
        blocks, offsets = slots[rows] // self.spec.block_size, slots[rows] % self.spec.block_size
        k_view, v_view = self.layout().logical(kv_cache, self.spec)  # [N, B, H, D] each
        k_view[blocks, offsets] = quantize_for_cache(key[rows], k_view.dtype, self.spec.k_scale)
        v_view[blocks, offsets] = quantize_for_cache(value[rows], v_view.dtype, self.spec.v_scale)

    def attend(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        kv_cache: torch.Tensor,
        metadata: MyMetadata,
        output: torch.Tensor,  # [T, num_heads, head_size]
    ) -> None:
        s = self.spec
        k_view, v_view = self.layout().logical(kv_cache, s)
        for i, seq_len in enumerate(metadata.seq_lens):
            q0, q1 = metadata.query_starts[i], metadata.query_starts[i + 1]
            if q1 == q0:
                continue
            ids = metadata.block_ids[i]
            # this request's K/V, [num_kv_heads, seq_len, head_size], in fp32
            k = k_view[ids].flatten(0, 1)[:seq_len].transpose(0, 1).float()
            v = v_view[ids].flatten(0, 1)[:seq_len].transpose(0, 1).float()
            q = query[q0:q1].transpose(0, 1).float()  # [num_heads, q_len, head_size]
            # query j of this request sits at position seq_len - q_len + j
            q_pos = torch.arange(seq_len - (q1 - q0), seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            visible = torch.ones(q1 - q0, seq_len, dtype=torch.bool, device=q.device)
            if s.causal:
                visible &= k_pos <= q_pos
            if s.sliding_window is not None:
                visible &= (q_pos - k_pos).abs() < s.sliding_window
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=visible, scale=s.scale, enable_gqa=True
            )
            output[q0:q1] = out.transpose(0, 1).to(output.dtype)
