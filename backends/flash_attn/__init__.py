"""FlashAttention paged attention: FA4, FA3 or FA2 behind one (2, num_blocks, ...) layout."""

from __future__ import annotations

import pagedkv
from pagedkv.backends.flash_attn.backend import FlashAttnBackend

__all__ = ["FlashAttnBackend"]


@pagedkv.hookimpl
def pagedkv_backends() -> list[type[pagedkv.AttentionBackend]]:
    return [FlashAttnBackend]
