"""Kernel tile configurations and the split-KV policy, as data.

The attention kernel keeps a ``[BLOCK_M, L]`` float32 accumulator in registers and
the ``[BLOCK_M, L + R]`` query plus ``num_stages`` latent tiles ``[BLOCK_N, L + R]``
in shared memory, so the right tile depends on the architecture, the element size
and the padded latent width. ``CONFIGS`` holds the measured choices;
``benchmarks/mla.py --sweep`` prints the table to update it from (docs/mla.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.intmath import next_power_of_2
from pagedkv.toolkit.split_kv import SplitPolicy


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of the attention kernel."""

    block_m: int  # query rows (token x head pairs) per program; decode: heads per program
    block_n: int  # latent rows (KV positions) per loop iteration
    num_warps: int
    num_stages: int  # software-pipelining depth of the latent loads
    # rescale the accumulator only when a row max grows by > 2**8; off by default: at
    # L = 512 with 8 warps it costs ptxas ~230 bytes of spills (docs/mla.md)
    lazy_rescale: bool = False
    use_tma: bool = True  # TMA loads where the layout allows (sm_90+, whole tile in one block)
    # the Gluon wgmma kernel where it applies (sm_90, 16-bit, block_size % 64 == 0, ...)
    use_gluon: bool = True

    def __str__(self) -> str:
        return (
            f"m{self.block_m}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}"
            f"{'-lazy' if self.lazy_rescale else ''}{'-tma' if self.use_tma else ''}"
            f"{'-gluon' if self.use_gluon else ''}"
        )


# (architecture, element bytes of the query dtype, padded kv_lora_rank) -> config.
# Anything absent falls back to choose_config's sizing rule. "interpret" is the Triton
# interpreter on a CPU: small tiles, so that the CPU tests cover several tiles per
# request, several loop iterations and the split-KV reduction.
CONFIGS: dict[tuple[str, int, int], KernelConfig] = {
    # Hopper, 16-bit, latent 512 (+ rope 64): 8 warps split the 512-wide accumulator
    # between two warpgroups (128 registers per thread); BLOCK_N 64 halves the query's
    # shared-memory reads per FLOP against 32; Q (72 KiB) and two 72 KiB latent stages
    # fit in shared memory; with TMA loads and the eager rescale ptxas reports no spills
    # (the lazy one spills ~230 bytes). Sweep: benchmarks/mla.py --sweep (docs/mla.md).
    ("sm90", 2, 512): KernelConfig(block_m=64, block_n=64, num_warps=8, num_stages=2),
    ("interpret", 2, 0): KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
    ("interpret", 4, 0): KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
}

# Splits of at least 256 positions, at most 64 (any query length: prefill tiles split
# too). Every step takes the makespan rule's ranges (work.choose_ranges), a step under a
# CUDA-graph reservation within the reservation's grid (work.graph_grid); ``choose``
# serves the num_splits option.
SPLIT_POLICY = SplitPolicy(max_query_len=None, min_keys_per_split=256, max_splits=64)

# What a program costs besides its tiles, in latent rows streamed (the makespan rule's
# overhead): the Gluon kernel's timeline on the H200 (benchmarks/mla_timeline.py,
# 256x1024) put a program's start to its first scores at 6.6 us and its epilogue at
# 2.9 us, against 2.06 us a 64-row tile: about 4.5 tiles (288 keys). Twice that, 9
# tiles: timed through CUDA graphs on the H200 (twenty-eighth session), 288 cut the
# ragged 256 and TP8 ragged 64 rows into 7 and 20 ranges (289.5 and 97.7 us), 576 and
# 1152 into 4 and 10 (262.8 and 91.4 us), 2304 over-merged (1x32k 34.3 -> 38.8 us,
# TP8 130.1); the uniform and mixed rows kept their plans at 576 and 1152
PROGRAM_OVERHEAD_KEYS = 576

