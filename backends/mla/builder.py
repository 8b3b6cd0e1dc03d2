"""The MLA backend's metadata and its builder: tiles, split-KV and the launch plan of a step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pagedkv.backend import AttentionMetadataBuilder, BackendMetadata
from pagedkv.backends.mla.configs import (
    MAX_FORCED_PARTIAL_BYTES,
    SPLIT_POLICY,
    KernelConfig,
    arch_of,
    choose_config,
    pad_dim,
)
from pagedkv.backends.mla.plan import StepPlan, max_tiles, plan_step, tile_table
from pagedkv.backends.mla.work import (
    GraphGrid,
    WorkList,
    choose_ranges,
    decode_tiles,
    fit_graph,
    graph_grid,
    merge_list,
    pad_items,
    tile_keys,
    work_list,
)
from pagedkv.errors import ConfigError
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.toolkit.interpreter import interpreting
from pagedkv.toolkit.split_kv import num_sms, splits_within
from pagedkv.transfer import to_device

# KernelConfig fields a config string may set (declared as BackendOptions in backend.py)
TILE_OPTIONS = (
    "block_m", "block_n", "num_warps", "num_stages", "lazy_rescale", "use_tma", "use_gluon"
)  # fmt: skip


@dataclass(frozen=True)
class MLAMetadata(BackendMetadata):
    """One step, planned for the MLA kernels (shared by every layer of the step)."""

    config: KernelConfig
    # [4, n] int32, device: request, first row, key range and its request's range keys of
    # each program
    items: torch.Tensor
    token_ranges: torch.Tensor  # [2, T] int32, device: each token's ranges, its first partial
    # [1 + 3 * entries] int32, device: how many tokens merge, each one's token, ranges and
    # first partial slot
    merges: torch.Tensor
    num_splits: int  # the step's most key ranges of a request (1: no partials)
    kv_per_split: int  # the step's KV positions per range, a multiple of config.block_n
    num_items: int  # the step's work items (a CUDA graph's grid holds more: padding)
    mid_o: torch.Tensor | None  # [partials, H, L] float32 (num_splits > 1)
    mid_lse: torch.Tensor | None  # [partials, H] float32 (num_splits > 1)
    plan: StepPlan  # the attention launches but for each layer's tensors
    # eager steps with padding rows: output rows from here on are zeroed (None: none;
    # under a CUDA-graph reservation padding rows are left as they are)
    zero_rows_from: int | None

    def describe(self) -> str:
        """The step's plan in a line (``pagedkv bench`` reports it)."""
        return (
            f"{self.plan.kind} {self.config}, {self.num_splits} range(s) of "
            f"{self.kv_per_split} keys, {self.num_items} programs"
        )


