"""ModelKVCache: every layer's paged KV cache, allocated together from one spec per layer.

Layers may differ (a sliding window on every other layer, an MLA model's latent
layers): layers with equal specs form a *group* that shares one backend, one
metadata builder and, each step, one metadata object. Each layer owns its cache
tensor and its impl (sinks are per layer). Block copies (copy-on-write) go to every
layer in one call, so no layer can be left out. ``switch_backend`` moves every
layer's cache into another backend's layout in place of the old one
(``pagedkv.convert_kv_cache``), keeping its contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pagedkv.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
from pagedkv.convert import convert_kv_cache
from pagedkv.errors import UnsupportedError
from pagedkv.kv import BlockCopy, copies_to_tensors
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.selection import select_backend
from pagedkv.serving.errors import EngineConfigError
from pagedkv.spec import AttentionSpec


@dataclass(frozen=True)
class AttentionLayer:
    """What a model tells the cache about one attention layer.

    sinks: [num_heads] learned sink logits (any float dtype) when ``spec.use_sinks``.
    """

    spec: AttentionSpec
    sinks: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerGroup:
    """Layers with one spec: they share a backend, a builder and each step's metadata."""

    spec: AttentionSpec
    backend: AttentionBackend
    layer_ids: tuple[int, ...]


class StepAttention:
    """One step's attention for every layer: what a model's attention calls read.

    ``forward(layer_idx, query, key, value)`` runs that layer's impl on its cache with
    its group's metadata; shapes follow the contract (``[T, heads, head_size]``, T the
    step's padded token count; MLA: see ``pagedkv.backends.mla``).
    """

    def __init__(self, cache: ModelKVCache, metadata: Sequence[Any], num_tokens: int) -> None:
        self.cache = cache
        self.metadata = tuple(metadata)  # one per group
        self.num_tokens = num_tokens

    def layer(self, layer_idx: int) -> tuple[AttentionImpl[Any], torch.Tensor, Any]:
        """(impl, kv_cache, metadata) of one layer."""
        c = self.cache
        return c.impls[layer_idx], c.caches[layer_idx], self.metadata[c.group_of[layer_idx]]

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
    ) -> torch.Tensor:
        impl, kv_cache, metadata = self.layer(layer_idx)
        return impl.forward(query, key, value, kv_cache, metadata)


