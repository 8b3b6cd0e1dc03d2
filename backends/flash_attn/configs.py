"""FlashAttention's tuning numbers: when a long decode splits its keys, and into how many.

The split itself is FA4's (``num_splits``, SM100) or pagedkv's combinator (SM90, where
FA4 refuses to split); either way one rule decides, pagedkv.toolkit.split_kv's
``SplitPolicy``, with the numbers below.
"""

from __future__ import annotations

import numpy as np
from pagedkv.intmath import cdiv
from pagedkv.toolkit.split_kv import SplitChoice, SplitPolicy

# Packed query rows per FA4 program (its m-block on SM90 and SM100): a decode's query
# heads of one KV head share one program.
FA4_TILE_M = 128

# An FA4 forward program is one large CTA per SM (three warpgroups, most of shared
# memory). Decode steps sliced by pagedkv's combinator (SM90) take the toolkit's makespan
# rule (``slice_choice``); FA4's and FA3's own splits (SM100, FA3) split a grid below one
# program per SM to two programs per SM. Slices keep at least 512 keys (four of FA4's
# 128-key tiles).
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


# An FA4 program's fixed cost in keys streamed (launch, query load, the epilogue with its
# LSE, its share of the merge): the H200's 1 x 32k decode took 49.9 / 52.9 / 65.1 us
# (graph) as 16 / 33 / 64 slices, i.e. one SM streaming 2048 + c, 2 x (1008 + c) and
# 4 x (512 + c) keys: c ~ 224 (docs/flash_attn.md).
PROGRAM_OVERHEAD_KEYS = 224


def slice_choice(
    seq_lens: np.ndarray, queries_per_kv: int, num_kv_heads: int, block_size: int, num_sms: int
) -> SplitChoice:
    """The combinator's slices of a decode step (one query per request) by the toolkit's
    makespan rule: a slice is a fixed key range of every request (a long request gets
    many, a short one stays whole; ``plan_decode_slices``), FA4 runs one program per
    slice and KV head (its GQA-packed rows in one m-block) and an SM holds one."""
    return SPLIT_POLICY.choose_by_makespan(
        np.asarray(seq_lens, dtype=np.float64),
        num_sms,
        granule=block_size,
        overhead_keys=PROGRAM_OVERHEAD_KEYS,
        copies=num_kv_heads * cdiv(queries_per_kv, FA4_TILE_M),
        key_ranges=True,
        listed=True,  # only slices that hold keys become requests
    )
