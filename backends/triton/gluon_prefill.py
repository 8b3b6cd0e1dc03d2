"""The Hopper (sm_90) prefill kernel of the Triton backend, written in Gluon (Triton's
explicit-layout dialect); device code only (gluon_plan.py plans its launch).

Why a second kernel: in ``unified_attention_kernel`` every warp runs the same program,
so a tile's softmax and its matmuls take turns on one instruction stream, the K/V
pages arrive through pointer loads the warps issue themselves, and Triton gives a
chained dot all warps along M. Here, as in FlashAttention-3's sm_90 forward kernel,
three partitions of one CTA (``gl.warp_specialize``) run different programs:

- a **producer** (one warp, few registers) walks the program's key tiles of TILE_N
  keys, looks each page up in the block table and brings the tile's K and V pages in
  with TMA (boxes of ``min(BLOCK_SIZE, TILE_N)`` rows x HEAD_SIZE columns, at column
  ``kv_head * HEAD_SIZE`` of the cache viewed as ``[num_blocks * BLOCK_SIZE, Hkv *
  HEAD_SIZE]``) into a STAGES-slot ring. K and V have their own ``ready`` barriers
  (the TMA transaction count) and ``empty`` barriers (count 2: each consumer releases
  a slot once its wgmma that read it has retired), so a tile's K can land while the
  previous tile's V is still being read;
- two **consumer warpgroups** own 64 rows each of the program's 128 query rows. For
  key tile j each computes ``S = Q·K_jᵀ`` with an asynchronous wgmma (Q stays in
  shared memory), issues ``O += P_{j-1}·V_{j-1}`` behind it, waits for S only, runs
  the online softmax of tile j in fp32 (base 2: scores times ``scale * log2(e)``,
  ``exp2``) while its ``P·V`` runs, then waits for ``P·V``, rescales O and keeps
  ``P_j`` in registers as the next ``P·V``'s A operand;
- **ping-pong**: a consumer may only issue its two wgmmas of an iteration after the
  other one has issued its own (two mbarriers, one per consumer, passed back and
  forth), so one warpgroup's softmax runs while the other's matmuls hold the tensor
  cores, as FA3 schedules them.

Rows (GQA packing, as in the portable kernel): row ``r`` of a program is query token
``q_block * BLOCK_Q + r // GROUP`` of one request and query head ``kv_head * GROUP +
r % GROUP``, with ``BLOCK_Q = 128 // GROUP``. Every program fills the 128 rows of two
m64 wgmmas whatever GROUP is (down to chunks of ``BLOCK_Q`` tokens), and each K/V tile
is read once for the GROUP heads that share it. Each consumer loads its query rows
through registers (masked: rows past the request's tokens are zeros, never stored)
while the producer fetches the first tiles; with one CTA per SM (its shared memory
and registers) a CTA's start is not hidden by another's, so the prologue keeps its
chain of dependent memory round trips short (the owning request is found with one
vector load of ``query_start_loc``, not a binary search).

Keys: a causal program visits the tiles up to its last token's position (both
consumers the same count, so the ping-pong barriers pair up); the tiles every row
sees entirely run without masks, the first tile and those past the first token's
position with them. Pages past the request's last block are not looked up: their
boxes start at a row past the cache, which TMA fills with zeros; keys past
``seq_len`` inside the last block are masked (the cache holds finite values there:
``allocate_kv_cache`` zero-fills). Query blocks are launched longest first.

Scope (``gluon_plan.gluon_prefill_problem``): sm_90, 16-bit query and cache, head
size 64/128 (256 with 64-key tiles), block sizes 16-128, causal or not, no sliding
window, soft cap, ALiBi, sinks or KV splits; the portable kernel runs everything else.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one m64 wgmma)


@gluon.jit
def _find_sequence(QueryStartLoc, q_block, num_seqs, BLOCK_Q: gl.constexpr):
    """The request owning global query block ``q_block``; request i's blocks start at
    query_start_loc[i] // BLOCK_Q + i (an upper bound that needs no prefix sum). These
    starts increase with i, so the owner is the last request starting at or before
    ``q_block``: counted over up to 128 requests per load (one memory round trip for
    most steps, where a binary search makes log2(num_seqs) dependent ones)."""
    CHUNK: gl.constexpr = 32 * gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    count = 0
    for first in range(0, num_seqs, CHUNK):
        i = first + gl.arange(0, CHUNK, layout=layout)
        ok = i < num_seqs
        start = gl.load(QueryStartLoc + i, mask=ok, other=0) // BLOCK_Q + i
        count += gl.sum(((start <= q_block) & ok).to(gl.int32), axis=0)
    return count - 1


@gluon.jit
def _load_tile(desc, ring, ready, empty, table_row, j, num_pages, head_col, oob_row,
               BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Producer: once slot ``j % STAGES`` is free, TMA the pages of key tile j (K or V)
    into it, on its ``ready`` barrier."""
    BOX: gl.constexpr = desc.block_type.shape[0]
    slot = j % STAGES
    mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
    bar = ready.index(slot)
    mbarrier.expect(bar, desc.block_type.nbytes * (TILE_N // BOX))
    for p in gl.static_range(TILE_N // BOX):
        key = j * TILE_N + p * BOX
        page = key // BLOCK_SIZE
        ok = page < num_pages
        block = gl.load(table_row + page, mask=ok, other=0)
        row = gl.where(ok, block * BLOCK_SIZE + key % BLOCK_SIZE, oob_row)
        tma.async_copy_global_to_shared(desc, [row, head_col], bar,
                                        ring.index(slot).slice(p * BOX, BOX, dim=0))  # fmt: skip


@gluon.jit
def _producer(a, BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr, STAGES: gl.constexpr):
    """The loading warp: K then V of each tile, each as soon as its slot is free."""
    (k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, k_desc, v_desc, table_row, num_pages,
     head_col, oob_row, n_tiles) = a  # fmt: skip
    for j in range(n_tiles):
        _load_tile(k_desc, k_ring, k_ready, k_empty, table_row, j, num_pages, head_col,
                   oob_row, BLOCK_SIZE, TILE_N, STAGES)  # fmt: skip
        _load_tile(v_desc, v_ring, v_ready, v_empty, table_row, j, num_pages, head_col,
                   oob_row, BLOCK_SIZE, TILE_N, STAGES)  # fmt: skip


@gluon.jit
def _softmax(s, m_i, l_i, j, q_pos, qk_scale, s_layout: gl.constexpr, TILE_N: gl.constexpr,
             MASKED: gl.constexpr):  # fmt: skip
    """Online softmax of score tile j (raw Q·Kᵀ) in base 2: the new running max, the
    probabilities against it, the factor that moves older sums to it, the new sum."""
    if MASKED:
        k_pos = j * TILE_N + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(k_pos, 0) <= gl.expand_dims(q_pos, 1)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _step(o, p_op, m_i, l_i, q_wg, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, turn,
          j, q_pos, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
          TILE_N: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, MASKED: gl.constexpr):  # fmt: skip
    """Key tile j >= 1 of one consumer: ``S_j = Q·K_jᵀ`` and ``O += P_{j-1}·V_{j-1}``
    issued in this consumer's turn, the softmax of S_j under ``P·V``, then O rescaled."""
    dtype: gl.constexpr = q_wg.dtype
    slot = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    s = gl.zeros([_WG_ROWS, TILE_N], gl.float32, layout=s_layout)
    s = warpgroup_mma(q_wg, k_ring.index(slot).permute((1, 0)), s, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    o = warpgroup_mma(p_op, v_ring.index(prev), o, is_async=True)
    mbarrier.arrive(turn.index(1 - WG), count=1)
    s = warpgroup_mma_wait(1, deps=[s])
    mbarrier.arrive(k_empty.index(slot), count=1)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, q_pos, qk_scale, s_layout, TILE_N, MASKED)
    o = warpgroup_mma_wait(0, deps=[o])
    mbarrier.arrive(v_empty.index(prev), count=1)
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(0, o_layout, 2))
    return o, p_op, m_i, l_i


@gluon.jit
def _consumer(a, HEAD_SIZE: gl.constexpr, GROUP: gl.constexpr, BLOCK_Q: gl.constexpr,
              TILE_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              WG: gl.constexpr):  # fmt: skip
    """The program of consumer warpgroup WG (0 or 1): rows [64 WG, 64 WG + 64)."""
    (q_s, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, turn, n_tiles, n_full, q_pos0,
     q_start, q_len, q_block, kv_head, qk_scale, out_scale, Q, Out, stride_qt, stride_qh,
     stride_ot, stride_oh) = a  # fmt: skip
    dtype: gl.constexpr = q_s.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_SIZE, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_wg = q_s.slice(WG * _WG_ROWS, _WG_ROWS, dim=0)
    # this warpgroup's query rows, through registers while the producer fetches the
    # first tiles (rows past the request's tokens are zero)
    q_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = WG * _WG_ROWS + gl.arange(0, _WG_ROWS, layout=gl.SliceLayout(1, q_load))
    token = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    q_row = (q_start + token).to(gl.int64) * stride_qt + head * stride_qh
    COLS: gl.constexpr = 64
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, q_load))
    q_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < COLS, 0)
    q_ptr = Q + gl.expand_dims(q_row, 1) + gl.expand_dims(cols, 0)
    for c in gl.static_range(HEAD_SIZE // COLS):
        chunk = gl.load(q_ptr + c * COLS, mask=q_mask, other=0.0)
        q_wg.slice(c * COLS, COLS, dim=1).store(chunk)
    fence_async_shared()  # the wgmma (async proxy) reads what the threads stored
    # each row's causal limit: its token's absolute position (rows past the request's
    # tokens see more, harmlessly: they are never stored)
    q_pos = q_pos0 + (WG * _WG_ROWS + gl.arange(0, _WG_ROWS, layout=row_s)) // GROUP
    if not CAUSAL:
        q_pos = gl.full([_WG_ROWS], 0, gl.int32, layout=row_s) + q_pos0

    # -- key tile 0 (always masked: it may be the only one) ------------------------------
    m_i = gl.full([_WG_ROWS], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([_WG_ROWS], gl.float32, layout=row_s)
    mbarrier.wait(turn.index(WG), 1 - WG)
    mbarrier.wait(k_ready.index(0), 0)
    s = gl.zeros([_WG_ROWS, TILE_N], gl.float32, layout=s_layout)
    s = warpgroup_mma(q_wg, k_ring.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - WG), count=1)
    s = warpgroup_mma_wait(0, deps=[s])
    mbarrier.arrive(k_empty.index(0), count=1)
    p, _, m_i, l_i = _softmax(s, m_i, l_i, 0, q_pos, qk_scale, s_layout, TILE_N, True)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(0, o_layout, 2))
    o = gl.zeros([_WG_ROWS, HEAD_SIZE], gl.float32, layout=o_layout)

    # -- tiles every row sees entirely, then the masked ones ---------------------------------
    for j in range(1, n_full):
        o, p_op, m_i, l_i = _step(
            o, p_op, m_i, l_i, q_wg, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty,
            turn, j, q_pos, qk_scale, s_layout, o_layout, TILE_N, STAGES, WG, False,
        )  # fmt: skip
    for j in range(gl.maximum(n_full, 1), n_tiles):
        o, p_op, m_i, l_i = _step(
            o, p_op, m_i, l_i, q_wg, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty,
            turn, j, q_pos, qk_scale, s_layout, o_layout, TILE_N, STAGES, WG, True,
        )  # fmt: skip

    # -- the last tile's P·V ----------------------------------------------------------------
    last = n_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    o = warpgroup_mma(p_op, v_ring.index(last % STAGES), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=[o])
    mbarrier.arrive(v_empty.index(last % STAGES), count=1)

    # -- epilogue: normalise, scale by v_scale, store the request's rows -------------------
    l_o = gl.convert_layout(l_i, row_o)
    o = o * gl.expand_dims(out_scale / gl.where(l_o == 0.0, 1.0, l_o), 1)
    rows = WG * _WG_ROWS + gl.arange(0, _WG_ROWS, layout=row_o)
    token = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    out_row = (q_start + token).to(gl.int64) * stride_ot + head * stride_oh
    dims = gl.arange(0, HEAD_SIZE, layout=gl.SliceLayout(0, o_layout))
    out_ptr = Out + gl.expand_dims(out_row, 1) + gl.expand_dims(dims, 0)
    mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(dims < HEAD_SIZE, 0)
    gl.store(out_ptr, o.to(Out.dtype.element_ty), mask=mask)


