"""The MLA backend's metadata builder and per-layer attention.

Prefill and chunked-prefill rows take the same absorbed path as decode: every query
row attends over the latent cache with its own causal limit. With 16 or more heads per
token the absorbed form is already compute-dense (the heads fill the M dimension of
the matmuls), it needs no per-head K/V up-projection of the context, and one kernel
serves mixed batches. A long prefill does more FLOPs per token this way than the
un-absorbed form (L + R = 576 wide scores instead of 192 per head), which is the
price of that simplicity (docs/mla.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from pagedkv.backend import AttentionImpl, AttentionMetadataBuilder
from pagedkv.backends.mla.configs import (
    INTERPRET_NUM_SMS,
    KernelConfig,
    arch_of,
    choose_config,
    choose_splits,
)
from pagedkv.errors import UnsupportedError
from pagedkv.metadata import CommonAttentionMetadata

# KernelConfig fields a config string may set (declared as BackendOptions in backend.py)
TILE_OPTIONS = (
    "block_m", "block_n", "num_warps", "num_stages", "lazy_rescale", "use_tma", "use_gluon"
)  # fmt: skip


@dataclass(frozen=True)
class MLAMetadata:
    """One step, planned for the MLA kernels (shared by every layer of the step)."""

    common: CommonAttentionMetadata
    config: KernelConfig
    tiles: torch.Tensor  # [2, num_tiles] int32, device: request and first row of each tile
    num_splits: int  # programs per tile along the KV range
    kv_per_split: int  # KV positions per split, a multiple of config.block_n
    mid_o: torch.Tensor | None  # [num_actual_tokens, H, num_splits, L] float32 (splits > 1)
    mid_lse: torch.Tensor | None  # [num_actual_tokens, H, num_splits] float32 (splits > 1)


class MLAMetadataBuilder(AttentionMetadataBuilder[MLAMetadata]):
    """Chooses the tile configuration and the split count, and lays out the tiles.

    A tile is ``block_m`` consecutive rows of one request, row ``j * H + h`` being
    head ``h`` of the request's query token ``j``; tiles of one request are adjacent
    so that the programs reading the same latent rows run together (L2 reuse).
    """

    def __init__(self, spec, device, **options) -> None:
        super().__init__(spec, device, **options)
        from pagedkv.backends.mla.kernels import INTERPRETED, pad_dim

        capability = None
        self.num_sms = INTERPRET_NUM_SMS
        if not INTERPRETED and self.device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.device)
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        lora, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
        self.config = choose_config(
            arch_of(capability), spec.dtype.itemsize, pad_dim(lora), pad_dim(rope)
        )
        # tile overrides from the config string, e.g. "mla(block_n=32, num_stages=3)"
        overrides = {name: options[name] for name in TILE_OPTIONS if options.get(name) is not None}
        if overrides and "use_gluon" not in overrides:
            # the tile options tune the Triton kernel: naming one asks for that kernel
            overrides["use_gluon"] = False
        self.config = dataclasses.replace(self.config, **overrides)
        self.num_splits = options.get("num_splits")  # None: SPLIT_POLICY decides

    def build(self, common: CommonAttentionMetadata) -> MLAMetadata:
        num_heads, cfg = self.spec.num_heads, self.config
        query_lens = np.diff(common.query_start_loc_cpu.numpy().astype(np.int64))
        tiles_per_req = -(-(query_lens * num_heads) // cfg.block_m)
        num_tiles = int(tiles_per_req.sum())
        first_tile = np.cumsum(tiles_per_req) - tiles_per_req
        tiles = np.empty((2, num_tiles), dtype=np.int32)
        tiles[0] = np.repeat(np.arange(len(query_lens)), tiles_per_req)
        tiles[1] = (np.arange(num_tiles) - np.repeat(first_tile, tiles_per_req)) * cfg.block_m
        max_kv_len = int(common.seq_lens_cpu.max()) if common.num_reqs else 0
        num_splits, kv_per_split = choose_splits(
            num_tiles, max_kv_len, cfg.block_n, self.num_sms, forced=self.num_splits
        )
        mid_o = mid_lse = None
        if num_splits > 1:
            n, lora = common.num_actual_tokens, self.spec.kv_lora_rank
            mid_o = torch.empty(
                (n, num_heads, num_splits, lora), dtype=torch.float32, device=self.device
            )
            mid_lse = torch.empty(
                (n, num_heads, num_splits), dtype=torch.float32, device=self.device
            )
        return MLAMetadata(
            common=common,
            config=cfg,
            tiles=torch.from_numpy(tiles).to(self.device),
            num_splits=num_splits,
            kv_per_split=kv_per_split,
            mid_o=mid_o,
            mid_lse=mid_lse,
        )


class MLAAttentionImpl(AttentionImpl[MLAMetadata]):
    """Latent write and absorbed attention for one MLA layer.

    ``forward`` takes the contract's concatenated tensors; ``forward_mla`` and
    ``write_latent`` take the parts (absorbed q_nope, q_pe, kv_c, k_pe) as a model
    produces them, so nothing is concatenated on the way in.
    """

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
    ) -> None:
        """key: the new latent rows [T, 1, L + R]; value must be None."""
        if value is not None:
            raise UnsupportedError(
                "value must be None for MLA: V is the latent's first kv_lora_rank values"
            )
        lora = self.spec.kv_lora_rank
        self.write_latent(key[:, 0, :lora], key[:, 0, lora:], kv_cache, metadata)

    def write_latent(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
    ) -> None:
        """kv_c [T, L] (normalised compressed KV) and k_pe [T, R] or [T, 1, R] (RoPE'd)
        go to their slots, concatenated in the cache; negative slots are skipped."""
        from pagedkv.backends.mla.kernels import launch, plan_write_latent

        s = self.spec
        if k_pe.dim() == 3:
            k_pe = k_pe[:, 0]
        num_tokens = metadata.common.num_tokens
        _expect("kv_c", kv_c, (num_tokens, s.kv_lora_rank), s.dtype)
        _expect("k_pe", k_pe, (num_tokens, s.qk_rope_head_dim), s.dtype)
        self._check_cache(kv_cache, metadata)
        launch(
            plan_write_latent(
                _rows_contiguous(kv_c),
                _rows_contiguous(k_pe),
                kv_cache,
                metadata.common.slot_mapping,
                s.k_scale,
            )
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, H, L + R] absorbed; key [T, 1, L + R] or None; value None.
        Returns [T, H, L] (apply W_UV to get the heads' values)."""
        self.check_forward_args(query, key, value, metadata.common.num_tokens, output)
        lora = self.spec.kv_lora_rank
        kv_c = k_pe = None
        if key is not None:
            kv_c, k_pe = key[:, 0, :lora], key[:, 0, lora:]
        return self.forward_mla(
            query[..., :lora], query[..., lora:], kv_c, k_pe, kv_cache, metadata, output
        )

    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor | None,
        k_pe: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The parts form of ``forward``.

        q_nope: [T, H, L], the query's no-PE part already multiplied by W_UK
        (``absorb_query``); q_pe: [T, H, R]; kv_c: [T, L] and k_pe: [T, R] or
        [T, 1, R], the new latent rows (both None: nothing to write). Returns
        ``output`` or a new [T, H, L] tensor in spec.dtype.
        """
        from pagedkv.backends.mla.kernels import launch

        s, common = self.spec, metadata.common
        num_tokens = common.num_tokens
        _expect("q_nope", q_nope, (num_tokens, s.num_heads, s.kv_lora_rank), s.dtype)
        _expect("q_pe", q_pe, (num_tokens, s.num_heads, s.qk_rope_head_dim), s.dtype)
        if output is not None:
            _expect("output", output, (num_tokens, s.num_heads, s.kv_lora_rank), s.dtype)
        if (kv_c is None) != (k_pe is None):
            raise UnsupportedError("kv_c and k_pe must be given together (or both None)")
        if kv_c is not None:
            self.write_latent(kv_c, k_pe, kv_cache, metadata)
        else:
            self._check_cache(kv_cache, metadata)
        out = output
        if out is None or out.stride(-1) != 1:
            out = q_nope.new_empty(num_tokens, s.num_heads, s.kv_lora_rank)
        out[common.num_actual_tokens :] = 0
        launch(self.plan_attention(q_nope, q_pe, kv_cache, metadata, out))
        if output is not None and out is not output:
            output.copy_(out)
            return output
        return out

    def plan_attention(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: MLAMetadata,
        out: torch.Tensor,
        allow_tma: bool | None = None,
        allow_gluon: bool | None = None,
    ) -> list:
        """The kernel launches of the attention (no write), for forward_mla and for
        the sm_90 compile check; allow_tma / allow_gluon None ask the cache's device."""
        from pagedkv.backends.mla.kernels import plan_attention

        s, common = self.spec, metadata.common
        return plan_attention(
            _rows_contiguous(q_nope),
            _rows_contiguous(q_pe),
            kv_cache,
            common.block_table,
            common.seq_lens,
            common.query_start_loc,
            metadata.tiles,
            out,
            num_tokens=common.num_actual_tokens,
            scale=s.scale,
            k_scale=s.k_scale,
            # one query token per request: its causal limit is the sequence's end
            causal=s.causal and common.max_query_len > 1,
            config=metadata.config,
            num_splits=metadata.num_splits,
            kv_per_split=metadata.kv_per_split,
            mid_o=metadata.mid_o,
            mid_lse=metadata.mid_lse,
            allow_tma=allow_tma,
            allow_gluon=allow_gluon,
        )

    def _check_cache(self, kv_cache: torch.Tensor, metadata: MLAMetadata) -> None:
        from pagedkv.backends.mla.kernels import INTERPRETED

        s = self.spec
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3:
            got = list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else kv_cache
            raise UnsupportedError(
                f"kv_cache: expected [num_blocks, {s.block_size}, {s.head_size}], got {got}"
            )
        if tuple(kv_cache.shape[1:]) != (s.block_size, s.head_size) or kv_cache.stride(2) != 1:
            raise UnsupportedError(
                f"kv_cache: expected [num_blocks, {s.block_size}, {s.head_size}] with a "
                f"contiguous last dim, got {list(kv_cache.shape)} strides {kv_cache.stride()}"
            )
        if kv_cache.dtype != s.cache_dtype:
            raise UnsupportedError(
                f"kv_cache: expected dtype {s.cache_dtype}, got {kv_cache.dtype}"
            )
        if kv_cache.device != metadata.common.device:
            raise UnsupportedError(
                f"kv_cache is on {kv_cache.device} but the metadata on {metadata.common.device}"
            )
        if kv_cache.device.type == "cpu" and not INTERPRETED:
            raise UnsupportedError(
                "the mla backend runs Triton kernels: on a CPU set TRITON_INTERPRET=1 before "
                "pagedkv.backends.mla.kernels is imported"
            )
        if INTERPRETED and s.dtype == torch.bfloat16:
            raise UnsupportedError(
                "bfloat16 is not supported under the Triton interpreter (it computes bf16 "
                "on raw bits, triton-lang/triton#11584); use float16/float32 on a CPU"
            )


def _expect(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise UnsupportedError(f"{name}: expected a tensor of shape {list(shape)}, got {t!r}")
    if tuple(t.shape) != shape:
        raise UnsupportedError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise UnsupportedError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with stride 1; other strides are free."""
    return t if t.stride(-1) == 1 else t.contiguous()
