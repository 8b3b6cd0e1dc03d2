"""Triton paged attention: a unified kernel for mixed batches, split-KV decode, CUDA graphs.

Importing this package does not import triton; the kernels load on first use.
"""

from __future__ import annotations

import pagedkv
from pagedkv.backends.triton.backend import TritonBackend

__all__ = ["TritonBackend"]


@pagedkv.hookimpl
def pagedkv_backends() -> list[type[pagedkv.AttentionBackend]]:
    return [TritonBackend]
