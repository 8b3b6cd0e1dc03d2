"""Optional attention features a backend may declare."""

from __future__ import annotations

import enum


class Feature(str, enum.Enum):
    """A capability beyond plain causal attention over a model-dtype cache."""

    SLIDING_WINDOW = "sliding_window"
    LOGITS_SOFT_CAP = "logits_soft_cap"
    ALIBI = "alibi"
    SINKS = "sinks"
    NON_CAUSAL = "non_causal"
    FP8_KV = "fp8_kv"
    MLA = "mla"
    CUDA_GRAPH = "cuda_graph"

    def __str__(self) -> str:
        return self.value
