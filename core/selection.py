"""Backend selection: the first candidate of a config string that is available here
and supports the layer (the grammar of config strings is in ``pagedkv.config``).

A backend that misbehaves while being asked (its constructor, ``is_available()`` or
``validate()`` raises, or answers with the wrong types) is skipped like an
unavailable one, with what went wrong as its reason: one broken third-party
backend never stops the others from being selected.
"""

from __future__ import annotations

import warnings

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.config import AUTO, BackendChoice, default_config, parse_config
from pagedkv.errors import ConfigError, NoUsableBackendError
from pagedkv.registry import (
    BackendErrorWarning,
    Registry,
    availability,
    describe_exception,
    get_registry,
)
from pagedkv.spec import AttentionSpec

__all__ = ["BackendChoice", "default_config", "parse_config", "select_backend"]


def select_backend(
    config: str | None,
    spec: AttentionSpec,
    device: torch.device | str | None = None,
    *,
    registry: Registry | None = None,
) -> AttentionBackend:
    """The first backend of ``config`` that is available and supports ``spec`` on ``device``.

    config: a preference list; None uses $PAGEDKV_BACKEND, else "auto".
    Returns the backend configured with its options. Raises UnknownBackendError
    for a name nobody registered, ConfigError for a malformed string or an option
    the backend does not declare or accept, and NoUsableBackendError (with every
    candidate's reasons) when none fits.
    """
    config = default_config() if config is None else config
    registry = registry or get_registry()
    reasons: dict[str, list[str]] = {}
    for choice in parse_config(config):
        if choice.name == AUTO:
            candidates = [
                BackendChoice(e.name) for e in registry.by_priority() if e.name not in reasons
            ]
            for failure in registry.failures:
                reasons.setdefault(failure.name, [failure.reason])
        else:
            candidates = [choice]
        for candidate in candidates:
            failure = registry.failure_for(candidate.name)
            if candidate.name not in registry.entries and failure is not None:
                reasons[candidate.name] = [failure.reason]
                continue
            backend, problems = _configure_and_check(registry, candidate, spec, device)
            if backend is not None and not problems:
                return backend
            reasons[str(candidate)] = problems
    raise NoUsableBackendError(config, reasons)


def _configure_and_check(
    registry: Registry,
    choice: BackendChoice,
    spec: AttentionSpec,
    device: torch.device | str | None,
) -> tuple[AttentionBackend | None, list[str]]:
    """The configured backend and every reason it cannot run ``spec`` here (empty:
    it can). A backend that raises or answers ill-typed gets that as its reason."""
    registry.backend_class(choice.name)  # an unknown name is the caller's error: raise
    try:
        backend = registry.create(choice.name, **choice.options)
    except Exception as exc:
        if isinstance(exc, ConfigError) and choice.options:
            raise  # the options the caller wrote are wrong
        return None, _misbehaved(choice, f"constructing it raised {describe_exception(exc)}")
    answer = availability(backend)
    if answer.misbehaved:
        return backend, _misbehaved(choice, answer.reason)
    if not answer.available:
        return backend, [answer.reason]
    try:
        problems = backend.validate(spec, device)
    except Exception as exc:
        return backend, _misbehaved(choice, f"validate() raised {describe_exception(exc)}")
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        return backend, _misbehaved(
            choice, f"validate() returned {problems!r}, expected a list of str"
        )
    return backend, problems


def _misbehaved(choice: BackendChoice, reason: str) -> list[str]:
    warnings.warn(f"backend {str(choice)!r} skipped: {reason}", BackendErrorWarning, stacklevel=4)
    return [reason]
