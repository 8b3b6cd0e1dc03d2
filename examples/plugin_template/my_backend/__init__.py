"""A third-party pagedkv backend: registered through the ``pagedkv`` entry point."""

from __future__ import annotations

import pagedkv

from my_backend.backend import MyBackend

__all__ = ["MyBackend"]


@pagedkv.hookimpl
def pagedkv_backends() -> list[type[pagedkv.AttentionBackend]]:
    return [MyBackend]
