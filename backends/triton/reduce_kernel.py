"""Merge the split-KV partial results of ``unified_attention_kernel`` into the output.

Grid ``(T, Hq)``: one program per (token, query head) rescales each split's
unnormalised accumulator by exp2(max_s - max) and divides by the merged
denominator, to which the attention sink (if any) contributes its own term.
Padding tokens (past query_start_loc[num_seqs]) are skipped.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def reduce_splits_kernel(
    Out,  # [T, Hq, HEAD_SIZE]
    PartAcc,  # [T, Hq, splits, HEAD_PAD] fp32
    PartMax,  # [T, Hq, splits] fp32, base 2
    PartSum,  # [T, Hq, splits] fp32
    Sinks,  # [Hq] fp32 (USE_SINKS)
    QueryStartLoc,  # [num_seqs + 1] int32
    num_seqs,
    num_splits,
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
    USE_SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(QueryStartLoc + num_seqs):
        return
    token = token.to(tl.int64)
    splits = tl.arange(0, SPLIT_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_PAD)

    stat = token * stride_mt + head * stride_mh + splits
    m = tl.load(PartMax + stat, mask=split_ok, other=float("-inf"))
    denom = tl.load(PartSum + stat, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(Sinks + head) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_use)
    total = tl.sum(weight * denom, 0)
    if USE_SINKS:
        total += tl.exp2(sink - m_use)

    acc = tl.load(
        PartAcc
        + token * stride_pt
        + head * stride_ph
        + splits[:, None] * stride_ps
        + dims[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        Out + token * stride_ot + head * stride_oh + dims,
        out.to(Out.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )
