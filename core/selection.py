"""Config strings and backend selection.

A config is a preference list: ``"flashinfer(kv_layout=HND),triton,auto"``. Each
entry is a backend name, optionally with ``(key=value, ...)`` options for it;
``auto`` stands for every registered backend by descending priority. The first
candidate that is available here and supports the layer wins.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from pagedkv.backend import AttentionBackend
from pagedkv.errors import ConfigError, NoUsableBackendError
from pagedkv.registry import Registry, get_registry
from pagedkv.spec import AttentionSpec

CONFIG_ENV = "PAGEDKV_BACKEND"
AUTO = "auto"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_BARE_VALUE = re.compile(r"[^,()=\s'\"]+")


@dataclass(frozen=True)
class BackendChoice:
    """One entry of a config string."""

    name: str
    options: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.options:
            return self.name
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.options.items())})"


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, message: str, pos: int | None = None) -> ConfigError:
        pos = self.pos if pos is None else pos
        found = repr(self.text[pos]) if pos < len(self.text) else "end of string"
        return ConfigError(
            f"malformed backend config at character {pos + 1}: {message} (found {found})\n"
            f"  {self.text}\n  {' ' * pos}^"
        )

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, char: str, what: str) -> None:
        self.skip_space()
        if self.peek() != char:
            raise self.error(what)
        self.pos += 1

    def match(self, pattern: re.Pattern[str], what: str) -> str:
        self.skip_space()
        m = pattern.match(self.text, self.pos)
        if not m:
            raise self.error(what)
        self.pos = m.end()
        return m.group()

    def value(self) -> str:
        self.skip_space()
        quote = self.peek()
        if quote in ("'", '"'):
            end = self.text.find(quote, self.pos + 1)
            if end < 0:
                raise self.error(f"unterminated {quote} string")
            raw = self.text[self.pos + 1 : end]
            self.pos = end + 1
            return raw
        return self.match(_BARE_VALUE, "expected an option value")


def parse_config(config: str) -> list[BackendChoice]:
    """Parse ``"name(key=value, ...), name, auto"`` into choices, in order.

    Raises ConfigError pointing at the offending character.
    """
    scanner = _Scanner(config)
    scanner.skip_space()
    if not scanner.peek():
        raise scanner.error("expected a backend name (the config is empty)")
    choices: list[BackendChoice] = []
    while True:
        name_pos = scanner.pos
        name = scanner.match(_NAME, "expected a backend name")
        options: dict[str, str] = {}
        scanner.skip_space()
        if scanner.peek() == "(":
            if name == AUTO:
                raise scanner.error("'auto' takes no options")
            scanner.pos += 1
            scanner.skip_space()
            if scanner.peek() != ")":
                while True:
                    key_pos = scanner.pos
                    key = scanner.match(_NAME, "expected an option name")
                    if key in options:
                        raise scanner.error(f"option {key!r} given twice", key_pos)
                    scanner.expect("=", f"expected '=' after option name {key!r}")
                    options[key] = scanner.value()
                    scanner.skip_space()
                    if scanner.peek() != ",":
                        break
                    scanner.pos += 1
            scanner.expect(")", "expected ',' or ')' in the option list")
        if any(c.name == name for c in choices) and name != AUTO:
            raise scanner.error(f"backend {name!r} listed twice", name_pos)
        choices.append(BackendChoice(name, options))
        scanner.skip_space()
        if not scanner.peek():
            return choices
        scanner.expect(",", "expected ',' between backends")


def default_config() -> str:
    return os.environ.get(CONFIG_ENV) or AUTO


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
    for a name nobody registered, ConfigError for a malformed string or option,
    and NoUsableBackendError (with every candidate's reasons) when none fits.
    """
    config = default_config() if config is None else config
    registry = registry or get_registry()
    reasons: dict[str, list[str]] = {}
    for choice in parse_config(config):
        if choice.name == AUTO:
            by_priority = sorted(
                registry.entries.values(), key=lambda e: (-e.cls.priority, e.cls.name)
            )
            candidates = [
                BackendChoice(e.cls.name) for e in by_priority if e.cls.name not in reasons
            ]
            for failure in registry.failures:
                reasons.setdefault(failure.plugin, [f"plugin failed to load: {failure.error}"])
        else:
            candidates = [choice]
        for candidate in candidates:
            failure = registry.failure_for(candidate.name)
            if candidate.name not in registry.entries and failure is not None:
                reasons[candidate.name] = [f"plugin failed to load: {failure.error}"]
                continue
            backend = registry.create(candidate.name, **candidate.options)
            available, why = backend.is_available()
            problems = [why] if not available else backend.validate(spec, device)
            if not problems:
                return backend
            reasons[str(candidate)] = problems
    raise NoUsableBackendError(config, reasons)
