"""The backend registry: plugins found through the ``pagedkv`` entry-point group.

Loading is guarded per plugin: one that fails to import, fails pluggy's signature
check or raises from its hook is recorded (and warned about) as unavailable with
the reason, and never hides the others. ``PAGEDKV_PLUGINS`` (comma-separated
entry-point names) restricts which plugins load; unset loads all.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import traceback
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy
from pagedkv import hookspecs
from pagedkv.backend import AttentionBackend
from pagedkv.errors import DuplicateBackendError, PagedKVError, UnknownBackendError

ENTRY_POINT_GROUP = "pagedkv"
PHASE_SPLIT = "split"  # the reserved config name of pagedkv.phase_split
ALLOWLIST_ENV = "PAGEDKV_PLUGINS"


class PluginLoadWarning(UserWarning):
    """A plugin could not be loaded; its backends show as unavailable."""


@dataclass(frozen=True)
class BackendRecord:
    """What ``list_backends`` reports about one backend (or one broken plugin)."""

    name: str
    available: bool
    reason: str  # why not available ("" when available)
    layout: str
    capabilities: dict[str, Any] | None
    distribution: str  # the distribution that provides it, "name version"
    plugin: str  # the entry-point name
    priority: int = 0


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    distribution: str
    error: str


@dataclass
class _Entry:
    cls: type[AttentionBackend]
    plugin: str
    distribution: str


@dataclass
class Registry:
    """Backends by name, with the plugin and distribution that provided each."""

    plugin_manager: pluggy.PluginManager = field(default_factory=lambda: _new_plugin_manager())
    entries: dict[str, _Entry] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)

    # -- loading ------------------------------------------------------------------

    def load_entry_points(self, allowlist: Iterable[str] | None = None) -> None:
        allowed = None if allowlist is None else set(allowlist)
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            if self.plugin_manager.has_plugin(ep.name):
                continue  # the same distribution seen twice on sys.path
            dist = _distribution_of(ep)
            try:
                plugin = ep.load()
            except Exception as exc:
                self._fail(ep.name, dist, f"import of {ep.value!r} failed: {_describe(exc)}")
                continue
            self.register_plugin(plugin, ep.name, dist)

    def register_plugin(
        self, plugin: object, name: str, distribution: str = "(in-process)"
    ) -> None:
        """Register a plugin object or module and collect the backends it gives."""
        try:
            self.plugin_manager.register(plugin, name=name)
        except Exception as exc:
            self._fail(name, distribution, f"registration failed: {_describe(exc)}")
            return
        impls = [
            i
            for i in self.plugin_manager.hook.pagedkv_backends.get_hookimpls()
            if i.plugin_name == name
        ]
        for impl in impls:
            try:
                backends = list(impl.function())
            except Exception as exc:
                self._fail(name, distribution, f"pagedkv_backends() raised {_describe(exc)}")
                continue
            for cls in backends:
                self._add(cls, name, distribution)

    def _add(self, cls: object, plugin: str, distribution: str) -> None:
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)) or not getattr(
            cls, "name", None
        ):
            self._fail(
                plugin,
                distribution,
                f"pagedkv_backends() returned {cls!r}, not a named AttentionBackend subclass",
            )
            return
        other = self.entries.get(cls.name)
        if other is not None and other.cls is not cls:
            raise DuplicateBackendError(
                f"backend name {cls.name!r} is registered twice: by plugin {other.plugin!r} "
                f"({other.distribution}) and by plugin {plugin!r} ({distribution}); uninstall one "
                f"or exclude it with {ALLOWLIST_ENV}"
            )
        self.entries[cls.name] = _Entry(cls, plugin, distribution)

    def _fail(self, plugin: str, distribution: str, error: str) -> None:
        self.failures.append(PluginFailure(plugin, distribution, error))
        warnings.warn(
            f"pagedkv plugin {plugin!r} ({distribution}) is unavailable: {error}",
            PluginLoadWarning,
            stacklevel=3,
        )

    # -- queries ------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self.entries)

    def backend_class(self, name: str) -> type[AttentionBackend]:
        if name == PHASE_SPLIT:  # a composite of two registered backends, not a plugin
            from pagedkv.phase_split import PhaseSplitBackend

            return PhaseSplitBackend
        entry = self.entries.get(name)
        if entry is None:
            failure = self.failure_for(name)
            if failure is not None:
                raise PagedKVError(
                    f"backend {name!r} is unavailable: plugin {failure.plugin!r} "
                    f"({failure.distribution}) failed to load: {failure.error}"
                )
            raise UnknownBackendError(name, self.entries)
        return entry.cls

    def failure_for(self, name: str) -> PluginFailure | None:
        return next((f for f in self.failures if f.plugin == name), None)

    def create(self, name: str, **options: Any) -> AttentionBackend:
        return self.backend_class(name)(**options)

    def records(self) -> list[BackendRecord]:
        out = [self._record(name, entry) for name, entry in sorted(self.entries.items())]
        out += [
            BackendRecord(
                f.plugin,
                False,
                f"plugin failed to load: {f.error}",
                "?",
                None,
                f.distribution,
                f.plugin,
            )
            for f in self.failures
        ]
        return out

    def _record(self, name: str, entry: _Entry) -> BackendRecord:
        try:
            backend = entry.cls()
            available, reason = backend.is_available()
            layout, caps = backend.layout, backend.capabilities.describe()
        except Exception as exc:
            available, reason, layout, caps = (
                False,
                f"introspection raised {_describe(exc)}",
                "?",
                None,
            )
        return BackendRecord(
            name,
            available,
            reason,
            layout,
            caps,
            entry.distribution,
            entry.plugin,
            entry.cls.priority,
        )


def _new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _distribution_of(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "(unknown distribution)"


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


_lock = threading.Lock()
_registry: Registry | None = None


def get_registry(*, reload: bool = False) -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _registry
    with _lock:
        if _registry is None or reload:
            registry = Registry()
            raw = os.environ.get(ALLOWLIST_ENV)
            allowlist = None if raw is None else [n.strip() for n in raw.split(",") if n.strip()]
            registry.load_entry_points(allowlist)
            _registry = registry
        return _registry


def reset_registry() -> None:
    """Forget the loaded registry; the next use reloads it. Mainly used for testing."""
    global _registry
    with _lock:
        _registry = None


def list_backends() -> list[BackendRecord]:
    """Every registered backend, plus a record per plugin that failed to load."""
    return get_registry().records()


def get_backend(name: str, **options: Any) -> AttentionBackend:
    """The backend called ``name``, configured with ``options``.

    Raises UnknownBackendError (listing the known names and the closest) for an
    unknown name.
    """
    return get_registry().create(name, **options)
