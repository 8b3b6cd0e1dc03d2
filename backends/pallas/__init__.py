"""JAX Pallas paged attention over the (num_blocks, block_size, 2 * num_kv_heads,
head_size) layout, zero-copy from torch through DLPack (docs/pallas.md)."""

from __future__ import annotations

import pagedkv
from pagedkv.backends.pallas.backend import PallasBackend

__all__ = ["PallasBackend"]


@pagedkv.hookimpl
def pagedkv_backends() -> list[type[pagedkv.AttentionBackend]]:
    return [PallasBackend]
