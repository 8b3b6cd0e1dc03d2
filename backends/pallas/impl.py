"""The Pallas backend's metadata builder and attention impl.

``build`` (once per step) turns the batch into query tiles on the host, from the CPU
copies of the metadata (no device sync), and hands the device metadata to JAX
through DLPack. ``forward`` (per layer) writes the new K/V with
``pagedkv.toolkit.kv_write.write_kv_by_slot`` (torch owns the cache), then launches one
jitted kernel on JAX views of the query and the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
import torch
from pagedkv.backend import AttentionImpl, AttentionMetadataBuilder
from pagedkv.backends.pallas import interop
from pagedkv.backends.pallas.kernel import (
    KernelConfig,
    default_block_n,
    num_tiles_bound,
    paged_attention,
)
from pagedkv.errors import UnsupportedError
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.toolkit.kv_write import write_kv_by_slot

# Tile heights (query rows x grouped heads): decode-like batches vs batches with prefill.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
MAX_KV_SPLITS = 32
# split-KV only when each split still gets this many key steps
MIN_STEPS_PER_SPLIT = 4


@dataclass(frozen=True)
class PallasMetadata:
    """One step's metadata as JAX arrays (views of the torch tensors where possible)."""

    common: CommonAttentionMetadata
    tile_req: jax.Array  # [num_tiles] int32: request of each query tile, -1 idle
    tile_qstart: jax.Array  # [num_tiles] int32: first query row of the tile in its request
    query_start_loc: jax.Array  # [B+1] int32 (DLPack view)
    seq_lens: jax.Array  # [B] int32 (DLPack view)
    block_table: jax.Array  # [B, max_blocks] int32 (DLPack view)
    block_q: int  # query tokens per tile
    num_splits: int  # KV splits per tile
    target: str  # "interpret" (CPU) or "triton" (CUDA)


