"""The backend contract: AttentionBackend, AttentionMetadataBuilder, AttentionImpl.

A backend is a configured object (``FlashInferBackend(kv_layout="HND")``). It declares
one physical KV layout (a ``pagedkv.KVLayout``; options may choose it per instance)
and exposes every cache to everyone else through that layout's *logical* views: K and
V, each ``[num_blocks, block_size, num_kv_heads, head_size]``, views of the same
storage. Shape, allocation, views, the cache check and block copies are behaviour of
the base class on that layout object, so a backend writes none of them.

The flow of one step, for each layer::

    backend = pagedkv.select_backend("triton,torch", spec)
    kv_cache = backend.allocate_kv_cache(num_blocks, spec, device)
    builder = backend.make_builder(spec, device)      # once
    impl = backend.make_impl(spec)                    # once per layer
    metadata = builder.build(common)                  # once per step, shared by layers
    out = impl.forward(q, k, v, kv_cache, metadata)   # per layer

A backend implements ``build_metadata`` (the builder's planning, after the shared
step checks) and ``attend`` (the attention, after the shared argument and cache
checks and the KV write). Backends written against the first contract, which
implement ``get_kv_cache_shape``/``kv_cache_to_logical``, ``build`` and ``forward``
themselves, keep working: docs/contract.md says how to move them.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, get_args, get_origin

import torch
from pagedkv.capabilities import Capabilities
from pagedkv.errors import ConfigError, UnsupportedError
from pagedkv.graph import GraphBounds, GraphStaging, GraphSupport
from pagedkv.intmath import is_int
from pagedkv.layout import CacheChecker, CacheLayout, KVLayout, cache_checker
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.options import BackendOption, OptionValue
from pagedkv.spec import AttentionSpec
from pagedkv.step_check import check_step, full_validation_enabled

if TYPE_CHECKING:
    from pagedkv.toolkit.kv_write import KVWriter

M = TypeVar("M")


@dataclass(frozen=True)
class BackendMetadata:
    """A base for backend metadata that carries the step it was built from."""

    common: CommonAttentionMetadata

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.common.slot_mapping

    @property
    def num_tokens(self) -> int:
        return self.common.num_tokens

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns CommonAttentionMetadata into the backend's own metadata, once per step.

    Everything that depends only on the batch (index conversions, plans, split
    decisions) happens here, so ``forward`` of every layer only launches kernels.
    ``build`` runs the shared step checks (``pagedkv.step_check``), pads the step into
    the CUDA-graph buffers after ``reserve_cuda_graph``, then calls the backend's
    ``build_metadata``.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        device: torch.device | str,
        *,
        cache_layout: CacheLayout | None = None,
        graph_support: GraphSupport = GraphSupport.NEVER,
        **options: Any,
    ) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.options = options
        self.cache_layout = cache_layout  # the backend's configured layout
        self.graph_support = graph_support
        self._graph: GraphStaging | None = None
        self._scratch: dict[str, torch.Tensor] = {}
        if type(self).build is AttentionMetadataBuilder.build and (
            type(self).build_metadata is AttentionMetadataBuilder.build_metadata
        ):
            raise TypeError(f"{type(self).__name__} must implement build_metadata (or build)")

    def build(self, common: CommonAttentionMetadata, **overrides: Any) -> M:
        """This step's metadata (valid until the next ``build``). ``overrides`` are
        passed to ``build_metadata`` (tuning knobs of a backend, e.g. a forced tile)."""
        common = check_step(common, self.spec.block_size)
        if self._graph is not None:
            common = self._graph.stage(common)
        return self.build_metadata(common, **overrides)

    def build_metadata(self, common: CommonAttentionMetadata, **overrides: Any) -> M:
        """The backend's planning of a checked step (after ``reserve_cuda_graph``: the
        step padded to the bounds, in persistent buffers)."""
        raise NotImplementedError

    # -- CUDA graphs ------------------------------------------------------------------

    def reserve_cuda_graph(self, bounds: GraphBounds) -> None:
        """From now on every ``build`` returns capture-safe metadata for steps within
        ``bounds`` (module pagedkv.graph). Raises UnsupportedError when the backend
        does not declare graph support for such steps."""
        self.check_graph_support(bounds)
        self._graph = GraphStaging(bounds, self.spec.block_size, self.device)
        self._scratch.clear()

    def check_graph_support(self, bounds: GraphBounds) -> None:
        if not self.graph_support.allows(bounds.max_query_len):
            raise UnsupportedError(
                f"CUDA graphs: this backend declares graph support {self.graph_support!s}; "
                f"GraphBounds.max_query_len {bounds.max_query_len} needs "
                f"{'mixed' if bounds.max_query_len > 1 else 'pure_decode'}"
            )

    @property
    def graph_bounds(self) -> GraphBounds | None:
        """The reservation, or None (eager)."""
        return self._graph.bounds if self._graph is not None else None

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A work buffer of this step (split-KV partials, plans): new each step when
        eager; under a CUDA-graph reservation one persistent buffer per name, whose
        shape must not change (it may only depend on the bounds)."""
        if self._graph is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        buf = self._scratch.get(name)
        if buf is None:
            buf = self._scratch[name] = torch.empty(shape, dtype=dtype, device=self.device)
        elif tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            raise RuntimeError(
                f"scratch buffer {name!r} changed from {tuple(buf.shape)} {buf.dtype} to "
                f"{tuple(shape)} {dtype} under a CUDA-graph reservation: its size must depend "
                "only on the GraphBounds"
            )
        return buf


