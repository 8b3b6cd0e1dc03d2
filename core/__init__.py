"""pagedkv: pluggable, conformance-checked paged-attention backends.

The contract (AttentionSpec, CommonAttentionMetadata, AttentionBackend and its
builder and impl), the plugin registry and config-string selection, the KV-cache
machinery and a float64 reference.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

# cheap and needed at plugin import time; everything else loads on first use, so that
# importing a plugin (or the pytest plugin, loaded into every pytest run) costs no torch import
from pagedkv.hookspecs import hookimpl
from pagedkv.lazy import lazy_exports

if TYPE_CHECKING:
    from pagedkv.backend import (
        AttentionBackend,
        AttentionImpl,
        AttentionMetadataBuilder,
        BackendMetadata,
    )
    from pagedkv.capabilities import Capabilities, MultipleOf
    from pagedkv.config import BackendChoice, parse_config
    from pagedkv.convert import convert_kv_cache
    from pagedkv.errors import (
        ConfigError,
        DuplicateBackendError,
        MetadataError,
        NoUsableBackendError,
        OutOfBlocksError,
        PagedKVError,
        RegistryReentryError,
        SpecError,
        UnknownBackendError,
        UnsupportedError,
    )
    from pagedkv.features import Feature
    from pagedkv.graph import GraphBounds, GraphSupport
    from pagedkv.layout import KVLayout
    from pagedkv.metadata import CommonAttentionMetadata
    from pagedkv.options import BackendOption
    from pagedkv.registry import BackendRecord, get_backend, get_registry, list_backends
    from pagedkv.selection import select_backend
    from pagedkv.spec import AttentionSpec

_EXPORTS = {
    "AttentionBackend": "pagedkv.backend",
    "AttentionImpl": "pagedkv.backend",
    "AttentionMetadataBuilder": "pagedkv.backend",
    "AttentionSpec": "pagedkv.spec",
    "BackendMetadata": "pagedkv.backend",
    "BackendChoice": "pagedkv.config",
    "BackendOption": "pagedkv.options",
    "BackendRecord": "pagedkv.registry",
    "Capabilities": "pagedkv.capabilities",
    "CommonAttentionMetadata": "pagedkv.metadata",
    "ConfigError": "pagedkv.errors",
    "DuplicateBackendError": "pagedkv.errors",
    "Feature": "pagedkv.features",
    "GraphBounds": "pagedkv.graph",
    "GraphSupport": "pagedkv.graph",
    "KVLayout": "pagedkv.layout",
    "MetadataError": "pagedkv.errors",
    "MultipleOf": "pagedkv.capabilities",
    "NoUsableBackendError": "pagedkv.errors",
    "OutOfBlocksError": "pagedkv.errors",
    "PagedKVError": "pagedkv.errors",
    "RegistryReentryError": "pagedkv.errors",
    "SpecError": "pagedkv.errors",
    "UnknownBackendError": "pagedkv.errors",
    "UnsupportedError": "pagedkv.errors",
    "convert_kv_cache": "pagedkv.convert",
    "get_backend": "pagedkv.registry",
    "get_registry": "pagedkv.registry",
    "list_backends": "pagedkv.registry",
    "parse_config": "pagedkv.config",
    "select_backend": "pagedkv.selection",
}

try:
    __version__ = version("pagedkv")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"


__getattr__, __dir__ = lazy_exports("pagedkv", _EXPORTS, globals())


__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "BackendChoice",
    "BackendMetadata",
    "BackendOption",
    "BackendRecord",
    "Capabilities",
    "CommonAttentionMetadata",
    "ConfigError",
    "DuplicateBackendError",
    "Feature",
    "GraphBounds",
    "GraphSupport",
    "KVLayout",
    "MetadataError",
    "MultipleOf",
    "NoUsableBackendError",
    "OutOfBlocksError",
    "PagedKVError",
    "RegistryReentryError",
    "SpecError",
    "UnknownBackendError",
    "UnsupportedError",
    "__version__",
    "convert_kv_cache",
    "get_backend",
    "get_registry",
    "hookimpl",
    "list_backends",
    "parse_config",
    "select_backend",
]