class ModelKVCache:
    """All layers' caches, impls and builders for one model.

    layers: one AttentionLayer per attention layer, in layer order; every spec must
    have the same block_size. backend: a config string resolved per distinct spec
    (``select_backend``), or a configured backend that must run every layer.
    num_blocks: physical blocks per layer (block 0 is the manager's null block).
    """

    def __init__(
        self,
        layers: Sequence[AttentionLayer],
        num_blocks: int,
        backend: str | AttentionBackend | None,
        device: torch.device | str,
    ) -> None:
        if not layers:
            raise EngineConfigError("the model has no attention layers")
        block_sizes = {layer.spec.block_size for layer in layers}
        if len(block_sizes) != 1:
            raise EngineConfigError(f"all layers need one block_size, got {sorted(block_sizes)}")
        self.block_size = block_sizes.pop()
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        specs: list[AttentionSpec] = []
        self.group_of: list[int] = []
        for layer in layers:
            if layer.spec not in specs:
                specs.append(layer.spec)
            self.group_of.append(specs.index(layer.spec))
        self.groups = [
            LayerGroup(
                spec,
                _resolve_backend(backend, spec, self.device, _ids(self.group_of, g)),
                _ids(self.group_of, g),
            )
            for g, spec in enumerate(specs)
        ]
        self.layers = tuple(layers)
        self.caches = [
            self.groups[g].backend.allocate_kv_cache(num_blocks, layer.spec, self.device)
            for layer, g in zip(layers, self.group_of, strict=True)
        ]
        self.impls = self._make_impls()
        self.builders = self.make_builders()

    def _make_impls(self) -> list[AttentionImpl[Any]]:
        return [
            self.groups[g].backend.make_impl(
                layer.spec, sinks=None if layer.sinks is None else layer.sinks.to(self.device)
            )
            for layer, g in zip(self.layers, self.group_of, strict=True)
        ]

    def resolve(self, backend: str | AttentionBackend | None) -> list[AttentionBackend]:
        """The backend each group would run on under ``backend`` (raises, naming the
        layers, when one cannot run them)."""
        return [_resolve_backend(backend, g.spec, self.device, g.layer_ids) for g in self.groups]

    def switch_backend(
        self, backend: str | AttentionBackend | None, blocks: Sequence[int] | None = None
    ) -> None:
        """Run every layer on ``backend`` from now on, keeping the cached K/V.

        Each layer's cache is converted into the new backend's layout
        (``convert_kv_cache``: the same tensor when the layouts share their bytes,
        else a new cache with ``blocks`` copied over in bounded chunks — default all)
        and replaces the old one before the next layer's is converted, so the extra
        memory is at most one layer's cache. Impls and builders are made anew
        (builders reserved for CUDA graphs must be reserved again).
        """
        # refused before anything changes: a backend that cannot run a group's spec
        # (validate() also refuses MLA layers to standard backends and the reverse)
        new_backends = self.resolve(backend)
        for i, (layer, g) in enumerate(zip(self.layers, self.group_of, strict=True)):
            old = self.groups[g].backend
            self.caches[i] = convert_kv_cache(
                old, self.caches[i], new_backends[g], layer.spec, blocks=blocks
            )
        self.groups = [
            LayerGroup(g.spec, b, g.layer_ids)
            for g, b in zip(self.groups, new_backends, strict=True)
        ]
        self.impls = self._make_impls()
        self.builders = self.make_builders()

    # -- sizes --------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @staticmethod
    def bytes_per_block(layers: Sequence[AttentionLayer]) -> int:
        """Cache bytes one block costs across all layers."""
        return sum(layer.spec.kv_bytes_per_token() * layer.spec.block_size for layer in layers)

    # -- per step -----------------------------------------------------------------------

    def make_builders(self) -> list[AttentionMetadataBuilder[Any]]:
        """One fresh metadata builder per group (CUDA-graph buckets reserve their own)."""
        return [g.backend.make_builder(g.spec, self.device) for g in self.groups]

    def build(
        self,
        common: CommonAttentionMetadata,
        builders: Sequence[AttentionMetadataBuilder[Any]] | None = None,
    ) -> StepAttention:
        """This step's metadata, once per group, for every layer's forward."""
        builders = self.builders if builders is None else builders
        return StepAttention(self, [b.build(common) for b in builders], common.num_tokens)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Apply copy-on-write copies to every layer's cache (before the step writes K/V)."""
        if not copies:
            return
        src, dst = copies_to_tensors(copies, self.device)
        for cache, g in zip(self.caches, self.group_of, strict=True):
            self.groups[g].backend.copy_blocks(cache, src, dst)

    def describe(self) -> list[str]:
        """One line per group: which layers run on which backend, with what spec."""
        lines = []
        for g in self.groups:
            s = g.spec
            extras = [
                f"window {s.sliding_window}" if s.sliding_window else "",
                f"softcap {s.logits_soft_cap:g}" if s.logits_soft_cap else "",
                "sinks" if s.use_sinks else "",
                f"MLA latent {s.kv_lora_rank}+{s.qk_rope_head_dim}" if s.is_mla else "",
            ]
            heads = f"{s.num_heads}/{s.num_kv_heads} heads x {s.head_size}"
            lines.append(
                f"layers {_ranges(g.layer_ids)}: {g.backend!r}, {heads}, "
                + ", ".join(x for x in [str(s.dtype).removeprefix("torch."), *extras] if x)
            )
        return lines


def _ids(group_of: list[int], g: int) -> tuple[int, ...]:
    return tuple(i for i, x in enumerate(group_of) if x == g)


def _ranges(ids: Sequence[int]) -> str:
    return ",".join(str(i) for i in ids) if len(ids) < 4 else f"{ids[0]}..{ids[-1]} ({len(ids)})"


def _resolve_backend(
    backend: str | AttentionBackend | None,
    spec: AttentionSpec,
    device: torch.device,
    layer_ids: tuple[int, ...],
) -> AttentionBackend:
    if backend is None or isinstance(backend, str):
        return select_backend(backend, spec, device)
    available, why = backend.is_available()
    reasons = [why] if not available else backend.validate(spec, device)
    if reasons:
        raise UnsupportedError(
            f"{backend!r} cannot run layers {_ranges(layer_ids)}: " + "; ".join(reasons)
        )
    return backend
