"""How the Triton kernels tile a step: the rule that picks rows per program, keys per
inner step, warps, stages and KV splits from the shape of the step and the GPU.

Data and rules only: nothing here imports triton, so the builder decides on the host,
from the CPU copies of the metadata, before a kernel module is loaded. The rule is a
small model of the work of one program (CTA); docs/triton.md gives the reasoning,
and lists the constants below that are measurements to repeat on a new GPU.

- A program owns BLOCK_M rows: BLOCK_M // GROUP query tokens of one request times the
  GROUP query heads of one KV head. For each key it visits it reads the key's K and V
  rows (2 * D * cache bytes) and computes BLOCK_M * 4 * D flops, masked rows included.
- **Rows** (``choose_block_m``): the step's cost at each candidate BLOCK_M is
  max(compute, memory), in (row, key) products: compute counts every row of every
  program at the rate of the MMA that BLOCK_M allows; memory counts each request's
  keys once from HBM and their re-reads by the request's other query blocks at L2's
  price. The cheapest wins; near-ties go to fewer rows (more programs, fewer
  registers). So decodes keep one small block per request, long queries take 64-row
  blocks, and a mixed step takes whichever its work favours.
- **Keys per step, warps, stages** (``choose_tile``): within explicit register and
  shared-memory limits (tests/test_triton_compile.py compiles the variants for sm_90
  and fails on a spill inside a loop or past ``SPILL_SLACK_BYTES``). A memory-bound
  program takes the smallest key tile that keeps enough K/V bytes in flight per SM; a compute-bound one keeps its score tile small,
  since Triton does not overlap the softmax with the MMAs.
- **Splits** (``makespan_splits``): the toolkit's makespan rule over the programs the
  chosen tile gives and the programs an SM holds of it: split until the waves are even
  and no long request is the critical path.
- **Parts** (``plan_step``): a step of decodes and chunked prefills is launched as two
  parts, each with its own rows, tile and splits.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pagedkv.backends.triton.parts import decode_and_longer_runs
from pagedkv.errors import ConfigError
from pagedkv.intmath import cdiv, next_power_of_2, prev_power_of_2
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit import split_kv
from pagedkv.toolkit.launch import KernelFit
from pagedkv.toolkit.split_kv import SplitChoice, SplitPolicy, merge_keys_per_split, splits_within

# -- the machine: what the unified kernel achieves (H200, docs/benchmarks.md) -----------
# Not datasheet peaks: the kernel's own rates. Their ratio says how many (row, key)
# products a program computes in the time one key's K and V rows arrive from HBM.
KERNEL_TFLOPS = 274.0  # causal prefill 8 x 2048, bf16, 64-row programs (wgmma)
KERNEL_TBPS = 4.09  # decode 64 x 4096, bf16: K/V streamed at 96% of copy bandwidth
# Hopper's wgmma multiplies 64 rows per warpgroup; below 64 rows Triton emits mma.sync,
# assumed to reach half the rate (to measure).
MMA_SYNC_SHARE = 0.5
# fp32 layers run IEEE dots on CUDA cores (TF32 would miss the fp32 tolerance): FMA
# throughput, assumed an eighth of the 16-bit tensor rate (to measure).
FP32_DOT_SHARE = 0.125
# A request's K/V re-read by its other query blocks comes mostly from L2, assumed at
# three times HBM's bandwidth (to measure).
L2_REREAD_COST = 1 / 3
# Rows that differ in cost by less than this are a tie, won by fewer rows.
ROWS_TIE = 0.05
BLOCK_M_CHOICES = (16, 32, 64, 128)

# -- the SM: limits of sm_90, and how much a program may use of them --------------------
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 227 * 1024
# The register estimate's budget: 255 is the hardware limit, the margin absorbs the
# estimate's error (tests/test_triton_compile.py is the real check)
REGISTER_BUDGET = 240
# estimate_registers, fitted to ptxas on sm_90 (Triton 3.6; decode and prefill tiles of
# D 64-256, 4 and 8 warps; docs/triton.md)
REGISTERS_BASE = 44
REGISTERS_PER_KV_16BIT = 1.5
# fp8 tiles: m16-n64 at D 128 compiled to 151 registers, and with the split epilogue
# to 168 and a 4-byte spill, so fp8 is costed at twice the 16-bit rate
REGISTERS_PER_KV_FP8 = 3.0
REGISTERS_PER_KV_FP32 = 6.0
# padded head sizes (D 192 in a 256-wide tile): m16-n32 spilled 8 bytes at 168 registers
# where D 256 compiled to 168 without a spill
REGISTERS_PER_KV_MASKED = 1.5
# keys per inner step: tl.dot needs 16; 256-key tiles spilled in 4 of the 6 measured
# layers, and 128 keys already keep enough bytes in flight at D >= 64
TILE_N_CHOICES = (16, 32, 64, 128)
# Memory-bound programs: K/V bytes of in-flight tiles per SM that saturate HBM. H200
# decode 64 x 4096: 3 programs x 32 KiB (m16-n64, 5 stages) and 2 x 64 KiB (m16-n128, 2
# stages) both ran at 96% of copy bandwidth, 4 x 16 KiB (m16-n32) 8% slower. m16-n64 at
# one split ran at 71% (364 us): unsplit, it takes 164 registers (3 programs per SM),
# split 124 (4); the estimate knows only the first (open: docs/triton.md).
BYTES_IN_FLIGHT_PER_SM = 96 * 1024
# ... in steps of at least this many K/V bytes (or the widest step, where it holds
# fewer): a step's fixed work (page lookups, the softmax's row statistics, the rescale)
# is paid per step, not per byte. H200, D 128, bf16 (twenty-second session): m16-n32
# (16 KiB steps) compiled to 80 registers, 6 programs per SM (96 KiB in flight), and
# ran slower than m16-n64 (32 KiB, 4 programs) on every decode row: 4 x 32k 145.9
# against 142.6 us, ragged 128 234.0 against 228.7, speculative 64 x 4 293.2 against
# 284.9. Every tile the rule picked on the H200 before (D 64 n128, D 128 n64, D 256 n32,
# fp8 D 128 n128) holds 32 KiB a step.
MIN_STEP_BYTES = 32 * 1024
# Compute-bound programs: fp32 score values per thread. H200 prefill 8 x 2048, D 128:
# m64-n32-w4 (16 per thread) 1012 us against 1113 us for m128-n64-w8 (32).
SCORES_PER_THREAD = 16
# ... and at least this many keys per step: each step rescales the accumulator on CUDA
# cores, ~15x slower than the tensor cores on Hopper, which adds 15 / (4 * TILE_N) to the
# step's MMA time: ~25% at 16 keys, ~12% at 32
MIN_COMPUTE_TILE_N = 32

# -- splits ----------------------------------------------------------------------------
# Split (flash-decoding) decode-like steps (queries of at most 8 tokens), at least 512 keys
# per split, at most 64 splits (the width the reduction kernel merges at once); how many
# is the toolkit's makespan rule over the step's programs (``makespan_splits``). A step
# of fewer programs than SMs unsplit may split down to 128 keys: H200, D 128, graph
# reserved for 32k (twenty-sixth session, docs/triton.md): 1 x 1024 15.0 -> 8.3 us,
# 4 x 2048 19.2 -> 14.6, 2 x 8192 30.5 -> 26.6; a step that fills the SMs took finer
# splits than 512 keys and ran slower (twenty-fifth session: D 256 mixed, D 64 mixed).
SPLIT_POLICY = SplitPolicy(
    max_query_len=8, min_keys_per_split=512, max_splits=64, sparse_grid_min_keys_per_split=128
)
# A program's fixed cost (query load, first page-table lookups, epilogue), in keys
# streamed: about one 64-key tile (to measure).
PROGRAM_OVERHEAD_KEYS = 64
# A step splits as far as its partial results stay within this size: a chunked prefill's
# (its every query row), a CUDA-graph plan's (scratch sized once for the bounds' every
# token) and an eager decode-like step's alike, so that a step's eager and graph plans
# choose from the same splits. A step of many tokens pays for its partials in the merge
# more than the estimate charges: H200, speculative decoding 64x4 (256 tokens x 32
# heads: at most 15 splits), 2048-key ranges ran 279 us, the 1280-key ranges the
# uncapped rule chose 294 (docs/results/sweep-h200-twelfth-key-ranges.json)
SPLIT_PARTIAL_BYTES = 64 << 20
# The batch-invariant mode's split: a fixed key range per split, whatever the batch and
# the GPU (as many programs per request as the default gives one long request).
BATCH_INVARIANT_KEYS_PER_SPLIT = 512
# A CUDA-graph plan's list of work items holds at most this many split programs an SM
# (or one item per request of the bounds): every step's split choice stays within it.
# The grid is fixed at capture, so each item a step does not use is a program that
# starts, finds nothing and exits, holding an SM slot; sized for every split of every
# request, a ragged batch's graph launched up to 8x the programs it ran (H200: 0.5-1.8%
# of the graph time on six rows, tenth session). The cap is in programs, not waves: what
# a step wants is items (its keys over its ranges), whatever the tile's programs per SM
# (ragged-decode-128 takes 267 items, 2136 programs, at 2 per SM and at 4). H200:
# - 16 an SM bound that row's choice at 2 per SM (+0.6%, tenth session) and at 4 (+4%;
#   GQA 1 ragged +42%, 32 long ragged +7%; twenty-seventh session).
# - 64 an SM (16 waves at 4 per SM) left 7,700 programs to start and exit after a 16 x
#   1024 step's 512 in a graph reserved for 32k: 31.0 us, against 26.2 at 32 an SM and
#   25.0 in its own graph; no other row's plan changed between 64 and 32 (26 rows).
GRAPH_ITEM_PROGRAMS_PER_SM = 32
# The fixed key ranges an eager step's rule compares: powers of two of the tile times
# each of these, so a ragged batch's ranges can fill its waves more closely. H200, 10
# ragged, speculative and mixed rows, eager, against powers of two alone: faster on 8
# (1-12%: mixed 16+1 178 -> 157 us), equal on 1, slower on 1 (speculative 32x8, 1792-key
# ranges instead of 2048: 190 -> 216 us; undone by the ranges' tail,
# split_kv.RANGE_TAIL_SHARE: 191 us). A CUDA-graph step keeps powers of two: with the
# waves' tail the finer ranges were slower on 7 of 9 graph rows; with the ranges' tail
# faster on 3 of 4 (0.6-1.7%), too few to change them (docs/triton.md). Nor does a part
# of a two-part step (``plan_step``): the impl overlaps its parts on two streams, so the
# waves the finer ranges fill, the whole GPU's, are not the part's (H200, nineteenth
# session: mixed 16+1 eager 142 -> 130 us with powers of two, mixed 96+2 331 -> 324;
# docs/benchmarks.md); run one after the other (overlap_parts=false) the plan is the
# same, so that the option changes the streams only
EAGER_RANGE_MULTIPLES = (1.0, 1.25, 1.5, 1.75)


@dataclass(frozen=True)
class TileConfig:
    """One program's tiling of the unified attention kernel."""

    block_m: int  # rows per program: query tokens x the query heads of one KV head (>= 16)
    tile_n: int  # keys per inner-loop step, spanning tile_n / block_size pages (>= 16)
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"m{self.block_m}-n{self.tile_n}-w{self.num_warps}-s{self.num_stages}"