class PallasMetadataBuilder(AttentionMetadataBuilder[PallasMetadata]):
    def __init__(self, spec, device, **options) -> None:
        super().__init__(spec, device, **options)
        self.target = "interpret" if self.device.type == "cpu" else "triton"
        self.group_pad = 1 << max(0, spec.num_queries_per_kv - 1).bit_length()
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 0
        )

    def build(self, common: CommonAttentionMetadata) -> PallasMetadata:
        if common.device.type != self.device.type:
            raise UnsupportedError(
                f"metadata is on {common.device}, this builder was made for {self.device}"
            )
        if common.block_size != self.spec.block_size:
            raise UnsupportedError(
                f"metadata block_size {common.block_size} != spec.block_size {self.spec.block_size}"
            )
        block_q = self._block_q(common)
        query_lens = np.diff(common.query_start_loc_cpu.numpy())
        tiles_per_req = -(-query_lens // block_q)
        num_real = int(tiles_per_req.sum())
        num_tiles = num_tiles_bound(common.num_tokens, common.num_reqs, block_q)
        tile_req = np.full(num_tiles, -1, dtype=np.int32)
        tile_qstart = np.zeros(num_tiles, dtype=np.int32)
        tile_req[:num_real] = np.repeat(np.arange(common.num_reqs, dtype=np.int32), tiles_per_req)
        first_tile = np.repeat(np.cumsum(tiles_per_req) - tiles_per_req, tiles_per_req)
        tile_qstart[:num_real] = (np.arange(num_real) - first_tile) * block_q
        block_table = interop.to_jax(
            common.block_table.contiguous(), "block_table", allow_copy=True
        )
        device = next(iter(block_table.devices()))
        return PallasMetadata(
            common=common,
            tile_req=jax.device_put(tile_req, device),
            tile_qstart=jax.device_put(tile_qstart, device),
            query_start_loc=interop.to_jax(
                common.query_start_loc, "query_start_loc", allow_copy=True
            ),
            seq_lens=interop.to_jax(common.seq_lens, "seq_lens", allow_copy=True),
            block_table=block_table,
            block_q=block_q,
            num_splits=self._num_splits(common, num_real),
            target=self.target,
        )

    def _block_q(self, common: CommonAttentionMetadata) -> int:
        block_m = int(self.options.get("block_m") or 0)
        if not block_m:
            decode_like = common.max_query_len * self.group_pad <= DECODE_BLOCK_M
            block_m = DECODE_BLOCK_M if decode_like else PREFILL_BLOCK_M
        return max(1, block_m // self.group_pad)

    def _num_splits(self, common: CommonAttentionMetadata, num_tiles: int) -> int:
        """Enough programs to fill the GPU when few long requests decode (flash-decoding)."""
        forced = int(self.options.get("num_kv_splits") or 0)
        if forced:
            return forced
        if self.target != "triton" or num_tiles == 0:
            return 1
        programs = num_tiles * self.spec.num_kv_heads
        block_n = int(self.options.get("block_n") or default_block_n(self.spec.head_size))
        key_steps = -(-common.max_seq_len // block_n)
        splits = 1
        while (
            splits < MAX_KV_SPLITS
            and programs * splits < 2 * self.num_sms
            and key_steps // (2 * splits) >= MIN_STEPS_PER_SPLIT
        ):
            splits *= 2
        return splits


class PallasAttentionImpl(AttentionImpl[PallasMetadata]):
    def __init__(self, spec, *, sinks=None, **options) -> None:
        super().__init__(spec, sinks=sinks, **options)
        self._cache_view = interop.CacheView()
        self._configs: dict[tuple[int, int, str], KernelConfig] = {}
        # host copies, read once here: forward must not sync to fetch them
        zeros = np.zeros(spec.num_heads, np.float32)
        self._slopes = np.asarray(spec.alibi_slopes, np.float32) if spec.alibi_slopes else zeros
        self._sinks = self.sinks.cpu().numpy() if self.sinks is not None else zeros
        self._head_arrays: dict[jax.Device, tuple[jax.Array, jax.Array]] = {}

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: PallasMetadata,
    ) -> None:
        # torch writes through the strided K/V views; the JAX view sees the same memory
        write_kv_by_slot(
            key,
            value,
            kv_cache[:, :, 0::2],
            kv_cache[:, :, 1::2],
            metadata.common.slot_mapping,
            self.spec.k_scale,
            self.spec.v_scale,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: PallasMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(metadata, PallasMetadata):
            raise UnsupportedError(
                "metadata: expected the PallasMetadata of this backend's builder.build(), "
                f"got {type(metadata).__name__}"
            )
        common = metadata.common
        self.check_forward_args(query, key, value, common.num_tokens, output)
        self._check_cache(kv_cache, common)
        if key is not None:
            self.write_kv(key, value, kv_cache, metadata)
        slopes, sinks = self._head_params(metadata.block_table.devices())
        result = paged_attention(
            interop.to_jax(query.contiguous(), "query", allow_copy=True),
            self._cache_view.get(kv_cache),
            metadata.tile_req,
            metadata.tile_qstart,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            slopes,
            sinks,
            cfg=self._config(metadata),
        )
        out = interop.to_torch(result)
        if output is None:
            return out
        output.copy_(out)
        return output

    def _check_cache(self, kv_cache: torch.Tensor, common: CommonAttentionMetadata) -> None:
        s = self.spec
        want = (s.block_size, 2 * s.num_kv_heads, s.head_size)
        if (
            not isinstance(kv_cache, torch.Tensor)
            or kv_cache.dim() != 4
            or (tuple(kv_cache.shape[1:]) != want)
        ):
            got = list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else kv_cache
            raise UnsupportedError(
                f"kv_cache: expected shape [num_blocks, {', '.join(map(str, want))}], got {got}"
            )
        if kv_cache.dtype != s.cache_dtype:
            raise UnsupportedError(
                f"kv_cache: expected dtype {s.cache_dtype}, got {kv_cache.dtype}"
            )
        if (
            kv_cache.device.type == "cuda"
            and kv_cache.element_size() == 1
            and kv_cache.numel() >= 2**31
            and kv_cache.numel() * kv_cache.element_size() <= 2**32
        ):
            # jax's Triton lowering uses 32-bit signed element offsets for arrays up to
            # 4 GiB: a 1-byte cache of 2-4 GiB would be read at wrapped addresses
            raise UnsupportedError(
                f"kv_cache: an fp8 cache of {kv_cache.numel()} elements (2-4 GiB) overflows "
                "the 32-bit offsets of the Pallas Triton lowering; allocate under 2 GiB or "
                "over 4 GiB per layer"
            )
        if kv_cache.device != common.device:
            raise UnsupportedError(
                f"kv_cache: expected on {common.device} (the metadata's device), got "
                f"{kv_cache.device}"
            )

    def _head_params(self, devices: set[jax.Device]) -> tuple[jax.Array, jax.Array]:
        """ALiBi slopes and sink logits as [num_heads] float32 arrays on the device."""
        device = next(iter(devices))
        if device not in self._head_arrays:
            self._head_arrays[device] = (
                jax.device_put(self._slopes, device),
                jax.device_put(self._sinks, device),
            )
        return self._head_arrays[device]

    def _config(self, metadata: PallasMetadata) -> KernelConfig:
        key = (metadata.block_q, metadata.num_splits, metadata.target)
        if key not in self._configs:
            self._configs[key] = self._new_config(*key)
        return self._configs[key]

    def _new_config(self, block_q: int, num_splits: int, target: str) -> KernelConfig:
        s = self.spec
        assert s.scale is not None
        return KernelConfig(
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            head_size=s.head_size,
            block_size=s.block_size,
            scale=s.scale,
            causal=s.causal,
            sliding_window=s.sliding_window,
            logits_soft_cap=s.logits_soft_cap,
            use_alibi=s.alibi_slopes is not None,
            use_sinks=s.use_sinks,
            k_scale=s.k_scale if s.is_fp8_kv else 1.0,
            v_scale=s.v_scale if s.is_fp8_kv else 1.0,
            block_q=block_q,
            block_n=int(self.options.get("block_n") or default_block_n(s.head_size)),
            num_splits=num_splits,
            target=target,
            num_warps=int(self.options.get("num_warps") or 4),
            num_stages=int(self.options.get("num_stages") or 2),
        )
