"""Merge the split-KV partial results of ``unified_attention_kernel`` into the output.

Grid ``(T, cdiv(Hq, BLOCK_H))`` over the tokens of the launch's requests: one program per
(token, ``BLOCK_H`` query heads) rescales each split's unnormalised accumulator by
exp2(max_s - max) and divides by the merged denominator, to which the attention sink
(if any) contributes its own term. A program takes several heads because one head's
merge is a few hundred bytes: a program per head left the merge latency-bound (on the
H200, 256 decodes x 32 heads x 2 splits took 11 us for 10 MB, docs/triton.md).
Padding tokens (past query_start_loc[num_seqs]) are skipped. ``WAIT_FOR_PRIMARY``: the
launch is a programmatic dependent of the attention kernel (sm_90+), which it may
overlap until it needs the partials. With ``DYNAMIC_SPLITS``
the split count is read from ``NumSplits`` on the device (a CUDA-graph plan, whose
count changes from step to step within the partials' width), with the token row the
partials start at.

``SKIP_MERGED`` (a CUDA-graph launch whose attention kernel may merge, ``MERGE_LAST``):
a step whose build chose the attention's merge (``merged_in_attention``) exits at once.
``merge_own_splits`` is that merge: one block's rows, their splits in rounds.

``TRIM_SPLITS`` (splits of fixed key ranges): a row merges only the ranges below its
last visible key, the only ones the attention kernel wrote for it.

``ORDERED`` merges split by split, in split order: a row's sums then see the same
terms in the same order whatever the number of splits of the launch (splits past a
row's keys add exact zeros), which the batch-invariant mode needs. Otherwise a row's
splits are merged at once (a tree reduction), in the narrowest power-of-two tile that
holds them, from ``MIN_WIDTH`` up to ``SPLIT_PAD`` (the launch's most): a CUDA-graph
plan allows the most splits any step may take (up to 64), but most steps take a few,
and a ragged step's short requests fewer than its long ones. A tile as wide as the
most masks most of its lanes; one fixed narrower tile takes the long rows in turns;
and one holding as many more heads as it is narrower leaves few programs to a step
of few splits (H200, twenty-fifth session, graphs reserved for 32k: a 64 x 1024 step
of one split took 80.0 us at 64 wide, 70.7 at 8 wide and 80.5 with 64 heads a
program; 1 x 32k, 64 splits, 41.3 us at 64 wide and 47.1 in turns of 8;
docs/benchmarks.md). So a narrower tile holds ``REDUCE_VALUES`` values, its programs
more heads each, and the programs past the heads (the grid is sized for the widest)
exit.
"""

from __future__ import annotations

import triton
import triton.language as tl
from pagedkv.toolkit.interpreter import interpreting
from pagedkv.toolkit.triton_helpers import LOG2E, fix_interpreter_loop_bounds

_LOG2E = tl.constexpr(LOG2E)  # kernels may read only constexpr globals


@triton.jit
def find_request(QueryStartLoc, token, num_seqs):
    """The request owning query row ``token`` (an absolute row index)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(QueryStartLoc + mid + 1) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit
def partials_first_row(partials_word):
    """The token row a CUDA-graph step's partials start at, from its word of
    ``NumSplits`` (``builder.StepSplits``: the row x 2 + whether the attention kernel
    merges)."""
    return partials_word >> 1


@triton.jit
def merged_in_attention(partials_word):
    """Whether the attention kernel merged the CUDA-graph step's splits (MERGE_LAST),
    from the word that holds its partials' first row (``builder.StepSplits``)."""
    return (partials_word & 1) != 0


