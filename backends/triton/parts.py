"""A step, or a part of one, as the Triton backend's kernels launch over it.

Both kernels (the portable ``unified_attention_kernel`` and the Gluon prefill kernel)
take a part of a step as views of the step's tensors from the part's first request on,
and number its query blocks from that request's: request ``i``'s blocks start at
``query_start_loc[i] // BLOCK_Q + i``, so a grid of ``query_blocks`` programs covers
the part.

Under CUDA-graph bounds that allow chunk-length queries, a step runs as two captured
launches, one over its decode-like requests and one over the longer ones
(``decode_and_longer_runs``); each step copies its part of the metadata into the
launch's persistent buffers (``StagedPart``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from pagedkv.graph import PaddingTail
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
    qsl = common.query_start_loc_cpu.numpy()
    lo, hi = int(qsl[first]), int(qsl[end])
    return PartViews(
        common.query_start_loc[first:],
        common.seq_lens[first:],
        common.block_table[first:],
        end - first,
        hi - lo,
        hi // block_q - lo // block_q + (end - first),
    )


# -- a mixed step under CUDA-graph bounds: its decodes and its longer requests apart ------


def decode_and_longer_runs(
    query_lens: np.ndarray, max_decode_len: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Requests ``[first, end)`` of the step's decode-like run (at most ``max_decode_len``
    queries each) and of its run of longer requests. A request without queries (padding)
    joins the run before it. A step whose kinds alternate more than once has no
    decode run: every request goes to the longer requests' launch, whose tiles serve both.
    An empty run is ``(i, i)``."""
    n = len(query_lens)
    least, most = query_lens.min(initial=1), query_lens.max(initial=0)
    if least > 0 and (most <= max_decode_len or least > max_decode_len):
        # every request live and of one kind (a decode step, a prefill step)
        return ((0, n), (n, n)) if most <= max_decode_len else ((0, 0), (0, n))
    live = query_lens > 0
    if not live.any():
        return (0, n), (n, n)
    # each request takes the kind of the last live request up to it (the first live
    # one's before it)
    last_live = np.maximum.accumulate(np.where(live, np.arange(n), -1))
    last_live = np.where(last_live < 0, int(np.argmax(live)), last_live)
    decode_like = (query_lens <= max_decode_len)[last_live]
    changes = np.flatnonzero(decode_like[1:] != decode_like[:-1])
    if len(changes) == 0:
        return ((0, n), (n, n)) if decode_like[0] else ((0, 0), (0, n))
    if len(changes) > 1:
        return (0, 0), (0, n)
    cut = int(changes[0]) + 1
    return ((0, cut), (cut, n)) if decode_like[0] else ((cut, n), (0, cut))


class StagedPart:
    """Persistent metadata buffers of one launch of a CUDA-graph step that runs a part
    of the step's requests: each step copies its part's requests into them (device to
    device) and pads the rest with requests without queries, so that the captured
    launch, sized for ``max_reqs`` requests and ``max_tokens`` tokens, covers it."""

    def __init__(
        self, scratch: Callable[..., torch.Tensor], name: str, max_reqs: int, max_tokens: int,
        table_width: int,
    ) -> None:  # fmt: skip
        i32 = torch.int32
        self.query_start_loc = scratch(f"{name}_query_start_loc", (max_reqs + 1,), i32)
        self.seq_lens = scratch(f"{name}_seq_lens", (max_reqs,), i32)
        self.block_table = scratch(f"{name}_block_table", (max_reqs, table_width), i32)
        self.max_reqs = max_reqs
        self.max_tokens = max_tokens
        # the padding requests after the part's (unknown in buffers another staging may
        # have written: filled at the first step; ``kept`` keeps a part across steps)
        self._padding = (
            PaddingTail(self.query_start_loc, -1), PaddingTail(self.seq_lens, -1)
        )  # fmt: skip

    @classmethod
    def kept(
        cls, parts: dict[str, StagedPart], scratch: Callable[..., torch.Tensor], name: str,
        max_reqs: int, max_tokens: int, table_width: int,
    ) -> StagedPart:  # fmt: skip
        """The part ``name`` of ``parts`` while its buffers are still ``scratch``'s (the
        same reservation), else a new one there: a steady step then writes no padding."""
        part = parts.get(name)
        buffer = scratch(f"{name}_query_start_loc", (max_reqs + 1,), torch.int32)
        if part is None or part.query_start_loc is not buffer or part.max_tokens != max_tokens:
            part = parts[name] = cls(scratch, name, max_reqs, max_tokens, table_width)
        return part

    def stage(self, common: CommonAttentionMetadata, requests: tuple[int, int]) -> None:
        """Copy requests ``[first, end)`` of the (staged) step in."""
        first, end = requests
        n = end - first
        qsl = common.query_start_loc
        starts, seqs = self._padding
        self.query_start_loc[: n + 1].copy_(qsl[first : end + 1], non_blocking=True)
        # padding requests start where the part's last one ends (the staged step's host copy)
        starts.pad(n + 1, int(common.query_start_loc_cpu[end]))
        self.seq_lens[:n].copy_(common.seq_lens[first:end], non_blocking=True)
        seqs.pad(n, 0)
        self.block_table[:n].copy_(common.block_table[first:end], non_blocking=True)

    def views(self, block_q: int) -> PartViews:
        """The launch's views. Its query blocks: the part's first block may be anywhere
        in the step, so one more than its tokens and requests need."""
        return PartViews(
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.max_reqs,
            self.max_tokens,
            self.max_tokens // block_q + self.max_reqs + 1,
        )
