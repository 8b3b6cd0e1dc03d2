"""CUDA graphs in the contract: what a backend supports, the bounds an engine reserves,
and the persistent metadata buffers every graph-capable builder shares.

The flow (one builder per model, any number of layers)::

    builder.reserve_cuda_graph(GraphBounds(max_num_reqs=64, max_num_tokens=64,
                                           max_blocks_per_req=256))
    md = builder.build(step_a)          # padded into the persistent buffers
    graph.capture(lambda: impl.forward(q, k, v, kv_cache, md, output=out))
    md = builder.build(step_b)          # same buffers, new contents
    graph.replay()                      # attends over step_b

After the reservation every ``build`` pads the step to the bounds: ``max_num_reqs``
requests (the extra ones empty: seq_len 0, no query rows) and ``max_num_tokens`` token
rows (slot -1), so query/key/value/output always have ``max_num_tokens`` rows, and the
launch geometry a backend derives from the padded step never changes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
from pagedkv.errors import ConfigError, MetadataError
from pagedkv.intmath import cdiv
from pagedkv.metadata import CommonAttentionMetadata


class GraphSupport(enum.Enum):
    """Which steps a backend's ``forward`` can be captured for and replayed on."""

    NEVER = "never"
    PURE_DECODE = "pure_decode"  # every request has exactly one query token
    MIXED = "mixed"  # any step within the bounds (decodes, chunks, prefills)

    def __str__(self) -> str:
        return self.value

    def allows(self, max_query_len: int) -> bool:
        if self is GraphSupport.NEVER:
            return False
        return self is GraphSupport.MIXED or max_query_len <= 1


@dataclass(frozen=True)
class GraphBounds:
    """The largest step a captured graph will replay."""

    max_num_reqs: int
    max_num_tokens: int  # rows of query/key/value/output in every graph step
    max_blocks_per_req: int  # block-table width: max_seq_len = this * block_size
    max_query_len: int = 1  # 1: pure decode

    def __post_init__(self) -> None:
        for name in ("max_num_reqs", "max_num_tokens", "max_blocks_per_req", "max_query_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"GraphBounds.{name} must be a positive int, got {value!r}")
        if self.max_query_len > self.max_num_tokens:
            raise ConfigError(
                f"GraphBounds.max_query_len {self.max_query_len} exceeds max_num_tokens "
                f"{self.max_num_tokens}"
            )


class PaddingTail:
    """A persistent 1-D buffer's padding: the entries from some index on hold one value (a
    CUDA-graph step's requests without queries, its slots without tokens). ``pad(start,
    value)`` makes ``buffer[start:]`` hold ``value``, writing only what the tail of the
    last call does not already hold: on a GPU each write is a launch, and a steady
    decode step's padding is the last step's. The caller writes ``buffer[:start]``; no
    one else writes the buffer."""

    def __init__(self, buffer: torch.Tensor, value: int) -> None:
        self.buffer = buffer
        self.start, self.value = 0, value  # buffer[start:] == value (as it was made)

    def pad(self, start: int, value: int) -> None:
        if value != self.value:
            self.buffer[start:].fill_(value)
        elif start < self.start:
            self.buffer[start : self.start].fill_(value)
        self.start, self.value = start, value


class GraphStaging:
    """Persistent, padded copies of the step's metadata tensors (one per builder).

    ``stage(common)`` copies a step into the buffers (device to device, no host sync)
    and returns metadata over them whose shape-deciding fields (number of requests
    and tokens, max query and sequence length, table width) are the bounds.
    """

    def __init__(self, bounds: GraphBounds, block_size: int, device: torch.device) -> None:
        self.bounds = bounds
        self.block_size = block_size
        b, i32 = bounds, dict(dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(b.max_num_reqs + 1, **i32)
        self.seq_lens = torch.zeros(b.max_num_reqs, **i32)
        self.block_table = torch.zeros(b.max_num_reqs, b.max_blocks_per_req, **i32)
        self.slot_mapping = torch.full((b.max_num_tokens,), -1, dtype=torch.int64, device=device)
        # the padding after the step's requests and tokens (as the buffers start)
        self._padding = (
            PaddingTail(self.query_start_loc, 0),  # the step's token count
            PaddingTail(self.seq_lens, 0),  # no keys
            PaddingTail(self.slot_mapping, -1),  # no slot
        )

    def stage(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        b = self.bounds
        num_reqs = common.num_reqs
        qsl = common.query_start_loc_cpu.numpy()
        seq = common.seq_lens_cpu.numpy()
        for name, got, cap in (
            ("num_reqs", num_reqs, b.max_num_reqs),
            ("num_tokens", common.num_tokens, b.max_num_tokens),
            (
                "max_query_len",
                int(np.maximum.reduce(qsl[1:] - qsl[:-1], initial=0)),
                b.max_query_len,
            ),
        ):
            if got > cap:
                raise MetadataError(
                    f"{name} = {got} exceeds the CUDA-graph reservation ({name} bound {cap}); "
                    "reserve_cuda_graph with larger GraphBounds"
                )
        needed = cdiv(int(np.maximum.reduce(seq, initial=0)), self.block_size)
        if needed > b.max_blocks_per_req:
            raise MetadataError(
                f"a request needs {needed} blocks but the CUDA-graph reservation holds "
                f"{b.max_blocks_per_req} per request (max_blocks_per_req)"
            )
        width = min(common.block_table.shape[1], b.max_blocks_per_req)
        num_actual, num_tokens = common.num_actual_tokens, common.num_tokens
        starts, seqs, slots = self._padding
        self.query_start_loc[: num_reqs + 1].copy_(common.query_start_loc, non_blocking=True)
        starts.pad(num_reqs + 1, num_actual)
        self.seq_lens[:num_reqs].copy_(common.seq_lens, non_blocking=True)
        seqs.pad(num_reqs, 0)
        self.block_table[:num_reqs, :width].copy_(common.block_table[:, :width], non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(common.slot_mapping, non_blocking=True)
        slots.pad(num_tokens, -1)
        # the host copies padded alike: requests without queries or keys
        qsl_padded = np.empty(b.max_num_reqs + 1, qsl.dtype)
        qsl_padded[: num_reqs + 1] = qsl
        qsl_padded[num_reqs + 1 :] = qsl[-1]
        seq_padded = np.zeros(b.max_num_reqs, seq.dtype)
        seq_padded[:num_reqs] = seq
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
            num_actual_tokens=num_actual,
            max_query_len=b.max_query_len,
            max_seq_len=b.max_blocks_per_req * self.block_size,
            query_start_loc_cpu=torch.from_numpy(qsl_padded),
            seq_lens_cpu=torch.from_numpy(seq_padded),
            block_size=common.block_size,
        )
