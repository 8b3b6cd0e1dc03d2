"""The float64 reference against a second, deliberately scalar spelling of the contract's
attention: one query head and one query row at a time, each key's logit through every
modifier in the contract's order. The reference groups query heads over their KV head
(GQA, MQA, MLA's one latent head) without copying the KV rows; this checks that grouping
and the masks against loops that share nothing with it."""

from __future__ import annotations

import math

import pytest
import torch
from pagedkv.reference import reference_attention
from pagedkv.spec import AttentionSpec, alibi_slopes


def _scalar_attention(q, keys, values, query_lens, spec, sinks):
    """Each (request, query row, head) on its own, in Python floats."""
    out = torch.zeros(q.shape[0], spec.num_heads, values[0].shape[-1], dtype=torch.float64)
    group = spec.num_heads // keys[0].shape[1]
    row = 0
    for k, v, q_len in zip(keys, values, query_lens, strict=True):
        seq_len = k.shape[0]
        for j in range(q_len):
            pos = seq_len - q_len + j
            for h in range(spec.num_heads):
                logits, kept = [], []
                for key in range(seq_len):
                    visible = key <= pos or not spec.causal
                    if spec.sliding_window is not None:
                        visible &= abs(pos - key) < spec.sliding_window
                    if not visible:
                        continue
                    s = float(q[row + j, h].double() @ k[key, h // group].double()) * spec.scale
                    if spec.logits_soft_cap is not None:
                        s = spec.logits_soft_cap * math.tanh(s / spec.logits_soft_cap)
                    if spec.alibi_slopes is not None:
                        s += spec.alibi_slopes[h] * (key - pos)
                    logits.append(s)
                    kept.append(key)
                sink = [float(sinks[h])] if sinks is not None else []
                top = max(logits + sink, default=0.0)
                weights = [math.exp(s - top) for s in logits]
                total = sum(weights) + sum(math.exp(s - top) for s in sink)
                for w, key in zip(weights, kept, strict=True):
                    out[row + j, h] += (w / total) * v[key, h // group].double()
        row += q_len
    return out


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, options",
    [
        (4, 4, {}),
        (4, 2, {"sliding_window": 5}),
        (6, 2, {"logits_soft_cap": 3.0, "causal": False}),
        (4, 1, {"alibi": True, "sinks": True}),  # MQA (and MLA's one latent head)
        (8, 2, {"sliding_window": 4, "causal": False, "sinks": True}),
    ],
    ids=["mha", "gqa-window", "gqa3-softcap-bidirectional", "mqa-alibi-sinks", "gqa4-window-sinks"],
)
def test_reference_matches_scalar_attention(num_heads, num_kv_heads, options):
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    options = dict(options)
    use_alibi, use_sinks = options.pop("alibi", False), options.pop("sinks", False)
    spec = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=8,
        head_size_v=6,
        dtype=torch.float32,
        block_size=16,
        alibi_slopes=alibi_slopes(num_heads) if use_alibi else None,
        use_sinks=use_sinks,
        **options,
    )
    seq_lens, query_lens = [9, 1, 13], [3, 1, 0]
    q = torch.randn(sum(query_lens), num_heads, 8, generator=gen)
    keys = [torch.randn(s, num_kv_heads, 8, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, 6, generator=gen) for s in seq_lens]
    sinks = torch.randn(num_heads, generator=gen) if use_sinks else None
    got = reference_attention(q, keys, values, query_lens, spec, sinks)
    want = _scalar_attention(q, keys, values, query_lens, spec, sinks)
    assert got.shape == (sum(query_lens), num_heads, 6) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
