"""Errors of the serving layer; each message names the field or request and what was expected."""

from __future__ import annotations

from pagedkv.errors import PagedKVError


class EngineConfigError(PagedKVError, ValueError):
    """An EngineConfig field is out of range or inconsistent with the model."""


class RequestError(PagedKVError, ValueError):
    """A request cannot be served as given (bad sampling parameters, a prompt that can
    never fit the pool or max_model_len, a duplicate or unknown request id)."""


class CudaGraphError(PagedKVError, RuntimeError):
    """Capturing or replaying a decode CUDA graph failed (the model or backend is not
    capture-safe); run with cuda_graph=False."""
