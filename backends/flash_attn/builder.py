"""FlashAttention's metadata and builder: one varlen paged call per layer, and how it
splits long decodes (the library's own split, or pagedkv's combinator)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pagedkv.backend import AttentionMetadataBuilder, BackendMetadata
from pagedkv.backends.flash_attn.adapters import gpu_major, require_adapter
from pagedkv.backends.flash_attn.configs import SPLIT_POLICY, fa4_programs, slice_choice
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.split_kv import (
    DecodeSlices,
    SliceCapacity,
    SplitChoice,
    num_sms,
    plan_decode_slices,
    split_problem,
)


@dataclass(frozen=True)
class FlashAttnMetadata(BackendMetadata):
    cu_seqlens_k: torch.Tensor  # [B+1] int32, device: cumulative seq_lens (FA2's varlen K)
    rows: int  # query rows given to the library: num_actual_tokens, or T under a reservation
    num_splits: int  # the library's split-KV: 1 none, 0 its own heuristic (FA3), n > 1 n
    sliced: SlicedStep | None  # the combinator's expanded step (FA4 where it cannot split)


@dataclass(frozen=True)
class SlicedStep:
    """Long decodes cut into slices, attended once and merged by log-sum-exp."""

    slices: DecodeSlices
    metadata: FlashAttnMetadata  # of slices.common


class FlashAttnMetadataBuilder(AttentionMetadataBuilder[FlashAttnMetadata]):
    """Adds what the FlashAttention calls need beyond the common metadata; mixed decode
    and prefill rows go into one varlen call, in the caller's order.

    Split-KV for long decodes, decided per step by ``configs.SPLIT_POLICY`` (or forced by
    ``num_splits``): FA3 splits by its own heuristic; FA4 takes ``num_splits`` where it
    splits (SM100/SM110); elsewhere (SM90) each long decode request becomes slices of its
    page table, extra requests of the same call (pagedkv.toolkit.split_kv). Under a
    CUDA-graph reservation the decision follows the bounds alone, so the captured path
    is every replay's, and the sliced step has the fixed size ``SliceCapacity`` gives.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        device: torch.device | str,
        *,
        impl: str | None = None,
        num_splits: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(spec, device, **options)
        self.adapter = require_adapter(impl, self.device)
        self.forced_splits = int(num_splits or 0)
        major = gpu_major(self.device)
        # who splits long decodes: the library itself, pagedkv's combinator, or nobody
        self.route: Literal["library", "combinator", "none"]
        if major in self.adapter.native_split_majors:
            self.route = "library"
        elif self.adapter.returns_lse and split_problem(spec) is None:
            self.route = "combinator"
        else:
            self.route = "none"

    def build_metadata(
        self, common: CommonAttentionMetadata, **overrides: Any
    ) -> FlashAttnMetadata:
        plain = self._metadata(common, "step")
        if self.route == "library" and self.adapter.own_split_heuristic:
            return dataclasses.replace(plain, num_splits=self.forced_splits)
        if self.route == "none":
            return plain
        choice = self._choose(common)
        if choice.num_splits <= 1:
            return plain
        if self.route == "library":
            return dataclasses.replace(plain, num_splits=choice.num_splits)
        bounds = self.graph_bounds
        if bounds is None:
            slices = plan_decode_slices(common, choice.keys_per_split)
            if not slices.num_cut:
                return plain
        else:
            capacity = SliceCapacity.for_bounds(bounds, choice.num_splits)
            slices = plan_decode_slices(
                common, choice.keys_per_split, capacity=capacity, buffer=self.scratch
            )
        sliced = SlicedStep(slices, self._metadata(slices.common, "slices"))
        return dataclasses.replace(plain, sliced=sliced)

    def _metadata(self, common: CommonAttentionMetadata, name: str) -> FlashAttnMetadata:
        cu = np.zeros(common.num_reqs + 1, dtype=np.int32)
        np.cumsum(common.seq_lens_cpu.numpy(), out=cu[1:])
        # under a reservation a persistent buffer (scratch), since a replay reads it
        cu_seqlens_k = self.scratch(f"flash_attn.{name}.cu_seqlens_k", cu.shape, torch.int32)
        cu_seqlens_k.copy_(torch.from_numpy(cu), non_blocking=True)
        # every padded row goes to the library under a reservation: a fixed shape
        rows = common.num_actual_tokens if self.graph_bounds is None else common.num_tokens
        return FlashAttnMetadata(common, cu_seqlens_k, rows, num_splits=1, sliced=None)

    def _choose(self, common: CommonAttentionMetadata) -> SplitChoice:
        """The split of this step, from its lengths (eager) or the bounds (reserved: the
        same for every step, as a captured graph needs)."""
        s = self.spec
        bounds = self.graph_bounds
        if bounds is None:
            query_lens = common.query_lens_cpu.tolist()
            max_query_len, max_seq_len = common.max_query_len, common.max_seq_len
            seq_lens = common.seq_lens_cpu.numpy()
        elif self.route == "combinator" and bounds.max_query_len > 1:
            # a mixed reservation keeps the plain call: slices serve decode-only graphs
            return SplitChoice(1, bounds.max_blocks_per_req * s.block_size)
        else:
            query_lens = [bounds.max_query_len] * bounds.max_num_reqs
            max_query_len = bounds.max_query_len
            max_seq_len = bounds.max_blocks_per_req * s.block_size
            seq_lens = np.full(bounds.max_num_reqs, max_seq_len)
        if self.route == "combinator" and not self.forced_splits and max_query_len <= 1:
            # a decode step: slices of the requests' keys, by the makespan rule
            return slice_choice(
                seq_lens, s.num_queries_per_kv, s.num_kv_heads, s.block_size, num_sms(self.device)
            )
        return SPLIT_POLICY.choose(
            fa4_programs(query_lens, s.num_queries_per_kv, s.num_kv_heads),
            max_query_len,
            max_seq_len,
            num_sms(self.device),
            forced=self.forced_splits,
            granule=s.block_size,
        )
