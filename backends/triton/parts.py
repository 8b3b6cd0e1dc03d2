"""A step, or a part of one, as the Triton backend's kernels launch over it.

Both kernels (the portable ``unified_attention_kernel`` and the Gluon prefill kernel)
take a part of a step as views of the step's tensors from the part's first request on,
and number its query blocks from that request's: request ``i``'s blocks start at
``query_start_loc[i] // BLOCK_Q + i``, so a grid of ``query_blocks`` programs covers
the part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedkv.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class PartViews:
    query_start_loc: torch.Tensor  # from the part's first request on
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_reqs: int
    num_tokens: int
    query_blocks: int  # programs along the grid's first axis, for BLOCK_Q queries each


def part_views(
    common: CommonAttentionMetadata, requests: tuple[int, int] | None, block_q: int
) -> PartViews:
    """Requests ``[first, end)`` of the step, or (None) the whole, maybe padded, step:
    every request and token row may then hold a query (a CUDA-graph plan's grid is
    sized for its bounds, not for this step's requests)."""
    if requests is None:
        num_reqs, num_tokens = common.num_reqs, common.num_tokens
        return PartViews(
            common.query_start_loc,
            common.seq_lens,
            common.block_table,
            num_reqs,
            num_tokens,
            num_tokens // block_q + num_reqs,
        )
    first, end = requests
    lo, hi = common.query_start_loc_cpu[[first, end]].tolist()
    return PartViews(
        common.query_start_loc[first:],
        common.seq_lens[first:],
        common.block_table[first:],
        end - first,
        hi - lo,
        hi // block_q - lo // block_q + (end - first),
    )
