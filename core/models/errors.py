"""Errors of the Hugging Face integration."""

from __future__ import annotations

from pagedkv.errors import PagedKVError


class ModelSupportError(PagedKVError, ValueError):
    """A model cannot run on pagedkv as given (transformers missing or out of range,
    an attention module pagedkv cannot map, an unknown built-in name or a bad path)."""
