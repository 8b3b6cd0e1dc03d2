"""Tile and split choices of the Triton kernels: data, tuned with benchmarks/triton_sweep.py.

Nothing here imports triton, so the builder can decide on the host before any
kernel module is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """One program's tiling of the unified attention kernel."""

    block_m: int  # rows per program: query tokens x the query heads of one KV head (>= 16)
    tile_n: int  # keys per inner-loop step, spanning tile_n / block_size pages (>= 16)
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"m{self.block_m}-n{self.tile_n}-w{self.num_warps}-s{self.num_stages}"


# Batches whose longest query needs at most this many rows (query tokens x GQA group)
# use the decode tiles; others the prefill tiles.
DECODE_MAX_ROWS = 16

# (kind, padded head size, dot inputs) -> tiles; kind is "decode", "decode-split" or
# "prefill"; dot inputs are "16-bit" (fp16/bf16), "16-bit-fp8" (over an fp8 cache;
# falls back to "16-bit"), "fp32" or "fp32-fp8" (an fp32 model over an fp8 cache). Decode is
# memory-bound: 16 rows, and key tiles of 4096 elements, small enough (~100-140
# registers at 4 warps, sm_90) that 4 programs fit an SM and 64 x 4096 runs in one
# wave. Prefill is compute-bound: 128 rows per K/V tile (wgmma on Hopper). fp32 runs
# IEEE dots on CUDA cores, which hold both operands in registers: small tiles, or
# they spill; over fp8 caches even the software pipeline's second buffer spills, so
# those run unpipelined. Starting points: benchmarks/triton_sweep.py measures the
# alternatives; tests/test_triton_compile.py checks every row compiles without spills.
TILES: dict[tuple[str, int, str], TileConfig] = {
    ("decode", 32, "16-bit"): TileConfig(16, 128, 4, 3),
    ("decode", 64, "16-bit"): TileConfig(16, 64, 4, 3),
    # H200, bf16, Hq32/Hkv8, block 16 (docs/benchmarks.md): 272.6 us for 64 x 4096
    # against 293.9 us with (16, 32, 4, 3)
    ("decode", 128, "16-bit"): TileConfig(16, 128, 4, 2),
    ("decode", 256, "16-bit"): TileConfig(16, 16, 4, 3),
    ("prefill", 32, "16-bit"): TileConfig(128, 64, 4, 3),
    ("prefill", 64, "16-bit"): TileConfig(128, 64, 8, 3),
    # H200 prefill 8 x 2048 causal: 1012 us, against 1113 us for (128, 64, 8, 3); the
    # fastest measured, (128, 32, 4, 2) at 938 us, spills registers on sm_90
    ("prefill", 128, "16-bit"): TileConfig(64, 32, 4, 2),
    ("prefill", 256, "16-bit"): TileConfig(64, 64, 8, 2),
    # a 16-bit model over an fp8 cache: the upcast needs registers, and the tuned
    # 16-bit decode tiles spill there on sm_90
    ("decode", 128, "16-bit-fp8"): TileConfig(16, 32, 4, 3),
    # split decode (few long sequences): H200 4 x 32k, 142.8 us against 162.8 us with (16, 32, 4, 3)
    ("decode-split", 128, "16-bit"): TileConfig(16, 64, 4, 2),
    ("decode", 32, "fp32"): TileConfig(16, 64, 4, 3),
    ("decode", 64, "fp32"): TileConfig(16, 32, 4, 3),
    ("decode", 128, "fp32"): TileConfig(16, 16, 4, 3),
    ("decode", 256, "fp32"): TileConfig(16, 16, 4, 3),
    ("prefill", 32, "fp32"): TileConfig(32, 32, 4, 2),
    ("prefill", 64, "fp32"): TileConfig(32, 32, 4, 2),
    ("prefill", 128, "fp32"): TileConfig(16, 16, 4, 2),
    ("prefill", 256, "fp32"): TileConfig(16, 16, 4, 2),
    ("decode", 32, "fp32-fp8"): TileConfig(16, 64, 4, 1),
    ("decode", 64, "fp32-fp8"): TileConfig(16, 32, 4, 1),
    ("decode", 128, "fp32-fp8"): TileConfig(16, 16, 4, 1),
    ("decode", 256, "fp32-fp8"): TileConfig(16, 16, 4, 1),
    ("prefill", 32, "fp32-fp8"): TileConfig(32, 32, 4, 1),
    ("prefill", 64, "fp32-fp8"): TileConfig(32, 32, 4, 1),
    ("prefill", 128, "fp32-fp8"): TileConfig(16, 16, 4, 1),
    ("prefill", 256, "fp32-fp8"): TileConfig(16, 16, 4, 1),
}


@dataclass(frozen=True)
class SplitPolicy:
    """When decode splits each sequence's keys over several programs (flash-decoding).

    A batch is split when its longest query is short and it has fewer than
    ``split_below_programs_per_sm`` programs per SM: then each sequence's keys are
    cut into enough splits for ``target_programs_per_sm``, keeping at least
    ``min_keys_per_split`` keys each.
    """

    max_query_len: int = 8
    split_below_programs_per_sm: int = 2
    target_programs_per_sm: int = 4
    min_keys_per_split: int = 512
    max_splits: int = 64  # also the reduction kernel's widest split axis


SPLIT_POLICY = SplitPolicy()
# Without a GPU (Triton's interpreter) there is no SM count; this stands in for it,
# small enough that only few-sequence, long-context batches split there too.
CPU_SM_COUNT = 4


def head_pad(head_size: int) -> int:
    """The head size rounded up to a power of two (at least 16: tl.dot's minimum)."""
    return max(16, 1 << (head_size - 1).bit_length())


def tile_kind(max_query_len: int, group: int) -> str:
    return "decode" if max_query_len * group <= DECODE_MAX_ROWS else "prefill"


def dot_inputs(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    if dtype != torch.float32:
        return "16-bit" if kv_cache_dtype == "auto" else "16-bit-fp8"
    return "fp32" if kv_cache_dtype == "auto" else "fp32-fp8"


def select_tile(
    kind: str, head_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> TileConfig:
    """The tiles for a batch kind ("decode" or "prefill"), head size, model and cache dtype."""
    pad = min(256, max(32, head_pad(head_size)))
    inputs = dot_inputs(dtype, kv_cache_dtype)
    # most specific first: a split-decode row falls back to the decode row, and a
    # 16-bit model over an fp8 cache to the 16-bit rows
    kinds = (kind, "decode") if kind == "decode-split" else (kind,)
    families = (inputs, "16-bit") if inputs == "16-bit-fp8" else (inputs,)
    for family in families:
        for k in kinds:
            if (k, pad, family) in TILES:
                return TILES[(k, pad, family)]
    raise KeyError(f"no tile for {kind}, head size {head_size} (padded {pad}), {inputs}")


def choose_num_splits(
    policy: SplitPolicy,
    num_programs: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
) -> int:
    """Splits per sequence for a batch of ``num_programs`` (query blocks x KV heads)."""
    if max_query_len > policy.max_query_len or num_programs <= 0:
        return 1
    if num_programs >= policy.split_below_programs_per_sm * num_sms:
        return 1
    target = policy.target_programs_per_sm * num_sms
    by_occupancy = -(-target // num_programs)
    by_length = max(1, max_seq_len // policy.min_keys_per_split)
    return max(1, min(policy.max_splits, by_occupancy, by_length))
