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

``TRIM_SPLITS`` (splits of fixed key ranges): a row merges only the ranges below its
last visible key, the only ones the attention kernel wrote for it.

``ORDERED`` merges split by split, in split order: a row's sums then see the same
terms in the same order whatever the number of splits of the launch (splits past a
row's keys add exact zeros), which the batch-invariant mode needs. Otherwise all
splits are merged at once (a tree reduction whose order follows ``SPLIT_PAD``).
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
    NumSplits,  # [5] int32: splits, tiles and keys per range, partials' first token, ... (DYNAMIC_SPLITS)
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
    SPLIT_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_SINKS: tl.constexpr,
    ORDERED: tl.constexpr,
    DYNAMIC_SPLITS: tl.constexpr,
    TRIM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    WAIT_FOR_PRIMARY: tl.constexpr,
):
    # a launch over a part of the step: its tokens start at its first request's
    token = tl.program_id(0) + tl.load(QueryStartLoc)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    if token >= tl.load(QueryStartLoc + num_seqs):
        return
    token = token.to(tl.int64)
    part_row = token
    if DYNAMIC_SPLITS:
        num_splits = tl.load(NumSplits)
        keys_per_split = tl.load(NumSplits + 2)
        part_row = token - tl.load(NumSplits + 3)
    if TRIM_SPLITS:
        # fixed key ranges (keys_per_split > 0): only those below this row's last key
        # were written (no window here)
        seq = find_request(QueryStartLoc, token, num_seqs)
        seq_len = tl.load(SeqLens + seq)
        key_hi = seq_len
        if CAUSAL:
            key_hi = seq_len - tl.load(QueryStartLoc + seq + 1) + token + 1
        trimmed = tl.cdiv(key_hi, tl.maximum(keys_per_split, 1))
        num_splits = tl.where(keys_per_split > 0, tl.minimum(num_splits, trimmed), num_splits)
    if WAIT_FOR_PRIMARY:
        # launched as a programmatic dependent: the partials are complete only after this
        # (what was read above was written before the attention kernel started)
        tl.extra.cuda.gdc_wait()
    dims = tl.arange(0, HEAD_PAD)
    stat = part_row * stride_mt + heads * stride_mh  # [BLOCK_H]
    part = PartAcc + part_row * stride_pt + heads[:, None] * stride_ph + dims[None, :]

    if ORDERED:
        # the maximum is exact in any order; the sums go split by split
        m_max = tl.load(PartMax + stat, mask=head_ok, other=float("-inf"))
        for s in range(1, num_splits):
            m_max = tl.maximum(m_max, tl.load(PartMax + stat + s, mask=head_ok, other=0.0))
    else:
        splits = tl.arange(0, SPLIT_PAD)
        stat_ok = head_ok[:, None] & (splits[None, :] < num_splits)  # [BLOCK_H, SPLIT_PAD]
        m = tl.load(PartMax + stat[:, None] + splits[None, :], mask=stat_ok, other=float("-inf"))
        m_max = tl.max(m, 1)
    if USE_SINKS:
        sink = tl.load(Sinks + heads, mask=head_ok, other=float("-inf")) * _LOG2E
        m_max = tl.maximum(m_max, sink)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)

    if ORDERED:
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_PAD], dtype=tl.float32)
        for s in range(0, num_splits):
            weight = tl.exp2(tl.load(PartMax + stat + s, mask=head_ok, other=0.0) - m_use)
            total += weight * tl.load(PartSum + stat + s, mask=head_ok, other=0.0)
            acc += weight[:, None] * tl.load(part + s * stride_ps, mask=head_ok[:, None], other=0.0)
    else:
        weight = tl.exp2(m - m_use[:, None])  # [BLOCK_H, SPLIT_PAD]
        denom = tl.load(PartSum + stat[:, None] + splits[None, :], mask=stat_ok, other=0.0)
        total = tl.sum(weight * denom, 1)
        acc = tl.load(
            part[:, None, :] + splits[None, :, None] * stride_ps,
            mask=stat_ok[:, :, None],
            other=0.0,
        )  # [BLOCK_H, SPLIT_PAD, HEAD_PAD]
        acc = tl.sum(acc * weight[:, :, None], 1)
    if USE_SINKS:
        total += tl.exp2(sink - m_use)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        Out + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=head_ok[:, None] & (dims[None, :] < HEAD_SIZE),
    )


if interpreting():
    fix_interpreter_loop_bounds()