class MLAMetadataBuilder(AttentionMetadataBuilder[MLAMetadata]):
    """Chooses the tile configuration and the key ranges, lists the work items (work.py)
    and plans the launches (plan.py). ``capability`` and ``num_sms`` describe the device planned
    for (the compile checks set them to an H200's)."""

    def __init__(self, spec, device, **options) -> None:
        super().__init__(spec, device, **options)
        self.capability: tuple[int, int] | None = None
        if not interpreting() and self.device.type == "cuda":
            self.capability = torch.cuda.get_device_capability(self.device)
        self.num_sms = num_sms(self.device)
        lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
        self.config = choose_config(
            arch_of(self.capability), spec.dtype.itemsize, pad_dim(lora), pad_dim(rope)
        )
        # tile overrides from the config string, e.g. "mla(block_n=32, num_stages=3)"
        overrides = {name: options[name] for name in TILE_OPTIONS if options.get(name) is not None}
        if overrides and "use_gluon" not in overrides:
            # the tile options tune the Triton kernel: naming one asks for that kernel
            overrides["use_gluon"] = False
        self.config = dataclasses.replace(self.config, **overrides)
        self.num_splits = options.get("num_splits")  # None: the rule (choose_ranges) decides
        # a CUDA-graph reservation's grid, by what it was made from (``_graph_grid``)
        self._grid: tuple[tuple, GraphGrid] | None = None

    def build_metadata(self, common: CommonAttentionMetadata, **overrides: Any) -> MLAMetadata:
        if overrides:
            raise ConfigError(
                f"mla: build() takes no overrides, got {', '.join(sorted(overrides))}"
            )
        spec, cfg, bounds = self.spec, self.config, self.graph_bounds
        heads, lora = spec.num_heads, spec.kv_lora_rank
        query_lens = np.diff(common.query_start_loc_cpu.numpy())
        seq_lens = common.seq_lens_cpu.numpy()
        tiles = tile_table(query_lens, heads, cfg.block_m)
        # under a CUDA-graph reservation every token row of the padded step is reduced
        reduce_rows = common.num_actual_tokens if bounds is None else common.num_tokens
        # partials of every token row for one range: [H, L] values and [H] sums
        slot_bytes = heads * (lora + 1) * 4
        forced = self.num_splits
        if forced:
            forced = min(forced, splits_within(MAX_FORCED_PARTIAL_BYTES, reduce_rows * slot_bytes))
        grid = None if bounds is None else self._graph_grid(common, reduce_rows, slot_bytes, forced)
        if forced:
            split = SPLIT_POLICY.choose(
                tiles.shape[1], common.max_query_len, int(seq_lens.max(initial=0)),
                self.num_sms, forced=forced, granule=cfg.block_n,
            )  # fmt: skip
        else:
            # the step's own ranges (a CUDA-graph step's within the reservation's grid)
            latent_bytes = (lora + spec.qk_rope_head_dim) * spec.cache_dtype.itemsize
            tiles_each = decode_tiles(query_lens, heads, cfg.block_m)
            if tiles_each:
                # a decode step's tiles of one request see its every key: one entry a
                # request, each standing for its tiles (the same estimates, a fraction
                # of the rule's arrays)
                keys, copies = seq_lens[query_lens > 0].astype(np.float64), tiles_each
            else:
                causal = spec.causal and common.max_query_len > 1
                keys = tile_keys(tiles, query_lens, seq_lens, heads, cfg.block_m, causal)
                copies = 1
            split = choose_ranges(
                keys, self.num_sms, cfg.block_n, reduce_rows * slot_bytes, latent_bytes, grid,
                copies=copies,
            )  # fmt: skip

        def relist(keys_per_split: int) -> WorkList:
            return work_list(tiles, query_lens, seq_lens, keys_per_split, reduce_rows)

        work = relist(split.keys_per_split)
        if grid is None:
            items = work.items
            num_splits, merge_entries, num_partials = (
                work.num_splits, len(work.merges), work.num_partials
            )  # fmt: skip
        else:
            work = fit_graph(work, grid, relist)
            # the grid's sizes: the launches the graph holds serve every step
            items = pad_items(work.items, grid.items, pad_row=bounds.max_query_len * heads)
            num_splits, merge_entries, num_partials = grid.splits, grid.merges, grid.partials
        merges = merge_list(work.merges, work.token_ranges, merge_entries)
        items, token_ranges, merges = self._tables(items, work.token_ranges, merges)
        mid_o = mid_lse = None
        if num_splits > 1:
            mid_o = self.scratch("mid_o", (max(1, num_partials), heads, lora), torch.float32)
            mid_lse = self.scratch("mid_lse", (max(1, num_partials), heads), torch.float32)
        plan = plan_step(
            spec,
            cfg,
            common,
            items,
            token_ranges,
            merges,
            num_splits,
            mid_o,
            mid_lse,
            merge_entries=merge_entries,
            num_sms=self.num_sms,
            capability=self.capability,
        )
        padding = bounds is None and common.num_actual_tokens < common.num_tokens
        return MLAMetadata(
            common=common,
            config=cfg,
            items=items,
            token_ranges=token_ranges,
            merges=merges,
            num_splits=work.num_splits,
            kv_per_split=work.keys_per_split,
            num_items=work.items.shape[1],
            mid_o=mid_o,
            mid_lse=mid_lse,
            plan=plan,
            zero_rows_from=common.num_actual_tokens if padding else None,
        )

    def _graph_grid(
        self, common: CommonAttentionMetadata, reduce_rows: int, slot_bytes: int, forced: int
    ) -> GraphGrid:
        """The reservation's grid (``work.graph_grid``) from its bounds: the same at every
        step, so made at its first and kept."""
        bounds = self.graph_bounds
        key = (bounds, common.max_seq_len, reduce_rows, forced)
        if self._grid is None or self._grid[0] != key:
            num_tiles = max_tiles(bounds, self.spec.num_heads, self.config.block_m)
            grid = graph_grid(
                num_tiles, common.max_seq_len, reduce_rows, slot_bytes, self.num_sms, forced
            )
            self._grid = (key, grid)
        return self._grid[1]

    def _tables(
        self, items: np.ndarray, token_ranges: np.ndarray, merges: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's three tables on the device in one host-to-device copy: a new tensor
        for an eager step, the reservation's persistent buffer under a CUDA graph (the
        captured launches read it)."""
        flat = np.concatenate([items.ravel(), token_ranges.ravel(), merges])
        if self.graph_bounds is None:
            tables = to_device(flat, self.device)
        else:
            tables = self.scratch("tables", flat.shape, torch.int32)
            tables.copy_(torch.from_numpy(flat.astype(np.int32)), non_blocking=True)
        first, second = items.size, items.size + token_ranges.size
        return (
            tables[:first].view(items.shape),
            tables[first:second].view(token_ranges.shape),
            tables[second:],
        )
