"""PagedModel: what the serving layer needs from a model (pagedkv.models adapts
Hugging Face models to it)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from pagedkv.serving.kv_cache import AttentionLayer, StepAttention


@runtime_checkable
class PagedModel(Protocol):
    """A decoder whose attention layers read and write pagedkv caches.

    ``forward`` must be CUDA-graph capturable for decode when graphs are used: no host
    syncs, no shapes that depend on data.
    """

    vocab_size: int

    def attention_layers(self, block_size: int) -> list[AttentionLayer]:
        """One AttentionLayer per attention layer, in layer order."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        attention: StepAttention,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 (the step's tokens, batch order, padded);
        logits_indices: [S] int64 rows to compute logits for. Every attention layer
        calls ``attention.forward(layer_idx, q, k, v)``. Returns logits [S, vocab]."""
        ...
