"""The Hopper (sm_90) MLA attention kernel, written in Gluon (Triton's explicit-layout
dialect); device code only (plan.py plans its launch).

Why a second kernel: in ``_mla_attention`` (kernels.py) every warp runs the same
program, so the softmax of a tile and its matmuls take turns on one instruction
stream. Here two warpgroups run different programs (``gl.warp_specialize``) over one
tile of 64 query rows (the heads of one token, for decode) of one request and one KV
split, and hand work back and forth like FlashMLA's sm_90 decode kernel:

- latent tiles (64 rows) come in pairs: warpgroup 0 computes the full scores
  S0 = Q·K0^T of the first, warpgroup 1 S1 = Q·K1^T of the second (all 576 columns,
  no score computed twice), each in its own registers;
- the output is split by columns: warpgroup 0 owns latent columns [0, L/2),
  warpgroup 1 [L/2, L), so each runs P0·V0 and P1·V1 on its half;
- warpgroup 0 hands its P0 (at its own row max) and that max to warpgroup 1 through
  shared memory; warpgroup 1 takes the pair's max (its own includes 0's), moves P0
  to it and runs P0·V0 first, then P1·V1, and hands P1 and the max back; warpgroup 0
  rescales its half and runs P1·V1. While one warpgroup does its softmax the other
  keeps the tensor cores busy, and P0 and P1 share one buffer;
- the query stays in shared memory; the two tiles of a pair sit in a two-slot ring,
  each slot in two halves (the left half of kv_c; the right half with k_pe) loaded in
  pieces with a barrier each, so scores start on the first piece. A half is refilled
  by the warpgroup that reads it last as soon as its last P·V retires (three of the
  four halves mid-pair), and each warpgroup first computes the scores of the half it
  loaded itself. Q (72 KiB) + 2 tiles (144 KiB) + P (8 KiB) fill sm_90's 227 KiB;
- a pair past the KV range's end (odd tile count) reads rows past the cache through
  TMA, which fills zeros, and masks them: no block-table entry past the request's
  blocks is read;
- the output leaves through the ring (free once both warpgroups are done with it), read
  back as 16-byte vectors so that each warp writes whole rows (``_store_rows``).

It computes what ``_mla_attention`` does (the same tiles, split-KV partial outputs
and log2-sum-exp for ``_mla_reduce``, causal limit per row; P0 is rounded to 16 bits
once more, when moved to the pair's max) for 16-bit
queries and caches with kv_lora_rank 128, 256 or 512; fp8 caches, fp32, other GPUs
and the interpreter use the Triton kernel. ``plan.gluon_problem`` says when this one is
chosen. A tile with no query rows (the padding of a CUDA-graph step) does nothing.
"""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# shared-memory barriers between the two warpgroups
_P0 = gl.constexpr(1)  # warpgroup 0's P0 (at its own max) is in the P buffer, the max in stats[0]
_P1 = gl.constexpr(2)  # warpgroup 1's P1 (at the pair's max) is there, the max in stats[1]
_SUM = gl.constexpr(3)  # (+ warpgroup) the row sums are in stats[2 + warpgroup]


