"""The backend contract: AttentionBackend, AttentionMetadataBuilder, AttentionImpl.

A backend is a configured object (``FlashInferBackend(kv_layout="HND")``): options
from a config string can change its physical layout, so layout methods are
instance methods. It owns one physical KV layout and exposes it to everyone else as
the *logical* view: K and V, each ``[num_blocks, block_size, num_kv_heads,
head_size]``, as views of the same storage.

The flow of one step, for each layer::

    backend = pagedkv.select_backend("triton,torch", spec)
    kv_cache = backend.allocate_kv_cache(num_blocks, spec, device)
    builder = backend.make_builder(spec, device)      # once
    impl = backend.make_impl(spec)                    # once per layer
    metadata = builder.build(common)                  # once per step, shared by layers
    out = impl.forward(q, k, v, kv_cache, metadata)   # per layer
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

import torch
from pagedkv.capabilities import Capabilities
from pagedkv.errors import ConfigError, UnsupportedError
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.options import BackendOption, OptionValue
from pagedkv.spec import AttentionSpec

M = TypeVar("M")


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns CommonAttentionMetadata into the backend's own metadata, once per step.

    Everything that depends only on the batch (index conversions, plans, split
    decisions) happens here, so ``forward`` of every layer only launches kernels.
    """

    def __init__(self, spec: AttentionSpec, device: torch.device | str, **options: Any) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.options = options

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M:
        """The backend's metadata for this step."""