@gluon.jit
def _consumer0(a, HEAD_SIZE: gl.constexpr, GROUP: gl.constexpr, BLOCK_Q: gl.constexpr,
               TILE_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    _consumer(a, HEAD_SIZE, GROUP, BLOCK_Q, TILE_N, STAGES, CAUSAL, 0)


@gluon.jit
def _consumer1(a, HEAD_SIZE: gl.constexpr, GROUP: gl.constexpr, BLOCK_Q: gl.constexpr,
               TILE_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):  # fmt: skip
    _consumer(a, HEAD_SIZE, GROUP, BLOCK_Q, TILE_N, STAGES, CAUSAL, 1)


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt"])
def gluon_prefill_kernel(
    Out,  # [T, Hq, HEAD_SIZE]
    Q,  # [T, Hq, HEAD_SIZE]
    KCache,  # TMA descriptor: K as [num_blocks * BLOCK_SIZE, Hkv * HEAD_SIZE], box [BOX, HEAD_SIZE]
    VCache,  # TMA descriptor: V likewise
    BlockTable,  # [num_seqs, max_blocks] int32
    SeqLens,  # [num_seqs] int32
    QueryStartLoc,  # [num_seqs + 1] int32
    num_seqs,
    qk_scale,  # softmax scale * log2(e) (> 0)
    v_scale,  # output scale (1: a 16-bit cache holds V as it is)
    oob_row,  # num_blocks * BLOCK_SIZE: a cache row past the last one (TMA reads zeros)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    HEAD_SIZE: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    GROUP: gl.constexpr,  # query heads per KV head
    BLOCK_Q: gl.constexpr,  # query tokens per program: 128 // GROUP
    TILE_N: gl.constexpr,  # keys per tile
    STAGES: gl.constexpr,  # K/V ring slots
    CAUSAL: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,  # registers per thread of the second consumer (setmaxnreg)
    PRODUCER_REGS: gl.constexpr,  # ... of the loading warp
):
    gl.static_assert(BLOCK_Q * GROUP <= 2 * _WG_ROWS)
    gl.static_assert(gl.num_warps() == 4)  # the first consumer warpgroup
    dtype: gl.constexpr = KCache.dtype
    BOX: gl.constexpr = KCache.block_type.shape[0]  # rows per TMA box: a page or part of one
    gl.static_assert((TILE_N % BOX == 0) and (BLOCK_SIZE % BOX == 0))
    # the last query blocks of a request see the most keys: launch them first, so the
    # final wave of a causal prefill is made of short programs (a launch over a part of
    # the step gets its tensors from the part's first request on: its query blocks are
    # numbered from that request's, like the whole step's)
    first_block = gl.load(QueryStartLoc) // BLOCK_Q
    q_block_global = first_block + gl.num_programs(0) - 1 - gl.program_id(0)
    kv_head = gl.program_id(1)
    seq = _find_sequence(QueryStartLoc, q_block_global, num_seqs, BLOCK_Q)
    q_start = gl.load(QueryStartLoc + seq)
    q_len = gl.load(QueryStartLoc + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = gl.load(SeqLens + seq)
    q_pos0 = seq_len - q_len + q_block * BLOCK_Q  # the first token's absolute position
    q_last = q_pos0 + gl.minimum(BLOCK_Q, q_len - q_block * BLOCK_Q) - 1
    if CAUSAL:
        n_tiles = q_last // TILE_N + 1
        n_full = (q_pos0 + 1) // TILE_N  # tiles every row sees entirely
    else:
        n_tiles = (seq_len + TILE_N - 1) // TILE_N
        n_full = seq_len // TILE_N
        q_pos0 = seq_len - 1  # every row's limit: the last key
    num_pages = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    table_row = BlockTable + seq.to(gl.int64) * stride_bt

    # -- shared memory: the query, the K/V ring, barriers ----------------------------------
    q_s = gl.allocate_shared_memory(dtype, [2 * _WG_ROWS, HEAD_SIZE], KCache.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_SIZE], KCache.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HEAD_SIZE], VCache.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # released by both consumers
        mbarrier.init(v_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    c = (q_s, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, turn, n_tiles, n_full, q_pos0,
         q_start, q_len, q_block, kv_head, qk_scale, v_scale, Q, Out, stride_qt, stride_qh,
         stride_ot, stride_oh)  # fmt: skip
    p = (k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, KCache, VCache, table_row, num_pages,
         kv_head * HEAD_SIZE, oob_row, n_tiles)  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer0, (c, HEAD_SIZE, GROUP, BLOCK_Q, TILE_N, STAGES, CAUSAL)),
            (_consumer1, (c, HEAD_SIZE, GROUP, BLOCK_Q, TILE_N, STAGES, CAUSAL)),
            (_producer, (p, BLOCK_SIZE, TILE_N, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
