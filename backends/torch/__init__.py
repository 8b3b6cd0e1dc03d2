"""Portable PyTorch paged attention: the embedded default on any device."""

from __future__ import annotations

import pagedkv
from pagedkv.backends.torch.backend import TorchBackend

__all__ = ["TorchBackend"]


@pagedkv.hookimpl
def pagedkv_backends() -> list[type[pagedkv.AttentionBackend]]:
    return [TorchBackend]