class AttentionImpl(ABC, Generic[M]):
    """Runs one layer: writes new K/V by slot mapping, then attends through the block table.

    Shapes (T = metadata.num_tokens, padded rows included):
      query  [T, num_heads, head_size], dtype spec.dtype
      key    [T, num_kv_heads, head_size] (MLA: the new latent rows [T, 1, head_size])
      value  [T, num_kv_heads, head_size_v] (MLA: None; V is the latent's prefix)
      output [T, num_heads, head_size_v], dtype spec.dtype; padded rows are unspecified.
    ``sinks`` ([num_heads] float32 logits) is required iff spec.use_sinks.
    """

    def __init__(
        self, spec: AttentionSpec, *, sinks: torch.Tensor | None = None, **options: Any
    ) -> None:
        if spec.use_sinks and sinks is None:
            raise UnsupportedError("spec.use_sinks is set: pass sinks=[num_heads] float32 logits")
        if not spec.use_sinks and sinks is not None:
            raise UnsupportedError("sinks were given but spec.use_sinks is False")
        if sinks is not None and tuple(sinks.shape) != (spec.num_heads,):
            raise UnsupportedError(
                f"sinks: expected shape ({spec.num_heads},), got {tuple(sinks.shape)}"
            )
        self.spec = spec
        self.sinks = None if sinks is None else sinks.float()
        self.options = options

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: M,
    ) -> None:
        """Store key/value rows at metadata's slot_mapping; negative slots are skipped."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: M,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new K/V when given, then attend. Returns [T, num_heads, head_size_v]."""

    # -- shared argument checks ------------------------------------------------------

    def check_forward_args(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        num_tokens: int,
        output: torch.Tensor | None,
    ) -> None:
        """Raise UnsupportedError naming the argument whose shape or dtype is wrong."""
        s = self.spec
        _expect("query", query, (num_tokens, s.num_heads, s.head_size), s.dtype)
        if s.is_mla:
            if key is not None:
                _expect("key (MLA latent)", key, (num_tokens, 1, s.head_size), s.dtype)
            if value is not None:
                raise UnsupportedError(
                    "value must be None for MLA: V is the latent's first kv_lora_rank values"
                )
        elif (key is None) != (value is None):
            raise UnsupportedError("key and value must be given together (or both None)")
        elif key is not None:
            _expect("key", key, (num_tokens, s.num_kv_heads, s.head_size), s.dtype)
            _expect("value", value, (num_tokens, s.num_kv_heads, s.head_size_v), s.dtype)
        if output is not None:
            _expect("output", output, (num_tokens, s.num_heads, s.head_size_v), s.dtype)

    def new_output(self, query: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
        if output is not None:
            return output
        return query.new_empty(query.shape[0], self.spec.num_heads, self.spec.head_size_v)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise UnsupportedError(
            f"{name}: expected a tensor of shape {list(shape)}, got {type(t).__name__}"
        )
    if tuple(t.shape) != shape:
        raise UnsupportedError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise UnsupportedError(f"{name}: expected dtype {dtype}, got {t.dtype}")


class AttentionBackend(ABC):
    """One paged-attention implementation with one physical KV layout.

    Subclasses set the class attributes and implement the abstract methods. The
    constructor takes the options of a config string (``name(key=value)``); it must
    stay cheap and must not import the backend's kernel library.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0  # `auto` tries higher first
    capabilities: ClassVar[Capabilities]
    option_specs: ClassVar[Mapping[str, BackendOption]] = {}
    # the physical layout in symbols, e.g. "(2, num_blocks, block_size, num_kv_heads, head_size)"
    layout: ClassVar[str]
    # the axis of the physical cache that indexes blocks (for copy_blocks)
    block_axis: ClassVar[int] = 0

    def __init__(self, **options: OptionValue) -> None:
        unknown = sorted(set(options) - set(self.option_specs))
        if unknown:
            accepted = ", ".join(sorted(self.option_specs)) or "none"
            raise ConfigError(
                f"{self.name}: unknown option(s) {', '.join(unknown)} (accepted: {accepted})"
            )
        resolved = {k: spec.default for k, spec in self.option_specs.items()}
        resolved.update({k: self.option_specs[k].parse(k, v) for k, v in options.items()})
        self.options: dict[str, OptionValue | None] = resolved

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v}" for k, v in self.options.items() if v is not None)
        return f"{self.name}({given})" if given else self.name

    # -- layout -----------------------------------------------------------------------

    @abstractmethod
    def get_kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Physical shape of one layer's cache."""

    @abstractmethod
    def kv_cache_to_logical(
        self, kv_cache: torch.Tensor, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views K, V [num_blocks, block_size, num_kv_heads, head_size(_v)] of ``kv_cache``.

        Writing through the views writes the cache. MLA: K is the whole latent
        [N, B, 1, kv_lora_rank + rope_dim] and V its prefix [N, B, 1, kv_lora_rank].
        fp8 caches are returned raw (stored value = real value / k_scale or v_scale).
        """

    def allocate_kv_cache(
        self, num_blocks: int, spec: AttentionSpec, device: torch.device | str
    ) -> torch.Tensor:
        """A zero-filled cache. Zeros, not garbage: some kernels read the rows past a
        sequence's end inside its last block and need them finite."""
        shape = self.get_kv_cache_shape(
            num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        return torch.zeros(shape, dtype=spec.cache_dtype, device=device)

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """kv_cache block dst[i] := block src[i] (all K/V data of the block); used for
        copy-on-write. All sources are read before any destination is written."""
        src = torch.as_tensor(src, dtype=torch.int64, device=kv_cache.device)
        dst = torch.as_tensor(dst, dtype=torch.int64, device=kv_cache.device)
        if src.shape != dst.shape or src.dim() != 1:
            raise UnsupportedError(
                f"copy_blocks: src and dst must be 1-D of equal length, got {tuple(src.shape)}, {tuple(dst.shape)}"
            )
        kv_cache.index_copy_(self.block_axis, dst, kv_cache.index_select(self.block_axis, src))

    # -- parts ------------------------------------------------------------------------

    @abstractmethod
    def get_builder_cls(self) -> type[AttentionMetadataBuilder[Any]]:
        """The metadata builder class."""

    @abstractmethod
    def get_impl_cls(self) -> type[AttentionImpl[Any]]:
        """The per-layer implementation class."""

    def make_builder(
        self, spec: AttentionSpec, device: torch.device | str
    ) -> AttentionMetadataBuilder[Any]:
        self.require(spec, device)
        return self.get_builder_cls()(spec, device, **self.options)

    def make_impl(
        self, spec: AttentionSpec, *, sinks: torch.Tensor | None = None
    ) -> AttentionImpl[Any]:
        self.require(spec)
        return self.get_impl_cls()(spec, sinks=sinks, **self.options)

    # -- support ----------------------------------------------------------------------

    def is_available(self) -> tuple[bool, str]:
        """(True, "") when this backend can run here; else (False, why not)."""
        missing = self.missing_dependency()
        if missing:
            return False, missing
        if "cpu" not in self.capabilities.devices and not torch.cuda.is_available():
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        return True, ""

    def missing_dependency(self) -> str | None:
        """Why the kernel library cannot be imported, or None. Override per backend."""
        return None

    def validate(self, spec: AttentionSpec, device: torch.device | str | None = None) -> list[str]:
        """Every reason this backend cannot run ``spec`` (empty: supported)."""
        reasons = self.capabilities.problems(spec, self.name)
        if device is not None and torch.device(device).type not in self.capabilities.devices:
            reasons.append(
                f"device {torch.device(device).type} not supported by {self.name} "
                f"(supports {', '.join(sorted(self.capabilities.devices))})"
            )
        reasons.extend(self.validate_extra(spec))
        return reasons

    def validate_extra(self, spec: AttentionSpec) -> list[str]:
        """Backend-specific combinations the declared capabilities cannot express."""
        return []

    def require(self, spec: AttentionSpec, device: torch.device | str | None = None) -> None:
        """Raise UnsupportedError with every reason when ``validate`` is not empty."""
        reasons = self.validate(spec, device)
        if reasons:
            raise UnsupportedError(f"{self!r} cannot run this layer: " + "; ".join(reasons))
