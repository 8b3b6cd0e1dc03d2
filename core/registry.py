"""The backend registry: plugins found through the ``pagedkv`` entry-point group.

Loading is contained per plugin, and per backend: a plugin that fails to import
(even one that calls ``sys.exit()``), fails pluggy's signature check, raises from
its hook or returns junk is recorded as unavailable with the reason (and a
``PluginLoadWarning``); so is a backend class that is ill-formed (a name that a
config string cannot name or a reserved one, an ill-typed priority, capabilities
or options, abstract methods left) and a backend name that two plugins claim. What
is recorded is listed by ``list_backends()``, refused with its reason by
``get_backend()`` and skipped with its reason by selection; everything else keeps
working. Hooks with unknown names and hook-like functions without
``@pagedkv.hookimpl`` are reported the same way.

``PAGEDKV_PLUGINS`` (comma-separated entry-point names) restricts which plugins
load; unset loads all.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pluggy
from pagedkv import hookspecs
from pagedkv.backend import AttentionBackend
from pagedkv.capabilities import Capabilities
from pagedkv.config import name_problem
from pagedkv.errors import (
    DuplicateBackendError,
    PagedKVError,
    RegistryReentryError,
    UnknownBackendError,
)
from pagedkv.options import BackendOption, parse_options

ENTRY_POINT_GROUP = "pagedkv"
PHASE_SPLIT = "split"  # the reserved config name of pagedkv.phase_split
ALLOWLIST_ENV = "PAGEDKV_PLUGINS"
HOOK_PREFIX = "pagedkv_"


class PluginLoadWarning(UserWarning):
    """A plugin, or a backend it gives, cannot be used (or has a mistake that hides part
    of it); the reason is recorded and shown by ``list_backends()``."""


class BackendErrorWarning(UserWarning):
    """A backend raised (or answered with the wrong types) while being selected; it was
    skipped as unavailable."""


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
    notes: tuple[str, ...] = ()  # Capabilities.notes: limits the declaration cannot express
    warnings: tuple[str, ...] = ()  # mistakes in its plugin that hide nothing of this backend


@dataclass(frozen=True)
class PluginFailure:
    """Something a plugin provides that cannot be used: the whole plugin (``backend``
    empty: it failed to import, its hook raised, it registers nothing) or one backend
    name (ill-formed, or claimed by two plugins)."""

    plugin: str  # the entry-point name(s)
    distribution: str  # "name version", or several joined by " and "
    error: str
    backend: str = ""
    conflict: bool = False  # the backend name is claimed by several plugins

    @property
    def name(self) -> str:
        """The name it is listed and looked up under: the backend's, else the plugin's."""
        return self.backend or self.plugin

    @property
    def reason(self) -> str:
        return self.error if self.backend else f"plugin failed to load: {self.error}"

    def __str__(self) -> str:
        if self.conflict:
            return f"backend {self.backend!r} is unusable: {self.error}"
        if self.backend:
            return (
                f"backend {self.backend!r} of plugin {self.plugin!r} ({self.distribution}) is "
                f"unusable: {self.error}"
            )
        return f"plugin {self.plugin!r} ({self.distribution}) failed to load: {self.error}"


@dataclass(frozen=True)
class PluginWarning:
    """A mistake in a plugin (or in ``$PAGEDKV_PLUGINS``) that makes nothing unavailable
    by itself: a misspelt hook, a hook function without ``@pagedkv.hookimpl``."""

    plugin: str  # "" for the registry as a whole
    distribution: str
    message: str

    def __str__(self) -> str:
        if not self.plugin:
            return self.message
        return f"plugin {self.plugin!r} ({self.distribution}): {self.message}"


@dataclass
class _Entry:
    cls: type[AttentionBackend]
    plugin: str
    distribution: str
    name: str  # cls.name and cls.priority, checked when registered
    priority: int


@dataclass
class Registry:
    """Backends by name, with the plugin and distribution that provided each."""

    plugin_manager: pluggy.PluginManager = field(default_factory=lambda: _new_plugin_manager())
    entries: dict[str, _Entry] = field(default_factory=dict)
    warnings: list[PluginWarning] = field(default_factory=list)
    loading_plugin: str | None = None  # the plugin being imported or asked for backends
    _failures: list[PluginFailure] = field(default_factory=list)
    _claimants: dict[str, list[_Entry]] = field(default_factory=dict)

    # -- loading ------------------------------------------------------------------

    def load_entry_points(self, allowlist: Iterable[str] | None = None) -> None:
        found = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        allowed = None if allowlist is None else set(allowlist)
        if allowed is not None:
            self._check_allowlist(allowed, {ep.name for ep in found})
        for ep in found:
            if allowed is not None and ep.name not in allowed:
                continue
            dist = _distribution_of(ep)
            self.loading_plugin = ep.name
            try:
                plugin = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # a plugin's sys.exit() must not end the host
                where = describe_exception(exc, _module_roots(ep.module))
                self._fail(ep.name, dist, f"import of {ep.value!r} failed: {where}")
                continue
            finally:
                self.loading_plugin = None
            self.register_plugin(plugin, ep.name, dist)

    def register_plugin(
        self, plugin: object, name: str, distribution: str = "(in-process)"
    ) -> None:
        """Register a plugin object or module and collect the backends it gives."""
        self.loading_plugin = name
        try:
            self._register(plugin, name, distribution)
        finally:
            self.loading_plugin = None

    def _register(self, plugin: object, name: str, distribution: str) -> None:
        holder = self.plugin_manager.get_name(plugin)
        if holder is not None:
            self._fail(
                name,
                distribution,
                f"it is the same module or object as plugin {holder!r}, registered already",
            )
            return
        # pluggy needs unique plugin names, but two distributions may use one entry-point
        # name (two plugins made from one template): the second is told apart internally
        unique = name if not self.plugin_manager.has_plugin(name) else f"{name}@{distribution}"
        try:
            self.plugin_manager.register(plugin, name=unique)
        except Exception as exc:
            if self.plugin_manager.has_plugin(unique):  # pluggy keeps what it checked before
                self.plugin_manager.unregister(name=unique)
            self._fail(name, distribution, f"registration failed: {describe_exception(exc)}")
            return
        if not self._check_hook_names(plugin, name, distribution):
            return
        impls = [
            i
            for i in self.plugin_manager.hook.pagedkv_backends.get_hookimpls()
            if i.plugin_name == unique
        ]
        for impl in impls:
            try:
                backends = impl.function()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                where = describe_exception(exc, _object_roots(plugin))
                self._fail(name, distribution, f"pagedkv_backends() raised {where}")
                continue
            if not isinstance(backends, list | tuple):
                self._fail(
                    name,
                    distribution,
                    f"pagedkv_backends() returned {backends!r}, expected a list of "
                    "AttentionBackend subclasses",
                )
                continue
            for cls in backends:
                self._add(cls, name, distribution)

    def _check_hook_names(self, plugin: object, name: str, distribution: str) -> bool:
        """Report hooks with unknown names and hook-like functions pluggy ignores (no
        ``@pagedkv.hookimpl``). False when the plugin implements no hook at all."""
        known = sorted(n for n, c in vars(self.plugin_manager.hook).items() if c.has_spec())
        implemented, reported, mistakes = set(), set(), []
        for caller in self.plugin_manager.get_hookcallers(plugin) or []:
            if caller.has_spec():
                implemented.add(caller.name)
            else:
                reported.add(caller.name)
                mistakes.append(
                    f"{caller.name} is not a pagedkv hook{_did_you_mean(caller.name, known)}"
                )
        for attr in _hook_like_functions(plugin):
            if attr in implemented or attr in reported:
                continue
            hint = "" if attr in known else _did_you_mean(attr, known)
            what = "a pagedkv hook" if attr in known else "named like a pagedkv hook"
            mistakes.append(
                f"function {attr} is {what} but not marked @pagedkv.hookimpl, so it is never "
                f"called{hint}"
            )
        if not implemented:
            detail = "; ".join(mistakes) or f"it defines none of {', '.join(known)}"
            self._fail(name, distribution, f"it registers no pagedkv hook implementation: {detail}")
            return False
        for mistake in mistakes:
            self._warn(PluginWarning(name, distribution, mistake))
        return True

    def _check_allowlist(self, allowed: set[str], installed: set[str]) -> None:
        unknown = sorted(allowed - installed)
        if unknown:
            self._warn(
                PluginWarning(
                    "",
                    "",
                    f"${ALLOWLIST_ENV} names no installed plugin called {', '.join(unknown)} "
                    f"(installed: {', '.join(sorted(installed)) or 'none'})",
                )
            )

    def _add(self, cls: object, plugin: str, distribution: str) -> None:
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            self._fail(
                plugin,
                distribution,
                f"pagedkv_backends() returned {cls!r}, not a named AttentionBackend subclass",
            )
            return
        name = getattr(cls, "name", None)
        label = name if isinstance(name, str) and name else f"{cls.__module__}.{cls.__qualname__}"
        problems = _class_problems(cls)
        if problems:
            self._fail(plugin, distribution, "; ".join(problems), backend=label)
            return
        entry = _Entry(cls, plugin, distribution, cls.name, cls.priority)
        claimants = self._claimants.setdefault(entry.name, [])
        if any(c.cls is cls for c in claimants):
            return  # the same class given twice (one distribution seen twice on sys.path)
        claimants.append(entry)
        if len(claimants) == 1:
            self.entries[entry.name] = entry
            return
        self.entries.pop(entry.name, None)
        self._warn_load(self._conflict(entry.name))

    def _conflict(self, name: str) -> PluginFailure:
        claimants = self._claimants[name]
        by = " and ".join(f"plugin {c.plugin!r} of {c.distribution}" for c in claimants)
        return PluginFailure(
            ", ".join(c.plugin for c in claimants),
            " and ".join(c.distribution for c in claimants),
            f"backend name {name!r} is claimed by {by}: "
            f"{'neither' if len(claimants) == 2 else 'none of them'} is used; uninstall all "
            f"but one, or choose one with ${ALLOWLIST_ENV}",
            backend=name,
            conflict=True,
        )

    def _fail(self, plugin: str, distribution: str, error: str, backend: str = "") -> None:
        failure = PluginFailure(plugin, distribution, error, backend)
        self._failures.append(failure)
        self._warn_load(failure)

    def _warn(self, warning: PluginWarning) -> None:
        self.warnings.append(warning)
        warnings.warn(str(warning), PluginLoadWarning, stacklevel=4)

    @staticmethod
    def _warn_load(failure: PluginFailure) -> None:
        warnings.warn(f"pagedkv {failure}", PluginLoadWarning, stacklevel=4)

    # -- queries ------------------------------------------------------------------

    @property
    def failures(self) -> list[PluginFailure]:
        """Every plugin and backend name that cannot be used, with the reason."""
        conflicts = [self._conflict(n) for n, c in self._claimants.items() if len(c) > 1]
        return self._failures + conflicts

    def names(self) -> list[str]:
        return sorted(self.entries)

    def by_priority(self) -> list[_Entry]:
        """The usable backends in ``auto`` order: higher priority first, then by name."""
        return sorted(self.entries.values(), key=lambda e: (-e.priority, e.name))

    def backend_class(self, name: str) -> type[AttentionBackend]:
        """The class registered as ``name`` (``split``: the phase-split composite).

        Raises DuplicateBackendError for a name two plugins claim, PagedKVError with
        the reason for another name that is registered but unusable,
        UnknownBackendError (with the known names) for any other."""
        if name == PHASE_SPLIT:  # a composite of two registered backends, not a plugin
            from pagedkv.phase_split import PhaseSplitBackend

            return PhaseSplitBackend
        entry = self.entries.get(name)
        if entry is None:
            failure = self.failure_for(name)
            if failure is not None and failure.conflict:
                raise DuplicateBackendError(str(failure))
            if failure is not None:
                raise PagedKVError(
                    str(failure)
                    if failure.backend
                    else f"backend {name!r} is unavailable: {failure}"
                )
            raise UnknownBackendError(name, self.entries)
        return entry.cls

    def failure_for(self, name: str) -> PluginFailure | None:
        """Why ``name`` (a backend, or a plugin that failed as a whole) is unusable; a
        backend's own failure first, where a plugin has the same name."""
        failures = self.failures
        return next((f for f in failures if f.backend == name), None) or next(
            (f for f in failures if f.name == name), None
        )

    def create(self, name: str, /, **options: Any) -> AttentionBackend:
        """The backend ``name`` configured with ``options``.

        The options are checked against the backend's declared ``option_specs``
        before its constructor runs: a key it does not declare (``self`` included)
        or a value out of range raises ConfigError."""
        cls = self.backend_class(name)
        parse_options(name, cls.option_specs, options)
        return cls(**options)

    def records(self) -> list[BackendRecord]:
        out = [self._record(entry) for _, entry in sorted(self.entries.items())]
        out += [
            BackendRecord(f.name, False, f.reason, "?", None, f.distribution, f.plugin)
            for f in self.failures
        ]
        return out

    def _record(self, entry: _Entry) -> BackendRecord:
        try:
            backend = entry.cls()
        except Exception as exc:
            backend, available = None, False
            reason = f"constructing it raised {describe_exception(exc)}"
        else:
            available, reason, _ = availability(backend)
        # declarations may be properties of the instance: read them from it when there is one
        source = entry.cls if backend is None else backend
        try:
            caps = source.capabilities
            described, notes = caps.describe(), tuple(str(n) for n in caps.notes)
        except Exception as exc:
            described, notes = None, ()
            if available:
                available = False
                reason = f"its capabilities cannot be described: {describe_exception(exc)}"
        try:
            layout = str(source.layout)
        except Exception:
            layout = "?"
        return BackendRecord(
            entry.name,
            available,
            reason,
            layout,
            described,
            entry.distribution,
            entry.plugin,
            entry.priority,
            notes,
            tuple(str(w) for w in self.warnings if w.plugin == entry.plugin),
        )


