"""StepAssembler: scheduled requests -> one CommonAttentionMetadata, over a persistent BlockTable."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pagedkv.errors import KVCacheUsageError, MetadataError
from pagedkv.intmath import cdiv
from pagedkv.kv.block_table import BlockTable, check_block_ids
from pagedkv.kv.manager import BlockCopy
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.transfer import to_device


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    ``new_block_ids``: the block ids added to the request's list since the assembler
    last saw it (all of them the first time), i.e. ``KVCacheManager.take_new_block_ids``
    called after this step's ``allocate_slots``.
    """

    request_id: str
    num_computed_tokens: int  # tokens already in the cache
    num_new_tokens: int  # tokens computed this step (query length)
    new_block_ids: Sequence[int] = ()


def copies_to_tensors(
    copies: Sequence[BlockCopy], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) int64 tensors for ``AttentionBackend.copy_blocks``."""
    src = to_device([c.src for c in copies], device, torch.int64)
    dst = to_device([c.dst for c in copies], device, torch.int64)
    return src, dst


class StepAssembler:
    """Keeps a block-table row per resident request and builds each step's metadata.

    Rows stay put between steps (only new blocks are written); ``build`` swaps the
    scheduled requests into rows 0..B-1 in batch order and commits those rows in
    one transfer. Requests that are resident but not scheduled keep rows >= B.
    """

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise KVCacheUsageError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.block_table = BlockTable(max_num_reqs, cdiv(max_model_len, block_size), device)
        self._row_of: dict[str, int] = {}
        self._req_at: list[str] = []  # request id of each used row; rows are dense

    # -- residency ----------------------------------------------------------------------------

    def add_request(self, request_id: str, block_ids: Sequence[int]) -> None:
        if request_id in self._row_of:
            raise KVCacheUsageError(f"request {request_id!r} already has a block-table row")
        row = len(self._req_at)
        if row >= self.block_table.max_num_reqs:
            raise KVCacheUsageError(
                f"no free block-table row for {request_id!r}: all {row} rows are in use"
            )
        self._row_of[request_id] = row
        self._req_at.append(request_id)
        self.block_table.add_row(block_ids, row)

    def remove_request(self, request_id: str) -> None:
        """Drop the request's row; the last row moves into the hole to keep rows dense."""
        row = self._row(request_id)
        last = len(self._req_at) - 1
        if row != last:
            moved = self._req_at[last]
            self.block_table.move_row(last, row)
            self._req_at[row] = moved
            self._row_of[moved] = row
        self.block_table.clear_row(last)
        self._req_at.pop()
        del self._row_of[request_id]

    def _row(self, request_id: str) -> int:
        row = self._row_of.get(request_id)
        if row is None:
            raise KVCacheUsageError(f"request {request_id!r} has no block-table row")
        return row

    @property
    def num_resident(self) -> int:
        return len(self._req_at)

    # -- one step ------------------------------------------------------------------------------

    def build(
        self, scheduled: Sequence[ScheduledRequest], num_tokens: int | None = None
    ) -> CommonAttentionMetadata:
        """The step's metadata, requests in the order given; ``num_tokens`` pads T."""
        num_reqs = len(scheduled)
        if len({s.request_id for s in scheduled}) != num_reqs:
            raise KVCacheUsageError("a request is scheduled twice in one step")
        computed = np.array([s.num_computed_tokens for s in scheduled], dtype=np.int64)
        query_lens = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
        if num_reqs and (computed.min() < 0 or query_lens.min() < 0):
            i = int(np.argmin(np.minimum(computed, query_lens)))
            raise KVCacheUsageError(
                f"request {scheduled[i].request_id!r}: token counts must be >= 0, got "
                f"num_computed_tokens={computed[i]}, num_new_tokens={query_lens[i]}"
            )
        row_of = self._row_of
        for s in scheduled:
            check_block_ids(s.new_block_ids, f"request {s.request_id!r}: new_block_ids")
        seq_lens = computed + query_lens
        per_row = self.block_table.num_blocks_per_row
        have = np.array(
            [
                (per_row[row_of[s.request_id]] if s.request_id in row_of else 0)
                + len(s.new_block_ids)
                for s in scheduled
            ],
            dtype=np.int64,
        )
        need = -(-seq_lens // self.block_size)
        for i in np.flatnonzero(need > have)[:1]:
            raise MetadataError(
                f"request {scheduled[i].request_id!r}: seq_len {seq_lens[i]} needs {need[i]} "
                f"blocks of {self.block_size}, its row would hold {have[i]}"
            )
        num_new_rows = sum(1 for s in scheduled if s.request_id not in row_of)
        if len(self._req_at) + num_new_rows > self.block_table.max_num_reqs:
            raise KVCacheUsageError(
                f"{num_new_rows} new requests need rows, but {len(self._req_at)} of "
                f"{self.block_table.max_num_reqs} block-table rows are in use"
            )
        for i, s in enumerate(scheduled):
            row = row_of.get(s.request_id)
            if row is None:
                self.add_request(s.request_id, s.new_block_ids)
                row = row_of[s.request_id]
            elif s.new_block_ids:
                self.block_table.append_row(s.new_block_ids, row)
            if row != i:
                self._swap(i, row)
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        seq_np = seq_lens.astype(np.int32)
        slots = self.block_table.compute_slot_mapping(qsl, seq_np, self.block_size, num_tokens)
        table = self.block_table.commit(num_reqs)
        qsl_cpu = torch.from_numpy(qsl)
        seq_cpu = torch.from_numpy(seq_np)
        return CommonAttentionMetadata(
            query_start_loc=to_device(qsl_cpu, self.device),
            seq_lens=to_device(seq_cpu, self.device),
            block_table=table,
            slot_mapping=to_device(slots, self.device),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
            block_size=self.block_size,
        )

    def _swap(self, a: int, b: int) -> None:
        self.block_table.swap_row(a, b)
        ra, rb = self._req_at[a], self._req_at[b]
        self._req_at[a], self._req_at[b] = rb, ra
        self._row_of[ra], self._row_of[rb] = b, a
