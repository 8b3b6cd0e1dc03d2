"""The Triton backend's attention: KV write, unified kernel, split-KV reduction.

``forward`` launches kernels only: every shape, tile and split was decided by the
builder, so it never syncs the host or allocates by data (CUDA-graph capturable
once each kernel has been compiled by a first, uncaptured call).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from pagedkv.backend import AttentionImpl
from pagedkv.backends.triton.attention_kernel import unified_attention_kernel
from pagedkv.backends.triton.builder import TritonMetadata
from pagedkv.backends.triton.configs import head_pad
from pagedkv.backends.triton.reduce_kernel import reduce_splits_kernel
from pagedkv.errors import UnsupportedError
from pagedkv.toolkit.kv_write import write_kv_by_slot
from pagedkv.toolkit.triton_helpers import LOG2E


class KernelLaunch(NamedTuple):
    """One kernel launch, planned: ``kernel[grid](*args, **kwargs)``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


class TritonAttentionImpl(AttentionImpl[TritonMetadata]):
    def __init__(self, spec: Any, *, sinks: torch.Tensor | None = None, **options: Any) -> None:
        super().__init__(spec, sinks=sinks, **options)
        self._alibi: dict[torch.device, torch.Tensor] = {}

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: TritonMetadata,
    ) -> None:
        self._check_cache(kv_cache)
        write_kv_by_slot(
            key,
            value,
            kv_cache[0],
            kv_cache[1],
            metadata.slot_mapping,
            self.spec.k_scale,
            self.spec.v_scale,
            use_triton=True,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: TritonMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_forward_args(query, key, value, metadata.num_tokens, output)
        if key is not None:
            self.write_kv(key, value, kv_cache, metadata)
        out = self.new_output(query, output)
        for launch in self.plan(query, kv_cache, metadata, out):
            launch()
        return out

    # -- planning -------------------------------------------------------------------------

    def plan(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonMetadata,
        output: torch.Tensor,
    ) -> list[KernelLaunch]:
        """The attention launches of one forward (the KV write excluded)."""
        s, md = self.spec, metadata
        self._check_cache(kv_cache)
        for name, t in (("query", query), ("output", output)):
            if t.stride(-1) != 1:
                raise UnsupportedError(f"{name}: the head dimension must be contiguous (stride 1)")
            if t.device != kv_cache.device:
                raise UnsupportedError(f"{name} is on {t.device} but kv_cache on {kv_cache.device}")
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        split = md.num_splits > 1
        sinks = self._device_sinks(query.device)
        alibi = self._device_alibi(query.device)
        qk_scale = s.scale * s.k_scale * (1.0 if s.logits_soft_cap else LOG2E)
        # tensors the kernel never reads when their feature is off
        part_acc = md.partial_acc if split else output
        part_max = md.partial_max if split else output
        part_sum = md.partial_sum if split else output
        pad = head_pad(s.head_size)
        tile = md.tile
        attention = KernelLaunch(
            unified_attention_kernel,
            (md.num_query_blocks, s.num_kv_heads, md.num_splits),
            (
                output,
                part_acc,
                part_max,
                part_sum,
                query,
                k_cache,
                v_cache,
                md.block_table,
                md.seq_lens,
                md.query_start_loc,
                sinks if sinks is not None else query,
                alibi if alibi is not None else query,
                md.num_seqs,
                qk_scale,
                float(s.logits_soft_cap or 0.0),
                float(s.v_scale),
                int(s.sliding_window or 0),
                query.stride(0),
                query.stride(1),
                output.stride(0),
                output.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                k_cache.stride(2),
                v_cache.stride(0),
                v_cache.stride(1),
                v_cache.stride(2),
                md.block_table.stride(0),
                *(part_acc.stride()[:3] if split else (0, 0, 0)),
                *(part_max.stride()[:2] if split else (0, 0)),
            ),
            dict(
                HEAD_SIZE=s.head_size,
                HEAD_PAD=pad,
                BLOCK_SIZE=s.block_size,
                GROUP=s.num_queries_per_kv,
                BLOCK_M=tile.block_m,
                BLOCK_Q=md.block_q,
                TILE_N=tile.tile_n,
                CAUSAL=s.causal,
                USE_WINDOW=s.sliding_window is not None,
                USE_SOFTCAP=s.logits_soft_cap is not None,
                USE_ALIBI=alibi is not None,
                USE_SINKS=sinks is not None,
                SPLIT=split,
                DOT_PRECISION="ieee" if s.dtype == torch.float32 else "tf32",
                num_warps=tile.num_warps,
                num_stages=tile.num_stages,
            ),
        )
        if not split:
            return [attention]
        split_pad = 1 << (md.num_splits - 1).bit_length()
        reduce = KernelLaunch(
            reduce_splits_kernel,
            (md.num_tokens, s.num_heads),
            (
                output,
                part_acc,
                part_max,
                part_sum,
                sinks if sinks is not None else part_max,
                md.query_start_loc,
                md.num_seqs,
                md.num_splits,
                output.stride(0),
                output.stride(1),
                *part_acc.stride()[:3],
                *part_max.stride()[:2],
            ),
            dict(
                HEAD_SIZE=s.head_size,
                HEAD_PAD=pad,
                SPLIT_PAD=split_pad,
                USE_SINKS=sinks is not None,
                num_warps=4 if split_pad * pad <= 8192 else 8,
            ),
        )
        return [attention, reduce]

    # -- helpers ------------------------------------------------------------------------

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        s = self.spec
        want = (2, s.block_size, s.num_kv_heads, s.head_size)
        got = tuple(kv_cache.shape)
        if len(got) != 5 or (got[0], *got[2:]) != want:
            raise UnsupportedError(
                f"kv_cache: expected shape [2, num_blocks, {s.block_size}, {s.num_kv_heads}, "
                f"{s.head_size}], got {list(kv_cache.shape)}"
            )
        if kv_cache.dtype != s.cache_dtype:
            raise UnsupportedError(
                f"kv_cache: expected dtype {s.cache_dtype}, got {kv_cache.dtype}"
            )
        if kv_cache.stride(-1) != 1:
            raise UnsupportedError("kv_cache: the head dimension must be contiguous (stride 1)")

    def _device_sinks(self, device: torch.device) -> torch.Tensor | None:
        if self.sinks is not None and self.sinks.device != device:
            # once, on the first (uncaptured) forward
            self.sinks = self.sinks.to(device)
        return self.sinks

    def _device_alibi(self, device: torch.device) -> torch.Tensor | None:
        if self.spec.alibi_slopes is None:
            return None
        if device not in self._alibi:
            self._alibi[device] = torch.tensor(
                self.spec.alibi_slopes, dtype=torch.float32, device=device
            )
        return self._alibi[device]
