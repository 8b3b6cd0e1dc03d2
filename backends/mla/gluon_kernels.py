"""The Hopper (sm_90) MLA attention kernel, written in Gluon (Triton's explicit-layout
dialect), and its launch plan.

Why a second kernel: in ``_mla_attention`` (kernels.py) Triton lays out the chained
``tl.dot`` of a 64-row tile with all 8 warps along the rows, so both warpgroups
compute the whole ``[64, BLOCK_N]`` score tile: Q·K^T, the larger of the two
matmuls (L + R = 576 deep), runs twice. Here the layouts are ours:

- one program = 64 query rows (the heads of one token, for decode) of one request
  and one KV split; 8 warps = two warpgroups;
- S = Q·K^T with the accumulator split by columns (``warps_per_cta=[4, 2]``): each
  warpgroup computes 32 of the 64 keys, so no score is computed twice; the row max
  crosses the warpgroups through shared memory (the compiler does that), the row
  sums are kept per element and reduced once at the end;
- O = P·V with O split by columns as well: warpgroup w owns latent columns
  [w·L/2, (w+1)·L/2); P (bf16/fp16) goes through shared memory (both warpgroups
  need all of it) and V is the latent tile already there (the first L values of
  the same rows as K);
- the query stays in shared memory for the whole KV range; latent tiles of 64 rows
  come by TMA (one page or part of one: ``block_size % 64 == 0``) into a two-slot
  ring (Q and two tiles fill sm_90's 227 KiB). P·V of tile j runs asynchronously
  into iteration j + 1, ahead of that iteration's Q·K^T; as soon as it retires its
  slot takes tile j + 2, so each load has about one iteration to land.

It computes exactly what ``_mla_attention`` does (same tiles, split-KV partial
outputs and log2-sum-exp for ``_mla_reduce``, causal limit per row) for 16-bit
queries and caches; fp8 caches, fp32, other GPUs and the interpreter use the
Triton kernel. ``applies`` says when this one is chosen.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from pagedkv.backends.mla.kernels import LOG2E
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = 64  # query rows per program: one warpgroup's wgmma M
BLOCK_N = 64  # latent rows per step
STAGES = 2  # latent tiles in flight: Q (72 KiB) + 2 x 72 KiB fill sm_90's shared memory
NUM_WARPS = 8  # two warpgroups

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def applies(
    q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, capability: tuple[int, int]
) -> str | None:
    """None when this kernel can run the launch, else why not (the Triton kernel does)."""
    lora, rope, block_size = q_nope.shape[2], q_pe.shape[2], cache.shape[1]
    if capability != (9, 0):
        return f"wgmma needs sm_90 (this device is sm_{capability[0]}{capability[1]})"
    if q_nope.dtype not in _GL_DTYPES or cache.dtype != q_nope.dtype:
        return f"16-bit query and cache only (query {q_nope.dtype}, cache {cache.dtype})"
    if lora not in (64, 128, 256, 512) or rope != 64:
        return f"kv_lora_rank in 64..512 (power of two) and rope 64 only (got {lora}, {rope})"
    if block_size % BLOCK_N:
        return f"block_size {block_size} is not a multiple of {BLOCK_N}"
    width = lora + rope
    if cache.stride() != (block_size * width, width, 1) or cache.data_ptr() % 16:
        return "the cache must be contiguous and 16-byte aligned (TMA)"
    if cache.shape[0] * block_size >= 2**31:
        return "more than 2**31 latent rows (TMA coordinates are 32-bit)"
    return None


@gluon.jit
def _tile_row(table_row, kv_lo, j, n_iter, BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr):
    """The cache row where latent tile j of this split starts (0 past the last tile):
    tiles start at multiples of TILE_N, so each lies inside one block."""
    start = kv_lo + j * TILE_N
    block = gl.load(table_row + start // BLOCK_SIZE, mask=j < n_iter, other=0)
    return block * BLOCK_SIZE + start % BLOCK_SIZE


@gluon.jit
def _issue_tile_load(
    kv_desc, pe_desc, kn_ring, kr_ring, bars, row, j, pred, L: gl.constexpr, STAGES: gl.constexpr
):
    """TMA of latent tile j (from cache row ``row``) into ring slot j % STAGES, if pred."""
    slot = j % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, kv_desc.block_type.nbytes + pe_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, kn_ring.index(slot), pred=pred)
    tma.async_copy_global_to_shared(pe_desc, [row, L], bar, kr_ring.index(slot), pred=pred)


@gluon.jit
def _scores(
    q_nope_s, q_rope_s, kn, kr, s_layout: gl.constexpr, TILE_M: gl.constexpr, TILE_N: gl.constexpr
):
    """S = q_nope·kv_c^T + q_pe·k_pe^T as two asynchronous wgmma groups."""
    s = gl.zeros([TILE_M, TILE_N], gl.float32, layout=s_layout)
    s = warpgroup_mma(q_nope_s, kn.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q_rope_s, kr.permute((1, 0)), s, is_async=True)


@gluon.jit
def _mla_attention_sm90(
    QN,  # [T, H, L] absorbed q_nope
    QP,  # [T, H, R] q_pe
    kv_desc,  # the cache as [num_blocks * BLOCK_SIZE, L + R], box [TILE_N, L]
    pe_desc,  # the same rows, box [TILE_N, R]
    BlockTable,  # [num_reqs, max_blocks] int32
    SeqLens,  # [num_reqs] int32
    QueryStartLoc,  # [num_reqs + 1] int32
    TileReq,  # [num_tiles] int32: the request of each tile
    TileRow0,  # [num_tiles] int32: its first row (token-in-request * H + head)
    Out,  # [T, H, L] (ONE_SPLIT)
    MidO,  # [T, H, num_splits, L] float32 (not ONE_SPLIT)
    MidLse,  # [T, H, num_splits] float32, log2 domain (not ONE_SPLIT)
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_bt,
    stride_o_t,
    stride_o_h,
    qk_scale,  # softmax scale * log2(e)
    kv_per_split,  # KV positions per split, a multiple of TILE_N
    num_splits,
    NUM_HEADS: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    TILE_M: gl.constexpr,
    TILE_N: gl.constexpr,
    STAGES: gl.constexpr,  # latent tiles in flight (ring slots)
    ONE_SPLIT: gl.constexpr,
    CAUSAL: gl.constexpr,
):
    dtype: gl.constexpr = kv_desc.dtype
    # accumulators split by columns between the two warpgroups (see the module doc)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, min(L // 2, 256), 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    q_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])

    tile = gl.program_id(0)
    split = gl.program_id(1)
    req = gl.load(TileReq + tile)
    row0 = gl.load(TileRow0 + tile)
    q_start = gl.load(QueryStartLoc + req)
    q_len = gl.load(QueryStartLoc + req + 1) - q_start
    seq_len = gl.load(SeqLens + req)
    context_len = seq_len - q_len
    last_tok = gl.minimum(row0 + TILE_M - 1, q_len * NUM_HEADS - 1) // NUM_HEADS
    kv_len = context_len + last_tok + 1 if CAUSAL else seq_len
    kv_lo = split * kv_per_split
    kv_hi = gl.minimum(kv_len, kv_lo + kv_per_split)
    n_iter = (gl.maximum(kv_hi - kv_lo, 0) + TILE_N - 1) // TILE_N
    table_row = BlockTable + req.to(gl.int64) * stride_bt

    # -- shared memory: the query, a two-slot latent ring, its barriers ------------------
    q_nope_s = gl.allocate_shared_memory(dtype, [TILE_M, L], kv_desc.layout)
    q_rope_s = gl.allocate_shared_memory(dtype, [TILE_M, R], pe_desc.layout)
    kn_ring = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, L], kv_desc.layout)
    kr_ring = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, R], pe_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_s = gl.allocate_shared_memory(dtype, [TILE_M, TILE_N], pe_desc.layout)  # P, bf16/fp16
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for t in gl.static_range(STAGES):
        row = _tile_row(table_row, kv_lo, t, n_iter, BLOCK_SIZE, TILE_N)
        _issue_tile_load(kv_desc, pe_desc, kn_ring, kr_ring, bars, row, t, t < n_iter, L, STAGES)

    # the query rows through registers (rows past the request's tokens are zero)
    q_rows = row0 + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, q_load))
    q_cols = gl.arange(0, 64, layout=gl.SliceLayout(0, q_load))
    q_tok = (q_start + q_rows // NUM_HEADS).to(gl.int64)
    q_head = q_rows % NUM_HEADS
    q_mask = gl.expand_dims(q_rows // NUM_HEADS < q_len, 1) & gl.expand_dims(q_cols < 64, 0)
    qn_ptr = QN + gl.expand_dims(q_tok * stride_qn_t + q_head * stride_qn_h, 1)
    for c in gl.static_range(L // 64):
        chunk = gl.load(qn_ptr + gl.expand_dims(c * 64 + q_cols, 0), mask=q_mask, other=0.0)
        q_nope_s.slice(c * 64, 64, dim=1).store(chunk)
    qp_ptr = QP + gl.expand_dims(q_tok * stride_qp_t + q_head * stride_qp_h, 1)
    q_rope_s.store(gl.load(qp_ptr + gl.expand_dims(q_cols, 0), mask=q_mask, other=0.0))
    fence_async_shared()  # the wgmma (async proxy) reads what the threads stored

    # causal limit of each score row: its token's absolute position
    s_rows = row0 + gl.arange(0, TILE_M, layout=row_s)
    q_pos = context_len + s_rows // NUM_HEADS
    key_offs = gl.arange(0, TILE_N, layout=col_s)

    m_i = gl.full([TILE_M], -1.0e30, gl.float32, layout=row_s)
    # softmax denominators, summed over the columns only at the end: a per-tile row sum
    # would cross the warpgroups through shared memory every iteration
    l_t = gl.zeros([TILE_M, TILE_N], gl.float32, layout=s_layout)
    # o is carried between iterations as a pending wgmma result (P·V of the last tile)
    o = warpgroup_mma_init(gl.zeros([TILE_M, L], gl.float32, layout=o_layout))
    for j in range(0, n_iter):
        slot = j % STAGES
        # read now, used after the scores: the block-table latency hides behind them
        next_row = _tile_row(table_row, kv_lo, j + STAGES - 1, n_iter, BLOCK_SIZE, TILE_N)
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        s = _scores(q_nope_s, q_rope_s, kn_ring.index(slot), kr_ring.index(slot), s_layout,
                    TILE_M, TILE_N)  # fmt: skip
        # P·V of tile j - 1 was issued before these scores: once it retires, its slot
        # takes tile j + STAGES - 1 (the first STAGES tiles went out before the loop)
        o = warpgroup_mma_wait(2, deps=[o])
        _issue_tile_load(kv_desc, pe_desc, kn_ring, kr_ring, bars, next_row, j + STAGES - 1,
                         (j >= 1) & (j + STAGES - 1 < n_iter), L, STAGES)  # fmt: skip
        s = warpgroup_mma_wait(0, deps=[s])
        pos = kv_lo + j * TILE_N + key_offs
        visible = gl.expand_dims(pos < kv_hi, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(pos, 0) <= gl.expand_dims(q_pos, 1))
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_t = l_t * gl.expand_dims(alpha, 1) + p
        m_i = m_new
        p_s.store(p.to(dtype))
        fence_async_shared()  # the wgmma reads P through the async proxy
        o = warpgroup_mma(p_s, kn_ring.index(slot), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=[o])
    l_i = gl.sum(l_t, axis=1)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    # -- output: final rows, or this split's normalised part and its log2-sum-exp ------
    l_o = gl.convert_layout(l_i, row_o)
    o_rows = row0 + gl.arange(0, TILE_M, layout=row_o)
    o_cols = gl.arange(0, L, layout=col_o)
    o_tok = (q_start + o_rows // NUM_HEADS).to(gl.int64)
    o_head = o_rows % NUM_HEADS
    o_valid = o_rows // NUM_HEADS < q_len
    o_mask = gl.expand_dims(o_valid, 1) & gl.expand_dims(o_cols < L, 0)
    o = o / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
    if ONE_SPLIT:
        out_ptr = Out + gl.expand_dims(o_tok * stride_o_t + o_head * stride_o_h, 1)
        gl.store(out_ptr + gl.expand_dims(o_cols, 0), o.to(Out.dtype.element_ty), mask=o_mask)
    else:
        m_o = gl.convert_layout(m_i, row_o)
        lse = gl.where(l_o == 0.0, float("-inf"), m_o + gl.log2(gl.maximum(l_o, 1e-30)))
        mid_row = (o_tok * NUM_HEADS + o_head) * num_splits + split
        gl.store(MidO + gl.expand_dims(mid_row * L, 1) + gl.expand_dims(o_cols, 0), o, mask=o_mask)
        gl.store(MidLse + mid_row, lse, mask=o_valid)


@dataclass(frozen=True)
class _CacheBase:
    """What a TMA descriptor reads from its base tensor (address and dtype), without
    keeping the cache tensor alive."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


