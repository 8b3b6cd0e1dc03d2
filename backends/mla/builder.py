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
from pagedkv.backends.mla.plan import StepPlan, max_tiles, pad_tiles, plan_step, tile_table
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
    tiles: torch.Tensor  # [2, num_tiles] int32, device: request and first row of each tile
    num_splits: int  # programs per tile along the KV range
    kv_per_split: int  # KV positions per split, a multiple of config.block_n
    mid_o: torch.Tensor | None  # [rows, H, num_splits, L] float32 (splits > 1)
    mid_lse: torch.Tensor | None  # [rows, H, num_splits] float32 (splits > 1)
    plan: StepPlan  # the attention launches but for each layer's tensors
    # eager steps with padding rows: output rows from here on are zeroed (None: none;
    # under a CUDA-graph reservation padding rows are left as they are)
    zero_rows_from: int | None


class MLAMetadataBuilder(AttentionMetadataBuilder[MLAMetadata]):
    """Chooses the tile configuration and the split count, lays out the tiles and plans
    the launches (plan.py). ``capability`` and ``num_sms`` describe the device planned
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
        self.num_splits = options.get("num_splits")  # None: SPLIT_POLICY decides

    def build_metadata(self, common: CommonAttentionMetadata, **overrides: Any) -> MLAMetadata:
        if overrides:
            raise ConfigError(
                f"mla: build() takes no overrides, got {', '.join(sorted(overrides))}"
            )
        spec, cfg, bounds = self.spec, self.config, self.graph_bounds
        heads = spec.num_heads
        query_lens = np.diff(common.query_start_loc_cpu.numpy())
        tiles_np = tile_table(query_lens, heads, cfg.block_m)
        if bounds is None:
            tiles = to_device(tiles_np, self.device)
            max_seq_len = int(common.seq_lens_cpu.numpy().max(initial=0))
            reduce_rows = common.num_actual_tokens
        else:
            # a fixed launch geometry from the bounds alone: padded tiles, the split of
            # the longest sequence the bounds allow, every token row reduced
            num_tiles = max_tiles(bounds, heads, cfg.block_m)
            padded = pad_tiles(tiles_np, num_tiles, pad_row=bounds.max_query_len * heads)
            tiles = self.scratch("tiles", (2, num_tiles), torch.int32)
            tiles.copy_(torch.from_numpy(padded), non_blocking=True)
            max_seq_len = common.max_seq_len
            reduce_rows = common.num_tokens
        forced = self.num_splits
        if forced:
            # partial outputs: [rows, H, splits, L] values and [rows, H, splits] sums
            per_split = reduce_rows * heads * (spec.kv_lora_rank + 1) * 4
            forced = min(forced, splits_within(MAX_FORCED_PARTIAL_BYTES, per_split))
        split = SPLIT_POLICY.choose(
            tiles.shape[1],
            common.max_query_len,
            max_seq_len,
            self.num_sms,
            forced=forced,
            granule=cfg.block_n,
        )
        mid_o = mid_lse = None
        if split.num_splits > 1:
            shape = (reduce_rows, heads, split.num_splits)
            mid_o = self.scratch("mid_o", (*shape, spec.kv_lora_rank), torch.float32)
            mid_lse = self.scratch("mid_lse", shape, torch.float32)
        plan = plan_step(
            spec,
            cfg,
            common,
            tiles,
            split,
            mid_o,
            mid_lse,
            reduce_rows=reduce_rows,
            capability=self.capability,
        )
        padding = bounds is None and common.num_actual_tokens < common.num_tokens
        return MLAMetadata(
            common=common,
            config=cfg,
            tiles=tiles,
            num_splits=split.num_splits,
            kv_per_split=split.keys_per_split,
            mid_o=mid_o,
            mid_lse=mid_lse,
            plan=plan,
            zero_rows_from=common.num_actual_tokens if padding else None,
        )
