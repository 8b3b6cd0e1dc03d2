"""The metadata builder: runs once per step, shared by every layer.

Whatever depends only on the batch is decided here, so that ``attend`` of every layer
only computes. ``build()`` (the base class) has already checked the step against
the layer (block size, lengths, dtypes) before ``build_metadata`` sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pagedkv
import torch


@dataclass(frozen=True)
class MyMetadata(pagedkv.BackendMetadata):
    """``common`` (from BackendMetadata) gives the shared forward its slot mapping and
    row count; the rest is this backend's own plan of the step."""

    query_starts: list[int]  # [B+1], host
    seq_lens: list[int]  # [B], host
    block_ids: list[torch.Tensor]  # per request: its blocks in order, int64, device


class MyMetadataBuilder(pagedkv.AttentionMetadataBuilder[MyMetadata]):
    def build_metadata(self, common: pagedkv.CommonAttentionMetadata, **_: Any) -> MyMetadata:
        starts = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        bs = self.spec.block_size
        table = common.block_table.long()
        block_ids = [table[i, : -(-n // bs)] for i, n in enumerate(seq_lens)]
        return MyMetadata(common, starts, seq_lens, block_ids)
