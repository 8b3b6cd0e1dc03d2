"""A third-party paged-attention backend: declare, lay out, build, attend.

This template reuses the torch backend's kernel so that it runs anywhere; a real
plugin puts its own kernel in ``forward`` and declares only what that kernel does.
"""

from __future__ import annotations

from typing import Any

import pagedkv
import torch
from pagedkv import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    Capabilities,
    Feature,
    MultipleOf,
)
from pagedkv.backends.torch.impl import TorchAttentionImpl, TorchMetadataBuilder


class MyBackend(pagedkv.AttentionBackend):
    name = "my_backend"
    priority = 1  # below the built-in backends for `auto`
    layout = "(2, num_blocks, block_size, num_kv_heads, head_size)"
    block_axis = 1
    # Everything not declared here is refused by validate() with a reason, and the
    # conformance suite checks that refusal as well as every declared feature.
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16, torch.float32}),
        head_sizes=(64, 128),
        block_sizes=(MultipleOf(16),),
        features=frozenset({Feature.SLIDING_WINDOW}),
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
        return TorchMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        return TorchAttentionImpl


@pagedkv.hookimpl
def pagedkv_backends() -> list[type[pagedkv.AttentionBackend]]:
    return [MyBackend]
