"""Float64 dense attention: the one reference every backend is compared with.

Deliberately naive and independent of block tables and layouts: it sees each
request's keys and values as plain [seq_len, ...] tensors and spells every score
modifier out in the order the contract defines (scale, softcap, mask, ALiBi, sinks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagedkv.spec import AttentionSpec


def reference_attention(
    query: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    query_lens: Sequence[int],
    spec: AttentionSpec,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed queries over per-request dense K/V, in float64.

    query: [sum(query_lens), num_heads, head_size] (the scheduled tokens, no padding)
    keys[i]: [seq_len_i, num_kv_heads, head_size]; values[i]: [seq_len_i, num_kv_heads, head_size_v]
    Query row j of request i sits at position seq_len_i - query_len_i + j.
    Returns [sum(query_lens), num_heads, head_size_v] float64.
    """
    outputs = []
    start = 0
    for k, v, q_len in zip(keys, values, query_lens, strict=True):
        q = query[start : start + q_len].double()
        start += q_len
        if q_len:  # a request with no query rows contributes no output
            outputs.append(_one_request(q, k.double(), v.double(), spec, sinks))
    if not outputs:
        return query.new_zeros((0, spec.num_heads, spec.head_size_v), dtype=torch.float64)
    return torch.cat(outputs)


def _one_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    q_len, seq_len, kv_heads = q.shape[0], k.shape[0], k.shape[1]
    group = spec.num_heads // kv_heads
    # query head h reads KV head h // group (grouped, not repeated: an MLA layer's one
    # latent head would otherwise be copied for each of its 128 query heads)
    grouped = q.reshape(q_len, kv_heads, group, q.shape[-1])
    scores = torch.einsum("qngd,knd->ngqk", grouped, k).reshape(spec.num_heads, q_len, seq_len)
    scores = scores * spec.scale
    if spec.logits_soft_cap is not None:
        scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
    # (on the inputs' device: the reference runs where they are, e.g. a GPU's float64)
    device = q.device
    q_pos = torch.arange(seq_len - q_len, seq_len, dtype=torch.float64, device=device)[:, None]
    k_pos = torch.arange(seq_len, dtype=torch.float64, device=device)[None, :]
    visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
    if spec.causal:
        visible &= k_pos <= q_pos
    if spec.sliding_window is not None:
        visible &= (q_pos - k_pos) < spec.sliding_window
        if not spec.causal:
            visible &= (k_pos - q_pos) < spec.sliding_window
    if spec.alibi_slopes is not None:
        slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float64, device=device)[:, None, None]
        scores = scores + slopes * (k_pos - q_pos)[None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.double().cpu().to(scores.device)[:, None, None].expand(-1, q_len, 1)
        scores = torch.cat([scores, sink], dim=-1)
    row_max = scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).min)
    weights = torch.exp(scores - row_max)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    weights = weights[..., :seq_len]  # the sink takes probability mass but has no value
    weights = weights.reshape(kv_heads, group, q_len, seq_len)
    return torch.einsum("ngqk,knd->qngd", weights, v).reshape(q_len, spec.num_heads, v.shape[-1])


def reference_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: Sequence[torch.Tensor],
    k_pe: Sequence[torch.Tensor],
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    query_lens: Sequence[int],
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Multi-head latent attention the un-absorbed way, in float64.

    Keys and values are up-projected per head from the latent, then ordinary
    multi-head attention runs with q = [q_nope, q_pe], k = [kv_c W_UK, k_pe].
    q_nope: [T, H, nope_dim]; q_pe: [T, H, rope_dim]
    kv_c[i]: [seq_len_i, kv_lora_rank]; k_pe[i]: [seq_len_i, rope_dim]
    w_uk: [kv_lora_rank, H, nope_dim]; w_uv: [kv_lora_rank, H, v_head_dim]
    Returns [T, H, v_head_dim] float64.
    """
    num_heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
    rope_dim = q_pe.shape[2]
    spec = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_size=nope_dim + rope_dim,
        head_size_v=w_uv.shape[2],
        dtype=torch.float32,
        block_size=1,
        scale=scale,
        causal=causal,
    )
    keys, values = [], []
    for c, pe in zip(kv_c, k_pe, strict=True):
        k_nope = torch.einsum("sl,lhd->shd", c.double(), w_uk.double())
        pe = pe.double()[:, None, :].expand(-1, num_heads, rope_dim)
        keys.append(torch.cat([k_nope, pe], dim=-1))
        values.append(torch.einsum("sl,lhd->shd", c.double(), w_uv.double()))
    query = torch.cat([q_nope.double(), q_pe.double()], dim=-1)
    return reference_attention(query, keys, values, query_lens, spec)
