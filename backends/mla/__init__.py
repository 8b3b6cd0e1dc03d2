"""Multi-head latent attention (DeepSeek V2/V3 style) over a latent paged cache, with
our own Triton kernels: latent write, split-KV absorbed attention, reduction."""

from __future__ import annotations

import pagedkv
from pagedkv.backends.mla.absorb import absorb_query, mla_attention, up_project
from pagedkv.backends.mla.backend import MLABackend

__all__ = ["MLABackend", "absorb_query", "mla_attention", "up_project"]


@pagedkv.hookimpl
def pagedkv_backends() -> list[type[pagedkv.AttentionBackend]]:
    return [MLABackend]
