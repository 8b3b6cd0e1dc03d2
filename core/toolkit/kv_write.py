"""Writing new K/V rows into any layout's logical view, by slot mapping.

``write_kv_by_slot`` is what backends call (``cache_writer`` is the same write kept for
one pair of views: an impl keeps one per cache): on CUDA it launches the Triton kernel
of ``pagedkv.toolkit.triton_kv_write`` (one launch for K and V, no host sync, CUDA-graph
capturable); elsewhere it falls back to ``write_rows_by_slot``, the portable torch
path, which syncs the host (a boolean mask over the slots). Both store the same
bits, including fp8 rounding and saturation (``quantize_for_cache``).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch

# a write into one pair of cache views: writer(key, value, slot_mapping) (``cache_writer``)
KVWriter = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], None]


def quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Values as the cache stores them: fp8 caches hold x / scale, saturated to the
    format's finite range (a NaN-free cache is part of the contract).

    The division is a float32 multiplication by float32(1 / scale): torch divides by
    a scalar that way on CUDA and exactly on the CPU, and a one-ulp difference
    moves values across fp8 rounding boundaries, so every writer (torch on any
    device, the Triton kernels) uses this one definition and stores the same bits."""
    if cache_dtype.itemsize == 1 and cache_dtype.is_floating_point:
        limit = torch.finfo(cache_dtype).max
        inv_scale = torch.tensor(1.0 / scale, dtype=torch.float32).item()
        return (x.float() * inv_scale).clamp_(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def dequantize_from_cache(
    x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Real values of cache entries (inverse of quantize_for_cache, up to rounding)."""
    if x.dtype.itemsize == 1 and x.dtype.is_floating_point:
        return x.to(dtype) * scale
    return x.to(dtype)


def write_rows_by_slot(
    rows: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """cache[slot // B, slot % B] = rows[t] for each token t with slot_mapping[t] >= 0.

    rows: [T, ...]; cache: a logical view [num_blocks, B, ...] (any strides);
    slot_mapping: [T'] int64 with T' <= T (rows past T' are ignored).
    """
    block_size = cache.shape[1]
    num_slots = slot_mapping.shape[0]
    token_idx = torch.nonzero(slot_mapping >= 0).squeeze(1)
    slots = slot_mapping[token_idx]
    if slots.numel() and int(slots.max()) >= cache.shape[0] * block_size:
        raise IndexError(
            f"slot {int(slots.max())} is past the cache's {cache.shape[0] * block_size} slots"
        )
    values = quantize_for_cache(rows[:num_slots][token_idx], cache.dtype, scale)
    cache[slots // block_size, slots % block_size] = values


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def write_kv_by_slot(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_view: torch.Tensor,
    v_view: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    use_triton: bool | None = None,
) -> None:
    """k_view[slot // B, slot % B] = key[t] (and v_view from value) for each slot >= 0.

    key: [T, H, D]; value: [T, H, Dv], or None when V lives inside K (MLA);
    k_view / v_view: logical views [num_blocks, B, H, D(v)] of any layout;
    slot_mapping: [T'] int64 with T' <= T. fp8 views store x / scale, saturated.

    use_triton: None picks the Triton kernel for CUDA tensors (when triton is
    installed) and the torch path otherwise; True forces the kernel (CPU tensors
    need TRITON_INTERPRET=1 set before the kernel module is first imported).
    The kernel skips slots past the pool instead of raising: no host sync.
    """
    if use_triton is None:
        use_triton = key.is_cuda and _triton_installed()
    cache_writer(k_view, v_view, k_scale, v_scale, use_triton=use_triton)(key, value, slot_mapping)


def cache_writer(
    k_view: torch.Tensor,
    v_view: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    use_triton: bool | None = None,
) -> KVWriter:
    """The write into these views, as ``writer(key, value, slot_mapping)``
    (``write_kv_by_slot``'s arguments): the Triton kernel's ``CacheWriter``, which finds
    what depends on the views once (an impl keeps one per cache:
    ``AttentionImpl.cache_writer``), or the torch path. use_triton: None picks the
    kernel for CUDA views (when triton is installed)."""
    if use_triton is None:
        use_triton = k_view.is_cuda and _triton_installed()
    if not use_triton:
        return functools.partial(_write_rows_kv, k_view, v_view, k_scale, v_scale)
    from pagedkv.toolkit.interpreter import interpreting
    from pagedkv.toolkit.triton_kv_write import CacheWriter

    if not k_view.is_cuda and not interpreting():
        raise ValueError(
            f"the Triton KV write needs CUDA tensors (the cache is on {k_view.device}), or "
            "TRITON_INTERPRET=1 set before pagedkv.toolkit.triton_kv_write is first imported"
        )
    return CacheWriter(k_view, v_view, k_scale, v_scale)


def _write_rows_kv(
    k_view: torch.Tensor,
    v_view: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    key: torch.Tensor,
    value: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    """The torch path of ``write_kv_by_slot`` (the views first)."""
    if (value is None) != (v_view is None):  # as the Triton writer: never K alone
        raise ValueError("value and v_view must be given together (or both None)")
    write_rows_by_slot(key, k_view, slot_mapping, k_scale)
    if value is not None:
        write_rows_by_slot(value, v_view, slot_mapping, v_scale)
