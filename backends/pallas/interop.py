"""torch <-> JAX through DLPack: views of the same memory, no copy, no host round trip.

Ordering on CUDA comes from the DLPack stream handshake: importing a torch tensor
makes JAX's stream wait for torch's current stream, and importing a JAX result makes
torch's current stream wait for JAX. A cache view imported once therefore stays
correct as long as every forward also imports its query (it does): that import
orders the kernel after the torch writes that came before it.
"""

from __future__ import annotations

import functools
import os
import weakref

import jax
import torch

_PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


@functools.cache
def configure_jax() -> None:
    """Configure JAX for sharing a GPU with torch; call before JAX's first computation.

    JAX's GPU client takes 75% of the GPU's memory when it starts unless told not to
    preallocate, and torch owns the cache, so this asks the client (through
    ``jax_pjrt_client_create_options``, merged with any options already set) to
    allocate on demand. A choice the user made stands: an explicit
    ``XLA_PYTHON_CLIENT_PREALLOCATE`` or a ``preallocate`` client option. Importing jax
    starts no client; the backend calls this before it asks JAX for a device. A JAX
    that has already started its GPU client keeps its allocator (set the variable
    yourself when JAX computes on the GPU before pagedkv does).
    """
    if os.environ.get(_PREALLOCATE_ENV):
        return
    current = jax.config.jax_pjrt_client_create_options
    if isinstance(current, str):
        options: dict[str, object] = dict(
            item.split(":", 1) for item in current.split(";") if ":" in item
        )
    else:
        options = dict(current or {})
    if "preallocate" not in options:
        options["preallocate"] = False
        jax.config.update("jax_pjrt_client_create_options", options)


# DLPack hands these over without a copy (int64 would be converted unless jax_enable_x64)
ZERO_COPY_DTYPES = frozenset(
    {
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int32,
    }
)


def jax_version() -> str:
    return jax.__version__


def to_jax(tensor: torch.Tensor, name: str, *, allow_copy: bool = False) -> jax.Array:
    """A JAX array sharing ``tensor``'s memory.

    DLPack copies int64 (unless jax_enable_x64), strided views and, on CPU, data
    not aligned to 64 bytes. Those raise TypeError/ValueError naming ``name``, except
    that ``allow_copy`` lets a contiguous, misaligned tensor be copied on its own
    device (small per-step inputs); the cache is never copied.
    """
    if tensor.dtype not in ZERO_COPY_DTYPES:
        raise TypeError(
            f"{name}: dtype {tensor.dtype} would be copied by DLPack; expected one of "
            f"{sorted(str(d).removeprefix('torch.') for d in ZERO_COPY_DTYPES)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous tensor (DLPack copies strided views), got "
            f"shape {list(tensor.shape)} with strides {list(tensor.stride())}"
        )
    try:
        return jax.dlpack.from_dlpack(tensor, copy=None if allow_copy else False)
    except (BufferError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"{name}: JAX cannot view this tensor without a copy ({exc}); on CPU the data "
            "pointer must be aligned to 64 bytes (a freshly allocated tensor is)"
        ) from exc


def to_torch(array: jax.Array) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory (on CUDA, ordered after JAX's work)."""
    return torch.from_dlpack(array)


class CacheView:
    """The JAX view of one layer's cache, imported once and reused while the caller
    passes the same tensor (same object, same storage)."""

    def __init__(self) -> None:
        self._tensor: weakref.ref[torch.Tensor] | None = None
        self._key: tuple[int, tuple[int, ...], torch.dtype] | None = None
        self._array: jax.Array | None = None

    def get(self, kv_cache: torch.Tensor) -> jax.Array:
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self._tensor is not None and self._tensor() is kv_cache and self._key == key:
            assert self._array is not None
            return self._array
        self._array = to_jax(kv_cache, "kv_cache")
        self._tensor, self._key = weakref.ref(kv_cache), key
        return self._array
