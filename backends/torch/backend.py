"""The torch backend's layout and declared capabilities."""

from __future__ import annotations

from typing import Any

import torch
from pagedkv.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from pagedkv.capabilities import Capabilities, MultipleOf
from pagedkv.features import Feature
from pagedkv.spec import AttentionSpec


class TorchBackend(AttentionBackend):
    """Plain PyTorch ops, fp32 maths, any device: slow but everywhere."""

    name = "torch"
    priority = 10
    layout = "(2, num_blocks, block_size, num_kv_heads, head_size)"
    block_axis = 1
    capabilities = Capabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
        head_sizes=(MultipleOf(1),),
        block_sizes=(MultipleOf(1),),
        features=frozenset(
            {
                Feature.SLIDING_WINDOW,
                Feature.LOGITS_SOFT_CAP,
                Feature.ALIBI,
                Feature.SINKS,
                Feature.NON_CAUSAL,
                Feature.FP8_KV,
            }
        ),
        devices=frozenset({"cpu", "cuda"}),
    )

    def get_kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def kv_cache_to_logical(
        self, kv_cache: torch.Tensor, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[0], kv_cache[1]

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        from pagedkv.backends.torch.impl import TorchMetadataBuilder

        return TorchMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        from pagedkv.backends.torch.impl import TorchAttentionImpl

        return TorchAttentionImpl