@gluon.jit
def _tile_row(table_row, kv_lo, j, n_iter, oob_row, BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr):
    """The cache row where latent tile j of this split starts (tiles start at multiples
    of TILE_N, so each lies inside one block); past the last tile, a row past the cache,
    which TMA reads as zeros."""
    start = kv_lo + j * TILE_N
    block = gl.load(table_row + start // BLOCK_SIZE, mask=j < n_iter, other=0)
    return gl.where(j < n_iter, block * BLOCK_SIZE + start % BLOCK_SIZE, oob_row)


@gluon.jit
def _load_half(half_desc, rope_desc, kn_ring, kr_ring, load_bars, slot, row, pred,
               HALF_IDX: gl.constexpr, L: gl.constexpr):  # fmt: skip
    """TMA of one half of the latent tile at cache row ``row`` into ring slot ``slot``:
    the left half of kv_c (HALF_IDX 0), or its right half and k_pe (HALF_IDX 1), in
    pieces of the descriptor's box width, each on its own barrier (k_pe on the last)."""
    W: gl.constexpr = half_desc.block_type.shape[1]
    for k in gl.static_range(L // 2 // W):
        bar = load_bars.index((slot * 2 + HALF_IDX) * (L // 2 // W) + k)
        dst = kn_ring.index(slot).slice(HALF_IDX * (L // 2) + k * W, W, dim=1)
        if HALF_IDX == 1 and k == L // 2 // W - 1:
            mbarrier.expect(bar, half_desc.block_type.nbytes + rope_desc.block_type.nbytes,
                            pred=pred)  # fmt: skip
            tma.async_copy_global_to_shared(half_desc, [row, HALF_IDX * (L // 2) + k * W], bar,
                                            dst, pred=pred)  # fmt: skip
            tma.async_copy_global_to_shared(
                rope_desc, [row, L], bar, kr_ring.index(slot), pred=pred
            )
        else:
            mbarrier.expect(bar, half_desc.block_type.nbytes, pred=pred)
            tma.async_copy_global_to_shared(half_desc, [row, HALF_IDX * (L // 2) + k * W], bar,
                                            dst, pred=pred)  # fmt: skip


@gluon.jit
def _load_query(qn_desc, qp_desc, q_nope_s, q_rope_s, q_bar, tok, head0, pred,
                L: gl.constexpr):  # fmt: skip
    """TMA of the tile's query rows into shared memory, on ``q_bar``: from token ``tok``,
    head ``head0``, a box of [tokens, heads] = [1, 64] (64 heads or more) or
    [64 / heads, heads] (fewer), so that its rows are the tile's (token-major, as
    ``TileRow0`` counts them). Rows past the query tensor's tokens come as zeros; rows of
    the next request's tokens (a partial tile) are loaded but never stored."""
    BOX_T: gl.constexpr = qn_desc.block_type.shape[0]
    BOX_H: gl.constexpr = qn_desc.block_type.shape[1]
    W: gl.constexpr = qn_desc.block_type.shape[2]
    R: gl.constexpr = qp_desc.block_type.shape[2]
    nbytes: gl.constexpr = (L // W) * qn_desc.block_type.nbytes + qp_desc.block_type.nbytes
    mbarrier.expect(q_bar, nbytes, pred=pred)
    for c in gl.static_range(L // W):
        dst = q_nope_s.index(c).reshape([BOX_T, BOX_H, W])
        tma.async_copy_global_to_shared(qn_desc, [tok, head0, c * W], q_bar, dst, pred=pred)
    tma.async_copy_global_to_shared(qp_desc, [tok, head0, 0], q_bar,
                                    q_rope_s.reshape([BOX_T, BOX_H, R]), pred=pred)  # fmt: skip


@gluon.jit
def _score_half(s, q_nope_s, q_rope_s, kn, kr, load_bars, slot, phase, W: gl.constexpr,
                HALF_IDX: gl.constexpr, FIRST: gl.constexpr, L: gl.constexpr):  # fmt: skip
    """Chain one half of S = Q·K^T (the right half with the rope part) into s as
    asynchronous wgmmas, each piece of W columns once it has landed."""
    for k in gl.static_range(L // 2 // W):
        mbarrier.wait(load_bars.index((slot * 2 + HALF_IDX) * (L // 2 // W) + k), phase)
        for c in gl.static_range(W // 64):
            s = warpgroup_mma(
                q_nope_s.index((HALF_IDX * (L // 2) + k * W) // 64 + c),
                kn.slice(HALF_IDX * (L // 2) + k * W + c * 64, 64, dim=1).permute((1, 0)),
                s,
                use_acc=(k > 0) or (c > 0) or not FIRST,
                is_async=True,
            )
    if HALF_IDX == 1:
        s = warpgroup_mma(q_rope_s, kr.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _masked(s, tile, kv_lo, kv_hi, q_pos, qk_scale, s_layout: gl.constexpr,
            TILE_N: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    """Scores in the log2 domain; keys past the split's range (or, causal, past the
    row's own position) at -inf."""
    pos = kv_lo + tile * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
    visible = gl.expand_dims(pos < kv_hi, 0)
    if CAUSAL:
        visible = visible & (gl.expand_dims(pos, 0) <= gl.expand_dims(q_pos, 1))
    return gl.where(visible, s * qk_scale, float("-inf"))


@gluon.jit
def _store_rows(vals, stage, base, stride_t, stride_h, row0, col0, q_start, q_len,
                NUM_HEADS: gl.constexpr, TILE_M: gl.constexpr, WIDTH: gl.constexpr,
                VEC: gl.constexpr):  # fmt: skip
    """Store a warpgroup's output block (rows ``row0 + i``: token ``i // NUM_HEADS`` of
    the request, head ``i % NUM_HEADS``; columns from ``col0``) at ``base + token *
    stride_t + head * stride_h + column``, through ``stage`` in shared memory. Stored
    straight from the wgmma layout, each instruction wrote 4 bytes to each of 8 rows
    (half-used 32-byte sectors, 64 to 128 instructions a thread: 6-7 µs of a program on
    the H200, a 16-tile program's loop taking 32); read back as VEC-element (16-byte)
    vectors, 8 threads write a row's 128 contiguous bytes (2.7 µs). Warp w reads back the
    16 rows it wrote; the barrier orders the whole warpgroup's stores before the loads."""
    stage.store(vals)
    gl.thread_barrier()
    rows_layout: gl.constexpr = gl.BlockedLayout([4, VEC], [4, 8], [4, 1], [1, 0])
    out = stage.load(rows_layout)
    rows = row0 + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, rows_layout))
    cols = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, rows_layout))
    tok = (q_start + rows // NUM_HEADS).to(gl.int64)
    offsets = gl.expand_dims(tok * stride_t + (rows % NUM_HEADS) * stride_h, 1)
    # rows past the request's tokens (a partial tile) stay unwritten; the columns' test
    # only broadcasts the mask
    live = gl.expand_dims(rows // NUM_HEADS < q_len, 1) & gl.expand_dims(cols >= 0, 0)
    gl.store(base + offsets + gl.expand_dims(cols, 0), out, mask=live)


@gluon.jit
def _warpgroup(a, NUM_HEADS: gl.constexpr, L: gl.constexpr, BLOCK_SIZE: gl.constexpr,
               TILE_M: gl.constexpr, TILE_N: gl.constexpr, ONE_SPLIT: gl.constexpr,
               CAUSAL: gl.constexpr, WG: gl.constexpr):  # fmt: skip
    """The program of warpgroup WG (0 or 1); see the module doc for the schedule."""
    (q_nope_s, q_rope_s, kn_ring, kr_ring, p_s, stats, load_bars, sync_bars, q_bar,
     half_desc, rope_desc, table_row, kv_lo, kv_hi, n_iter, oob_row, row0, context_len,
     q_start, q_len, qk_scale, split, ranges, partial0, Out, MidO, MidLse, stride_o_t,
     stride_o_h) = a  # fmt: skip
    dtype: gl.constexpr = half_desc.dtype
    HALF: gl.constexpr = L // 2
    W: gl.constexpr = half_desc.block_type.shape[1]  # latent columns per TMA piece
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    # causal limit of each score row: its token's absolute position
    q_pos = context_len + (row0 + gl.arange(0, TILE_M, layout=row_s)) // NUM_HEADS
    m_i = gl.full([TILE_M], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([TILE_M], gl.float32, layout=row_s)
    o = gl.zeros([TILE_M, HALF], gl.float32, layout=o_layout)
    n_pairs = (n_iter + 1) // 2
    # the query has landed (a program without keys loads none)
    mbarrier.wait(q_bar, 0, pred=n_iter > 0)
    for i in range(n_pairs):
        ph = i & 1
        more = i + 1 < n_pairs
        kn = kn_ring.index(WG)
        kr = kr_ring.index(WG)
        # the scores of tile 2i + WG, the half this warpgroup loaded itself first
        s = gl.zeros([TILE_M, TILE_N], gl.float32, layout=s_layout)
        s = _score_half(s, q_nope_s, q_rope_s, kn, kr, load_bars, WG, ph, W, WG, True, L)
        s = _score_half(s, q_nope_s, q_rope_s, kn, kr, load_bars, WG, ph, W, 1 - WG, False, L)
        s = warpgroup_mma_wait(0, deps=[s])
        s = _masked(s, 2 * i + WG, kv_lo, kv_hi, q_pos, qk_scale, s_layout, TILE_N, CAUSAL)
        if WG == 0:
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            # P0 and its max for warpgroup 1, which moves it to the pair's max itself
            p16 = p.to(dtype)
            stats[0].store(m_new)
            p_s.store(p16)
            mbarrier.arrive(sync_bars.index(_P0), count=1)
            o = warpgroup_mma(gl.convert_layout(p16, p_op), kn.slice(0, HALF, dim=1), o,
                              is_async=True)  # fmt: skip
            o = warpgroup_mma_wait(0, deps=[o])
            # P0·V0 retired: this slot's left half takes the next pair's first tile
            row = _tile_row(table_row, kv_lo, 2 * i + 2, n_iter, oob_row, BLOCK_SIZE, TILE_N)
            _load_half(half_desc, rope_desc, kn_ring, kr_ring, load_bars, 0, row, more, 0, L)
            # warpgroup 1's P1, at the pair's max
            mbarrier.wait(sync_bars.index(_P1), ph)
            m_pair = stats[1].load(row_s)
            p_other = p_s.load(p_op)
            beta = gl.exp2(m_new - m_pair)
            o = o * gl.expand_dims(gl.convert_layout(beta, row_o), 1)
            l_i = l_i * beta
            m_i = m_pair
            o = warpgroup_mma(p_other, kn_ring.index(1).slice(0, HALF, dim=1), o, is_async=True)
            # not carried into the next pair: ptxas then serialises every wgmma (C7514)
            o = warpgroup_mma_wait(0, deps=[o])
            row = _tile_row(table_row, kv_lo, 2 * i + 3, n_iter, oob_row, BLOCK_SIZE, TILE_N)
            _load_half(half_desc, rope_desc, kn_ring, kr_ring, load_bars, 1, row, more, 0, L)
        else:
            # the pair's max includes warpgroup 0's; P0 moves to it here
            mbarrier.wait(sync_bars.index(_P0), ph)
            m_0 = stats[0].load(row_s)
            m_new = gl.maximum(m_0, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p0 = p_s.load(s_layout).to(gl.float32) * gl.expand_dims(gl.exp2(m_0 - m_new), 1)
            o = warpgroup_mma(gl.convert_layout(p0.to(dtype), p_op),
                              kn_ring.index(0).slice(HALF, HALF, dim=1), o, is_async=True)  # fmt: skip
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p16 = p.to(dtype)
            stats[1].store(m_new)
            p_s.store(p16)
            mbarrier.arrive(sync_bars.index(_P1), count=1)
            o = warpgroup_mma(gl.convert_layout(p16, p_op), kn.slice(HALF, HALF, dim=1), o,
                              is_async=True)  # fmt: skip
            o = warpgroup_mma_wait(1, deps=[o])
            # P0·V0 retired: slot 0's right half takes the next pair's first tile
            row = _tile_row(table_row, kv_lo, 2 * i + 2, n_iter, oob_row, BLOCK_SIZE, TILE_N)
            _load_half(half_desc, rope_desc, kn_ring, kr_ring, load_bars, 0, row, more, 1, L)
            o = warpgroup_mma_wait(0, deps=[o])
            row = _tile_row(table_row, kv_lo, 2 * i + 3, n_iter, oob_row, BLOCK_SIZE, TILE_N)
            _load_half(half_desc, rope_desc, kn_ring, kr_ring, load_bars, 1, row, more, 1, L)

    # each warpgroup summed the probabilities of its own tiles
    stats[2 + WG].store(l_i)
    mbarrier.arrive(sync_bars.index(_SUM + WG), count=1)
    mbarrier.wait(sync_bars.index(_SUM + 1 - WG), 0)
    l_i = l_i + stats[3 - WG].load(row_s)

    # -- output: final rows (a request of one range), or this range's normalised part and
    # its log2-sum-exp (slots: the tile's first token's ranges from partial0, each later
    # token's ``ranges`` further on)
    l_o = gl.convert_layout(l_i, row_o)
    o = o / gl.expand_dims(gl.where(l_o == 0.0, 1.0, l_o), 1)
    # the ring is free: both warpgroups passed the sums' barrier after their last P·V,
    # and no load is in flight past the last pair
    out_stage = kn_ring.index(0).slice(WG * HALF, HALF, dim=1)
    # the final rows' store twice: a one-split kernel has no `ranges` to test (a runtime
    # test of a constant, with the partial branch beside it, crashed Triton 3.6's
    # lowering to LLVM)
    if ONE_SPLIT:
        _store_rows(o.to(Out.dtype.element_ty), out_stage, Out, stride_o_t, stride_o_h, row0,
                    WG * HALF, q_start, q_len, NUM_HEADS, TILE_M, HALF, 8)  # fmt: skip
    else:
        if ranges == 1:
            _store_rows(o.to(Out.dtype.element_ty), out_stage, Out, stride_o_t, stride_o_h, row0,
                        WG * HALF, q_start, q_len, NUM_HEADS, TILE_M, HALF, 8)  # fmt: skip
        else:
            f32_layout: gl.constexpr = gl.NVMMASharedLayout(128, 32)
            part_stage = kn_ring._reinterpret(gl.float32, [2, TILE_M, HALF], f32_layout).index(WG)
            first = MidO + (partial0 + split).to(gl.int64) * (NUM_HEADS * L)
            tok0 = row0 // NUM_HEADS
            _store_rows(o, part_stage, first, ranges * (NUM_HEADS * L), L, row0, WG * HALF,
                        -tok0, q_len, NUM_HEADS, TILE_M, HALF, 4)  # fmt: skip
            if WG == 0:
                o_rows = row0 + gl.arange(0, TILE_M, layout=row_o)
                slot = partial0 + (o_rows // NUM_HEADS - tok0) * ranges + split
                m_o = gl.convert_layout(m_i, row_o)
                lse = gl.where(l_o == 0.0, float("-inf"), m_o + gl.log2(gl.maximum(l_o, 1e-30)))
                gl.store(MidLse + slot.to(gl.int64) * NUM_HEADS + o_rows % NUM_HEADS, lse,
                         mask=o_rows // NUM_HEADS < q_len)  # fmt: skip


@gluon.jit
def _warpgroup0(a, NUM_HEADS: gl.constexpr, L: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                TILE_M: gl.constexpr, TILE_N: gl.constexpr, ONE_SPLIT: gl.constexpr,
                CAUSAL: gl.constexpr):  # fmt: skip
    _warpgroup(a, NUM_HEADS, L, BLOCK_SIZE, TILE_M, TILE_N, ONE_SPLIT, CAUSAL, 0)


@gluon.jit
def _warpgroup1(a, NUM_HEADS: gl.constexpr, L: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                TILE_M: gl.constexpr, TILE_N: gl.constexpr, ONE_SPLIT: gl.constexpr,
                CAUSAL: gl.constexpr):  # fmt: skip
    _warpgroup(a, NUM_HEADS, L, BLOCK_SIZE, TILE_M, TILE_N, ONE_SPLIT, CAUSAL, 1)


@gluon.jit
def _mla_attention_sm90(
    qn_desc,  # the absorbed q_nope [T, H, L], box [tokens, heads, 64] of one tile's rows
    qp_desc,  # q_pe [T, H, R], the same box but R wide
    half_desc,  # the cache as [num_blocks * BLOCK_SIZE, L + R], box [TILE_N, piece_width(L)]
    rope_desc,  # the same rows, box [TILE_N, R]
    # the step's tables, work items, partial slots and output: _mla_attention's
    BlockTable,
    SeqLens,
    QueryStartLoc,
    TileReq,
    TileRow0,
    TileSplit,
    TileKeys,
    TokenRanges,
    TokenPartial,
    Out,
    MidO,
    MidLse,
    stride_bt,
    stride_o_t,
    stride_o_h,
    qk_scale,  # softmax scale * log2(e)
    oob_row,  # a cache row past the last one (TMA reads zeros there)
    NUM_HEADS: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    TILE_M: gl.constexpr,
    TILE_N: gl.constexpr,
    ONE_SPLIT: gl.constexpr,
    CAUSAL: gl.constexpr,
    WORKER_REGS: gl.constexpr,
    LAUNCH_DEPENDENTS: gl.constexpr,  # the reduction is this launch's programmatic dependent
):
    if LAUNCH_DEPENDENTS:
        # the reduction may take the SMs this grid leaves: it waits for the grid's end
        # before it reads a partial
        tl.extra.cuda.gdc_launch_dependents()
    dtype: gl.constexpr = half_desc.dtype
    item = gl.program_id(0)
    # (the four loads before the test: one memory round trip at the program's start)
    req = gl.load(TileReq + item)
    row0 = gl.load(TileRow0 + item)
    split = gl.load(TileSplit + item)
    kv_per_split = gl.load(TileKeys + item)  # a multiple of TILE_N
    if kv_per_split == 0:
        return  # a CUDA-graph grid's padding item: its program ends at once
    q_start = gl.load(QueryStartLoc + req)
    q_len = gl.load(QueryStartLoc + req + 1) - q_start
    seq_len = gl.load(SeqLens + req)
    context_len = seq_len - q_len
    last_tok = gl.minimum(row0 + TILE_M - 1, q_len * NUM_HEADS - 1) // NUM_HEADS
    kv_len = context_len + last_tok + 1 if CAUSAL else seq_len
    # a tile with no query rows (CUDA-graph padding): no loads, no block-table reads,
    # no stores (every row is masked)
    kv_len = gl.where(row0 < q_len * NUM_HEADS, kv_len, 0)
    kv_lo = split * kv_per_split
    kv_hi = gl.minimum(kv_len, kv_lo + kv_per_split)
    n_iter = (gl.maximum(kv_hi - kv_lo, 0) + TILE_N - 1) // TILE_N
    table_row = BlockTable + req.to(gl.int64) * stride_bt

    # -- shared memory: the query, a two-slot latent ring, P, row statistics, barriers --
    # the query in pieces of 64 columns, as TMA boxes bring them and wgmmas read them
    q_nope_s = gl.allocate_shared_memory(dtype, [L // 64, TILE_M, 64], rope_desc.layout)
    q_rope_s = gl.allocate_shared_memory(dtype, [TILE_M, R], rope_desc.layout)
    kn_ring = gl.allocate_shared_memory(dtype, [2, TILE_N, L], rope_desc.layout)
    kr_ring = gl.allocate_shared_memory(dtype, [2, TILE_N, R], rope_desc.layout)
    p_s = gl.allocate_shared_memory(dtype, [TILE_M, TILE_N], rope_desc.layout)
    # row max of warpgroup 0, of warpgroup 1, row sums of 0, of 1
    stats_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    stats = (
        gl.allocate_shared_memory(gl.float32, [TILE_M], stats_layout),
        gl.allocate_shared_memory(gl.float32, [TILE_M], stats_layout),
        gl.allocate_shared_memory(gl.float32, [TILE_M], stats_layout),
        gl.allocate_shared_memory(gl.float32, [TILE_M], stats_layout),
    )
    load_bars = gl.allocate_shared_memory(gl.int64, [16, 1], mbarrier.MBarrierLayout())
    sync_bars = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(16):
        mbarrier.init(load_bars.index(i), count=1)
    for i in gl.static_range(8):
        mbarrier.init(sync_bars.index(i), count=1)
    mbarrier.init(q_bar, count=1)

    # the query through TMA before the first tiles' block-table reads (each tile's TMA
    # waits on one; the query then queued behind both tiles: 1x32k 42.0 -> 39.2 µs on the
    # H200 when it still came through registers, which took 5.4 µs of a program's start)
    _load_query(qn_desc, qp_desc, q_nope_s, q_rope_s, q_bar, q_start + row0 // NUM_HEADS,
                row0 % NUM_HEADS, n_iter > 0, L)  # fmt: skip
    ranges = 1
    partial0 = 0
    if not ONE_SPLIT:
        # the request's ranges and the tile's first token's first partial slot (a padding
        # item's token may lie past the tables: it stores nothing)
        live = row0 < q_len * NUM_HEADS
        ranges = gl.load(TokenRanges + q_start + row0 // NUM_HEADS, mask=live, other=1)
        partial0 = gl.load(TokenPartial + q_start + row0 // NUM_HEADS, mask=live, other=0)
    for t in gl.static_range(2):
        row = _tile_row(table_row, kv_lo, t, n_iter, oob_row, BLOCK_SIZE, TILE_N)
        for half in gl.static_range(2):
            _load_half(half_desc, rope_desc, kn_ring, kr_ring, load_bars, t, row, n_iter > 0,
                       half, L)  # fmt: skip

    a = (q_nope_s, q_rope_s, kn_ring, kr_ring, p_s, stats, load_bars, sync_bars, q_bar,
         half_desc, rope_desc, table_row, kv_lo, kv_hi, n_iter, oob_row, row0, context_len,
         q_start, q_len, qk_scale, split, ranges, partial0, Out, MidO, MidLse, stride_o_t,
         stride_o_h)  # fmt: skip
    gl.warp_specialize(
        [
            (_warpgroup0, (a, NUM_HEADS, L, BLOCK_SIZE, TILE_M, TILE_N, ONE_SPLIT, CAUSAL)),
            (_warpgroup1, (a, NUM_HEADS, L, BLOCK_SIZE, TILE_M, TILE_N, ONE_SPLIT, CAUSAL)),
        ],
        [gl.num_warps()],  # the second warpgroup: as many warps as the first
        [WORKER_REGS],
    )
