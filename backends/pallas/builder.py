"""The Pallas backend's metadata and its builder: query tiles and the split count of a
step, decided on the host from the CPU copies of the metadata (no device sync), and
the step's arrays handed to JAX once for every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import torch
from pagedkv.backend import AttentionMetadataBuilder, BackendMetadata
from pagedkv.backends.pallas import configs, interop
from pagedkv.backends.pallas.kernel import StepArrays
from pagedkv.errors import ConfigError, UnsupportedError
from pagedkv.intmath import cdiv
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.spec import AttentionSpec
from pagedkv.toolkit.split_kv import num_sms


@dataclass(frozen=True)
class PallasMetadata(BackendMetadata):
    """One step for the kernel: ``common`` (the step) plus its JAX arrays and tiling."""

    arrays: StepArrays  # int32, on ``jax_device`` (DLPack views of the torch tensors)
    jax_device: jax.Device
    block_q: int  # query tokens per tile
    block_n: int  # keys per inner-loop step
    num_splits: int  # KV splits per tile (the policy's choice)
    split_slots: int  # programs per tile along the keys: num_splits rounded up
    target: str  # "interpret" (CPU) or "triton" (CUDA)


def num_tiles_bound(num_tokens: int, num_reqs: int, block_q: int) -> int:
    """Most query tiles a batch of ``num_tokens`` rows over ``num_reqs`` requests needs.

    Each request adds at most one partial tile, and every tile holds a token, so the
    launch size depends on shapes only.
    """
    return max(1, min(num_tokens, cdiv(num_tokens, block_q) + num_reqs))


def plan_tiles(
    query_lens: np.ndarray, num_tokens: int, block_q: int
) -> tuple[np.ndarray, np.ndarray]:
    """Query tiles of ``block_q`` tokens over requests with ``query_lens`` ([B] ints),
    ``num_tiles_bound`` of them: (tile_req, tile_qstart), int32. ``tile_req[i]`` is the
    request of tile i (-1: idle), ``tile_qstart[i]`` its first query row in the request."""
    num_reqs = query_lens.shape[0]
    tiles_per_req = -(-query_lens // block_q)
    num_real = int(tiles_per_req.sum())
    num_tiles = num_tiles_bound(num_tokens, num_reqs, block_q)
    tile_req = np.full(num_tiles, -1, dtype=np.int32)
    tile_qstart = np.zeros(num_tiles, dtype=np.int32)
    tile_req[:num_real] = np.repeat(np.arange(num_reqs, dtype=np.int32), tiles_per_req)
    first_tile = np.repeat(np.cumsum(tiles_per_req) - tiles_per_req, tiles_per_req)
    tile_qstart[:num_real] = (np.arange(num_real) - first_tile) * block_q
    return tile_req, tile_qstart


class PallasMetadataBuilder(AttentionMetadataBuilder[PallasMetadata]):
    """Cuts each request's query rows into tiles of ``block_q`` tokens and chooses the
    split count (``configs.choose_splits``: the toolkit's makespan rule). Options:
    ``block_m``, ``block_n`` and ``num_splits`` (0 = chosen per step)."""

    def __init__(self, spec: AttentionSpec, device: torch.device | str, **options: Any) -> None:
        super().__init__(spec, device, **options)
        interop.configure_jax()  # before this builder's first JAX computation
        self.target = "interpret" if self.device.type == "cpu" else "triton"
        self.group_pad = configs.padded_group(spec.num_queries_per_kv)
        self.block_m = int(options.get("block_m") or 0)
        self.block_n = int(options.get("block_n") or configs.default_block_n(spec.head_size))
        self.forced_splits = configs.check_num_splits(
            int(options.get("num_splits") or 0), "option num_splits"
        )
        self.num_sms = num_sms(self.device)

    def build_metadata(
        self, common: CommonAttentionMetadata, *, num_splits: int | None = None, **overrides: Any
    ) -> PallasMetadata:
        """``num_splits`` forces this step's split count (tuning), as the option does."""
        if overrides:
            raise ConfigError(
                f"build: unknown override(s) {', '.join(sorted(overrides))} (accepted: num_splits)"
            )
        if common.device.type != self.device.type:
            raise UnsupportedError(
                f"metadata is on {common.device}, this builder was made for {self.device}"
            )
        query_lens = np.diff(common.query_start_loc_cpu.numpy())
        max_query_len = int(query_lens.max(initial=0))
        block_q = configs.block_q(max_query_len, self.group_pad, self.block_m)
        tile_req, tile_qstart = plan_tiles(query_lens, common.num_tokens, block_q)
        seq_lens = common.seq_lens_cpu.numpy()
        splits = configs.choose_splits(
            seq_lens[tile_req[tile_req >= 0]],
            max_query_len,
            num_heads=self.spec.num_heads,
            num_kv_heads=self.spec.num_kv_heads,
            head_size=self.spec.head_size,
            cache_bytes=self.spec.cache_dtype.itemsize,
            num_tokens=common.num_tokens,
            block_n=self.block_n,
            num_sms=self.num_sms,
            forced=configs.check_num_splits(num_splits or 0, "build(num_splits)")
            or self.forced_splits,
        ).num_splits

        block_table = interop.to_jax(common.block_table, "block_table", allow_copy=True)
        device = next(iter(block_table.devices()))
        arrays = StepArrays(
            tile_req=jax.device_put(tile_req, device),
            tile_qstart=jax.device_put(tile_qstart, device),
            query_start_loc=interop.to_jax(
                common.query_start_loc, "query_start_loc", allow_copy=True
            ),
            seq_lens=interop.to_jax(common.seq_lens, "seq_lens", allow_copy=True),
            block_table=block_table,
            num_splits=jax.device_put(np.array([splits], np.int32), device),
        )
        return PallasMetadata(
            common=common,
            arrays=arrays,
            jax_device=device,
            block_q=block_q,
            block_n=self.block_n,
            num_splits=splits,
            split_slots=configs.split_slots(splits),
            target=self.target,
        )
