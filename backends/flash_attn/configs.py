"""FlashAttention's tuning numbers: when a long decode splits its keys, and into how many.

The split itself is FA4's (``num_splits``, SM100) or pagedkv's combinator (SM90, where
FA4 refuses to split); either way one rule decides, pagedkv.toolkit.split_kv's
``SplitPolicy``, with the numbers below.
"""

from __future__ import annotations

from pagedkv.intmath import cdiv
from pagedkv.toolkit.split_kv import SplitPolicy

# Packed query rows per FA4 program (its m-block on SM90 and SM100): a decode's query
# heads of one KV head share one program.
FA4_TILE_M = 128

# An FA4 forward program is one large CTA per SM (three warpgroups, most of shared
# memory): a grid below one program per SM splits, to two programs per SM (two even
# waves), each slice at least 512 keys (four of FA4's 128-key tiles).
SPLIT_POLICY = SplitPolicy(
    max_query_len=8,
    split_below_programs_per_sm=1.0,
    target_programs_per_sm=2.0,
    min_keys_per_split=512,
    max_splits=64,
)


def fa4_programs(query_lens: list[int], queries_per_kv: int, num_kv_heads: int) -> int:
    """FA4's grid for requests of these query lengths: one program per KV head and
    m-block of packed query rows (GQA packing is FA4's default)."""
    return num_kv_heads * sum(cdiv(n * queries_per_kv, FA4_TILE_M) for n in query_lens if n)