# (address, shape, strides, dtype) of a cache -> its descriptors. Building them costs
# tens of microseconds of Python per call (a decode step is ~100 us on the GPU); the
# same bytes always give the same descriptors, so a reused address is harmless.
_DESCRIPTORS: dict[tuple, tuple[TensorDescriptor, TensorDescriptor]] = {}
_MAX_CACHED = 1024


def descriptors(cache: torch.Tensor, lora: int, rope: int) -> tuple[TensorDescriptor, ...]:
    """TMA descriptors of the cache's latent rows: the kv_c box and the k_pe box."""
    key = (cache.data_ptr(), tuple(cache.shape), cache.stride(), cache.dtype, lora, rope)
    found = _DESCRIPTORS.get(key)
    if found is not None:
        return found
    kv_layout, pe_layout = _layouts(lora, rope, cache.dtype)
    rows = (cache.shape[0] * cache.shape[1], lora + rope)
    base = _CacheBase(cache.data_ptr(), cache.dtype)
    made = (
        TensorDescriptor(base, list(rows), [lora + rope, 1], [BLOCK_N, lora], kv_layout),
        TensorDescriptor(base, list(rows), [lora + rope, 1], [BLOCK_N, rope], pe_layout),
    )
    if len(_DESCRIPTORS) >= _MAX_CACHED:
        _DESCRIPTORS.clear()
    _DESCRIPTORS[key] = made
    return made