# A CUDA-graph reservation's grid holds its bounds' tiles and this many programs an SM
# more, for the ranges a step cuts its long requests into: the rule's eager choices on
# the H200 took 128 to 196 more (1x32k, the ragged 256 and TP8 ragged 64 rows of
# ``pagedkv bench --matrix mla``); an unsplit step's grid ends in that many programs
# that exit at once (one an SM: the kernels' shared memory)
GRAPH_SPLIT_PROGRAMS_PER_SM = 2

# ... and its partial results (float32 [H, L] and [H] per token and range) at most this
# many bytes: 255 slots at 128 heads and L 512 (the ragged 256 row takes 158)
GRAPH_PARTIAL_BYTES = 64 << 20

# The reduction's grid: at most this many programs an SM (4 warps each: one SM's 64
# warps), each taking every grid-th unit of (merged token, head, column block) ...
REDUCE_PROGRAMS_PER_SM = 16
# ... and its rows cut into column blocks while the units stay within this many an SM:
# on the H200 (twenty-eighth session) 4x32k's 512 rows took 4.8 / 4.9 / 8.9 / 10.6 us
# in 1 / 2 / 4 / 8 blocks, 1x32k's 128 rows 13.1 / 6.1 / 6.3 / 5.9 us
REDUCE_UNITS_PER_SM = 8

# A forced split count (the num_splits option) holds while the step's float32 partial
# outputs fit in this many bytes; a larger step splits less (a long prefill, not at
# all). The rule above stays far below it (about 17 MiB at 128 heads: it splits only
# steps of fewer tiles than SMs), but num_splits=3 on the prefill of 200 requests'
# contexts (240k tokens, 128 heads) asked for 173 GiB.
MAX_FORCED_PARTIAL_BYTES = 256 << 20

# The Gluon sm_90 kernel (gluon_kernels.py): its tile shape is part of its design
# (one warpgroup's wgmma M; latent tiles in pairs in a two-slot ring), not a tuning knob.
GLUON_BLOCK_M = 64  # query rows per program: one warpgroup's wgmma M
GLUON_BLOCK_N = 64  # latent rows per tile
GLUON_NUM_WARPS = 4  # per warpgroup; the kernel runs two (the second is a worker partition)
GLUON_WORKER_REGS = 240  # registers per thread of the worker warpgroup (setmaxnreg)
GLUON_PIECES = 4  # TMA pieces per half tile, each on its own barrier: scores start on the first


def gluon_piece_width(lora: int) -> int:
    """Latent columns per TMA piece: a half of kv_c in GLUON_PIECES pieces of 64-column units."""
    return max(64, lora // 2 // GLUON_PIECES)


def pad_dim(n: int) -> int:
    """Power of two >= n and >= 16 (tl.arange needs powers of two, tl.dot K >= 16)."""
    return max(16, next_power_of_2(n))


def arch_of(capability: tuple[int, int] | None) -> str:
    """The CONFIGS key of a device: "interpret" (no GPU), "sm80", "sm90", "sm100", ..."""
    if capability is None:
        return "interpret"
    return f"sm{capability[0]}{capability[1]}"


def choose_config(arch: str, elem_bytes: int, l_pad: int, r_pad: int) -> KernelConfig:
    """The table's entry, else a configuration sized to fit registers and shared memory."""
    key_width = 0 if arch == "interpret" else l_pad
    found = CONFIGS.get((arch, elem_bytes, key_width))
    if found is not None:
        return found
    # 128 accumulator registers per thread at most; 64-row tiles use Hopper's wgmma
    block_m = 64 if elem_bytes == 2 else 32
    num_warps = max(4, min(8, block_m * l_pad // (128 * 32)))
    block_m = min(block_m, 128 * 32 * num_warps // l_pad)
    block_m = max(16, block_m)
    smem_budget = 200 * 1024
    q_bytes = block_m * (l_pad + r_pad) * elem_bytes
    block_n, num_stages = 64, 2
    while block_n > 16 and q_bytes + num_stages * block_n * (l_pad + r_pad) * elem_bytes > (
        smem_budget
    ):
        block_n //= 2
    return KernelConfig(block_m, block_n, num_warps, num_stages)
