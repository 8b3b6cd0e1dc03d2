"""Tuning of the Pallas kernel: tile heights, key steps, launch parameters and the
split-KV policy, with the rules that choose from them.

Imports no JAX, so the backend and the builder decide on the host before the kernel
module is loaded. Measured on an H200 (bf16, Hq 32 or 64 over Hkv 8, head 128, block
16; kernel times from the CUDA profiler, docs/pallas.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from pagedkv.errors import ConfigError
from pagedkv.intmath import next_power_of_2, prev_power_of_2
from pagedkv.toolkit import split_kv
from pagedkv.toolkit.split_kv import (
    SplitChoice,
    SplitPolicy,
    merge_keys_per_split,
    splits_within,
)

if TYPE_CHECKING:
    from pagedkv.graph import GraphBounds

# Rows of one tile = query tokens x the query heads of one KV head (GQA packed into
# the rows, the group padded to a power of two). Decode-like batches, whose longest
# query fills at most DECODE_BLOCK_M rows, take short tiles (memory-bound: each tile
# streams its request's keys once for the whole group); batches with prefill take
# tall tiles (more rows per key loaded).
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64

# Triton launch parameters of the GPU lowering (warps: ``num_warps``).
NUM_WARPS = 4
NUM_STAGES = 2
# The largest fp32 accumulator (tile rows x padded head) 4 warps hold: 64 registers a
# thread. A 64 x 256 tile at 4 warps spilled inside the key loop (sm_90 compile,
# tests/test_pallas_direct.py); at 8 it does not.
ACCUMULATOR_ELEMENTS_PER_4_WARPS = 64 * 128


def num_warps(block_m: int, head_size: int) -> int:
    """Warps of a program whose tile has ``block_m`` rows: twice as many past the
    accumulator 4 warps hold."""
    if block_m * head_pad(head_size) <= ACCUMULATOR_ELEMENTS_PER_4_WARPS:
        return NUM_WARPS
    return 2 * NUM_WARPS


# Flash-decoding. H200 kernel times for 1 x 32k decode (8 programs unsplit): 64 splits
# 36 us, 32 splits 42 us, 16 splits 64 us; for 4 x 32k (32 programs): 16 splits 127 us,
# 32 splits 128 us, 8 splits 152 us; 256 x 1024 (2048 programs): unsplit 250 us, 2
# splits 261 us. Steps split by the toolkit's makespan rule (``choose_splits``: a ragged
# batch's longest request is its critical path, which the count of programs alone does
# not see); each split keeps at least 512 keys, at most 64 splits.
SPLIT_POLICY = SplitPolicy(
    max_query_len=None,
    split_below_programs_per_sm=2.0,
    target_programs_per_sm=4.0,
    min_keys_per_split=512,
    max_splits=64,
)
# Programs of the decode tile one SM holds at once (an estimate: a 4-warp program of
# 16 rows x 64 keys at head 128 takes ~128 registers a thread, 65536 / (128 x 128) = 4;
# its two stages of K/V tiles, 2 x 2 x 64 x 128 x 2 bytes, leave shared memory to spare)
PROGRAMS_PER_SM = 4
# A program's fixed cost (query load, first page-table reads, epilogue) in keys
# streamed: about one 64-key step, as the triton backend's kernel of the same tiles
PROGRAM_OVERHEAD_KEYS = 64


def padded_group(num_queries_per_kv: int) -> int:
    """Rows one query token takes in a tile: its GQA group, rounded up to a power of two."""
    return next_power_of_2(num_queries_per_kv)


def head_pad(head_size: int) -> int:
    """head_size rounded up to a power of two, at least 16 (the dot's minimum)."""
    return max(16, next_power_of_2(head_size))


def default_block_n(head_size: int, cache_bytes: int = 2) -> int:
    """Keys per step: K and V tiles of [block_n, head_pad] stay within a few tens of KiB;
    a 1-byte cache takes twice the keys of a 2-byte one (the same tile bytes; H200, fp8
    decode 64 x 4096: 64 keys 447.5 us, 128 keys 339.4, twentieth session)."""
    keys = 64 if head_size <= 128 else 32
    return 2 * keys if cache_bytes == 1 else keys


def block_q(max_query_len: int, group_pad: int, block_m: int = 0) -> int:
    """Query tokens per tile for a batch whose longest query has ``max_query_len``
    tokens; ``block_m`` (the option, 0 = auto) forces the tile height."""
    if not block_m:
        decode_like = max_query_len * group_pad <= DECODE_BLOCK_M
        block_m = DECODE_BLOCK_M if decode_like else PREFILL_BLOCK_M
    return max(1, block_m // group_pad)


def check_num_splits(value: int, where: str) -> int:
    """``value`` if it is a valid forced split count (0 = chosen per step), else
    ConfigError naming ``where``."""
    if not 0 <= value <= SPLIT_POLICY.max_splits:
        raise ConfigError(
            f"{where}={value}: expected 0 (chosen per step) to {SPLIT_POLICY.max_splits}"
        )
    return value


def tile_keys(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    tile_req: np.ndarray,
    tile_qstart: np.ndarray,
    block_q: int,
    *,
    causal: bool,
    window: int | None,
    block_n: int,
) -> np.ndarray:
    """Keys each live query tile visits (one KV head): the toolkit's ``tile_keys`` over
    the tiles' query rows (``block_q`` queries from ``tile_qstart``, at most the
    request's), the kernel's key steps ``block_n`` keys."""
    live = tile_req >= 0
    req = tile_req[live]
    q_len = query_lens[req]
    first = tile_qstart[live]
    return split_kv.tile_keys(
        seq_lens[req], q_len, first, np.minimum(first + block_q, q_len),
        causal=causal, window=window, key_step=block_n,
    )  # fmt: skip


def choose_splits(
    tile_keys: np.ndarray,
    max_query_len: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    cache_bytes: int,
    num_tokens: int,
    block_n: int,
    num_sms: int,
    forced: int = 0,
) -> SplitChoice:
    """A step's KV splits: forced, else the toolkit's makespan rule over the tiles' keys
    (``tile_keys``: the keys each query tile visits, for one KV head), for every step:
    a mixed step's long decodes are its critical path as a ragged batch's are (H200,
    mixed 16 + 1 chunk unsplit: 1128 us against the triton backend's 128), and a
    prefill's many tiles keep it unsplit (the partials' merge counts in the rule).

    The kernel cuts each tile's keys into as many ranges as ranges of
    ``keys_per_split`` keys take, shared evenly, so a short tile takes fewer programs
    (and writes fewer partials) than the longest one's ``num_splits``: even shares of
    the longest tile (the rule's default) and the rule's fixed key ranges both run so.
    The merge's cost is counted per range that a tile's cut adds
    (``merge_split_only``). A launch of fewer split slots widens the ranges
    (``split_steps``)."""
    longest = int(np.max(tile_keys, initial=0))
    if forced or longest <= 0:
        return SPLIT_POLICY.choose(
            len(tile_keys) * num_kv_heads, max_query_len, longest, num_sms,
            forced=forced, granule=block_n,
        )  # fmt: skip
    slots = PROGRAMS_PER_SM * num_sms
    # each split's partials: fp32 rows of the padded head and a log-sum-exp per head
    partial_bytes = num_tokens * num_heads * (head_pad(head_size) + 1) * 4
    return SPLIT_POLICY.choose_by_makespan(
        np.asarray(tile_keys, dtype=np.float64),
        slots,
        granule=block_n,
        overhead_keys=PROGRAM_OVERHEAD_KEYS,
        merge_keys_per_split=merge_keys_per_split(partial_bytes, slots, head_size, cache_bytes),
        copies=num_kv_heads,
        key_ranges=True,
        merge_split_only=True,
    )


def split_steps(
    choice: SplitChoice, longest_keys: int, block_n: int, slots: int
) -> tuple[int, int]:
    """(the most key steps of a range, ranges of the longest tile) that run ``choice`` in a
    launch of ``slots`` split slots: its ranges, widened where the longest tile would
    need more ranges than the slots (a CUDA graph's launch): the slots are then all
    used, as the rule chosen within them would not (its key ranges are powers of two:
    H200, twenty-first session, D 64 mixed in a graph of 8 slots took 5 ranges of 4096
    keys, 198.5 us, where 8 even shares took 175.2)."""
    steps = -(-max(longest_keys, 1) // block_n)
    per_split = max(1, choice.keys_per_split // block_n, -(-steps // slots))
    return per_split, -(-steps // per_split)


def split_slots(num_splits: int) -> int:
    """The launch's programs per tile along the keys for ``num_splits`` splits: the
    next power of two, so that serving sees a handful of compiled variants, not one per
    split count (programs past the step's split count attend an empty key range)."""
    return next_power_of_2(num_splits)


# A CUDA graph's launch keeps the split slots of its capture: every step within the
# bounds runs that many programs per tile along the keys (a step's split count, at most
# the slots, is an input), and those past the step's count only mark their rows empty.
# Each slot holds an fp32 partial row per token of the bounds; the slots stay within
# this many bytes of partials (the triton backend's graph budget) ...
GRAPH_PARTIAL_BYTES = 64 << 20
# ... and within this many waves of programs (PROGRAMS_PER_SM on every SM): an idle
# program still starts, reads its tile and stores its rows' log-sum-exp. H200, twentieth
# session (docs/pallas.md): a 64 x 4096 decode graph with 32 slots (one used) took 300.6
# us against 252.4 eagerly while idle programs loaded their query tile; once they did
# not, 8 waves (8 slots) 256.8 and 16 waves (16 slots) 257.4, while speculative 64x4
# went 374.8 -> 323.8 (4 -> 8 slots; 12 splits eagerly, 315.4) and GQA 8 ragged 312.5
# -> 275.0 (eagerly 285.5). The triton backend's graph plans hold 16 waves too.
GRAPH_PROGRAM_WAVES = 16


def graph_split_slots(
    bounds: GraphBounds,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    num_tiles: int,
    num_sms: int,
) -> int:
    """Split slots of a graph launch of ``num_tiles`` query tiles for steps within
    ``bounds``: the most the policy, the partial budget and the program waves allow,
    rounded down to a power of two."""
    per_slot = bounds.max_num_tokens * num_heads * (head_pad(head_size) + 1) * 4
    waves = GRAPH_PROGRAM_WAVES * PROGRAMS_PER_SM * num_sms // (num_tiles * num_kv_heads)
    most = min(SPLIT_POLICY.max_splits, splits_within(GRAPH_PARTIAL_BYTES, per_slot), waves)
    return prev_power_of_2(most)
