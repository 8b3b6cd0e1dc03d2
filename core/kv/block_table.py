"""BlockTable: the worker's [max_num_reqs, max_num_blocks_per_req] table, host and device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from pagedkv.errors import KVCacheUsageError
from pagedkv.slots import compute_slot_mapping


def check_block_ids(block_ids: Sequence[int], what: str) -> None:
    """Refuse ids < 1: block 0 is the null block, padding that every table shares, and
    a real token's K/V written there would land in every request's padding."""
    if len(block_ids) and min(block_ids) < 1:
        i, bad = next((i, b) for i, b in enumerate(block_ids) if b < 1)
        what_is = "block 0 is the null block (padding)" if bad == 0 else "block ids are >= 0"
        raise KVCacheUsageError(
            f"{what}: block id {bad} at position {i}: expected a block the KV manager "
            f"handed out (>= 1); {what_is}"
        )


class BlockTable:
    """Row ``r`` holds the physical block ids of the request in batch slot ``r``.

    Rows are edited on the host (a numpy view of a CPU tensor, pinned when the
    device is CUDA) and ``commit`` copies the first rows to the device tensor in one
    transfer, so per-step edits cost no device work. Entries past a row's length
    are 0, the null block.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        device: torch.device | str = "cpu",
        *,
        pin_memory: bool | None = None,
    ) -> None:
        for name, value in (
            ("max_num_reqs", max_num_reqs),
            ("max_num_blocks_per_req", max_num_blocks_per_req),
        ):
            if not isinstance(value, int) or value <= 0:
                raise KVCacheUsageError(f"{name} must be a positive int, got {value!r}")
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.device = torch.device(device)
        if pin_memory is None:
            pin_memory = self.device.type == "cuda" and torch.cuda.is_available()
        shape = (max_num_reqs, max_num_blocks_per_req)
        # [max_num_reqs, max_num_blocks_per_req] int32, host; edited through block_table_np
        self.block_table_cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=pin_memory)
        self.block_table_np: np.ndarray = self.block_table_cpu.numpy()
        # [max_num_reqs, max_num_blocks_per_req] int32, device; valid up to the last commit
        self.block_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        # [max_num_reqs] int32: entries in use per row
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    # -- row edits (host only) ---------------------------------------------------------------

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Add ``block_ids`` (each >= 1) after the row's current entries."""
        self._check_row(row)
        n = len(block_ids)
        if n == 0:
            return
        check_block_ids(block_ids, f"block table row {row}")
        start = int(self.num_blocks_per_row[row])
        end = start + n
        if end > self.max_num_blocks_per_req:
            raise KVCacheUsageError(
                f"block table row {row}: {start} + {n} blocks exceed max_num_blocks_per_req "
                f"{self.max_num_blocks_per_req}"
            )
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Replace the row with ``block_ids``."""
        self.clear_row(row)
        self.append_row(block_ids, row)

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src`` over row ``tgt`` (``src`` is left as it was)."""
        self._check_row(src)
        self._check_row(tgt)
        n = int(self.num_blocks_per_row[src])
        old = int(self.num_blocks_per_row[tgt])
        self.block_table_np[tgt, :n] = self.block_table_np[src, :n]
        if old > n:
            self.block_table_np[tgt, n:old] = 0
        self.num_blocks_per_row[tgt] = n

    def swap_row(self, a: int, b: int) -> None:
        self._check_row(a)
        self._check_row(b)
        self.block_table_np[[a, b]] = self.block_table_np[[b, a]]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

    def clear_row(self, row: int) -> None:
        self._check_row(row)
        n = int(self.num_blocks_per_row[row])
        self.block_table_np[row, :n] = 0
        self.num_blocks_per_row[row] = 0

    # -- device --------------------------------------------------------------------------------

    def commit(self, num_reqs: int) -> torch.Tensor:
        """Copy rows [0, num_reqs) to the device without waiting for its queue.

        Returns the device view [num_reqs, max_num_blocks_per_req].
        """
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise KVCacheUsageError(
                f"commit: num_reqs must be in [0, {self.max_num_reqs}], got {num_reqs}"
            )
        dst = self.block_table[:num_reqs]
        src = self.block_table_cpu[:num_reqs]
        if dst.is_cuda:
            # the host may change these rows for the next step before this copy has
            # run (a scheduler working ahead of the device): copy a snapshot, which
            # the copy stages before it returns, never the live pinned rows
            src = src.clone(memory_format=torch.contiguous_format)
        dst.copy_(src, non_blocking=True)
        return dst

    def compute_slot_mapping(
        self,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_size: int,
        num_tokens: int | None = None,
    ) -> np.ndarray:
        """Slots of the scheduled tokens of rows [0, len(seq_lens)); see pagedkv.slots."""
        return compute_slot_mapping(
            self.block_table_np[: len(seq_lens)], query_start_loc, seq_lens, block_size, num_tokens
        )

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise KVCacheUsageError(
                f"block table row {row} is out of range [0, {self.max_num_reqs})"
            )
