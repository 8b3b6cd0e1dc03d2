"""Tuning of the Pallas kernel: tile heights, key steps, launch parameters and the
split-KV policy, with the rules that choose from them.

Imports no JAX, so the backend and the builder decide on the host before the kernel
module is loaded. Measured on an H200 (bf16, Hq 32 or 64 over Hkv 8, head 128, block
16; kernel times from the CUDA profiler, docs/pallas.md).
"""

from __future__ import annotations

from pagedkv.errors import ConfigError
from pagedkv.toolkit.split_kv import SplitPolicy

# Rows of one tile = query tokens x the query heads of one KV head (GQA packed into
# the rows, the group padded to a power of two). Decode-like batches, whose longest
# query fills at most DECODE_BLOCK_M rows, take short tiles (memory-bound: each tile
# streams its request's keys once for the whole group); batches with prefill take
# tall tiles (more rows per key loaded).
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64

# Triton launch parameters of the GPU lowering.
NUM_WARPS = 4
NUM_STAGES = 2

# Flash-decoding. H200 kernel times for 1 x 32k decode (8 programs unsplit): 64 splits
# 36 us, 32 splits 42 us, 16 splits 64 us; for 4 x 32k (32 programs): 16 splits 127 us,
# 32 splits 128 us, 8 splits 152 us; 256 x 1024 (2048 programs): unsplit 250 us, 2
# splits 261 us. So: split below 2 programs per SM, aim at 4, keep 512 keys per split.
SPLIT_POLICY = SplitPolicy(
    max_query_len=8,
    split_below_programs_per_sm=2.0,
    target_programs_per_sm=4.0,
    min_keys_per_split=512,
    max_splits=64,
)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_group(num_queries_per_kv: int) -> int:
    """Rows one query token takes in a tile: its GQA group, rounded up to a power of two."""
    return next_power_of_2(num_queries_per_kv)


def head_pad(head_size: int) -> int:
    """head_size rounded up to a power of two, at least 16 (the dot's minimum)."""
    return max(16, next_power_of_2(head_size))


def default_block_n(head_size: int) -> int:
    """Keys per step: K and V tiles of [block_n, head_pad] stay within a few tens of KiB."""
    return 64 if head_size <= 128 else 32


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


def split_slots(num_splits: int) -> int:
    """The launch's programs per tile along the keys for ``num_splits`` splits: the
    next power of two, so that serving sees a handful of compiled variants, not one per
    split count (programs past the step's split count attend an empty key range)."""
    return next_power_of_2(num_splits)