@dataclass(frozen=True)
class LayerShape:
    """What the tiles depend on in a layer. Two layers with equal shapes (the compared
    fields) can share a step's plan."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    # read by the cost model only: a plan stays valid for another mask
    causal: bool = field(compare=False)
    window: int | None = field(compare=False)

    @staticmethod
    def of(spec: AttentionSpec) -> LayerShape:
        return _layer_shape(spec)

    # (computed once: the rule reads them many times a step)
    @functools.cached_property
    def group(self) -> int:
        """Query heads per KV head (rows per query token)."""
        return self.num_heads // self.num_kv_heads

    @functools.cached_property
    def head_pad(self) -> int:
        """The head size rounded up to a power of two, at least 16 (tl.dot's minimum)."""
        return max(16, next_power_of_2(self.head_size))

    @property
    def fp32(self) -> bool:
        """IEEE fp32 dots on CUDA cores, both operands in registers."""
        return self.dtype == torch.float32

    @property
    def cache_bytes(self) -> int:
        return self.cache_dtype.itemsize

    def describe(self) -> str:
        cache = "" if self.cache_dtype == self.dtype else f" over {self.cache_dtype}"
        return (
            f"Hq {self.num_heads}, Hkv {self.num_kv_heads}, D {self.head_size}, block "
            f"{self.block_size}, {self.dtype}{cache}"
        )


@functools.lru_cache(maxsize=256)
def _layer_shape(spec: AttentionSpec) -> LayerShape:
    # cached: the builder's and the impl's shapes of one spec are then one object
    return LayerShape(
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_size,
        spec.block_size,
        spec.dtype,
        spec.cache_dtype,
        spec.causal,
        spec.sliding_window,
    )


@dataclass(frozen=True)
class StepShape:
    """What the rule reads of a step: each request's query and sequence length."""

    query_lens: np.ndarray  # [B] int
    seq_lens: np.ndarray  # [B] int

    @staticmethod
    def of(common: CommonAttentionMetadata) -> StepShape:
        qsl = common.query_start_loc_cpu.numpy()
        return StepShape(qsl[1:] - qsl[:-1], common.seq_lens_cpu.numpy())

    @staticmethod
    def of_bounds(common: CommonAttentionMetadata) -> StepShape:
        """A step padded to CUDA-graph bounds, seen through its bounds only (so the plan
        is the same every step): as many full-length queries as the token rows hold,
        over the longest sequences."""
        q = max(1, common.max_query_len)
        n = max(1, min(common.num_reqs, common.num_tokens // q))
        return StepShape(np.full(n, q, dtype=np.int64), np.full(n, common.max_seq_len, np.int64))

    def part(self, first: int, end: int) -> StepShape:
        """Requests ``[first, end)`` (one object per range: the plan of a two-part step
        reads each part several times, and each keeps what it computed)."""
        parts = self._parts
        found = parts.get((first, end))
        if found is None:
            found = parts[(first, end)] = StepShape(
                self.query_lens[first:end], self.seq_lens[first:end]
            )
        return found

    @functools.cached_property
    def _parts(self) -> dict[tuple[int, int], StepShape]:
        return {}

    @functools.cached_property
    def _costs(self) -> dict[tuple[int, int], tuple[LayerShape, tuple[float, float]]]:
        """``step_cost`` by (the layer's id, rows per program), with the layer kept."""
        return {}

    @functools.cached_property
    def _live(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The requests with queries: their query lengths, sequence lengths, the latter
        as floats, and their contexts."""
        q, seq = self.query_lens, self.seq_lens
        if not self.all_live:
            live = q > 0
            q, seq = q[live], seq[live]
        return q, seq, seq.astype(np.float64), seq - q

    # read many times by one step's plan (a shape's arrays are never written)
    @functools.cached_property
    def max_query_len(self) -> int:
        return int(self.query_lens.max(initial=0))

    @functools.cached_property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max(initial=0))

    @functools.cached_property
    def all_live(self) -> bool:
        """Whether every request has queries (no padding request)."""
        return bool(self.query_lens.min(initial=1) > 0)


@dataclass(frozen=True)
class TilePlan:
    """A step's tiles and splits."""

    tile: TileConfig
    block_q: int  # query tokens per program: tile.block_m // GQA group
    num_splits: int  # programs per query block along the keys
    split: bool  # partial results + reduction (num_splits > 1, or batch-invariant)
    tiles_per_split: int  # 0: even shares of the visited tiles; > 0: fixed key ranges
    ordered_reduction: bool  # merge the splits one by one, in order
    # a CUDA-graph plan whose split count each step chooses (``step_splits``), at most
    # ``num_splits`` (the grid's split axis and the partials' width)
    dynamic_splits: bool = False
    # ... and whose steps may take fixed key ranges, not only even shares
    step_ranges: bool = True

    @property
    def trim_splits(self) -> bool:
        """Fixed key ranges that balance a ragged batch (not the batch-invariant mode's,
        whose order-preserving reduction reads every split): a range past a query
        block's keys is skipped, and each row merges only the ranges below its keys.
        A CUDA-graph plan's steps may take ranges (``step_splits``): the kernels check."""
        ranges = self.tiles_per_split > 0 or (self.dynamic_splits and self.step_ranges)
        return ranges and not self.ordered_reduction


# -- rows ------------------------------------------------------------------------------


def rows_per_key(layer: LayerShape) -> float:
    """(row, key) products at the full tensor rate in the time one key's K and V rows
    (2 * D * cache bytes) arrive: cache_bytes * flops-per-byte / 2."""
    return layer.cache_bytes * KERNEL_TFLOPS / KERNEL_TBPS / 2


def mma_rate(layer: LayerShape, block_m: int) -> float:
    """The MMA rate of a program of ``block_m`` rows, relative to wgmma's."""
    if layer.fp32:
        return FP32_DOT_SHARE
    return 1.0 if block_m >= 64 else MMA_SYNC_SHARE


def step_cost(layer: LayerShape, step: StepShape, block_m: int) -> tuple[float, float]:
    """(compute, memory) of a step at ``block_m`` rows, in (row, key) products at the
    full tensor rate (per KV head; every KV head costs the same)."""
    return step_costs(layer, step, (block_m,))[0]


def step_costs(
    layer: LayerShape, step: StepShape, block_ms: tuple[int, ...]
) -> list[tuple[float, float]]:
    """``step_cost`` at each of ``block_ms``, kept per step; those not yet kept computed
    in one pass over the requests (one row per row count: the same values, element by
    element and row by row, as one count at a time)."""
    kept = step._costs
    key = id(layer)
    missing = [m for m in block_ms if (hit := kept.get((key, m))) is None or hit[0] is not layer]
    if missing:
        q, seq, seq_f64, context = step._live
        rows = np.array(missing, dtype=np.int64)[:, None]  # [C, 1]
        block_q = rows // layer.group
        blocks = -(-q // block_q)  # [C, P]
        # causal: a query block sees its context and, on average, half its queries
        keys = np.minimum(seq, context + (q + block_q) / 2) if layer.causal else seq_f64
        distinct = seq_f64  # keys the request's blocks read between them
        if layer.window is not None:
            keys = np.minimum(keys, layer.window + block_q)
            distinct = np.minimum(distinct, layer.window + q)
        # np.add.reduce: ndarray.sum without its Python frame (the same pairwise sum)
        compute = np.add.reduce(blocks * rows * keys, axis=-1)
        memory = np.add.reduce(distinct + L2_REREAD_COST * (blocks - 1) * keys, axis=-1)
        per_key = rows_per_key(layer)
        for i, m in enumerate(missing):
            cost = (float(compute[i]) / mma_rate(layer, m), float(memory[i]) * per_key)
            kept[(key, m)] = (layer, cost)
    return [kept[(key, m)][1] for m in block_ms]


def portable_us(layer: LayerShape, step: StepShape) -> float:
    """The model's time for the portable kernel over ``step`` on the whole GPU, in us:
    the larger of its compute and memory terms at the kernel's own rates (no split or
    merge costs; a yardstick for comparing plans, not a prediction)."""
    if not (step.query_lens > 0).any():
        return 0.0
    block_m, _ = choose_block_m(layer, step)
    products = max(step_cost(layer, step, block_m))  # (row, key) products per KV head
    flops = products * layer.num_kv_heads * 4 * layer.head_size  # QK^T and PV
    return flops / (KERNEL_TFLOPS * 1e6)


@functools.lru_cache(maxsize=1024)
def block_m_candidates(layer: LayerShape) -> tuple[int, ...]:
    """Row counts a program may have: whole GQA groups, and a tile within the limits.
    fp32 dots keep both operands in registers: they stay at the fewest rows."""
    least = max(16, next_power_of_2(layer.group))
    if layer.fp32:
        return (least,)
    return tuple(m for m in BLOCK_M_CHOICES if m >= least and _fitting_tiles(layer, m)) or (least,)


def choose_block_m(layer: LayerShape, step: StepShape) -> tuple[int, bool]:
    """(rows per program, whether the step is memory-bound at those rows)."""
    candidates = block_m_candidates(layer)
    least = candidates[0]
    if step.max_query_len * layer.group <= least:
        # every request fits one program of the fewest rows: more rows only add compute;
        # each program then computes `least` rows per key it reads
        return least, rows_per_key(layer) * mma_rate(layer, least) >= least
    costs = dict(zip(candidates, step_costs(layer, step, candidates), strict=True))
    best = min(max(c) for c in costs.values())
    block_m = min(m for m, c in costs.items() if max(c) <= best * (1 + ROWS_TIE))
    compute, memory = costs[block_m]
    return block_m, memory >= compute


# -- keys per step, warps, stages --------------------------------------------------------


def kv_per_thread(layer: LayerShape, tile_n: int, num_warps: int) -> float:
    """Elements of one K (or V) tile each thread holds on its way to the MMA."""
    return tile_n * layer.head_pad / (32 * num_warps)


def fp32_values_per_thread(layer: LayerShape, block_m: int, tile_n: int, num_warps: int) -> float:
    """The accumulator [BLOCK_M, D] and the score tile [BLOCK_M, TILE_N], per thread."""
    return block_m * (layer.head_pad + tile_n) / (32 * num_warps)


def estimate_registers(layer: LayerShape, block_m: int, tile_n: int, num_warps: int) -> float:
    """Registers per thread on sm_90: a base, one per fp32 accumulator and score value,
    and a cost per element of the thread's share of a K/V tile, which passes through
    registers on its way to the MMA (fp8 tiles are also upcast there, padded head
    sizes carry a mask per element, fp32 dots keep both operands there). Fitted to
    ptxas (docs/triton.md): it overestimates the largest tiles, so the rule errs
    towards smaller ones."""
    if layer.fp32:
        per_kv = REGISTERS_PER_KV_FP32
    elif layer.cache_bytes == 1:
        per_kv = REGISTERS_PER_KV_FP8
    else:
        per_kv = REGISTERS_PER_KV_16BIT
    if layer.head_size != layer.head_pad:
        per_kv += REGISTERS_PER_KV_MASKED
    return (
        REGISTERS_BASE
        + fp32_values_per_thread(layer, block_m, tile_n, num_warps)
        + per_kv * kv_per_thread(layer, tile_n, num_warps)
    )


def estimate_shared(layer: LayerShape, block_m: int, tile_n: int) -> int:
    """Shared memory of one program: a K and a V tile, the query and the probabilities
    (the gathered K/V loads are not multi-buffered, whatever num_stages says)."""
    kv = 2 * tile_n * layer.head_pad * layer.cache_bytes
    return kv + block_m * (layer.head_pad + tile_n) * layer.dtype.itemsize


def fits(layer: LayerShape, block_m: int, tile_n: int, num_warps: int) -> bool:
    """Whether a tile stays within the limits that keep ptxas from spilling on sm_90
    (checked by tests/test_triton_compile.py) and within shared memory."""
    if estimate_shared(layer, block_m, tile_n) > SHARED_PER_SM:
        return False
    if layer.fp32:  # the estimate does not hold for FMA dots: a direct limit instead
        return tile_n == TILE_N_CHOICES[0] or kv_per_thread(layer, tile_n, num_warps) <= 16
    return estimate_registers(layer, block_m, tile_n, num_warps) <= REGISTER_BUDGET


def _fitting_tiles(layer: LayerShape, block_m: int) -> list[TileConfig]:
    """Every tile of ``block_m`` rows within the limits."""
    out = []
    for warps in (4, 8):
        if warps == 8 and block_m < 64:
            continue  # fewer rows than two warpgroups' MMAs: more warps only add copies
        out += [
            TileConfig(block_m, tile_n, warps, num_stages(layer))
            for tile_n in TILE_N_CHOICES
            if fits(layer, block_m, tile_n, warps)
        ]
    return out


class LaunchForm(enum.Enum):
    """How a step's attention launch covers its keys. Each form compiles to its own
    variant of the kernel, and ptxas may give each its own registers: on the H200 a GQA-16
    layer's m16-n64 takes 4 programs per SM launched as listed key ranges, 3 as even
    shares (so the rule estimates each form with its own occupancy)."""

    UNSPLIT = "unsplit"
    EVEN_SHARES = "even shares"  # a split launch: every program a share of its keys
    KEY_RANGES = "fixed key ranges"  # a split launch listing the ranges that hold keys


# Spilled bytes per thread a compiled variant may keep: near its occupancy steps ptxas
# parks a value or two in local memory for the whole kernel (m16-n64 D 128, unsplit, one
# program per request: a predicate stored in the prologue, read in the epilogue, 128
# registers where the request search's variant took 164 without one; H200: 64x4096
# 260.7 us against 368.9). tests/test_triton_compile.py holds every launched variant to
# no spill inside a loop (its SASS) and to this many bytes.
SPILL_SLACK_BYTES = 8


# The compiled kernel's fit of a tile in a launch form on this GPU:
# ``occupancy.CompiledFits`` on a CUDA device. Where it is None, or gives None (nothing
# compiles here), the register estimate stands in.
FitSource = Callable[[TileConfig, LaunchForm], KernelFit | None]


@functools.lru_cache(maxsize=1024)
def programs_per_sm(layer: LayerShape, tile: TileConfig) -> int:
    """Programs one SM holds at once by the estimate: by registers (at most 255 per
    thread, allocated in 8s) and shared memory."""
    regs = min(255.0, estimate_registers(layer, tile.block_m, tile.tile_n, tile.num_warps))
    by_registers = REGISTERS_PER_SM // (int(regs + 7) // 8 * 8 * 32 * tile.num_warps)
    by_shared = SHARED_PER_SM // estimate_shared(layer, tile.block_m, tile.tile_n)
    return max(1, min(by_registers, by_shared))


def slots_per_sm(
    layer: LayerShape, tile: TileConfig, form: LaunchForm, fit: FitSource | None = None
) -> int:
    """Programs of ``tile`` launched in ``form`` one SM holds at once: the compiled
    kernel's count where ``fit`` knows it (a split launch may take fewer registers than an
    unsplit one, or more), else the estimate's."""
    compiled = fit(tile, form) if fit is not None else None
    if compiled is not None and compiled.programs_per_sm > 0:
        return compiled.programs_per_sm
    return programs_per_sm(layer, tile)


def num_stages(layer: LayerShape) -> int:
    """Software-pipelining depth: 2 overlaps the next page-table lookups and loads with
    the current tile. Triton divides the stages among the chain of loads (table entry,
    then K/V), so the K/V tiles get a second buffer only from 5 stages on; on the H200
    that took 178-224 registers (2 programs per SM) and was slower on every decode row
    (docs/triton.md). An fp32 layer over an fp8 cache (upcast and FMA operands in
    registers) spills even its smallest tile pipelined."""
    return 1 if layer.fp32 and layer.cache_bytes == 1 else 2


def step_bytes(layer: LayerShape, tile_n: int) -> int:
    """K/V bytes one key step of ``tile_n`` keys loads (a K and a V tile)."""
    return 2 * tile_n * layer.head_pad * layer.cache_bytes


def saturates(layer: LayerShape, tile_n: int, in_flight: int) -> bool:
    """Whether memory-bound programs of ``tile_n``-key steps keep HBM busy: enough K/V
    bytes in flight per SM (``in_flight``), in steps of at least ``MIN_STEP_BYTES`` (or
    the widest step's bytes, for layers too narrow to reach it)."""
    widest = step_bytes(layer, TILE_N_CHOICES[-1])
    return in_flight >= BYTES_IN_FLIGHT_PER_SM and step_bytes(layer, tile_n) >= min(
        MIN_STEP_BYTES, widest
    )


def choose_tile(
    layer: LayerShape, block_m: int, memory_bound: bool, fit: FitSource | None = None
) -> TileConfig:
    """Keys per step and warps for programs of ``block_m`` rows: one warpgroup, unless
    only two can hold a useful tile. ``fit``: the compiled kernels' registers decide
    memory-bound tiles of one warpgroup where they are known (``fit`` keeps what it
    compiled, so this costs a few lookups per step; it is not part of a cache key,
    which would keep every builder's probe alive)."""
    if memory_bound and fit is not None and not layer.fp32 and block_m < 64:
        compiled = _compiled_memory_tile(layer, block_m, fit)
        if compiled is not None:
            return compiled
    return _estimated_tile(layer, block_m, memory_bound)


@functools.lru_cache(maxsize=1024)  # a function of the layer's shape: once per shape
def _estimated_tile(layer: LayerShape, block_m: int, memory_bound: bool) -> TileConfig:
    """``choose_tile`` by the register estimate."""
    fitting = _fitting_tiles(layer, block_m)
    for warps in (4, 8):
        tiles = [t for t in fitting if t.num_warps == warps]
        if memory_bound and tiles:
            # the smallest key step with enough K/V bytes in flight per SM to saturate
            # HBM, in steps large enough (fewer registers: more programs for the tail);
            # short of that, the most bytes in flight, in the fewest steps
            def in_flight(t: TileConfig) -> int:
                return programs_per_sm(layer, t) * step_bytes(layer, t.tile_n)

            enough = [t for t in tiles if saturates(layer, t.tile_n, in_flight(t))]
            if enough:
                return min(enough, key=lambda t: t.tile_n)
            return max(tiles, key=lambda t: (in_flight(t), t.tile_n))
        # compute-bound: the widest key step whose score tile stays within its budget,
        # and wide enough to amortise the per-step softmax rescaling
        useful = [
            t
            for t in tiles
            if t.tile_n >= MIN_COMPUTE_TILE_N
            and block_m * t.tile_n <= SCORES_PER_THREAD * 32 * warps
        ]
        if useful:
            return max(useful, key=lambda t: t.tile_n)
    if fitting:
        return min(fitting, key=lambda t: (t.num_warps, t.tile_n))
    # only rows that are not candidates get here (an explicit tile override's rows)
    return TileConfig(block_m, TILE_N_CHOICES[0], 8 if block_m >= 64 else 4, num_stages(layer))


def _compiled_memory_tile(layer: LayerShape, block_m: int, fit: FitSource) -> TileConfig | None:
    """The memory-bound rule of ``choose_tile`` over the compiled kernels: the smallest
    key step (of ``MIN_STEP_BYTES`` at least: ``saturates``) whose split launch (decode
    steps mostly split: ``makespan_splits``) holds ``BYTES_IN_FLIGHT_PER_SM`` of K/V per
    SM, among the tiles that compile without a spill, split or not; short of that, the
    most bytes in flight. Nothing is assumed of the tiles' registers, so tiles the
    estimate rejects (fp8 m16-n128: estimated 460 registers, compiled 168) are
    candidates. None where nothing compiles here."""
    short: tuple[int, TileConfig] | None = None
    for tile_n in TILE_N_CHOICES:
        tile = TileConfig(block_m, tile_n, 4, num_stages(layer))
        if estimate_shared(layer, block_m, tile_n) > SHARED_PER_SM:
            continue
        split = fit(tile, LaunchForm.EVEN_SHARES)
        if split is None:
            return None
        if split.spill_bytes > SPILL_SLACK_BYTES or split.programs_per_sm == 0:
            continue
        in_flight = split.programs_per_sm * step_bytes(layer, tile_n)
        enough = saturates(layer, tile_n, in_flight)
        if not enough and short is not None and short[0] >= in_flight:
            continue
        whole = fit(tile, LaunchForm.UNSPLIT)  # unsplit, the tile must not spill either
        if whole is None or whole.spill_bytes > SPILL_SLACK_BYTES or whole.programs_per_sm == 0:
            continue
        if enough:
            return tile
        short = (in_flight, tile)
    return short[1] if short is not None else None


# -- splits ------------------------------------------------------------------------------


def check_forced_splits(value: object) -> int:
    """The ``num_splits`` option as an int: 0 (choose per step) to SPLIT_POLICY.max_splits."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"option num_splits={value!r}: expected an int")
    if not 0 <= value <= SPLIT_POLICY.max_splits:
        raise ConfigError(
            f"option num_splits={value}: expected 0 (auto) to {SPLIT_POLICY.max_splits}"
        )
    return value


@dataclass(frozen=True)
class StepPart:
    """Requests ``[first, end)`` of a step, launched with one plan."""

    first: int
    end: int
    plan: TilePlan


def plan_step(
    layer: LayerShape,
    step: StepShape,
    num_sms: int,
    *,
    forced_splits: int = 0,
    forced_keys: int = 0,
    batch_invariant: bool = False,
    tile: TileConfig | None = None,
    bounded: bool = False,
    fit: FitSource | None = None,
    listing: bool = True,
    unsplit: Callable[[int, int, bool], bool] | None = None,
    free_share: Callable[[int, int], float] | None = None,
) -> tuple[StepPart, ...]:
    """A step's launches: one per part, a part being a run of decode-like requests (at
    most ``SPLIT_POLICY.max_query_len`` queries) or of longer ones. A step made of one
    run of each (the decodes first, as schedulers order them, or last) gets two
    launches, so that its decodes keep their small tiles and splits and its chunks
    their large tiles; any other step, a CUDA-graph step (``bounded``: one plan for
    every step within the bounds), a batch-invariant one or a forced tile gets one.
    ``fit``: the compiled kernels' registers (``FitSource``); ``listing``: fixed key
    ranges may be launched as a list of work items (``range_list_choice``). The parts
    of a two-part step take key ranges of powers of two (``EAGER_RANGE_MULTIPLES``).
    ``unsplit(first, end, whole)``: whether requests ``[first, end)`` (the whole step or
    one of two parts) are planned unsplit, without the split rule: a part that another
    kernel runs whatever the rule would split (the builder's Gluon prefill), whose plan
    here is only its fallback. ``free_share(first, end)``: the share of the GPU's slots
    free when one of two parts launches, the other holding the rest for a while
    (``makespan_splits``; default: all of them)."""
    n = len(step.query_lens)
    parts = [(0, n)]
    if not (bounded or batch_invariant or tile is not None or forced_splits or forced_keys):
        runs = decode_and_longer_runs(step.query_lens, SPLIT_POLICY.max_query_len)
        if all(end > first for first, end in runs):
            parts = sorted(runs)
    multiples = (1.0,) if len(parts) == 2 else EAGER_RANGE_MULTIPLES
    whole = len(parts) == 1
    return tuple(
        StepPart(
            first,
            end,
            plan_tiles(
                layer,
                step.part(first, end) if (first, end) != (0, n) else step,
                num_sms,
                forced_splits=1 if unsplit and unsplit(first, end, whole) else forced_splits,
                forced_keys=forced_keys,
                batch_invariant=batch_invariant,
                tile=tile,
                bounded=bounded,
                fit=fit,
                listing=listing,
                range_multiples=multiples,
                free_share=1.0 if whole or free_share is None else free_share(first, end),
            ),
        )
        for first, end in parts
    )


def plan_tiles(
    layer: LayerShape,
    step: StepShape,
    num_sms: int,
    *,
    forced_splits: int = 0,
    forced_keys: int = 0,
    batch_invariant: bool = False,
    tile: TileConfig | None = None,
    bounded: bool = False,
    fit: FitSource | None = None,
    listing: bool = True,
    range_multiples: tuple[float, ...] = EAGER_RANGE_MULTIPLES,
    free_share: float = 1.0,
) -> TilePlan:
    """The tiles and splits of one launch over ``step`` (``tile`` overrides the rule's
    tile, ``forced_splits`` its splits, ``forced_keys`` its splits as fixed key ranges
    of that many keys; ``bounded``: a CUDA-graph plan, whose splits each step chooses
    within a width its scratch is sized for once, ``graph_split_limit``;
    ``range_multiples``: the multiples of powers of two an eager step's key ranges
    compare, ``free_share`` the share of the slots free at its launch:
    ``makespan_splits``')."""
    if batch_invariant:
        if forced_splits:
            raise ConfigError(
                f"num_splits={forced_splits}: a batch-invariant plan splits every sequence "
                f"into {BATCH_INVARIANT_KEYS_PER_SPLIT}-key ranges, not into a count"
            )
        # nothing may depend on the batch: the layer's decode tile, fixed key ranges
        tile = tile or invariant_tile(layer)
        keys = max(tile.tile_n, BATCH_INVARIANT_KEYS_PER_SPLIT // tile.tile_n * tile.tile_n)
        splits = max(1, cdiv(step.max_seq_len, keys))
        return TilePlan(tile, _block_q(layer, tile), splits, True, keys // tile.tile_n, True)
    if tile is None:
        block_m, memory_bound = choose_block_m(layer, step)
        tile = choose_tile(layer, block_m, memory_bound, fit)
    block_q = _block_q(layer, tile)
    if forced_keys:
        if layer.window is not None:
            # the reduction merges every range below a row's last key, but the kernel
            # skips those before the window (the rule's own ranges avoid windows too)
            raise ConfigError(
                f"keys_per_split={forced_keys}: fixed key ranges with a sliding window"
            )
        choice = forced_key_ranges(step, tile, forced_keys)
    elif forced_splits:
        choice = SPLIT_POLICY.choose(
            0, step.max_query_len, step.max_seq_len, num_sms, forced=forced_splits,
            granule=tile.tile_n,
        )  # fmt: skip
    elif bounded:
        # a CUDA-graph plan: each step within the bounds chooses its own splits, up to
        # what the most-splitting of them takes (``graph_split_limit``)
        most = graph_split_limit(layer, step, tile, block_q, num_sms, fit)
        # chunk-length queries take even shares: the kernel's check of a fixed range
        # against each query block's keys costs registers, which their tiles have none
        # to spare (H100, fp8 D 128, m64-n32: 169 registers with it, two programs an SM,
        # 166 without, three; the fp8 16:2048:8192:256 step's graph took 282 us with it,
        # 201 without; thirty-ninth session)
        ranges = step.max_query_len <= SPLIT_POLICY.max_query_len
        return TilePlan(
            tile, block_q, most, most > 1, 0, False, dynamic_splits=most > 1, step_ranges=ranges
        )
    else:
        choice = makespan_splits(
            layer, step, tile, block_q, num_sms, fit=fit, key_ranges=True, listing=listing,
            range_multiples=range_multiples, free_share=free_share,
        )  # fmt: skip
    tiles_per_split = choice.keys_per_split // tile.tile_n if choice.fixed_ranges else 0
    return TilePlan(tile, block_q, choice.num_splits, choice.num_splits > 1, tiles_per_split, False)


def forced_key_ranges(step: StepShape, tile: TileConfig, keys: int) -> SplitChoice:
    """Splits of ``keys`` keys each (fixed ranges; tuning, e.g. benchmarks/triton_sweep.py
    --key-ranges): whole key tiles, at most ``SPLIT_POLICY.max_splits`` of the longest
    sequence, for decode-like steps (a chunk's partials would take the scratch of its
    every query row times the ranges)."""
    if step.max_query_len > SPLIT_POLICY.max_query_len:
        raise ConfigError(
            f"keys_per_split={keys}: decode-like steps only (at most "
            f"{SPLIT_POLICY.max_query_len} queries a request; this one has {step.max_query_len})"
        )
    if keys <= 0 or keys % tile.tile_n:
        raise ConfigError(
            f"keys_per_split={keys}: expected a positive multiple of the tile's "
            f"{tile.tile_n} keys ({tile})"
        )
    splits = max(1, cdiv(step.max_seq_len, keys))
    if splits > SPLIT_POLICY.max_splits:
        raise ConfigError(
            f"keys_per_split={keys} cuts a {step.max_seq_len}-key sequence into {splits} "
            f"ranges; at most {SPLIT_POLICY.max_splits}: expected at least "
            f"{cdiv(cdiv(step.max_seq_len, SPLIT_POLICY.max_splits), tile.tile_n) * tile.tile_n}"
        )
    return SplitChoice(splits, keys, fixed_ranges=splits > 1)


def partial_bytes_per_split(layer: LayerShape, tokens: int) -> int:
    """The partial results one split of ``tokens`` query rows writes: an fp32
    accumulator of the padded head size, a running max and a denominator per head."""
    return tokens * layer.num_heads * (layer.head_pad + 2) * 4


def graph_split_limit(
    layer: LayerShape,
    bounds: StepShape,
    tile: TileConfig,
    block_q: int,
    num_sms: int,
    fit: FitSource | None = None,
) -> int:
    """The most splits any step within CUDA-graph bounds (``bounds``: the bounds as a
    step, ``StepShape.of_bounds``) may choose: those of one request of the longest
    query and sequence (a decode-like reservation's: one decode), at the split floor
    of the bounds' fullest step, as far as the partials of the bounds' every token stay
    within ``SPLIT_PARTIAL_BYTES`` and the merge's widest tile. A reservation of chunks
    (the longer launch of a mixed reservation) thus splits a long context's chunk as
    an eager step of the same chunk would, its steps of shorter chunks at most that
    width; bounds of many tokens leave it fewer splits, or none. A
    reservation whose fullest step fills the SMs keeps the narrower grid of that step's
    longer splits: every step replays the grid's width (H200, twenty-sixth session:
    256 x 1024 in its own graph took 265.0 us at 8 splits wide, 262.9 at 2); its steps of
    fewer requests still take short splits up to that width."""
    one = StepShape(bounds.query_lens[:1], bounds.seq_lens[:1])
    most = makespan_splits(
        layer, one, tile, block_q, num_sms, fit=fit, floor_step=bounds
    ).num_splits
    split_bytes = partial_bytes_per_split(layer, int(bounds.query_lens.sum()))
    return min(most, splits_within(SPLIT_PARTIAL_BYTES, split_bytes), SPLIT_POLICY.max_splits)


def step_splits(
    layer: LayerShape,
    step: StepShape,
    plan: TilePlan,
    num_sms: int,
    fit: FitSource | None = None,
    listing: bool = True,
    max_items: int | None = None,
) -> SplitChoice:
    """A step's splits under a CUDA-graph plan with ``dynamic_splits``: the makespan
    rule over the step's own requests (even shares or fixed key ranges), with the
    plan's tile, at most the plan's width and, listed, ``max_items`` work items (the
    captured grid's, ``graph_items``). Such a step writes partials and runs the merge
    whatever its splits, so short splits cost it only their programs: it takes the
    sparse floor while its unsplit grid leaves slots of the split kernel free, not only
    SMs (H200, a 32 x 512 step, 256 programs, in a graph reserved for 32k: one split at
    the 512-key floor 29.5 us, two of 256 keys 26.2; thirty-fifth session)."""
    # (the captured launch: a list of work items where listing, else a grid of shares)
    form = LaunchForm.KEY_RANGES if listing else LaunchForm.EVEN_SHARES
    slots = slots_per_sm(layer, plan.tile, form, fit) * num_sms
    return makespan_splits(
        layer, step, plan.tile, plan.block_q, num_sms, max_splits=plan.num_splits, fit=fit,
        key_ranges=plan.step_ranges, listing=listing, max_items=max_items, sparse_below=slots,
    )  # fmt: skip


def graph_items(layer: LayerShape, plan: TilePlan, max_reqs: int, num_sms: int) -> int:
    """Work items of a CUDA-graph plan's listed launch over at most ``max_reqs``
    requests: every split of every request, at most ``GRAPH_ITEM_PROGRAMS_PER_SM`` split
    programs an SM (each item is one program per KV head), at least one item per
    request."""
    programs = GRAPH_ITEM_PROGRAMS_PER_SM * num_sms
    return min(max_reqs * plan.num_splits, max(max_reqs, cdiv(programs, layer.num_kv_heads)))


def one_block_per_request(step: StepShape, block_q: int) -> bool:
    """Whether every request's queries fit one query block: what a launch needs to list
    its work items (``range_list_choice``), and what the split rule then assumes."""
    return step.max_query_len <= block_q


def range_list_choice(step: StepShape, plan: TilePlan) -> SplitChoice | None:
    """The splits a launch of ``plan`` over ``step`` lists as work items (the kernel's
    ``RANGE_LIST``), or None for a (query blocks, splits) grid. A list needs one query
    block per request; it pays for fixed key ranges (which leave the splits past a short
    request's keys empty) and for a CUDA-graph plan's per-step splits (whose grid is
    the most splits for every request of the bounds: past the step's items a program
    exits after one load). ``step``: a CUDA-graph plan's bounds (``StepShape.of_bounds``)."""
    if plan.ordered_reduction or not one_block_per_request(step, plan.block_q):
        return None
    if plan.dynamic_splits:
        return SplitChoice(plan.num_splits, 0)  # the step's own choice: ``work_items``
    if plan.tiles_per_split > 0:
        return SplitChoice(plan.num_splits, plan.tiles_per_split * plan.tile.tile_n, True)
    return None


def work_items(step: StepShape, choice: SplitChoice) -> np.ndarray:
    """Each request's work items in a range-list launch: its fixed key ranges up to its
    last key, or every split of even shares (an even share of a short request may hold
    no key, but the reduction reads every split of one). Requests without queries: none."""
    if choice.fixed_ranges:
        items = np.minimum(-(-step.seq_lens // choice.keys_per_split), choice.num_splits)
    else:
        items = np.full(len(step.seq_lens), choice.num_splits)
    return np.where(step.query_lens > 0, items, 0)


def program_keys(layer: LayerShape, step: StepShape, block_q: int, tile_n: int) -> np.ndarray:
    """Keys each query block of the step visits (one entry per query block, for one KV
    head): the toolkit's ``tile_keys`` over its queries (the kernel's steps ``tile_n``
    keys)."""
    q, seq = step.query_lens, step.seq_lens
    if not step.all_live:
        live = q > 0
        q, seq = q[live], seq[live]
    if step.max_query_len <= block_q:  # one block per request (decodes): its queries
        if layer.window is None:  # the block's last query sees every key
            return seq.astype(np.float64)
        return split_kv.tile_keys(
            seq, q, np.zeros_like(q), q,
            causal=layer.causal, window=layer.window, key_step=tile_n,
        )  # fmt: skip
    blocks = -(-q // block_q)
    owner = np.repeat(np.arange(len(q)), blocks)
    first_block = np.repeat(np.cumsum(blocks) - blocks, blocks)
    first = (np.arange(len(owner)) - first_block) * block_q  # block within its request
    end = np.minimum(first + block_q, q[owner])
    return split_kv.tile_keys(
        seq[owner], q[owner], first, end,
        causal=layer.causal, window=layer.window, key_step=tile_n,
    )  # fmt: skip


def makespan_splits(
    layer: LayerShape,
    step: StepShape,
    tile: TileConfig,
    block_q: int,
    num_sms: int,
    *,
    max_splits: int | None = None,
    fit: FitSource | None = None,
    key_ranges: bool = False,
    listing: bool = True,
    max_items: int | None = None,
    range_multiples: tuple[float, ...] = (1.0,),
    floor_step: StepShape | None = None,
    sparse_below: int | None = None,
    free_share: float = 1.0,
) -> SplitChoice:
    """Splits by the toolkit's makespan rule, over the programs this tile gives and the
    programs an SM holds of it, launched split and unsplit (``slots_per_sm``).
    A step may split up to the policy's maximum (or ``max_splits``), as far as its
    partial results stay within ``SPLIT_PARTIAL_BYTES``. ``key_ranges``: a split may also be a fixed key range
    of every sequence (the toolkit rule's ``key_ranges``), which balances a ragged batch
    (not with a sliding window: a range is absolute, the grid would have to cover the
    keys before the window). ``listing``: a step of one query block per request then
    launches only the ranges that hold keys (``range_list_choice``), at most
    ``max_items`` of them (a CUDA-graph grid's). ``range_multiples``: the key ranges
    compared, powers of two of the tile times each of these. ``floor_step``: the step
    whose unsplit grid decides the fewest keys a split keeps (``SplitPolicy.key_floor``;
    default: this one); ``sparse_below``: the grid size (programs of all KV heads) below
    which it keeps the sparse floor (default: the SM count); ``free_share``: the share of
    the slots free when the launch starts, another launch (a two-part step's other
    part, beside it) holding the rest for a while: a grid of more programs than those
    pays the tail of several waves (``SplitPolicy.choose_by_makespan``)."""
    split_bytes = partial_bytes_per_split(layer, int(step.query_lens.sum()))
    limit = min(splits_within(SPLIT_PARTIAL_BYTES, split_bytes), SPLIT_POLICY.max_splits)
    if max_splits is not None:
        limit = min(limit, max_splits)
    key_ranges = key_ranges and layer.window is None
    keys, split_slots, range_slots, costs = _makespan_inputs(
        layer, step, tile, block_q, num_sms, fit, key_ranges and limit > 1
    )
    floor_keys = (
        keys if floor_step is None else program_keys(layer, floor_step, block_q, tile.tile_n)
    )
    return SPLIT_POLICY.choose_by_makespan(
        keys,
        slots_per_sm(layer, tile, LaunchForm.UNSPLIT, fit) * num_sms,
        **costs,
        max_splits=limit,
        split_slots=split_slots,
        range_slots=range_slots,
        key_ranges=key_ranges,
        # fixed key ranges launched as a list of the ranges that hold keys
        listed=listing and one_block_per_request(step, block_q),
        max_programs=max_items,
        range_multiples=range_multiples,
        min_keys_per_split=SPLIT_POLICY.key_floor(
            len(floor_keys) * layer.num_kv_heads, sparse_below or num_sms
        ),
        free_share=free_share,
    )


def key_range_estimates(
    layer: LayerShape,
    step: StepShape,
    tile: TileConfig,
    keys_per_split: list[int],
    num_sms: int,
    fit: FitSource | None = None,
    listing: bool = True,
) -> np.ndarray:
    """The makespan rule's estimate (in keys) of ``step`` split into fixed ranges of each
    of ``keys_per_split`` keys with ``tile``: what benchmarks/triton_sweep.py
    --key-ranges records beside each measured range."""
    block_q = _block_q(layer, tile)
    keys, split_slots, range_slots, costs = _makespan_inputs(
        layer, step, tile, block_q, num_sms, fit, True
    )
    assert range_slots is not None
    return SPLIT_POLICY.key_range_estimates(
        keys, range_slots, keys_per_split, **costs,
        listed=listing and one_block_per_request(step, block_q), split_slots=split_slots,
    )  # fmt: skip


def _makespan_inputs(
    layer: LayerShape,
    step: StepShape,
    tile: TileConfig,
    block_q: int,
    num_sms: int,
    fit: FitSource | None,
    key_ranges: bool,
) -> tuple[np.ndarray, int, int | None, dict[str, Any]]:
    """The makespan rule's view of a step with ``tile``: each program's keys, the slots
    of a split launch in even shares and, where ``key_ranges`` are compared, in fixed key
    ranges (else None: no probe of that variant), and the costs (key step, program
    overhead, merge, copies)."""
    split_bytes = partial_bytes_per_split(layer, int(step.query_lens.sum()))
    split_slots = slots_per_sm(layer, tile, LaunchForm.EVEN_SHARES, fit) * num_sms
    range_slots = None
    if key_ranges:
        range_slots = slots_per_sm(layer, tile, LaunchForm.KEY_RANGES, fit) * num_sms
    costs = dict(
        granule=tile.tile_n,
        overhead_keys=PROGRAM_OVERHEAD_KEYS,
        merge_keys_per_split=merge_keys_per_split(
            split_bytes, split_slots, layer.head_size, layer.cache_bytes
        ),
        copies=layer.num_kv_heads,
    )
    return program_keys(layer, step, block_q, tile.tile_n), split_slots, range_slots, costs


def invariant_tile(layer: LayerShape) -> TileConfig:
    """The batch-invariant mode's one tile per layer: the decode tile (the mode's
    speed target is decode; prefills run with it too)."""
    block_m = max(16, next_power_of_2(layer.group))
    return choose_tile(layer, block_m, memory_bound=True)


def _block_q(layer: LayerShape, tile: TileConfig) -> int:
    block_q = tile.block_m // layer.group
    if block_q < 1:
        raise ConfigError(
            f"tile {tile}: block_m {tile.block_m} is smaller than the GQA group {layer.group}"
        )
    return block_q


# values one program of the split merge holds at once: enough loads in flight to hide
# the latency of a merge that is a few hundred bytes per head
REDUCE_TILE_VALUES = 4096
# The narrowest tile of a merge whose rows take fewer splits than its most (a CUDA-graph
# plan's, fixed key ranges'): a row of fewer splits is merged in a tile this wide, of
# REDUCE_TILE_VALUES values, so that a step of one split still spreads its rows' heads
# over several programs (H200, twenty-fifth session: a 64 x 1024 step of one split in a
# graph reserved for 32k took 70.7 us at 4 heads x 8 splits a program, 80.5 at 64 x 1)
REDUCE_MIN_WIDTH = 8


def reduce_tile(split_pad: int, head_pad: int, num_heads: int, ordered: bool) -> tuple[int, int]:
    """(query heads per program, warps) of the split merge: as many heads as fit
    ``REDUCE_TILE_VALUES`` (all splits of a head at once, or one split at a time when
    ``ordered``), at least one; 8 warps when one head's splits are a wider tile."""
    width = 1 if ordered else split_pad
    fit = max(1, REDUCE_TILE_VALUES // (width * head_pad))
    block_h = min(prev_power_of_2(fit), next_power_of_2(num_heads))
    return block_h, 8 if block_h * width * head_pad > 8192 else 4


# values the attention kernel's merging program (MERGE_LAST) loads at once: 32 a thread
# at four warps. It merges after its main loop, whose registers bind it: 8 splits of a
# decode's 4 rows x D 128 kept the listed CUDA-graph variant at 128 registers (four
# programs an SM), 16 took it to 153 (sm_90, forty-fifth session)
MERGE_TILE_VALUES = 4096
# the most rounds of loads a block's merging program takes (``merge_chunk`` splits a
# round): its rounds are one after the other, at the launch's end for its last block,
# where the merge kernel loads every row at once (the builder's ``_merges_in_attention``)
MERGE_ROUNDS = 2


def merge_rows(layer: LayerShape, query_rows: int) -> int:
    """The rows a block's merging program holds (its MERGE_ROWS): the block's query
    rows that may hold tokens (``query_rows``: at most the launch's longest query, one
    for decodes) times the GQA group, to a power of two. A decode's m16 block holds one
    token's 4 rows of GQA 4: merged as its 16, its tile held four times the values."""
    return next_power_of_2(query_rows * layer.group)


def merges_last(layer: LayerShape, query_rows: int) -> bool:
    """Whether a split launch of one query block per request may merge in its last
    program of each block (MERGE_LAST): where the block's rows take at most half of
    ``MERGE_TILE_VALUES`` (decodes of GQA groups up to 16 at D 128), so that a round
    loads two splits or more. A block of a chunk's queries (64 rows and more) merged in
    a program that holds its m64 tile's registers: 255 registers and a spill (sm_90,
    D 128)."""
    return merge_rows(layer, query_rows) * layer.head_pad <= MERGE_TILE_VALUES // 2


def merge_chunk(plan: TilePlan, layer: LayerShape, query_rows: int) -> int:
    """Splits the merging program of a block loads in one round (its MERGE_CHUNK): as
    many of its rows' partials as ``MERGE_TILE_VALUES`` hold, at most the plan's."""
    fit = max(1, MERGE_TILE_VALUES // (merge_rows(layer, query_rows) * layer.head_pad))
    return min(prev_power_of_2(fit), next_power_of_2(plan.num_splits))
