"""The Triton backend's metadata: tile and split choices per step, and the fixed
buffers that let a captured CUDA graph replay with new metadata.

Every decision is made here, on the host, from the CPU copies in
CommonAttentionMetadata; ``forward`` only launches kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedkv.backend import AttentionMetadataBuilder
from pagedkv.backends.triton.configs import (
    CPU_SM_COUNT,
    SPLIT_POLICY,
    SplitPolicy,
    TileConfig,
    choose_num_splits,
    head_pad,
    select_tile,
    tile_kind,
)
from pagedkv.errors import ConfigError, MetadataError
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec


@dataclass(frozen=True)
class TritonMetadata:
    """One step for the Triton kernels. B = num_seqs (padded in CUDA-graph mode)."""

    query_start_loc: torch.Tensor  # [B+1] int32; padded requests repeat the last value
    seq_lens: torch.Tensor  # [B] int32; padded requests have 0
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64; < 0 = padding
    num_seqs: int  # B, the launch size
    num_tokens: int  # T, rows of query/key/value/output
    max_query_len: int  # upper bound; picks the tiles
    tile: TileConfig
    block_q: int  # query tokens per program: tile.block_m // GQA group
    num_splits: int  # 1: single pass; > 1: split-KV partials + reduction
    partial_acc: torch.Tensor | None  # [T, Hq, splits, head_pad] fp32
    partial_max: torch.Tensor | None  # [T, Hq, splits] fp32
    partial_sum: torch.Tensor | None  # [T, Hq, splits] fp32

    @property
    def num_query_blocks(self) -> int:
        """Programs along the grid's first axis: an upper bound of the query blocks."""
        return self.num_tokens // self.block_q + self.num_seqs


@dataclass
class _GraphBuffers:
    """Fixed-address copies of the metadata tensors for CUDA-graph capture and replay."""

    query_start_loc: torch.Tensor  # [max_num_reqs + 1] int32
    seq_lens: torch.Tensor  # [max_num_reqs] int32
    block_table: torch.Tensor  # [max_num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [max_num_tokens] int64
    max_query_len: int
    tile: TileConfig
    block_q: int
    num_splits: int
    partials: tuple[torch.Tensor, ...] | None