class Availability(NamedTuple):
    available: bool
    reason: str  # why not ("" when available)
    misbehaved: bool = False  # is_available() raised or answered ill-typed


def availability(backend: AttentionBackend) -> Availability:
    """``backend.is_available()``, with an exception or an ill-typed answer turned into
    "unavailable" with what went wrong."""
    try:
        answer = backend.is_available()
    except Exception as exc:
        return Availability(False, f"is_available() raised {describe_exception(exc)}", True)
    if not (
        isinstance(answer, tuple)
        and len(answer) == 2
        and isinstance(answer[0], bool)
        and isinstance(answer[1], str)
    ):
        return Availability(
            False, f"is_available() returned {answer!r}, expected (bool, str)", True
        )
    available, reason = answer
    return Availability(available, "" if available else (reason or "unavailable (no reason given)"))


def _class_problems(cls: type[AttentionBackend]) -> list[str]:
    """Why a class cannot be registered as a backend (empty: it can)."""
    out = []
    problem = name_problem(getattr(cls, "name", None))
    if problem:
        out.append(problem)
    priority = getattr(cls, "priority", None)
    if not isinstance(priority, int) or isinstance(priority, bool):
        out.append(f"priority must be an int, got {priority!r}")
    caps = inspect.getattr_static(cls, "capabilities", None)
    if not isinstance(caps, Capabilities | property):  # a property: chosen per instance
        shown = "nothing (no such attribute)" if caps is None else repr(caps)
        out.append(f"capabilities must be a pagedkv.Capabilities, got {shown}")
    specs = getattr(cls, "option_specs", None)
    if not isinstance(specs, Mapping) or not all(
        isinstance(v, BackendOption) and not name_problem(k, "option name")
        for k, v in specs.items()
    ):
        out.append(
            "option_specs must map option names (config-string names) to BackendOption, "
            f"got {specs!r}"
        )
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        out.append(f"abstract methods not implemented: {', '.join(abstract)}")
    return out


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else f" (pagedkv hooks: {', '.join(known)})"


