"""The unified paged-attention kernel: prefill, chunked prefill and decode in one launch.

Grid ``(query blocks, KV heads, splits)`` (``RANGE_LIST`` and ``BLOCK_PER_REQUEST``:
see below), over the whole step or over one part of it (a run of its requests, whose
metadata tensors start at the part's first request). A program owns BLOCK_Q query
tokens of one request times the GROUP query heads that share one KV head (GQA packing:
row ``r`` is token ``r // GROUP``, head ``r % GROUP``), so each K/V tile is read once
per KV head. It walks the request's keys in tiles of TILE_N tokens, looking each
token's page up in the block table, with an online softmax in fp32 (base 2).

Only the tiles some row can see are visited (causal horizon, sliding window); the
tiles every row sees entirely are run without masks, the few boundary tiles with
them. With splits (flash-decoding), split ``s`` takes its share of those tiles and
writes an unnormalised partial result that ``reduce_kernel`` merges: an even share
of the visited tiles (``tiles_per_split = 0``), or the fixed key range
``[s, s + 1) * tiles_per_split * TILE_N`` of the sequence, which makes a row's
arithmetic independent of the rest of the batch (the batch-invariant mode). With
``DYNAMIC_SPLITS`` (a CUDA-graph plan) the split count (and the fixed range, if the
step takes ranges) is read from ``NumSplits`` on the device, written by each step's
build: the grid's split axis is the most the reservation allows, and the splits past
the step's count exit at once. So is the first token row of the launch's partials: a
graph's decode launch of a mixed step writes its partials from row 0, wherever its
decodes sit among the step's tokens, so the partials are sized for the decodes only.

``RANGE_LIST`` (steps of one query block per request): the grid is a list of work
items times the KV heads (one axis, the heads of an item adjacent) instead of (query
blocks) x (KV heads) x (splits), each request's splits that hold keys one after another
(``RangeStarts``, from the builder). A ragged batch cut into fixed key ranges then
launches no empty program: with a (blocks, splits) grid most of its programs would find
their range past their request's keys and exit, each holding an SM's slot for a few
dependent loads. ``BLOCK_PER_REQUEST`` (the same steps' launches unlisted: even
shares, or any under ``split_grid=blocks``): the grid is ``(KV heads, requests,
splits)`` (a CUDA-graph plan's: one axis of as many programs, in that order), so no
program searches for its request (``find_sequence``: a chain of dependent loads before
the first key).

``MERGE_LAST`` (a split launch of one query block per request that fits one wave, the
builder's ``_merges_in_attention``): no merge kernel follows; each program counts its
split on its block's counter once its partials are stored, and the program that counts
the last merges them all (``reduce_kernel.merge_own_splits``) and writes the output. A
CUDA-graph launch compiled with it merges so only where the step's build chose it
(in the word of ``NumSplits`` that holds the partials' first row, which the program keeps
anyway: a step that leaves the merge reads nothing more); otherwise its captured merge
kernel does.

Both decode grids start the KV heads of one request's key range together (the GPU
starts programs in grid order, the first axis fastest). A page holds every head's rows
of its tokens, so the programs that run at once read whole stretches of memory rather
than one head's 256-byte rows of many pages (H200, twenty-third session, CUDA graph:
GQA 16 ragged 119.2 -> 110.0 us, 32 long ragged 608.7 -> 598.1, ragged 128 221.9 ->
217.7; docs/triton.md).
"""

from __future__ import annotations

import triton
import triton.language as tl
from pagedkv.backends.triton.reduce_kernel import (
    merge_own_splits,
    merged_in_attention,
    partials_first_row,
)
from pagedkv.toolkit.interpreter import interpreting
from pagedkv.toolkit.triton_helpers import LOG2E, fix_interpreter_loop_bounds

_LOG2E = tl.constexpr(LOG2E)  # kernels may read only constexpr globals

# Where a split launch's programs let their reduction (a programmatic dependent launch)
# start: at their start, so that its programs take SMs as the attention's last ones
# finish; or after their keys, where a part beside another part's launch (on the other
# stream) would otherwise hold slots that launch needs (the builder's ``_dependents_at``)
DEPENDENTS_AT_START = 1
DEPENDENTS_AFTER_KEYS = 2
_AT_START = tl.constexpr(DEPENDENTS_AT_START)
_AFTER_KEYS = tl.constexpr(DEPENDENTS_AFTER_KEYS)
# MERGE_LAST's splits of a block, stored as first split * _SPLIT_FIELD + count
_SPLIT_FIELD = tl.constexpr(1 << 16)


@triton.jit
def find_sequence(QueryStartLoc, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The request owning global query block ``q_block``; request i's blocks start at
    query_start_loc[i] // BLOCK_Q + i (an upper bound that needs no prefix sum)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(QueryStartLoc + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def find_owner(Starts, item, num_seqs):
    """The request whose run of work items holds ``item``: the last ``i`` with
    ``Starts[i] <= item`` (a request without items shares its start with the next)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(Starts + mid) <= item:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # overflow-safe: exp2 saturates to inf or 0, giving exactly +1 or -1
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)


@triton.jit
def fp16_rows(q):
    """bfloat16 query rows as float16, each scaled by a power of two that puts its largest
    element in [2^14, 2^15) (a row of subnormals: 2^126): the rows (exact, but for
    elements 2^28 below their row's largest) and each row's inverse scale,
    ``[BLOCK_M, 1]``. Over an fp8 cache the tiles then convert to float16, one
    instruction per two elements on sm_90, where bfloat16 takes three (float16 first,
    then each element on its own): at 64 x 4096 that conversion, not HBM, set the
    decode's time (docs/triton.md)."""
    largest = tl.max(tl.abs(q.to(tl.float32)), 1)
    exponent = (largest.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased; 0: subnormal
    # (at most 2^126, which a row of subnormals takes: exact, though below 2^14)
    shift = tl.where(largest == 0, 0, tl.minimum(127 + 14 - exponent, 126))
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)  # 2^shift, exactly
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) * up[:, None]).to(tl.float16), down[:, None]


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, HEAD_PAD] fp32
    l_i,  # [BLOCK_M] fp32, softmax denominator
    m_i,  # [BLOCK_M] fp32, running max (base-2 units)
    q,  # [BLOCK_M, HEAD_PAD]
    KCache,
    VCache,
    block_table_row,  # this request's block table row
    tile,
    seq_len,
    q_pos,  # [BLOCK_M] absolute position of each row's token
    slope,  # [BLOCK_M] ALiBi slope (base-2 units)
    k_head_offset,
    v_head_offset,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    qk_scale,
    softcap,
    window,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    k_pos = tile * TILE_N + tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_PAD)
    # -- gather the tile's pages ------------------------------------------------
    if MASKED:
        key_ok = k_pos < seq_len
        page = tl.load(block_table_row + k_pos // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        page = tl.load(block_table_row + k_pos // BLOCK_SIZE)
    page = page.to(tl.int64)
    in_page = (k_pos % BLOCK_SIZE).to(tl.int64)
    k_rows = page * stride_kb + in_page * stride_ks + k_head_offset
    v_rows = page * stride_vb + in_page * stride_vs + v_head_offset
    k_ptrs = KCache + k_rows[:, None] + dims[None, :]
    v_ptrs = VCache + v_rows[:, None] + dims[None, :]
    if MASKED:
        if HEAD_PAD != HEAD_SIZE:
            load_mask = key_ok[:, None] & (dims < HEAD_SIZE)[None, :]
        else:
            load_mask = key_ok[:, None]
        k = tl.load(k_ptrs, mask=load_mask, other=0.0)
        v = tl.load(v_ptrs, mask=load_mask, other=0.0)
    else:
        if HEAD_PAD != HEAD_SIZE:
            k = tl.load(k_ptrs, mask=(dims < HEAD_SIZE)[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=(dims < HEAD_SIZE)[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    # fp8 -> the query dtype is exact (float16 for a bfloat16 query: ``fp16_rows``); the
    # K/V scales are applied to scores / output
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    # -- scores, base-2 units ----------------------------------------------------
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if USE_SOFTCAP:
        s = (softcap * _LOG2E) * _tanh(s / softcap)
    if USE_ALIBI:
        s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    if MASKED:
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
            if not CAUSAL:
                visible = visible & (k_pos[None, :] - q_pos[:, None] < window)
        s = tl.where(visible, s, float("-inf"))

    # -- online softmax ------------------------------------------------------------
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that sees nothing yet keeps m = -inf; exponentiate against 0 instead
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Scalars that vary from step to step and feed only scalar address arithmetic are not
# specialised (Triton would otherwise compile a variant for == 1 and for multiples of
# 16: a recompile mid-serving when the split count or the table width changes).
@triton.jit(
    do_not_specialize=[
        "num_seqs", "window", "tiles_per_split", "stride_bt", "stride_mt", "stride_mh",
    ]
)  # fmt: skip
def unified_attention_kernel(
    Out,  # [T, Hq, HEAD_SIZE] (unused when SPLIT)
    PartAcc,  # [T, Hq, splits, HEAD_PAD] fp32 (SPLIT only)
    PartMax,  # [T, Hq, splits] fp32, base-2 running max (SPLIT only)
    PartSum,  # [T, Hq, splits] fp32, softmax denominator (SPLIT only)
    Q,  # [T, Hq, HEAD_SIZE]
    KCache,  # [num_blocks, BLOCK_SIZE, Hkv, HEAD_SIZE] view
    VCache,  # [num_blocks, BLOCK_SIZE, Hkv, HEAD_SIZE] view
    BlockTable,  # [num_seqs, max_blocks] int32 (a part: its requests' rows)
    SeqLens,  # [num_seqs] int32
    QueryStartLoc,  # [num_seqs + 1] int32, absolute token indices
    Sinks,  # [Hq] fp32 logits (USE_SINKS)
    AlibiSlopes,  # [Hq] fp32 (USE_ALIBI)
    NumSplits,  # [5] int32: splits, tiles and keys per range, partials' first token x 2 + merged here, items per request or 0 (DYNAMIC_SPLITS; builder.StepSplits)
    RangeStarts,  # [num_seqs + 1] int32: each request's first work item, then the total (RANGE_LIST)
    SplitCounts,  # [T, NUM_KV_HEADS + 1] int32 by a block's first token: counts, zero between launches, then the splits (MERGE_LAST)
    num_seqs,
    qk_scale,  # softmax scale * k_scale (* log2(e) unless USE_SOFTCAP)
    softcap,
    v_scale,
    window,
    tiles_per_split,  # 0: even shares of the visited tiles; > 0: fixed key ranges
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mt,
    stride_mh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
    DYNAMIC_SPLITS: tl.constexpr,
    TRIM_SPLITS: tl.constexpr,  # fixed key ranges; empty ones neither run nor write
    RANGE_LIST: tl.constexpr,  # one program per (request, split) that has keys
    BLOCK_PER_REQUEST: tl.constexpr,  # every request's queries fit one block: a program per (head, request, split)
    LAUNCH_DEPENDENTS: tl.constexpr,  # 0, or where: DEPENDENTS_AT_START / _AFTER_KEYS
    MERGE_LAST: tl.constexpr,  # (one query block per request) a block's last split merges
    MERGE_ROWS: tl.constexpr,  # (MERGE_LAST) BLOCK_Q * GROUP, to a power of two
    MERGE_CHUNK: tl.constexpr,  # (MERGE_LAST) splits the merge loads at once
    DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_Q * GROUP <= BLOCK_M)
    if LAUNCH_DEPENDENTS == _AT_START:
        # the reduction (a programmatic dependent launch) may take free SMs now: it waits
        # for this grid's end before it reads the partials
        tl.extra.cuda.gdc_launch_dependents()
    if RANGE_LIST:
        # a list of work items, a request's splits that hold keys one after another (one
        # query block per request): no program of the grid is empty. An item's KV heads
        # are consecutive programs (the module's note on grid order)
        item = tl.program_id(0) // NUM_KV_HEADS
        kv_head = tl.program_id(0) % NUM_KV_HEADS
        # a CUDA-graph step of even shares gives every request with queries the same
        # number of items, the requests without any (padding) after them: an item's
        # owner is a division, and an item past the step's belongs to a padding request
        # (no queries: it exits below) or to none. Its program waits for one load (the
        # count) before its request's, where the list's total was a second in turn
        per_request = 0
        if DYNAMIC_SPLITS:
            per_request = tl.load(NumSplits + 4)
        if per_request > 0:
            seq = item // per_request
            if seq >= num_seqs:
                return  # past the bounds' requests
            split = item - seq * per_request
        else:
            if item >= tl.load(RangeStarts + num_seqs):
                return  # past this step's items (a CUDA-graph grid covers the bounds')
            seq = find_owner(RangeStarts, item, num_seqs)
            split = item - tl.load(RangeStarts + seq)
    elif BLOCK_PER_REQUEST:
        # (decode steps) no search of the request: a search costs a chain of dependent
        # loads before the first key, in every program. A request's heads adjacent (the
        # module's note), then the requests, then the splits
        if DYNAMIC_SPLITS:
            # one axis (a CUDA-graph grid: the bounds' requests and splits): on three,
            # this variant compiled to 156 registers instead of the 126 of the plan's
            # probe, three programs an SM instead of four (sm_90; H100, the 4 x 32k
            # graph under split_grid=blocks 204.7 us, 188.1 on one axis; forty-second
            # session)
            kv_head = tl.program_id(0) % NUM_KV_HEADS
            request_split = tl.program_id(0) // NUM_KV_HEADS
            seq = request_split % num_seqs
            split = request_split // num_seqs
        else:
            kv_head = tl.program_id(0)
            seq = tl.program_id(1)
            split = tl.program_id(2)
    else:
        # the last query blocks see the most keys: launch them first, so the final wave
        # of a causal prefill is made of short programs
        # (a launch over a part of the step gets its tensors from the part's first
        # request on: its query blocks are numbered from that request's, like the whole
        # step's)
        first_block = tl.load(QueryStartLoc) // BLOCK_Q
        q_block_global = first_block + tl.num_programs(0) - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
    past_splits = False
    if DYNAMIC_SPLITS:
        # this step's (splits, tiles per fixed key range or 0 for even shares)
        num_splits = tl.load(NumSplits)
        tiles_per_split = tl.load(NumSplits + 1)
        if BLOCK_PER_REQUEST:
            # tested with the request's queries below, so that the two loads go together:
            # a program waits for one round trip before its request's keys, not two
            past_splits = split >= num_splits
        # (a listed item is one of its request's splits: at most the step's)
        elif not RANGE_LIST:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if split >= num_splits:
                return
        partials_word = tl.load(NumSplits + 3)  # decoded where used (one register)
    else:
        num_splits = tl.num_programs(2)  # (a static range list holds fixed ranges only)
        partials_word = 0

    if not RANGE_LIST:  # noqa: SIM102 (constexpr tests, one at a time)
        if not BLOCK_PER_REQUEST:
            seq = find_sequence(QueryStartLoc, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    q_block = 0  # (q_block_global exists only with neither of the two)
    if not RANGE_LIST:  # noqa: SIM102
        if not BLOCK_PER_REQUEST:
            q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if (q_block * BLOCK_Q >= q_len) | past_splits:
        return
    seq_len = tl.load(SeqLens + seq)
    context_len = seq_len - q_len

    # -- rows: (token, query head of this KV head) ----------------------------------
    rows = tl.arange(0, BLOCK_M)
    token = q_block * BLOCK_Q + rows // GROUP  # within the request's queries
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    q_pos = context_len + token
    token_row = (q_start + token).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q = tl.load(
        Q + token_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if KCache.dtype.element_ty.is_fp8() and q.dtype == tl.bfloat16:
        q, row_scale = fp16_rows(q)
        qk_scale = qk_scale * row_scale  # [BLOCK_M, 1]: the scores' scale per row

    if USE_ALIBI:
        slope = tl.load(AlibiSlopes + head) * _LOG2E
    else:
        slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS and not SPLIT:
        # the sink joins the denominator: start from its logit with weight 1
        m_i = tl.load(Sinks + head) * _LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # -- which keys: any row sees [key_lo, key_hi); every row sees [full_lo, full_hi) --
    q_first = context_len + q_block * BLOCK_Q
    q_last = context_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    key_lo = 0
    full_lo = 0
    if CAUSAL:
        key_hi = q_last + 1
        full_hi = q_first + 1
    else:
        key_hi = seq_len
        full_hi = seq_len
    if USE_WINDOW:
        key_lo = tl.maximum(q_first - window + 1, 0)
        full_lo = tl.maximum(q_last - window + 1, 0)
        if not CAUSAL:
            key_hi = tl.minimum(q_last + window, seq_len)
            full_hi = tl.minimum(q_first + window, seq_len)
    tile_lo = key_lo // TILE_N
    tile_hi = tl.cdiv(key_hi, TILE_N)
    full_tile_lo = tl.minimum(tl.cdiv(full_lo, TILE_N), tile_hi)
    full_tile_hi = tl.maximum(full_hi // TILE_N, full_tile_lo)
    # this split's share of the tiles
    if tiles_per_split > 0:
        # a fixed key range per split, whatever the batch: the same tiles, in the same
        # order, make up each partial result of a row in any batch
        first = tl.maximum(split * tiles_per_split, tile_lo)
        last = tl.minimum(split * tiles_per_split + tiles_per_split, tile_hi)
    else:
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        first = tile_lo + split * per_split
        last = tl.minimum(first + per_split, tile_hi)
    # (the constexpr test alone: the branch is compiled out without TRIM_SPLITS)
    if TRIM_SPLITS:  # noqa: SIM102
        # a fixed key range past this block's keys: nothing to write, the reduction
        # merges only the ranges below each row's last key (even shares write them all)
        if (first >= last) & (tiles_per_split > 0):
            return

    if MERGE_LAST:
        # the splits of this request that write (those the merge reads): the launch's
        # count; of fixed ranges, those that hold some of the block's keys (a list's
        # items of the request, without its starts' loads: those in the prologue took
        # the listed CUDA-graph variant to 162 registers). Stored beside the block's
        # counters, not kept through the main loop: an m16 decode's loop holds 126 of
        # the 128 registers that keep four programs an SM, and one more value live
        # across it took that variant to 158 (three programs an SM; sm_90, forty-fifth
        # session)
        split_lo = 0
        split_hi = num_splits
        if TRIM_SPLITS:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if tiles_per_split > 0:
                split_lo = tile_lo // tiles_per_split
                split_hi = tl.cdiv(tile_hi, tiles_per_split)
                # (a static list's launch holds no count: its items end at the keys')
                if DYNAMIC_SPLITS or not RANGE_LIST:
                    split_hi = tl.minimum(split_hi, num_splits)
        # (every program of the block stores the same value)
        tl.store(
            SplitCounts + q_start * (NUM_KV_HEADS + 1) + NUM_KV_HEADS,
            split_lo * _SPLIT_FIELD + (split_hi - split_lo),
        )

    block_table_row = BlockTable + seq.to(tl.int64) * stride_bt
    k_head_offset = kv_head.to(tl.int64) * stride_kh
    v_head_offset = kv_head.to(tl.int64) * stride_vh

    # -- tiles every row sees entirely: no masks ---------------------------------------
    for tile in range(tl.maximum(first, full_tile_lo), tl.minimum(last, full_tile_hi)):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, KCache, VCache, block_table_row, tile, seq_len, q_pos, slope,
            k_head_offset, v_head_offset, stride_kb, stride_ks, stride_vb, stride_vs,
            qk_scale, softcap, window,
            BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_PAD, False, CAUSAL, USE_WINDOW,
            USE_SOFTCAP, USE_ALIBI, DOT_PRECISION,
        )  # fmt: skip
    # -- boundary tiles, below and above that range: masked ------------------------------
    num_below = tl.maximum(tl.minimum(last, full_tile_lo) - first, 0)
    above = tl.maximum(first, full_tile_hi)
    num_above = tl.maximum(last - above, 0)
    for i in range(0, num_below + num_above):
        tile = tl.where(i < num_below, first + i, above + i - num_below)
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, KCache, VCache, block_table_row, tile, seq_len, q_pos, slope,
            k_head_offset, v_head_offset, stride_kb, stride_ks, stride_vb, stride_vs,
            qk_scale, softcap, window,
            BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_PAD, True, CAUSAL, USE_WINDOW,
            USE_SOFTCAP, USE_ALIBI, DOT_PRECISION,
        )  # fmt: skip

    # -- epilogue ------------------------------------------------------------------
    if LAUNCH_DEPENDENTS == _AFTER_KEYS:
        # (a program that exits early lets it launch too)
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT:
        # every split writes, even an empty one (m = -inf, l = 0), for the reduction
        # (but those TRIM_SPLITS skips, which the reduction does not read)
        part_row = token_row - partials_first_row(partials_word)
        part = part_row[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
        tl.store(PartAcc + part + dims[None, :], acc * v_scale, mask=row_ok[:, None])
        stat = part_row * stride_mt + head * stride_mh + split
        tl.store(PartMax + stat, m_i, mask=row_ok)
        tl.store(PartSum + stat, l_i, mask=row_ok)
        if MERGE_LAST:
            merges = True
            if DYNAMIC_SPLITS:
                # a CUDA-graph step merges here or in the merge kernel (the launch's),
                # as the step's build chose
                merges = merged_in_attention(partials_word)
            if merges:
                # the block's row of counters (one per KV head, then its splits) is its
                # first token's, found from the rows this program keeps for its stores
                first_row = tl.min(token_row)
                first_head = tl.min(head)
                block_counts = SplitCounts + first_row * (NUM_KV_HEADS + 1)
                counter = block_counts + first_head // GROUP
                # every thread's stores before what follows: the block's splits (stored
                # by one thread before the loop, which a program without keys runs no
                # barrier in) and the partials, which the count releases at GPU scope;
                # the program that counts the block's last split reads them all (acquire)
                tl.debug_barrier()
                merge_splits = tl.load(block_counts + NUM_KV_HEADS, cache_modifier=".cg")
                done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if done == merge_splits % _SPLIT_FIELD - 1:
                    tl.store(counter, 0)  # for the next launch (a CUDA graph's replay too)
                    split_lo = merge_splits // _SPLIT_FIELD
                    split_hi = split_lo + merge_splits % _SPLIT_FIELD
                    block_tokens = tl.max(tl.where(row_ok, token_row, first_row)) - first_row + 1
                    merge_rows = tl.arange(0, MERGE_ROWS)
                    merge_token = merge_rows // GROUP
                    merge_ok = (merge_rows < BLOCK_Q * GROUP) & (merge_token < block_tokens)
                    out_rows = first_row + merge_token
                    merge_own_splits(
                        Out, PartAcc, PartMax, PartSum, Sinks, out_rows,
                        out_rows - partials_first_row(partials_word),
                        first_head + merge_rows % GROUP, merge_ok, split_lo, split_hi,
                        stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt,
                        stride_mh, HEAD_SIZE, HEAD_PAD, MERGE_ROWS, MERGE_CHUNK, USE_SINKS,
                    )  # fmt: skip
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc * (v_scale / l_safe)[:, None]
        tl.store(
            Out + token_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


if interpreting():
    fix_interpreter_loop_bounds()