@functools.cache
def _layouts(lora: int, rope: int, dtype: torch.dtype) -> tuple:
    gl_dtype = _GL_DTYPES[dtype]
    return (
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, lora], gl_dtype),
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, rope], gl_dtype),
    )


def plan(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    num_splits: int,
    kv_per_split: int,
) -> tuple:
    """The attention launch ``(kernel, grid, args, kwargs)``; tiles of 64 rows."""
    num_heads, lora, rope = q_nope.shape[1], q_nope.shape[2], q_pe.shape[2]
    kv_desc, pe_desc = descriptors(cache, lora, rope)
    args = (
        q_nope,
        q_pe,
        kv_desc,
        pe_desc,
        block_table,
        seq_lens,
        query_start_loc,
        tiles[0],
        tiles[1],
        out,
        mid_o,
        mid_lse,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        kv_per_split,
        num_splits,
    )
    kwargs = dict(
        NUM_HEADS=num_heads,
        L=lora,
        R=rope,
        BLOCK_SIZE=cache.shape[1],
        TILE_M=BLOCK_M,
        TILE_N=BLOCK_N,
        STAGES=STAGES,
        ONE_SPLIT=num_splits == 1,
        CAUSAL=causal,
        num_warps=NUM_WARPS,
    )
    return (_mla_attention_sm90, (tiles.shape[1], num_splits), args, kwargs)