class TritonMetadataBuilder(AttentionMetadataBuilder[TritonMetadata]):
    """Chooses tiles and splits per step; in CUDA-graph mode writes into fixed buffers.

    Eager: ``build`` wraps the step's own tensors. CUDA graphs: call
    ``reserve_cuda_graph`` once, then every ``build`` copies the step into the same
    buffers (padded to the reserved batch) and returns metadata with the same
    launch geometry, so a graph captured on one step replays any later one.
    Options: ``num_splits`` (0 = chosen per batch).
    """

    def __init__(
        self,
        spec: AttentionSpec,
        device: torch.device | str,
        *,
        split_policy: SplitPolicy = SPLIT_POLICY,
        **options: object,
    ) -> None:
        super().__init__(spec, device, **options)
        self.split_policy = split_policy
        forced = int(options.get("num_splits") or 0)
        if not 0 <= forced <= split_policy.max_splits:
            raise ConfigError(
                f"option num_splits={forced}: expected 0 (auto) to {split_policy.max_splits}"
            )
        self.forced_splits = forced
        self._sms: int | None = None
        self._graph: _GraphBuffers | None = None

    # -- decisions -------------------------------------------------------------------

    def num_sms(self) -> int:
        if self.device.type != "cuda":
            return CPU_SM_COUNT
        if self._sms is None:
            self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return self._sms

    def choose(
        self,
        num_seqs: int,
        num_tokens: int,
        max_query_len: int,
        max_seq_len: int,
        num_splits: int | None = None,
    ) -> tuple[TileConfig, int, int]:
        """(tiles, query tokens per program, splits) for a batch of this shape;
        ``num_splits`` overrides the split decision (tuning)."""
        spec = self.spec
        group = spec.num_queries_per_kv
        tile = select_tile(
            tile_kind(max_query_len, group), spec.head_size, spec.dtype, spec.kv_cache_dtype
        )
        block_m = max(tile.block_m, 1 << (group - 1).bit_length())
        if block_m != tile.block_m:
            tile = TileConfig(block_m, tile.tile_n, tile.num_warps, tile.num_stages)
        block_q = block_m // group
        splits = num_splits or self.forced_splits
        if not splits:
            query_blocks = min(
                num_seqs * -(-max_query_len // block_q), num_tokens // block_q + num_seqs
            )
            programs = query_blocks * spec.num_kv_heads
            splits = choose_num_splits(
                self.split_policy, programs, max_query_len, max_seq_len, self.num_sms()
            )
        if splits > 1 and tile_kind(max_query_len, group) == "decode":
            split_tile = select_tile(
                "decode-split", spec.head_size, spec.dtype, spec.kv_cache_dtype
            )
            if split_tile.block_m == tile.block_m:  # same rows: the split decision stands
                tile = split_tile
        return tile, block_q, splits

    def _partials(self, num_tokens: int, num_splits: int) -> tuple[torch.Tensor, ...] | None:
        if num_splits <= 1:
            return None
        s = self.spec
        shape = (num_tokens, s.num_heads, num_splits)
        return (
            torch.empty((*shape, head_pad(s.head_size)), dtype=torch.float32, device=self.device),
            torch.empty(shape, dtype=torch.float32, device=self.device),
            torch.empty(shape, dtype=torch.float32, device=self.device),
        )

    # -- eager --------------------------------------------------------------------------

    def build(
        self,
        common: CommonAttentionMetadata,
        *,
        tile: TileConfig | None = None,
        num_splits: int | None = None,
    ) -> TritonMetadata:
        """This step's metadata. ``tile`` / ``num_splits`` override the choices (tuning)."""
        if self._graph is not None:
            return self._build_into_graph_buffers(common)
        chosen, block_q, splits = self.choose(
            common.num_reqs, common.num_tokens, common.max_query_len, common.max_seq_len, num_splits
        )
        if tile is not None:
            chosen = tile
            block_q = tile.block_m // self.spec.num_queries_per_kv
            if block_q < 1:
                raise ConfigError(
                    f"tile {tile}: block_m {tile.block_m} is smaller than the GQA group "
                    f"{self.spec.num_queries_per_kv}"
                )
        partials = self._partials(common.num_tokens, splits)
        return TritonMetadata(
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            num_seqs=common.num_reqs,
            num_tokens=common.num_tokens,
            max_query_len=common.max_query_len,
            tile=chosen,
            block_q=block_q,
            num_splits=splits,
            partial_acc=partials[0] if partials else None,
            partial_max=partials[1] if partials else None,
            partial_sum=partials[2] if partials else None,
        )

    # -- CUDA graphs ----------------------------------------------------------------------

    def reserve_cuda_graph(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_blocks_per_req: int,
        *,
        max_query_len: int = 1,
    ) -> None:
        """Switch to fixed buffers sized for the largest batch a graph will replay.

        From now on ``build`` pads every step to ``max_num_reqs`` requests and
        ``max_num_tokens`` tokens (query/key/value/output must have that many rows)
        and keeps the tiles and splits chosen here, for queries up to
        ``max_query_len`` tokens and sequences up to ``max_blocks_per_req`` blocks.
        """
        for name, value in (
            ("max_num_reqs", max_num_reqs),
            ("max_num_tokens", max_num_tokens),
            ("max_blocks_per_req", max_blocks_per_req),
            ("max_query_len", max_query_len),
        ):
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        max_seq_len = max_blocks_per_req * self.spec.block_size
        tile, block_q, splits = self.choose(
            max_num_reqs, max_num_tokens, max_query_len, max_seq_len
        )
        i32 = dict(dtype=torch.int32, device=self.device)
        self._graph = _GraphBuffers(
            query_start_loc=torch.zeros(max_num_reqs + 1, **i32),
            seq_lens=torch.zeros(max_num_reqs, **i32),
            block_table=torch.zeros(max_num_reqs, max_blocks_per_req, **i32),
            slot_mapping=torch.full((max_num_tokens,), -1, dtype=torch.int64, device=self.device),
            max_query_len=max_query_len,
            tile=tile,
            block_q=block_q,
            num_splits=splits,
            partials=self._partials(max_num_tokens, splits),
        )

    def _build_into_graph_buffers(self, common: CommonAttentionMetadata) -> TritonMetadata:
        g = self._graph
        assert g is not None
        max_reqs, max_tokens = g.seq_lens.shape[0], g.slot_mapping.shape[0]
        num_reqs, width = common.num_reqs, common.block_table.shape[1]
        for name, got, cap in (
            ("num_reqs", num_reqs, max_reqs),
            ("num_tokens", common.num_tokens, max_tokens),
            ("max_query_len", common.max_query_len, g.max_query_len),
        ):
            if got > cap:
                raise MetadataError(
                    f"{name} = {got} exceeds the CUDA-graph reservation ({cap}); "
                    "call reserve_cuda_graph with a larger size"
                )
        if width > g.block_table.shape[1]:
            needed = -(-common.max_seq_len // self.spec.block_size)
            if needed > g.block_table.shape[1]:
                raise MetadataError(
                    f"block_table needs {needed} blocks per request but the CUDA-graph "
                    f"reservation holds {g.block_table.shape[1]}"
                )
            width = g.block_table.shape[1]
        # device-to-device copies and fills only: no host sync
        g.query_start_loc[: num_reqs + 1].copy_(common.query_start_loc, non_blocking=True)
        g.query_start_loc[num_reqs + 1 :].fill_(common.num_actual_tokens)
        g.seq_lens[:num_reqs].copy_(common.seq_lens, non_blocking=True)
        g.seq_lens[num_reqs:].zero_()
        g.block_table[:num_reqs, :width].copy_(common.block_table[:, :width], non_blocking=True)
        g.slot_mapping[: common.num_tokens].copy_(common.slot_mapping, non_blocking=True)
        g.slot_mapping[common.num_tokens :].fill_(-1)
        partials = g.partials
        return TritonMetadata(
            query_start_loc=g.query_start_loc,
            seq_lens=g.seq_lens,
            block_table=g.block_table,
            slot_mapping=g.slot_mapping,
            num_seqs=max_reqs,
            num_tokens=max_tokens,
            max_query_len=g.max_query_len,
            tile=g.tile,
            block_q=g.block_q,
            num_splits=g.num_splits,
            partial_acc=partials[0] if partials else None,
            partial_max=partials[1] if partials else None,
            partial_sum=partials[2] if partials else None,
        )
