"""Declared capabilities: what a backend supports, checked against a spec with reasons."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from pagedkv.features import Feature
from pagedkv.graph import GraphSupport


@dataclass(frozen=True)
class MultipleOf:
    """Any multiple of ``base`` within [minimum, maximum] (bounds optional)."""

    base: int
    minimum: int | None = None
    maximum: int | None = None

    def matches(self, value: int) -> bool:
        if value <= 0 or value % self.base:
            return False
        if self.minimum is not None and value < self.minimum:
            return False
        return self.maximum is None or value <= self.maximum

    def __str__(self) -> str:
        text = f"multiple of {self.base}"
        if self.minimum is not None or self.maximum is not None:
            text += f" in [{self.minimum or self.base}, {self.maximum or 'inf'}]"
        return text


@dataclass(frozen=True)
class BothOf:
    """Sizes both rule lists accept: the intersection of two backends' declarations."""

    first: tuple[SizeRule, ...]
    second: tuple[SizeRule, ...]

    def matches(self, value: int) -> bool:
        return sizes_match(self.first, value) and sizes_match(self.second, value)

    def __str__(self) -> str:
        return f"({describe_sizes(self.first)}) and ({describe_sizes(self.second)})"


SizeRule = int | MultipleOf | BothOf


def sizes_match(rules: Iterable[SizeRule], value: int) -> bool:
    return any(r == value if isinstance(r, int) else r.matches(value) for r in rules)


def describe_sizes(rules: Iterable[SizeRule]) -> str:
    return ", ".join(str(r) for r in rules)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it supports. Anything absent is rejected with a reason.

    ``Feature.MLA`` marks a backend that runs MLA (latent-cache) layers only; every
    other backend runs standard layers only.
    """

    dtypes: frozenset[torch.dtype]
    kv_cache_dtypes: frozenset[str] = frozenset({"auto"})
    head_sizes: tuple[SizeRule, ...] = (MultipleOf(1),)
    block_sizes: tuple[SizeRule, ...] = (MultipleOf(1),)
    features: frozenset[Feature] = frozenset()
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    # which steps forward can be captured in a CUDA graph (builder.reserve_cuda_graph)
    cuda_graph: GraphSupport = GraphSupport.NEVER
    # a request's output is bitwise identical whatever else is in the batch (other
    # requests, their order, padding rows, the split-KV decision)
    batch_invariant: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)  # e.g. limits per feature

    @property
    def graph_support(self) -> GraphSupport:
        """The declared graph support; the first contract's Feature.CUDA_GRAPH means
        pure-decode steps."""
        if self.cuda_graph is GraphSupport.NEVER and Feature.CUDA_GRAPH in self.features:
            return GraphSupport.PURE_DECODE
        return self.cuda_graph

    def problems(self, spec: Any, backend_name: str) -> list[str]:
        """Reasons ``spec`` falls outside these capabilities (empty: inside)."""
        out = []
        if spec.dtype not in self.dtypes:
            out.append(
                f"dtype {dtype_name(spec.dtype)} not supported by {backend_name} "
                f"(supports {', '.join(sorted(dtype_name(d) for d in self.dtypes))})"
            )
        if spec.kv_cache_dtype not in self.kv_cache_dtypes:
            out.append(
                f"kv_cache_dtype {spec.kv_cache_dtype!r} not supported by {backend_name} "
                f"(supports {', '.join(sorted(self.kv_cache_dtypes))})"
            )
        if not sizes_match(self.head_sizes, spec.head_size):
            out.append(
                f"head_size {spec.head_size} not supported by {backend_name} "
                f"(supports {describe_sizes(self.head_sizes)})"
            )
        if not sizes_match(self.block_sizes, spec.block_size):
            out.append(
                f"block_size {spec.block_size} not supported by {backend_name} "
                f"(supports {describe_sizes(self.block_sizes)})"
            )
        runs_mla = Feature.MLA in self.features
        if spec.is_mla and not runs_mla:
            out.append(f"MLA layers (kv_lora_rank set) are not supported by {backend_name}")
        elif runs_mla and not spec.is_mla:
            out.append(
                f"{backend_name} runs MLA layers only (kv_lora_rank and qk_rope_head_dim unset)"
            )
        if not spec.is_mla and spec.head_size_v != spec.head_size:
            out.append(
                f"head_size_v {spec.head_size_v} != head_size {spec.head_size}: the paged layouts "
                "store K and V with one head size"
            )
        for feature in sorted(spec.required_features() - self.features - {Feature.MLA}):
            out.append(f"{feature} is not supported by {backend_name}")
        return out

    def intersect(self, other: Capabilities) -> Capabilities:
        """What two backends both support (a composite of the two declares this)."""
        levels = list(GraphSupport)
        return Capabilities(
            dtypes=self.dtypes & other.dtypes,
            kv_cache_dtypes=self.kv_cache_dtypes & other.kv_cache_dtypes,
            head_sizes=(BothOf(self.head_sizes, other.head_sizes),),
            block_sizes=(BothOf(self.block_sizes, other.block_sizes),),
            features=(self.features & other.features) - {Feature.CUDA_GRAPH},
            devices=self.devices & other.devices,
            cuda_graph=min(self.graph_support, other.graph_support, key=levels.index),
            batch_invariant=self.batch_invariant and other.batch_invariant,
            notes=self.notes + tuple(n for n in other.notes if n not in self.notes),
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary (for the CLI and reports)."""
        return {
            "dtypes": sorted(dtype_name(d) for d in self.dtypes),
            "kv_cache_dtypes": sorted(self.kv_cache_dtypes),
            "head_sizes": describe_sizes(self.head_sizes),
            "block_sizes": describe_sizes(self.block_sizes),
            "features": sorted(str(f) for f in self.features),
            "devices": sorted(self.devices),
            "cuda_graph": str(self.graph_support),
            "batch_invariant": self.batch_invariant,
        }
