"""The torch backend: its layout and declared capabilities."""

from __future__ import annotations

from typing import Any

import torch
from pagedkv.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from pagedkv.capabilities import Capabilities, MultipleOf
from pagedkv.features import Feature
from pagedkv.layout import KV_FIRST


class TorchBackend(AttentionBackend):
    """Plain PyTorch ops, fp32 maths, any device: slow but everywhere."""

    name = "torch"
    priority = 10
    kv_layout = KV_FIRST
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
        # one request at a time, its own keys, a fixed chunking of its queries: nothing
        # about the rest of the batch reaches a request's arithmetic
        batch_invariant=True,
    )

    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        from pagedkv.backends.torch.builder import TorchMetadataBuilder

        return TorchMetadataBuilder

    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        from pagedkv.backends.torch.impl import TorchAttentionImpl

        return TorchAttentionImpl
