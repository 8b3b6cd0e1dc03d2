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
    choose_ranges,
    max_items,
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
    items: torch.Tensor  # [3, n] int32, device: request, first row and key range of each program
    token_ranges: torch.Tensor  # [2, T] int32, device: each token's ranges, its first partial
    num_splits: int  # the most key ranges of a request (1: every output written directly)
    kv_per_split: int  # KV positions per range, a multiple of config.block_n
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
            f"{self.kv_per_split} keys, {self.items.shape[1]} programs"
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
        self.num_splits = options.get("num_splits")  # None: SPLIT_POLICY decides

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
        if bounds is None:
            num_tiles, max_seq_len = tiles.shape[1], int(seq_lens.max(initial=0))
            reduce_rows = common.num_actual_tokens
        else:
            # a fixed launch geometry from the bounds alone: the tiles and ranges of the
            # longest sequence the bounds allow, every token row reduced
            num_tiles, max_seq_len = max_tiles(bounds, heads, cfg.block_m), common.max_seq_len
            reduce_rows = common.num_tokens
        # partials of every token row for one range: [H, L] values and [H] sums
        per_split = reduce_rows * heads * (lora + 1) * 4
        forced = self.num_splits
        if forced:
            forced = min(forced, splits_within(MAX_FORCED_PARTIAL_BYTES, per_split))
        if bounds is None and not forced:
            causal = spec.causal and common.max_query_len > 1
            keys = tile_keys(tiles, query_lens, seq_lens, heads, cfg.block_m, causal)
            latent_bytes = (lora + spec.qk_rope_head_dim) * spec.cache_dtype.itemsize
            split = choose_ranges(keys, self.num_sms, cfg.block_n, per_split, latent_bytes)
        else:
            split = SPLIT_POLICY.choose(
                num_tiles, common.max_query_len, max_seq_len, self.num_sms,
                forced=forced, granule=cfg.block_n,
            )  # fmt: skip
        work = work_list(tiles, query_lens, seq_lens, split.keys_per_split, reduce_rows)
        items, token_ranges = work.items, work.token_ranges
        num_splits, num_partials = work.num_splits, work.num_partials
        if bounds is None:
            # both tables in one host-to-device copy
            flat = to_device(np.concatenate([items.ravel(), token_ranges.ravel()]), self.device)
            items, token_ranges = (
                flat[: items.size].view(items.shape),
                flat[items.size :].view(token_ranges.shape),
            )
        else:
            # every step within the bounds: the grid of the most items, the kernels
            # compiled for split steps once the bounds may split, partials for every row
            num_splits = split.num_splits
            num_partials = reduce_rows * num_splits if num_splits > 1 else 0
            capacity = max_items(num_tiles, num_splits)
            padded = pad_items(items, capacity, pad_row=bounds.max_query_len * heads)
            items = self.scratch("items", (3, capacity), torch.int32)
            items.copy_(torch.from_numpy(padded), non_blocking=True)
            ranges = self.scratch("token_ranges", (2, reduce_rows), torch.int32)
            ranges.copy_(torch.from_numpy(token_ranges), non_blocking=True)
            token_ranges = ranges
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
            num_splits,
            split.keys_per_split,
            mid_o,
            mid_lse,
            reduce_rows=reduce_rows,
            capability=self.capability,
        )
        padding = bounds is None and common.num_actual_tokens < common.num_tokens
        return MLAMetadata(
            common=common,
            config=cfg,
            items=items,
            token_ranges=token_ranges,
            num_splits=num_splits,
            kv_per_split=split.keys_per_split,
            mid_o=mid_o,
            mid_lse=mid_lse,
            plan=plan,
            zero_rows_from=common.num_actual_tokens if padding else None,
        )
