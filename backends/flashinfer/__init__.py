"""FlashInfer paged attention: batch decode and batch prefill wrappers, NHD or HND."""

from __future__ import annotations

import pagedkv
from pagedkv.backends.flashinfer.backend import FlashInferBackend

__all__ = ["FlashInferBackend"]


@pagedkv.hookimpl
def pagedkv_backends() -> list[type[pagedkv.AttentionBackend]]:
    return [FlashInferBackend]
