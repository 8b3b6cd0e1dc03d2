"""KV-cache layouts: one object per physical layout, everything else derived from it.

A layout is the order of the physical axes of one layer's cache, each axis one of

- ``KV``      size 2: K at index 0, V at index 1
- ``BLOCKS``  num_blocks: the pool's blocks (block ids index this axis)
- ``TOKENS``  block_size: the token slots inside a block
- ``HEADS``   num_kv_heads
- ``DIM``     head_size (for a latent cache: kv_lora_rank + qk_rope_head_dim)

and an axis may be a *group* of adjacent axes stored merged into one, row-major:
``(HEADS, KV)`` is one axis of size ``2 * num_kv_heads`` holding K of head h at
``2h`` and V at ``2h + 1``. A layout with no ``KV`` axis is a latent cache (MLA):
one row per token, K is the whole row and V its first ``head_size_v`` values; with
no ``HEADS`` axis the single KV head is implied.

From the axes follow the physical shape, the block axis, the logical K/V views
``[num_blocks, block_size, num_kv_heads, head_size(_v)]`` that every tool reads, the
cache check, allocation and block copies — so a backend declares its layout once::

    class MyBackend(pagedkv.AttentionBackend):
        kv_layout = pagedkv.KVLayout("mine", (BLOCKS, TOKENS, HEADS, KV, DIM))
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from pagedkv.errors import UnsupportedError

if TYPE_CHECKING:
    from pagedkv.spec import AttentionSpec


class Axis(enum.Enum):
    """One physical axis of a cache; the value is its symbol in layout strings."""

    KV = "2"
    BLOCKS = "num_blocks"
    TOKENS = "block_size"
    HEADS = "num_kv_heads"
    DIM = "head_size"


KV, BLOCKS, TOKENS, HEADS, DIM = Axis.KV, Axis.BLOCKS, Axis.TOKENS, Axis.HEADS, Axis.DIM
AxisSpec = Axis | tuple[Axis, ...]  # one axis, or adjacent axes stored merged
# the logical order of K and V views
_LOGICAL = (BLOCKS, TOKENS, HEADS, DIM)


class CacheLayout(Protocol):
    """What the contract needs of a layout; KVLayout is the implementation. A backend
    written against the first contract (its own get_kv_cache_shape and
    kv_cache_to_logical) is seen through an adapter with the same methods."""

    name: str

    @property
    def block_axis(self) -> int: ...

    def describe(self) -> str: ...

    def shape(self, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]: ...

    def logical(
        self, kv_cache: torch.Tensor, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def check(
        self, kv_cache: object, spec: AttentionSpec, device: torch.device | None = None
    ) -> None: ...

    def checker(self, spec: AttentionSpec) -> CacheChecker: ...


# kv_cache, device (None: any) -> None, or raises UnsupportedError
CacheChecker = Callable[[object, "torch.device | None"], None]


@dataclass(frozen=True)
class KVLayout:
    """A physical KV-cache layout (see the module docstring)."""

    name: str
    axes: tuple[AxisSpec, ...]

    def __post_init__(self) -> None:
        flat = self._flat_axes()
        if BLOCKS not in self.axes:
            raise ValueError(f"layout {self.name}: BLOCKS must be an axis of its own")
        if len(set(flat)) != len(flat):
            raise ValueError(f"layout {self.name}: an axis appears twice in {self.describe()}")
        for required in (TOKENS, DIM):
            if required not in flat:
                raise ValueError(f"layout {self.name}: needs a {required.name} axis")
        if KV not in flat and HEADS in flat:
            raise ValueError(
                f"layout {self.name}: a latent layout (no KV axis) holds one KV head, no HEADS axis"
            )

    # -- derived facts ----------------------------------------------------------------

    @property
    def block_axis(self) -> int:
        """The physical axis that block ids index."""
        return self.axes.index(BLOCKS)

    @property
    def is_latent(self) -> bool:
        """One row per token (MLA): V is the prefix of K, no K/V axis."""
        return KV not in self._flat_axes()

    def describe(self) -> str:
        """The layout in symbols, e.g. ``(2, num_blocks, block_size, num_kv_heads, head_size)``."""
        parts = []
        for axis in self.axes:
            group = axis if isinstance(axis, tuple) else (axis,)
            parts.append(" * ".join(self._symbol(a) for a in group))
        return f"({', '.join(parts)})"

    def _symbol(self, axis: Axis) -> str:
        if axis is DIM and self.is_latent:
            return "kv_lora_rank + qk_rope_head_dim"
        return axis.value

    def _flat_axes(self) -> tuple[Axis, ...]:
        out: list[Axis] = []
        for axis in self.axes:
            out.extend(axis if isinstance(axis, tuple) else (axis,))
        return tuple(out)

    def _sizes(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> dict[Axis, int]:
        return {KV: 2, BLOCKS: num_blocks, TOKENS: block_size, HEADS: num_kv_heads, DIM: head_size}

    # -- shape, views -----------------------------------------------------------------

    def physical_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """The physical shape of one layer's cache (what ``get_kv_cache_shape`` returns)."""
        sizes = self._sizes(num_blocks, block_size, num_kv_heads, head_size)
        out = []
        for axis in self.axes:
            size = 1
            for a in axis if isinstance(axis, tuple) else (axis,):
                size *= sizes[a]
            out.append(size)
        return tuple(out)

    def shape(self, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        """The physical shape of one layer's cache of ``num_blocks`` blocks."""
        return self.physical_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)

    def logical(
        self, kv_cache: torch.Tensor, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as views ``[num_blocks, block_size, num_kv_heads, head_size(_v)]``.

        Writing through them writes the cache. A latent layout gives K the whole row
        ``[N, B, 1, head_size]`` and V its prefix ``[N, B, 1, head_size_v]``. fp8 caches
        are returned raw (stored value = real value / k_scale or v_scale).
        """
        num_blocks = kv_cache.shape[self.block_axis]
        sizes = self._sizes(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        flat = self._flat_axes()
        unmerged = kv_cache.view(*(sizes[a] for a in flat))  # merged groups split apart
        if self.is_latent:
            order = [flat.index(a) for a in (BLOCKS, TOKENS, DIM)]
            k = unmerged.permute(order).unsqueeze(2)
            return k, k[..., : spec.head_size_v]
        views = []
        for index in (0, 1):
            half = unmerged.select(flat.index(KV), index)
            rest = [a for a in flat if a is not KV]
            views.append(half.permute([rest.index(a) for a in _LOGICAL]))
        return views[0], views[1]

    def same_bytes(self, other: object) -> bool:
        """Whether a cache in this layout is, byte for byte, a cache in ``other``."""
        return isinstance(other, KVLayout) and other.axes == self.axes

    # -- checks -------------------------------------------------------------------------

    def check(
        self, kv_cache: object, spec: AttentionSpec, device: torch.device | None = None
    ) -> None:
        """Raise UnsupportedError naming what is wrong: type, shape (every axis but the
        blocks), dtype (``spec.cache_dtype``, fp8 included), contiguity, device."""
        self.checker(spec)(kv_cache, device)

    def checker(self, spec: AttentionSpec) -> CacheChecker:
        """``check`` for one spec, with everything it compares computed once (the
        forward of every layer runs it)."""
        return cache_checker(
            spec, self.block_axis, self.shape(1, spec), lambda: self._named_shape(spec)
        )

    def _named_shape(self, spec: AttentionSpec) -> str:
        dims: list[object] = list(self.shape(1, spec))
        dims[self.block_axis] = "num_blocks"
        return f"the {self.name} layout [{', '.join(map(str, dims))}] = {self.describe()}"


def cache_checker(
    spec: AttentionSpec,
    block_axis: int,
    one_block_shape: Sequence[int],
    expected: Callable[[], str],
    *,
    contiguous: bool = True,
) -> CacheChecker:
    """A check of caches for ``spec``: the common case in a few comparisons, the
    message (``check_cache_tensor``) built only when something is wrong."""
    before = tuple(one_block_shape[:block_axis])
    after = tuple(one_block_shape[block_axis + 1 :])
    ndim, dtype = len(one_block_shape), spec.cache_dtype
    # the last shape that passed: a model's caches share one, so most calls compare it
    # whole instead of slicing it
    passed: list[torch.Size | None] = [None]

    def check(kv_cache: object, device: torch.device | None = None) -> None:
        if (
            isinstance(kv_cache, torch.Tensor)
            and kv_cache.dtype == dtype
            and (
                kv_cache.shape == passed[0]
                or (
                    kv_cache.dim() == ndim
                    and kv_cache.shape[:block_axis] == before
                    and kv_cache.shape[block_axis + 1 :] == after
                    and kv_cache.shape[block_axis] >= 1
                )
            )
            and (not contiguous or kv_cache.is_contiguous())
            and (device is None or kv_cache.device == device)
        ):
            passed[0] = kv_cache.shape
            return
        check_cache_tensor(
            kv_cache, spec, block_axis, one_block_shape, expected(), device, contiguous=contiguous
        )

    return check


def check_cache_tensor(
    kv_cache: object,
    spec: AttentionSpec,
    block_axis: int,
    one_block_shape: Sequence[int],
    expected: str,
    device: torch.device | None = None,
    *,
    contiguous: bool = True,
) -> None:
    """The cache check shared by every layout (see KVLayout.check)."""
    if not isinstance(kv_cache, torch.Tensor):
        raise UnsupportedError(
            f"kv_cache: expected a tensor in {expected}, got {type(kv_cache).__name__}"
        )
    got = list(kv_cache.shape)
    want = list(one_block_shape)
    if (
        len(got) != len(want)
        or got[block_axis] < 1
        or any(g != w for i, (g, w) in enumerate(zip(got, want, strict=True)) if i != block_axis)
    ):
        raise UnsupportedError(f"kv_cache: expected {expected}, got shape {got}")
    if kv_cache.dtype != spec.cache_dtype:
        raise UnsupportedError(
            f"kv_cache: expected dtype {spec.cache_dtype} (spec.kv_cache_dtype "
            f"{spec.kv_cache_dtype!r}, spec.dtype {spec.dtype}), got {kv_cache.dtype}"
        )
    if contiguous and not kv_cache.is_contiguous():
        raise UnsupportedError(
            f"kv_cache: expected a contiguous tensor (as allocate_kv_cache returns), got "
            f"strides {list(kv_cache.stride())} for shape {got}"
        )
    if device is not None and kv_cache.device != device:
        raise UnsupportedError(f"kv_cache: expected on {device}, got {kv_cache.device}")


# -- the standard layouts ---------------------------------------------------------------

# K and V halves first: vLLM's FlashAttention layout (torch, triton, flash_attn)
KV_FIRST = KVLayout("kv_first", (KV, BLOCKS, TOKENS, HEADS, DIM))
# FlashInfer's paged layouts: each block holds its K then its V
BLOCK_NHD = KVLayout("NHD", (BLOCKS, KV, TOKENS, HEADS, DIM))
BLOCK_HND = KVLayout("HND", (BLOCKS, KV, HEADS, TOKENS, DIM))
# K and V of each head interleaved (the ragged-paged-attention convention; pallas)
INTERLEAVED_HEADS = KVLayout("interleaved_heads", (BLOCKS, TOKENS, (HEADS, KV), DIM))
# MLA: one latent row concat(kv_c, k_pe) per token
LATENT = KVLayout("latent", (BLOCKS, TOKENS, DIM))

STANDARD_LAYOUTS = (KV_FIRST, BLOCK_NHD, BLOCK_HND, INTERLEAVED_HEADS, LATENT)