def _hook_like_functions(plugin: object) -> list[str]:
    """Names of the plugin's functions named ``pagedkv_*``: each should be a marked hook."""
    out = []
    for attr in dir(plugin):
        if not attr.startswith(HOOK_PREFIX):
            continue
        value = inspect.getattr_static(plugin, attr, None)
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if inspect.isfunction(value):
            out.append(attr)
    return out


def _new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _distribution_of(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "(unknown distribution)"


def describe_exception(exc: BaseException, roots: Iterable[Path] = ()) -> str:
    """``"Type: message (at file:line)"``: the deepest frame inside ``roots`` (a
    plugin's own files) when there is one, so that an error raised inside the
    standard library or a dependency points at the plugin line that called it."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if not frames:
        return text
    last = frames[-1]
    roots = [r.resolve() for r in roots]
    own = [f for f in frames if roots and _is_under(f.filename, roots)]
    if own and own[-1] is not last:
        mine = own[-1]
        return (
            f"{text} (at {mine.filename}:{mine.lineno}, in the plugin; raised in "
            f"{last.filename}:{last.lineno})"
        )
    return f"{text} (at {last.filename}:{last.lineno})"


def _is_under(filename: str, roots: list[Path]) -> bool:
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return False
    return any(path == root or root in path.parents for root in roots)


def _module_roots(module: str) -> list[Path]:
    """The files of module ``module`` and of its top-level package, found without running
    any of their code (their import may be what failed)."""
    top = module.split(".")[0]
    names = [top]
    if module != top and module.rpartition(".")[0] in sys.modules:
        names.append(module)  # its parent is imported: finding it imports nothing
    out = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except Exception:
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            out += [Path(p) for p in spec.submodule_search_locations]
        elif spec.origin and spec.has_location:
            out.append(Path(spec.origin))
    return out


def _object_roots(plugin: object) -> list[Path]:
    module = plugin.__name__ if inspect.ismodule(plugin) else type(plugin).__module__
    return _module_roots(module)


# The process-wide registry. The lock is reentrant so that a plugin which calls back
# into the registry while it loads gets an error instead of a deadlock.
_lock = threading.RLock()
_registry: Registry | None = None
_loading: Registry | None = None  # set while this process loads the registry


def get_registry(*, reload: bool = False) -> Registry:
    """The process-wide registry, loaded from entry points on first use.

    Raises RegistryReentryError when called from a plugin while the registry loads
    (its import or its ``pagedkv_backends`` hook)."""
    global _registry, _loading
    with _lock:
        _refuse_reentry()
        if _registry is None or reload:
            registry = Registry()
            raw = os.environ.get(ALLOWLIST_ENV)
            allowlist = None if raw is None else [n.strip() for n in raw.split(",") if n.strip()]
            _loading = registry
            try:
                registry.load_entry_points(allowlist)
            finally:
                _loading = None
            _registry = registry
        return _registry


def _refuse_reentry() -> None:
    # Other threads wait on the lock while one loads: only the loading thread itself,
    # from inside a plugin, gets here with _loading set.
    if _loading is not None:
        raise RegistryReentryError(
            f"the pagedkv registry was used while it loads its plugins (by plugin "
            f"{_loading.loading_plugin!r}): a plugin's import and its pagedkv_backends hook "
            "must not call pagedkv.get_backend(), list_backends(), select_backend() or "
            "get_registry(); look backends up when they are used, not while registering"
        )


def reset_registry() -> None:
    """Forget the loaded registry; the next use reloads it. Mainly used for testing."""
    global _registry
    with _lock:
        _refuse_reentry()
        _registry = None


def list_backends() -> list[BackendRecord]:
    """Every registered backend, plus a record per plugin or backend that cannot be used."""
    return get_registry().records()


def get_backend(name: str, /, **options: Any) -> AttentionBackend:
    """The backend called ``name``, configured with ``options``.

    Raises UnknownBackendError (listing the known names and the closest) for an
    unknown name, PagedKVError with the reason for a registered but unusable one,
    ConfigError for an option the backend does not declare or a bad value.
    """
    return get_registry().create(name, **options)
