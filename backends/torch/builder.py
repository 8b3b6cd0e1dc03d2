"""The torch backend's metadata: the step's host-side lengths, read once per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.backend import AttentionMetadataBuilder, BackendMetadata
from pagedkv.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class TorchMetadata(BackendMetadata):
    query_starts: list[int]  # [B+1] host copy of query_start_loc
    seq_lens: list[int]  # [B] host copy


class TorchMetadataBuilder(AttentionMetadataBuilder[TorchMetadata]):
    def build_metadata(self, common: CommonAttentionMetadata, **overrides: Any) -> TorchMetadata:
        return TorchMetadata(
            common, common.query_start_loc_cpu.tolist(), common.seq_lens_cpu.tolist()
        )
