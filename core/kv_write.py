"""Writing new K/V rows into any layout's logical view, by slot mapping.

The portable path used by every backend that has no write kernel of its own. It
syncs the host (a boolean mask over the slots), so it is neither the fast path nor
CUDA-graph capturable; kernel backends bring their own writer.
"""

from __future__ import annotations

import torch


def quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Values as the cache stores them: fp8 caches hold x / scale, saturated to the
    format's finite range (a NaN-free cache is part of the contract)."""
    if cache_dtype.itemsize == 1 and cache_dtype.is_floating_point:
        limit = torch.finfo(cache_dtype).max
        return (x.float() / scale).clamp_(-limit, limit).to(cache_dtype)
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
