"""The declaration: name, layout, what the kernel supports, and its two parts.

Everything not declared in ``capabilities`` is refused by ``validate()`` with a reason,
and the conformance suite checks that refusal as well as every declared feature.
"""

from __future__ import annotations

from typing import Any

import pagedkv
import torch
from pagedkv import Capabilities, Feature, KVLayout, MultipleOf
from pagedkv.layout import BLOCKS, DIM, HEADS, KV, TOKENS

# This kernel wants K and V of one head next to each other inside a block:
# (num_blocks, block_size, num_kv_heads, 2, head_size). Declaring the axes is all a
# backend does about its layout: the shape, the logical K/V views the harness and
# tools read, allocation, the cache check and block copies follow from it.
MY_LAYOUT = KVLayout("my_layout", (BLOCKS, TOKENS, HEADS, KV, DIM))


class MyBackend(pagedkv.AttentionBackend):
    name = "my_backend"
    priority = 1  # below the built-in backends for `auto`
    kv_layout = MY_LAYOUT
    capabilities = Capabilities(
        dtypes=frozenset({torch.float16, torch.float32}),
        head_sizes=(MultipleOf(8, maximum=256),),
        block_sizes=(MultipleOf(8),),
        features=frozenset({Feature.SLIDING_WINDOW, Feature.NON_CAUSAL}),
        devices=frozenset({"cpu", "cuda"}),
        notes=("a plain-torch reference kernel: correct everywhere, fast nowhere",),
    )

    def get_builder_cls(self) -> type[pagedkv.AttentionMetadataBuilder[Any]]:
        from my_backend.builder import MyMetadataBuilder

        return MyMetadataBuilder

    def get_impl_cls(self) -> type[pagedkv.AttentionImpl[Any]]:
        from my_backend.impl import MyAttentionImpl

        return MyAttentionImpl