class AttentionImpl(ABC, Generic[M]):
    """Runs one layer: writes new K/V by slot mapping, then attends through the block table.

    Shapes (T = metadata.num_tokens, padded rows included):
      query  [T, num_heads, head_size], dtype spec.dtype
      key    [T, num_kv_heads, head_size] (MLA: the new latent rows [T, 1, head_size])
      value  [T, num_kv_heads, head_size_v] (MLA: None; V is the latent's prefix)
      output [T, num_heads, head_size_v], dtype spec.dtype; padded rows are unspecified.
    ``sinks`` ([num_heads] float32 logits) is required iff spec.use_sinks.
    """

    # what this impl's builder builds: M of ``AttentionImpl[M]``, found when the subclass
    # is defined (None where it leaves M open), so that another backend's metadata is
    # refused by name, not by an AttributeError from inside its attend
    metadata_class: ClassVar[type | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if get_origin(base) is AttentionImpl:
                (arg,) = get_args(base)
                cls.metadata_class = arg if isinstance(arg, type) and arg is not Any else None

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        sinks: torch.Tensor | None = None,
        cache_layout: CacheLayout | None = None,
        **options: Any,
    ) -> None:
        if spec.use_sinks and sinks is None:
            raise UnsupportedError("spec.use_sinks is set: pass sinks=[num_heads] float32 logits")
        if not spec.use_sinks and sinks is not None:
            raise UnsupportedError("sinks were given but spec.use_sinks is False")
        if sinks is not None and tuple(sinks.shape) != (spec.num_heads,):
            raise UnsupportedError(
                f"sinks: expected shape ({spec.num_heads},), got {tuple(sinks.shape)}"
            )
        if (
            type(self).forward is AttentionImpl.forward
            and type(self).attend is AttentionImpl.attend
        ):
            raise TypeError(f"{type(self).__name__} must implement attend (or forward)")
        self.spec = spec
        self.sinks = None if sinks is None else sinks.float()
        self.cache_layout = cache_layout  # the backend's configured layout
        self.options = options
        self._cache_checker: CacheChecker | None = None
        self._kept_views: CacheViews | None = None
        # a forward's rows past the token count, as the fast check compares them: query,
        # output, and key and value (MLA: the latent row, no value)
        self._row_dims = (
            (spec.num_heads, spec.head_size),
            (spec.num_heads, spec.head_size_v),
            (1, spec.head_size) if spec.is_mla else (spec.num_kv_heads, spec.head_size),
            None if spec.is_mla else (spec.num_kv_heads, spec.head_size_v),
        )

    # -- the shared forward -----------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: M,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new K/V when given, then attend. Returns [T, num_heads, head_size_v].
        A step of no token rows (T = 0: a scheduler's empty step, a rank with no requests)
        has nothing to write or attend: ``write_kv`` and ``attend`` are never called with
        zero rows, which some kernel launchers reject (JAX's Pallas did, deep inside)."""
        num_tokens = self.check_metadata(metadata)
        self.check_forward_args(query, key, value, num_tokens, output)
        self.check_cache(kv_cache, query.device, metadata)
        out = self.new_output(query, output)
        if num_tokens == 0:
            return out
        if key is not None:
            self.write_kv(key, value, kv_cache, metadata)
        self.attend(query, kv_cache, metadata, out)
        return out

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: M, output: torch.Tensor
    ) -> None:
        """Attention of ``query`` over the cache into ``output`` (the backend's kernel).
        The arguments are checked and this step's K/V are already in the cache."""
        raise NotImplementedError

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: M,
    ) -> None:
        """Store key/value rows at metadata's slot_mapping; negative slots are skipped.
        Default: the shared writer (pagedkv.toolkit.kv_write) through the layout's views,
        kept per cache (``cache_writer``)."""
        self.cache_writer(kv_cache)(key, value, metadata.slot_mapping)  # type: ignore[attr-defined]

    def cache_writer(self, kv_cache: torch.Tensor) -> KVWriter:
        """The shared KV writer into ``kv_cache``'s views (``pagedkv.toolkit.kv_write.
        cache_writer``: ``writer(key, value, slot_mapping)``), kept with the views
        (``cache_views``): what depends only on the cache is found once per cache."""
        views = self.cache_views(kv_cache)
        writer = views.derived.get("writer")
        if writer is None:
            from pagedkv.toolkit.kv_write import cache_writer

            s = self.spec
            writer = views.derived["writer"] = cache_writer(
                views.k, None if s.is_mla else views.v, s.k_scale, s.v_scale
            )
        return writer

    def cache_views(self, kv_cache: torch.Tensor) -> CacheViews:
        """The layout's logical K and V views of ``kv_cache`` (``CacheLayout.logical``),
        kept between calls: made again only when the cache object, its storage or its
        shape change. Every layer's write and attention read them, and making the views
        took longer than a forward's checks (11 µs on this project's CPU machine)."""
        views = self._kept_views
        if (
            views is not None
            and views.cache() is kv_cache
            and views.data_ptr == kv_cache.data_ptr()
            and views.shape == kv_cache.shape
        ):
            return views
        k, v = self.layout().logical(kv_cache, self.spec)
        # views on the storage rather than on kv_cache, so that they do not keep the
        # cache tensor alive; its death drops them (and the storage with them)
        storage = kv_cache.untyped_storage()
        if k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() == storage.data_ptr():
            k, v = (
                t.new_empty(0).set_(storage, t.storage_offset(), t.shape, t.stride())
                for t in (k, v)
            )
        views = self._kept_views = CacheViews(
            weakref.ref(kv_cache, self._forget_cache_views), kv_cache.data_ptr(),
            kv_cache.shape, k, v,
        )  # fmt: skip
        return views

    def _forget_cache_views(self, _: object) -> None:
        self._kept_views = None

    # -- shared checks ----------------------------------------------------------------

    def layout(self) -> CacheLayout:
        """The backend's configured layout (given by ``make_impl``)."""
        if self.cache_layout is None:
            raise UnsupportedError(
                f"{type(self).__name__} has no KV layout: create impls with "
                "backend.make_impl(spec) (or pass cache_layout=)"
            )
        return self.cache_layout

    def check_metadata(self, metadata: object) -> int:
        """Raise UnsupportedError unless ``metadata`` is what this backend's builder
        builds; return its token count (T)."""
        cls = self.metadata_class
        if cls is not None:
            if not isinstance(metadata, cls):
                raise UnsupportedError(
                    f"metadata: expected the {cls.__name__} that this backend's "
                    f"builder.build() returns, got {type(metadata).__name__}"
                )
            return metadata.num_tokens  # type: ignore[attr-defined]
        num_tokens = getattr(metadata, "num_tokens", None)
        if not isinstance(num_tokens, int):
            raise UnsupportedError(
                "metadata: expected a builder's step metadata (with num_tokens and "
                f"slot_mapping), got {type(metadata).__name__}"
            )
        return num_tokens

    def check_cache(
        self, kv_cache: object, device: torch.device | None = None, metadata: object = None
    ) -> None:
        """The layout's cache check; with PAGEDKV_VALIDATE=1 also the full metadata
        validation against this cache's pool size."""
        checker = self._cache_checker
        if checker is None:
            checker = self._cache_checker = self.layout().checker(self.spec)
        checker(kv_cache, device)
        common = getattr(metadata, "common", None)
        if isinstance(common, CommonAttentionMetadata):
            built_for = common.device
            if device is not None and built_for != device:
                raise UnsupportedError(
                    f"metadata: built for {built_for}, but the query is on {device} "
                    "(build it with a builder for the query's device)"
                )
            if full_validation_enabled():
                assert isinstance(kv_cache, torch.Tensor)
                common.validate(kv_cache.shape[self.layout().block_axis])

    def check_forward_args(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        num_tokens: int,
        output: torch.Tensor | None,
    ) -> None:
        """Raise UnsupportedError naming the argument whose shape, dtype or device is
        wrong (compiled kernels take tensors as bare addresses: one on another device
        would be read as this one's memory)."""
        s = self.spec
        # the usual call in a few comparisons (every layer's forward runs it); the
        # messages below only when one fails
        q_dims, out_dims, k_dims, v_dims = self._row_dims
        dtype = s.dtype
        if _rows_ok(query, (num_tokens, *q_dims), dtype, None):
            device = query.device
            if (output is None or _rows_ok(output, (num_tokens, *out_dims), dtype, device)) and (
                (key is None and value is None)
                or (
                    _rows_ok(key, (num_tokens, *k_dims), dtype, device)
                    and (
                        value is None
                        if v_dims is None
                        else _rows_ok(value, (num_tokens, *v_dims), dtype, device)
                    )
                )
            ):
                return
        expect_tensor("query", query, (num_tokens, s.num_heads, s.head_size), s.dtype)
        device = query.device
        if s.is_mla:
            if key is not None:
                shape = (num_tokens, 1, s.head_size)
                expect_tensor("key (MLA latent)", key, shape, s.dtype, device)
            if value is not None:
                raise UnsupportedError(
                    "value must be None for MLA: V is the latent's first kv_lora_rank values"
                )
        elif (key is None) != (value is None):
            raise UnsupportedError("key and value must be given together (or both None)")
        elif key is not None:
            expect_tensor("key", key, (num_tokens, s.num_kv_heads, s.head_size), s.dtype, device)
            shape = (num_tokens, s.num_kv_heads, s.head_size_v)
            expect_tensor("value", value, shape, s.dtype, device)
        if output is not None:
            shape = (num_tokens, s.num_heads, s.head_size_v)
            expect_tensor("output", output, shape, s.dtype, device)

    def new_output(self, query: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
        if output is not None:
            return output
        return query.new_empty(query.shape[0], self.spec.num_heads, self.spec.head_size_v)


@dataclass(frozen=True)
class CacheViews:
    """A cache's logical views (``AttentionImpl.cache_views``): K ``[num_blocks,
    block_size, num_kv_heads, head_size]`` and V (a latent cache's: K's prefix), on the
    cache's storage; ``derived``: what impls make of the views once per cache (its
    writer: ``AttentionImpl.cache_writer``), dropped with them."""

    cache: weakref.ref[torch.Tensor]
    data_ptr: int
    shape: torch.Size
    k: torch.Tensor
    v: torch.Tensor
    derived: dict[object, Any] = field(default_factory=dict, compare=False, repr=False)


def _rows_ok(t: object, shape: tuple[int, ...], dtype: torch.dtype, device: object) -> bool:
    """``expect_tensor``'s test without its messages (``device`` None: any)."""
    return (
        isinstance(t, torch.Tensor)
        and t.shape == shape
        and t.dtype == dtype
        and (device is None or t.device == device)
    )


def expect_tensor(
    name: str,
    t: object,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> None:
    """Raise UnsupportedError naming ``name`` unless ``t`` is a tensor of this shape and
    dtype (and on ``device`` when given)."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedError(
            f"{name}: expected a tensor of shape {list(shape)}, got {type(t).__name__}"
        )
    if tuple(t.shape) != shape:
        raise UnsupportedError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise UnsupportedError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise UnsupportedError(
            f"{name}: expected a tensor on {device} (the query's), got {t.device}"
        )


class _DeclaredLayout:
    """The layout of a backend written against the first contract, through its own
    get_kv_cache_shape / kv_cache_to_logical / block_axis / layout declarations."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.name = backend.name
        axis = getattr(type(backend), "block_axis", 0)
        self._block_axis = axis if isinstance(axis, int) else 0

    @property
    def block_axis(self) -> int:
        return self._block_axis

    def describe(self) -> str:
        declared = getattr(type(self.backend), "layout", None)
        return declared if isinstance(declared, str) else "(declared by get_kv_cache_shape)"

    def _expected(self, spec: AttentionSpec) -> str:
        dims: list[object] = list(self.shape(1, spec))
        dims[self.block_axis] = "num_blocks"
        return f"the {self.name} layout [{', '.join(map(str, dims))}] = {self.describe()}"

    def shape(self, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        return tuple(
            self.backend.get_kv_cache_shape(
                num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
            )
        )

    def logical(
        self, kv_cache: torch.Tensor, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.kv_cache_to_logical(kv_cache, spec)

    def check(
        self, kv_cache: object, spec: AttentionSpec, device: torch.device | None = None
    ) -> None:
        self.checker(spec)(kv_cache, device)

    def checker(self, spec: AttentionSpec) -> CacheChecker:
        # the first contract did not require a contiguous cache
        return cache_checker(
            spec,
            self.block_axis,
            self.shape(1, spec),
            lambda: self._expected(spec),
            contiguous=False,
        )


class AttentionBackend(ABC):
    """One paged-attention implementation with one physical KV layout.

    Subclasses set the class attributes (``name``, ``capabilities``, ``kv_layout``,
    optionally ``priority`` and ``option_specs``) and return their builder and impl
    classes. The constructor takes the options of a config string
    (``name(key=value)``); it must stay cheap and must not import the backend's
    kernel library. A backend whose layout depends on an option sets
    ``self.kv_layout`` in its ``__init__``.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0  # `auto` tries higher first
    capabilities: ClassVar[Capabilities]
    option_specs: ClassVar[Mapping[str, BackendOption]] = {}
    # the physical KV layout; None only for backends of the first contract, which
    # implement get_kv_cache_shape and kv_cache_to_logical (and set layout/block_axis)
    kv_layout: KVLayout | None = None

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

    # -- layout (all derived from kv_layout) ------------------------------------------

    def get_kv_layout(self) -> CacheLayout:
        """The configured layout object (for a first-contract backend, an adapter over
        its own layout methods)."""
        if self.kv_layout is not None:
            return self.kv_layout
        if type(self).get_kv_cache_shape is AttentionBackend.get_kv_cache_shape:
            raise TypeError(
                f"backend {self.name!r} declares no layout: set kv_layout = pagedkv.KVLayout(...) "
                "(or implement get_kv_cache_shape and kv_cache_to_logical)"
            )
        return _DeclaredLayout(self)

    @property
    def layout(self) -> str:
        """The physical layout in symbols, e.g. "(2, num_blocks, block_size, num_kv_heads, head_size)"."""
        return self.get_kv_layout().describe()

    @property
    def block_axis(self) -> int:
        """The physical axis that block ids index."""
        return self.get_kv_layout().block_axis

    def get_kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Physical shape of one layer's cache."""
        layout = self.get_kv_layout()
        assert isinstance(layout, KVLayout)  # first-contract backends override this method
        return layout.physical_shape(num_blocks, block_size, num_kv_heads, head_size)

    def kv_cache_to_logical(
        self, kv_cache: torch.Tensor, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views K, V [num_blocks, block_size, num_kv_heads, head_size(_v)] of ``kv_cache``.

        Writing through the views writes the cache. MLA: K is the whole latent
        [N, B, 1, kv_lora_rank + rope_dim] and V its prefix [N, B, 1, kv_lora_rank].
        fp8 caches are returned raw (stored value = real value / k_scale or v_scale).
        """
        layout = self.get_kv_layout()
        layout.check(kv_cache, spec)
        return layout.logical(kv_cache, spec)

    def check_kv_cache(
        self, kv_cache: object, spec: AttentionSpec, device: torch.device | str | None = None
    ) -> None:
        """Raise UnsupportedError naming what is wrong with a cache for ``spec``."""
        self.get_kv_layout().check(kv_cache, spec, None if device is None else torch.device(device))

    def allocate_kv_cache(
        self, num_blocks: int, spec: AttentionSpec, device: torch.device | str
    ) -> torch.Tensor:
        """A zero-filled cache. Zeros, not garbage: some kernels read the rows past a
        sequence's end inside its last block and need them finite."""
        if not (is_int(num_blocks) and num_blocks > 0):
            raise UnsupportedError(f"num_blocks: expected a positive int, got {num_blocks!r}")
        shape = self.get_kv_cache_shape(
            num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        return torch.zeros(shape, dtype=spec.cache_dtype, device=device)

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """kv_cache block dst[i] := block src[i] (all K/V data of the block); used for
        copy-on-write. All sources are read before any destination is written. Block ids
        are checked against the pool where they are on the host (lists, CPU tensors); ids
        already on the device only with PAGEDKV_VALIDATE=1 (the check reads them back)."""
        num_blocks = kv_cache.shape[self.block_axis]
        _check_block_ids("src", src, num_blocks)
        _check_block_ids("dst", dst, num_blocks)
        src = torch.as_tensor(src, dtype=torch.int64, device=kv_cache.device)
        dst = torch.as_tensor(dst, dtype=torch.int64, device=kv_cache.device)
        if src.shape != dst.shape or src.dim() != 1:
            raise UnsupportedError(
                f"copy_blocks: src and dst must be 1-D of equal length, got {tuple(src.shape)}, {tuple(dst.shape)}"
            )
        axis = self.block_axis
        kv_cache.index_copy_(axis, dst, kv_cache.index_select(axis, src))

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
        return self.get_builder_cls()(
            spec,
            device,
            cache_layout=self.get_kv_layout(),
            graph_support=self.capabilities.graph_support,
            **self.options,
        )

    def make_impl(
        self, spec: AttentionSpec, *, sinks: torch.Tensor | None = None
    ) -> AttentionImpl[Any]:
        self.require(spec)
        return self.get_impl_cls()(
            spec, sinks=sinks, cache_layout=self.get_kv_layout(), **self.options
        )

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


def _check_block_ids(name: str, ids: object, num_blocks: int) -> None:
    """Raise UnsupportedError naming the first id of ``ids`` outside the pool; ids on
    the device are read back only with PAGEDKV_VALIDATE=1 (the read waits for the GPU)."""
    if isinstance(ids, torch.Tensor) and ids.device.type != "cpu" and not full_validation_enabled():
        return
    host = torch.as_tensor(ids, dtype=torch.int64, device="cpu")
    bad = ((host < 0) | (host >= num_blocks)).nonzero()
    if len(bad):
        at = bad[0].tolist()
        raise UnsupportedError(
            f"copy_blocks: {name}{at} = {int(host[tuple(at)])} is out of range: "
            f"expected a block id in [0, {num_blocks})"
        )