@triton.jit
def _merge_heads(
    Out, PartAcc, PartMax, PartSum, Sinks, token, part_row, block, num_heads,
    num_splits, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_SINKS: tl.constexpr,
):  # fmt: skip
    """Merge and write the ``block``-th ``BLOCK_H`` heads of one token row, all their
    (at most ``WIDTH``) splits at once."""
    heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dims = tl.arange(0, HEAD_PAD)
    splits = tl.arange(0, WIDTH)
    stat = part_row * stride_mt + heads * stride_mh  # [BLOCK_H]
    stat_ok = head_ok[:, None] & (splits[None, :] < num_splits)  # [BLOCK_H, WIDTH]
    m = tl.load(PartMax + stat[:, None] + splits[None, :], mask=stat_ok, other=float("-inf"))
    m_max = tl.max(m, 1)
    if USE_SINKS:
        sink = tl.load(Sinks + heads, mask=head_ok, other=float("-inf")) * _LOG2E
        m_max = tl.maximum(m_max, sink)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_use[:, None])  # [BLOCK_H, WIDTH]
    denom = tl.load(PartSum + stat[:, None] + splits[None, :], mask=stat_ok, other=0.0)
    total = tl.sum(weight * denom, 1)
    part = PartAcc + part_row * stride_pt + heads[:, None] * stride_ph + dims[None, :]
    acc = tl.load(
        part[:, None, :] + splits[None, :, None] * stride_ps, mask=stat_ok[:, :, None], other=0.0
    )  # [BLOCK_H, WIDTH, HEAD_PAD]
    acc = tl.sum(acc * weight[:, :, None], 1)
    if USE_SINKS:
        total += tl.exp2(sink - m_use)
    _write_rows(Out, acc, total, token, heads, head_ok, dims, stride_ot, stride_oh, HEAD_SIZE)


@triton.jit
def _tile_width(num_splits, MIN_WIDTH: tl.constexpr):
    """The narrowest power of two from MIN_WIDTH that holds ``num_splits``."""
    width = tl.full([], MIN_WIDTH, tl.int32)
    while width < num_splits:
        width *= 2
    return width


@triton.jit
def _heads_held(
    num_splits, MIN_WIDTH: tl.constexpr, REDUCE_VALUES: tl.constexpr, HEAD_PAD: tl.constexpr
):
    """Heads a program merges for a row of ``num_splits`` splits (``_merge_heads``'s
    BLOCK_H at its tile's width), at least one."""
    return tl.maximum(REDUCE_VALUES // (HEAD_PAD * _tile_width(num_splits, MIN_WIDTH)), 1)


@triton.jit
def _write_rows(Out, acc, total, token, heads, head_ok, dims, stride_ot, stride_oh, HEAD_SIZE):
    """One token's merged rows of ``heads``: the accumulator over the denominator."""
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        Out + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=head_ok[:, None] & (dims[None, :] < HEAD_SIZE),
    )


