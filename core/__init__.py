"""pagedkv: pluggable, conformance-checked paged-attention backends.

The contract (AttentionSpec, CommonAttentionMetadata, AttentionBackend and its
builder and impl), the plugin registry and config-string selection, the KV-cache
machinery and a float64 reference.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from pagedkv.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, BackendOption
from pagedkv.capabilities import Capabilities, MultipleOf
from pagedkv.errors import (
    ConfigError,
    DuplicateBackendError,
    MetadataError,
    NoUsableBackendError,
    OutOfBlocksError,
    PagedKVError,
    SpecError,
    UnknownBackendError,
    UnsupportedError,
)
from pagedkv.features import Feature
from pagedkv.hookspecs import hookimpl
from pagedkv.metadata import CommonAttentionMetadata
from pagedkv.registry import BackendRecord, get_backend, get_registry, list_backends
from pagedkv.selection import BackendChoice, parse_config, select_backend
from pagedkv.spec import AttentionSpec

try:
    __version__ = version("pagedkv")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "BackendChoice",
    "BackendOption",
    "BackendRecord",
    "Capabilities",
    "CommonAttentionMetadata",
    "ConfigError",
    "DuplicateBackendError",
    "Feature",
    "MetadataError",
    "MultipleOf",
    "NoUsableBackendError",
    "OutOfBlocksError",
    "PagedKVError",
    "SpecError",
    "UnknownBackendError",
    "UnsupportedError",
    "__version__",
    "get_backend",
    "get_registry",
    "hookimpl",
    "list_backends",
    "parse_config",
    "select_backend",
]
