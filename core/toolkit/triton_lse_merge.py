"""The Triton kernel behind ``pagedkv.toolkit.split_kv.merge_by_lse``: partial attention
results over disjoint key ranges, merged by their log-sum-exp.

Grid ``(T, H)``: one program per (output row, head) walks the partial rows
``merge_indptr[t]:merge_indptr[t + 1]`` a chunk of ``CHUNK`` at a time (one round trip
to memory per chunk, not per partial: a long decode has tens of slices), with an
online rescale by the running maximum of the LSEs as flash-decoding's reduction does
(``lse_weights``, which the MLA backend's reduction shares), adds the head's sink logit
to the denominator once, and stores the normalised row. A row with no partials stores
zeros. Bounds come from ``merge_indptr`` on the device, so no host data is read per
step and the launch is CUDA-graph capturable.

Importing this module imports triton; ``pagedkv`` itself never does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagedkv.intmath import next_power_of_2
from pagedkv.toolkit.launch import KernelLaunch
from pagedkv.toolkit.triton_helpers import fix_interpreter_loop_bounds

fix_interpreter_loop_bounds()  # the loop over partial rows has runtime bounds


# partial rows merged per loop iteration: 16 covers most rows in one or two round trips
CHUNK = 16


@triton.jit
def lse_weights(top, lse, LOG2: tl.constexpr):
    """The weights of a chunk of partial results merged by log-sum-exp: ``lse`` [C] their
    log-sum-exps (natural, or base 2 with ``LOG2``; -inf: a part that saw no key, weight
    0), ``top`` the largest so far (-inf before any). Returns the new largest, the
    factor that moves sums made relative to ``top`` to it (0 before the first part with
    a key), and each part's weight relative to it: ``acc = acc * rescale + sum(weight *
    part)``, likewise the denominator."""
    new_top = tl.maximum(top, tl.max(lse, 0))
    # all -inf so far: nothing to rescale, keep exp() away from -inf - -inf
    base = tl.where(new_top == float("-inf"), 0.0, new_top)
    if LOG2:
        return new_top, tl.exp2(top - base), tl.exp2(lse - base)
    return new_top, tl.exp(top - base), tl.exp(lse - base)


@triton.jit
def merge_by_lse_kernel(
    Out,  # [T, H, Dv]
    PartOut,  # [R, H, Dv]
    PartLse,  # [R, H] float32, natural log
    MergeIndptr,  # [T + 1] int32
    Sinks,  # [H] float32 (read only when HAS_SINKS)
    stride_ot,
    stride_oh,
    stride_od,
    stride_pt,
    stride_ph,
    stride_pd,
    stride_lt,
    stride_lh,
    HEAD_SIZE_V: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    start = tl.load(MergeIndptr + row).to(tl.int64)
    end = tl.load(MergeIndptr + row + 1).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE_V

    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    if HAS_SINKS:
        # the sink's term exp(sink - m) with m = sink: 1 (0 for a -inf sink)
        m = tl.load(Sinks + head).to(tl.float32)
        denom = tl.where(m == float("-inf"), 0.0, 1.0)
    else:
        m = tl.full([], float("-inf"), tl.float32)
        denom = tl.full([], 0.0, tl.float32)
    for k0 in range(start, end, CHUNK):
        ks = k0 + tl.arange(0, CHUNK)
        k_ok = ks < end
        lse = tl.load(PartLse + ks * stride_lt + head * stride_lh, mask=k_ok, other=float("-inf"))
        m, rescale, weight = lse_weights(m, lse, False)
        # a partial with no key (LSE -inf) is not read: its row may be unwritten
        has_keys = k_ok & (lse > float("-inf"))
        parts = tl.load(
            PartOut + ks[:, None] * stride_pt + head * stride_ph + dims[None, :] * stride_pd,
            mask=has_keys[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = acc * rescale + tl.sum(weight[:, None] * parts, 0)
        denom = denom * rescale + tl.sum(weight, 0)
    out = acc / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        Out + row * stride_ot + head * stride_oh + dims * stride_od,
        out.to(Out.dtype.element_ty),
        mask=dim_ok,
    )


def plan_merge_by_lse(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    merge_indptr: torch.Tensor,
    output: torch.Tensor,
    sinks: torch.Tensor | None,
) -> KernelLaunch:
    """The planned launch (shapes as in ``split_kv.merge_by_lse``, already checked)."""
    template = merge_template(partial_out, partial_lse, merge_indptr, output.shape[0], sinks)
    return KernelLaunch(template.kernel, template.grid, {**template.kwargs, **output_args(output)})


def merge_template(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    merge_indptr: torch.Tensor,
    num_rows: int,
    sinks: torch.Tensor | None,
) -> KernelLaunch:
    """The launch for ``num_rows`` output rows without the output (``output_args``): a
    step plans it once, each layer's forward runs it into its own output
    (``KernelLaunch.run_with(call=output_args(output))``)."""
    _, num_heads, head_size_v = partial_out.shape
    p, lse = partial_out.stride(), partial_lse.stride()
    return KernelLaunch(
        merge_by_lse_kernel,
        (num_rows, num_heads),
        dict(
            PartOut=partial_out,
            PartLse=partial_lse,
            MergeIndptr=merge_indptr,
            Sinks=partial_lse if sinks is None else sinks,
            stride_pt=p[0],
            stride_ph=p[1],
            stride_pd=p[2],
            stride_lt=lse[0],
            stride_lh=lse[1],
            HEAD_SIZE_V=head_size_v,
            HEAD_PAD=next_power_of_2(head_size_v),
            CHUNK=CHUNK,
            HAS_SINKS=sinks is not None,
            num_warps=2 if head_size_v <= 128 else 4,
        ),
    )


def output_args(output: torch.Tensor) -> dict[str, object]:
    """The output's arguments of a merge launch (``merge_template``)."""
    o = output.stride()
    return dict(Out=output, stride_ot=o[0], stride_oh=o[1], stride_od=o[2])