@triton.jit
def merge_own_splits(
    Out, PartAcc, PartMax, PartSum, Sinks, out_rows, part_rows, heads, row_ok, split_lo,
    split_hi, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_SINKS: tl.constexpr,
):  # fmt: skip
    """Merge splits ``[split_lo, split_hi)`` of the rows (``out_rows``: their output
    token rows, ``part_rows``: their partials' rows, ``heads``) and write them: the
    attention kernel's last program of a query block (``MERGE_LAST``). ``CHUNK`` splits
    are loaded at once, a running maximum carried between chunks (most rows take one
    chunk). The partials were written by other programs of the same launch: loaded
    through L2 (``.cg``), never an SM's L1, which is not coherent within a launch."""
    dims = tl.arange(0, HEAD_PAD)
    chunk = tl.arange(0, CHUNK)
    stat = part_rows * stride_mt + heads * stride_mh  # [ROWS]
    part = PartAcc + part_rows[:, None] * stride_pt + heads[:, None] * stride_ph + dims[None, :]
    m_run = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    for first in range(split_lo, split_hi, CHUNK):
        splits = first + chunk
        ok = row_ok[:, None] & (splits < split_hi)[None, :]  # [ROWS, CHUNK]
        m = tl.load(
            PartMax + stat[:, None] + splits[None, :], mask=ok, other=float("-inf"),
            cache_modifier=".cg",
        )  # fmt: skip
        denom = tl.load(
            PartSum + stat[:, None] + splits[None, :], mask=ok, other=0.0, cache_modifier=".cg"
        )
        part_acc = tl.load(
            part[:, None, :] + splits[None, :, None] * stride_ps, mask=ok[:, :, None],
            other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp2(m_run - m_use)
        weight = tl.exp2(m - m_use[:, None])
        total = total * rescale + tl.sum(weight * denom, 1)
        acc = acc * rescale[:, None] + tl.sum(part_acc * weight[:, :, None], 1)
        m_run = m_new
    if USE_SINKS:
        sink = tl.load(Sinks + heads, mask=row_ok, other=float("-inf")) * _LOG2E
        m_new = tl.maximum(m_run, sink)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp2(m_run - m_use)
        total = total * rescale + tl.exp2(sink - m_use)
        acc = acc * rescale[:, None]
    # (each row its own token: ``_write_rows``'s token as a column)
    _write_rows(
        Out, acc, total, out_rows[:, None], heads, row_ok, dims, stride_ot, stride_oh, HEAD_SIZE
    )


# step-dependent scalars of scalar address arithmetic: one compiled variant for all
@triton.jit(
    do_not_specialize=["num_seqs", "num_splits", "keys_per_split", "stride_mt", "stride_mh"]
)
def reduce_splits_kernel(
    Out,  # [T, Hq, HEAD_SIZE]
    PartAcc,  # [T, Hq, splits, HEAD_PAD] fp32
    PartMax,  # [T, Hq, splits] fp32, base 2
    PartSum,  # [T, Hq, splits] fp32
    Sinks,  # [Hq] fp32 (USE_SINKS)
    QueryStartLoc,  # [num_seqs + 1] int32
    SeqLens,  # [num_seqs] int32 (TRIM_SPLITS)
    NumSplits,  # [5] int32: splits, tiles and keys per range, partials' first token x 2 + merged, ... (DYNAMIC_SPLITS; builder.StepSplits)
    num_seqs,
    num_heads,
    num_splits,
    keys_per_split,  # TRIM_SPLITS: split s holds keys [s, s + 1) * keys_per_split
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mt,
    stride_mh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,  # the launch's most splits, a power of two (at most 64)
    BLOCK_H: tl.constexpr,  # heads a program merges at that width
    MIN_WIDTH: tl.constexpr,  # the narrowest tile compiled (a power of two)
    REDUCE_VALUES: tl.constexpr,  # values a tile holds (heads x width x HEAD_PAD), a power of two
    USE_SINKS: tl.constexpr,
    ORDERED: tl.constexpr,
    DYNAMIC_SPLITS: tl.constexpr,
    TRIM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    WAIT_FOR_PRIMARY: tl.constexpr,
    SKIP_MERGED: tl.constexpr,  # (DYNAMIC_SPLITS) the attention kernel may have merged
):
    # a launch over a part of the step: its tokens start at its first request's
    token = tl.program_id(0) + tl.load(QueryStartLoc)
    if token >= tl.load(QueryStartLoc + num_seqs):
        return
    token = token.to(tl.int64)
    part_row = token
    if DYNAMIC_SPLITS:
        num_splits = tl.load(NumSplits)
        partials_word = tl.load(NumSplits + 3)
        if SKIP_MERGED:  # noqa: SIM102 (a constexpr test, then a runtime one)
            if merged_in_attention(partials_word):
                # the attention kernel's last program of each block merged this step's
                # splits (MERGE_LAST; a CUDA-graph launch captures this merge for the
                # steps it leaves): nothing to wait for
                return
        keys_per_split = tl.load(NumSplits + 2)
        part_row = token - partials_first_row(partials_word)
    if not ORDERED:
        tl.static_assert(SPLIT_PAD <= 64)  # the widths below (the ordered merge: any count)
        # a program past the heads this row's tile width leaves to the others exits
        # before the request's search and the wait (the grid holds them for the widest
        # tile; trimmed below, a row's tile is narrower and its programs fewer still)
        if (
            tl.program_id(1) * _heads_held(num_splits, MIN_WIDTH, REDUCE_VALUES, HEAD_PAD)
            >= num_heads
        ):
            return
    if TRIM_SPLITS:  # noqa: SIM102 (a constexpr test, then a runtime one)
        # fixed key ranges (keys_per_split > 0): only those below this row's last key
        # were written (no window here). A CUDA-graph step of even shares (0) merges
        # every split, without looking its request up (a chain of dependent loads)
        if keys_per_split > 0:
            seq = find_request(QueryStartLoc, token, num_seqs)
            seq_len = tl.load(SeqLens + seq)
            key_hi = seq_len
            if CAUSAL:
                key_hi = seq_len - tl.load(QueryStartLoc + seq + 1) + token + 1
            trimmed = tl.cdiv(key_hi, keys_per_split).to(tl.int32)
            num_splits = tl.minimum(num_splits, trimmed)
    if WAIT_FOR_PRIMARY:
        # launched as a programmatic dependent: the partials are complete only after this
        # (what was read above was written before the attention kernel started)
        tl.extra.cuda.gdc_wait()
    if not ORDERED:
        # the narrowest tile that holds this row's splits (a constexpr-unrolled choice
        # among the powers of two from MIN_WIDTH), of REDUCE_VALUES values: a program
        # takes more heads at a narrower width, those the grid's axis (sized for the
        # widest) gives the programs past them exit
        width = _tile_width(num_splits, MIN_WIDTH)
        for w in tl.static_range(7):  # widths 1 to 64
            # (constexpr tests, then a runtime one; Triton takes no chained comparison)
            if (1 << w) >= MIN_WIDTH and (1 << w) <= SPLIT_PAD:  # noqa: SIM102
                if width == (1 << w):
                    # heads a program merges at this width: REDUCE_VALUES values, at
                    # least one head (no fewer than the grid's BLOCK_H at SPLIT_PAD)
                    _merge_heads(
                        Out, PartAcc, PartMax, PartSum, Sinks, token, part_row,
                        tl.program_id(1), num_heads, num_splits, stride_ot, stride_oh,
                        stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, HEAD_SIZE,
                        HEAD_PAD, 1 << w, (REDUCE_VALUES + (HEAD_PAD << w) - 1) // (HEAD_PAD << w),
                        USE_SINKS,
                    )  # fmt: skip
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dims = tl.arange(0, HEAD_PAD)
    stat = part_row * stride_mt + heads * stride_mh  # [BLOCK_H]
    part = PartAcc + part_row * stride_pt + heads[:, None] * stride_ph + dims[None, :]
    # the maximum is exact in any order; the sums go split by split
    m_max = tl.load(PartMax + stat, mask=head_ok, other=float("-inf"))
    for s in range(1, num_splits):
        m_max = tl.maximum(m_max, tl.load(PartMax + stat + s, mask=head_ok, other=0.0))
    if USE_SINKS:
        sink = tl.load(Sinks + heads, mask=head_ok, other=float("-inf")) * _LOG2E
        m_max = tl.maximum(m_max, sink)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], dtype=tl.float32)
    for s in range(0, num_splits):
        weight = tl.exp2(tl.load(PartMax + stat + s, mask=head_ok, other=0.0) - m_use)
        total += weight * tl.load(PartSum + stat + s, mask=head_ok, other=0.0)
        acc += weight[:, None] * tl.load(part + s * stride_ps, mask=head_ok[:, None], other=0.0)
    if USE_SINKS:
        total += tl.exp2(sink - m_use)
    _write_rows(Out, acc, total, token, heads, head_ok, dims, stride_ot, stride_oh, HEAD_SIZE)


if interpreting():
    fix_interpreter_loop_bounds()
