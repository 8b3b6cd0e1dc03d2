"""Triton kernels of the MLA backend (device code only; plan.py plans their launches).

Two kernels over the latent cache ``[num_blocks, block_size, L + R]`` (the latent write
is the shared writer, ``pagedkv.toolkit.triton_kv_write``):

- ``_mla_attention``: the absorbed attention. One program takes ``BLOCK_M`` query
  rows of one request, a row being a (query token, head) pair laid out token-major,
  so a decode tile is ``BLOCK_M`` heads of one token and a prefill tile holds a few
  tokens times all heads. Every row shares one latent stream, which is why the heads
  sit in the M dimension of ``tl.dot``: K = the whole latent row, V = its first L
  values, read once per tile for all its rows. A program is one work item (work.py):
  a tile and one key range of its request (split-KV); a request of one range writes
  its output directly, the ranges of a longer one write partial results. A tile with
  no query rows (the padding of a CUDA-graph step) does nothing.
- ``_mla_reduce``: combines the ranges of each row of the listed tokens (those of
  requests cut into several ranges) by their log-sum-exp.

All scores live in the log2 domain (``exp2``), the scale folded into one multiply.
Offsets that can pass 2**31 (cache rows, token rows, partial rows) are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl
from pagedkv.toolkit.interpreter import interpreting
from pagedkv.toolkit.triton_helpers import fix_interpreter_loop_bounds
from pagedkv.toolkit.triton_lse_merge import lse_weights

if interpreting():
    fix_interpreter_loop_bounds()  # runtime loop bounds under numpy >= 2.4


@triton.jit
def _mla_attention(
    QN,  # [T, H, L] absorbed q_nope
    QP,  # [T, H, R] q_pe
    Cache,  # [num_blocks, BLOCK_SIZE, L + R]
    KVDesc,  # USE_TMA: descriptor of Cache as [num_blocks * BLOCK_SIZE, L + R], box [BLOCK_N, L]
    PEDesc,  # USE_TMA: the same view, box [BLOCK_N, R]
    BlockTable,  # [num_reqs, max_blocks] int32
    SeqLens,  # [num_reqs] int32
    QueryStartLoc,  # [num_reqs + 1] int32
    TileReq,  # [items] int32: the request of each work item
    TileRow0,  # [items] int32: its tile's first row (token-in-request * H + head)
    TileSplit,  # [items] int32: its key range
    TileKeys,  # [items] int32: the keys of its request's ranges, a multiple of BLOCK_N
    TokenRanges,  # [T] int32: the ranges of each token's request (1: output written here)
    TokenPartial,  # [T] int32: the token's first partial slot (its ranges' slots follow)
    Out,  # [T, H, L]
    MidO,  # [partials, H, L] float32 (not ONE_SPLIT)
    MidLse,  # [partials, H] float32, log2 domain (not ONE_SPLIT)
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_cache_block,
    stride_cache_slot,
    stride_bt,
    stride_o_t,
    stride_o_h,
    qk_scale,  # softmax scale * log2(e) (* k_scale for fp8)
    out_scale,  # k_scale for fp8 (V is the stored latent), else 1
    NUM_HEADS: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    L_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_SPLIT: tl.constexpr,  # no request has several ranges: every output written here
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    USE_TMA: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,  # the reduction is this launch's programmatic dependent
):
    if LAUNCH_DEPENDENTS:
        # the reduction may take the SMs this grid leaves: it waits for the grid's end
        # before it reads a partial
        tl.extra.cuda.gdc_launch_dependents()
    item = tl.program_id(0)
    # (the four loads before the test: one memory round trip at the program's start)
    req = tl.load(TileReq + item)
    row0 = tl.load(TileRow0 + item)
    split = tl.load(TileSplit + item)
    kv_per_split = tl.load(TileKeys + item)
    if kv_per_split == 0:
        return  # a CUDA-graph grid's padding item: its program ends at once
    q_start = tl.load(QueryStartLoc + req)
    q_len = tl.load(QueryStartLoc + req + 1) - q_start
    seq_len = tl.load(SeqLens + req)
    context_len = seq_len - q_len

    # -- rows of this tile: (query token, head) ------------------------------------------
    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // NUM_HEADS
    head = rows % NUM_HEADS
    row_valid = tok < q_len
    q_pos = context_len + tok  # absolute position of each row's token
    tok_global = (q_start + tok).to(tl.int64)
    last_tok = tl.minimum(row0 + BLOCK_M - 1, q_len * NUM_HEADS - 1) // NUM_HEADS
    kv_len = context_len + last_tok + 1 if CAUSAL else seq_len
    # a tile with no query rows (CUDA-graph padding) reads no block-table entry and
    # writes nothing: its KV range is empty and every row is masked
    kv_len = tl.where(row0 < q_len * NUM_HEADS, kv_len, 0)
    kv_lo = split * kv_per_split
    kv_hi = tl.minimum(kv_len, kv_lo + kv_per_split)

    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    qn = tl.load(
        QN + tok_global[:, None] * stride_qn_t + head[:, None] * stride_qn_h + offs_l[None, :],
        mask=row_valid[:, None] & (offs_l[None, :] < L),
        other=0.0,
    )
    if R > 0:
        qp = tl.load(
            QP + tok_global[:, None] * stride_qp_t + head[:, None] * stride_qp_h + offs_r[None, :],
            mask=row_valid[:, None] & (offs_r[None, :] < R),
            other=0.0,
        )

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, L_PAD], dtype=tl.float32)
    table_row = BlockTable + req.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        # -- BLOCK_N latent rows through the block table ----------------------------------
        pos = start + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_hi
        if USE_TMA:
            # whole tile inside one block: two TMA boxes of the [num_blocks * B, L + R] view
            # (rows past kv_hi inside the block are finite by the cache contract, masked below)
            block = tl.load(table_row + start // BLOCK_SIZE)
            cache_row = block * BLOCK_SIZE + start % BLOCK_SIZE
            kv = KVDesc.load([cache_row, 0]).to(QN.dtype.element_ty)
            if R > 0:
                kpe = PEDesc.load([cache_row, L]).to(QN.dtype.element_ty)
        else:
            if BLOCK_SIZE % BLOCK_N == 0:
                # the tile lies inside one block (tiles and splits start at multiples of BLOCK_N)
                block = tl.load(table_row + start // BLOCK_SIZE).to(tl.int64)
            else:
                block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
            kv_row = Cache + block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_slot
            # fp8 caches: upcast here; k_scale is folded into qk_scale and out_scale
            kv = tl.load(
                kv_row[:, None] + offs_l[None, :],
                mask=pos_valid[:, None] & (offs_l[None, :] < L),
                other=0.0,
            ).to(QN.dtype.element_ty)
            if R > 0:
                kpe = tl.load(
                    kv_row[:, None] + L + offs_r[None, :],
                    mask=pos_valid[:, None] & (offs_r[None, :] < R),
                    other=0.0,
                ).to(QN.dtype.element_ty)
        # -- scores: q_nope . kv_c + q_pe . k_pe (log2 domain) ----------------------------
        s = tl.dot(qn, tl.trans(kv), input_precision=DOT_PRECISION)
        if R > 0:
            s = tl.dot(qp, tl.trans(kpe), s, input_precision=DOT_PRECISION)
        s = s * qk_scale
        visible = pos_valid[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # -- online softmax ---------------------------------------------------------------
        m_tile = tl.max(s, 1)
        if LAZY_RESCALE:
            # Move the running max only when some row's max grew by more than 2**8; p
            # stays <= 256 meanwhile (harmless in fp32/bf16/fp16) and most iterations
            # skip the [BLOCK_M, L] accumulator rescale (FlashAttention-4's trick).
            grow = tl.max(m_tile - m_i, 0) > 8.0
            m_new = tl.where(grow, tl.maximum(m_i, m_tile), m_i)
        else:
            m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)  # 1 for rows whose max stays
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        p = p.to(kv.dtype)
        if LAZY_RESCALE:
            if grow:
                acc = acc * alpha[:, None]
        else:
            acc = acc * alpha[:, None]
        acc = tl.dot(p, kv, acc, input_precision=DOT_PRECISION)

    # the request's ranges (the same for each of its tokens; 1: the output is written
    # here) and the tile's first token's first partial slot, a later token's ``ranges``
    # slots further on (a padding item's token may lie past the tables: it stores nothing)
    tok0 = q_start + row0 // NUM_HEADS
    live = row0 < q_len * NUM_HEADS
    ranges = 1
    if not ONE_SPLIT:
        ranges = tl.load(TokenRanges + tok0, mask=live, other=1)
    if ranges == 1:
        out = acc * (out_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
        tl.store(
            Out + tok_global[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_l[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_valid[:, None] & (offs_l[None, :] < L),
        )
    else:
        # partial output normalised by its own denominator, plus its log2-sum-exp
        # (-inf for a range with no visible key: the reduction gives it weight 0)
        part = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.maximum(l_i, 1e-30)))
        slot = tl.load(TokenPartial + tok0, mask=live, other=0)
        slot += (tok - row0 // NUM_HEADS) * ranges + split
        mid_row = slot.to(tl.int64) * NUM_HEADS + head
        tl.store(
            MidO + mid_row[:, None] * L + offs_l[None, :],
            part,
            mask=row_valid[:, None] & (offs_l[None, :] < L),
        )
        tl.store(MidLse + mid_row, lse, mask=row_valid)


@triton.jit
def _mla_reduce(
    MidO,  # [partials, H, L] float32
    MidLse,  # [partials, H] float32, log2 domain
    Out,  # [T, H, L]
    Merges,  # [1 + 3 * entries] int32: how many tokens merge, then (token, ranges, first slot)
    stride_o_t,
    stride_o_h,
    out_scale,
    NUM_HEADS: tl.constexpr,
    L: tl.constexpr,
    SPLITS_CHUNK: tl.constexpr,  # ranges merged per loop step (a power of two)
    BLOCK_L: tl.constexpr,  # latent columns per unit
    COL_BLOCKS: tl.constexpr,  # cdiv(L, BLOCK_L)
    WAIT_FOR_PRIMARY: tl.constexpr,  # launched as the attention's programmatic dependent
):
    # units of work: (merged token, head, column block). The grid is fixed (a CUDA
    # graph's holds every step within its bounds) and the count of tokens to merge is on
    # the device: each program takes every num_programs-th unit, a program past the
    # step's units none. Only the tokens of cut requests are listed: a request of one
    # range wrote its rows itself. (The list was copied before the attention kernel
    # started: readable before the wait, so a program without units ends at once.)
    units = tl.load(Merges) * (NUM_HEADS * COL_BLOCKS)
    offs_s = tl.arange(0, SPLITS_CHUNK)
    for unit in range(tl.program_id(0), units, tl.num_programs(0)):
        if WAIT_FOR_PRIMARY:
            # the partials are complete only after this (a wait past the first returns
            # at once)
            tl.extra.cuda.gdc_wait()
        row = unit // COL_BLOCKS  # merge entry * NUM_HEADS + head
        offs_l = (unit % COL_BLOCKS) * BLOCK_L + tl.arange(0, BLOCK_L)
        entry = Merges + 1 + 3 * (row // NUM_HEADS)
        token = tl.load(entry).to(tl.int64)
        ranges = tl.load(entry + 1)
        first = tl.load(entry + 2).to(tl.int64)
        head = row % NUM_HEADS
        # SPLITS_CHUNK ranges a step, their parts weighted by their log2-sum-exp against
        # the running largest (the toolkit's lse_weights; -inf for a range that saw no key:
        # weight 0); one step for most tokens, its loads independent (a range without a
        # key wrote zeros: its part is read unmasked), so a long list costs bandwidth,
        # not latency
        top = tl.max(tl.full([SPLITS_CHUNK], float("-inf"), tl.float32), 0)
        denom = tl.sum(tl.zeros([SPLITS_CHUNK], tl.float32), 0)
        acc = tl.zeros([BLOCK_L], tl.float32)
        for s0 in range(0, ranges, SPLITS_CHUNK):
            in_list = s0 + offs_s < ranges
            slot = first + s0 + offs_s
            lse = tl.load(MidLse + slot * NUM_HEADS + head, mask=in_list, other=float("-inf"))
            part = tl.load(
                MidO + (slot * NUM_HEADS + head)[:, None] * L + offs_l[None, :],
                mask=in_list[:, None] & (offs_l[None, :] < L),
                other=0.0,
            )
            top, rescale, w = lse_weights(top, lse, True)
            denom = denom * rescale + tl.sum(w, 0)
            acc = acc * rescale + tl.sum(w[:, None] * part, 0)
        out = acc * (out_scale / tl.where(denom == 0.0, 1.0, denom))
        tl.store(
            Out + token * stride_o_t + head * stride_o_h + offs_l,
            out.to(Out.dtype.element_ty),
            mask=offs_l < L,
        )
