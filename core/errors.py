"""Exception types. Each means one thing; every message says which field and what was expected."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping


class PagedKVError(Exception):
    """Base of every error pagedkv raises on purpose."""


class SpecError(PagedKVError, ValueError):
    """An AttentionSpec is inconsistent (e.g. num_heads not a multiple of num_kv_heads)."""


class MetadataError(PagedKVError, ValueError):
    """CommonAttentionMetadata breaks an invariant; the message names field and request."""


class UnsupportedError(PagedKVError, ValueError):
    """A backend was asked for something its declared capabilities exclude."""


class ConfigError(PagedKVError, ValueError):
    """A backend config string or an option value is malformed."""


class UnknownBackendError(PagedKVError, KeyError):
    """No registered backend has this name."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = sorted(known)
        close = difflib.get_close_matches(name, self.known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        super().__init__(
            f"unknown attention backend {name!r}{hint} Known backends: {', '.join(self.known) or '(none)'}"
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class NoUsableBackendError(PagedKVError, RuntimeError):
    """No candidate in a config string is available and supports the spec."""

    def __init__(self, config: str, reasons: Mapping[str, list[str]]) -> None:
        self.config = config
        self.reasons = dict(reasons)
        lines = [f"no usable attention backend for config {config!r}:"]
        for name, why in self.reasons.items():
            lines.append(f"  {name}: " + "; ".join(why))
        super().__init__("\n".join(lines))


class DuplicateBackendError(PagedKVError, RuntimeError):
    """A backend name that two plugins register was asked for (neither is used)."""


class RegistryReentryError(PagedKVError, RuntimeError):
    """A plugin used the registry while the registry was loading that plugin."""


class UsageError(PagedKVError, ValueError):
    """A command-line argument is missing, contradicts another or makes no sense."""


class OutOfBlocksError(PagedKVError, ValueError):
    """The block pool cannot hand out as many blocks as asked."""


class KVCacheUsageError(PagedKVError, ValueError):
    """A call into the KV-cache manager or block pool breaks its contract (a negative
    count, more tokens than max_model_len, a request in the wrong state)."""


class UnknownRequestError(KVCacheUsageError):
    """The KV-cache manager holds no blocks for this request id."""


class DoubleFreeError(KVCacheUsageError):
    """A request or block was freed when it held no reference (freed twice)."""


class TraceFormatError(PagedKVError, ValueError):
    """A request-trace file is malformed; the message names the file, line and field."""
