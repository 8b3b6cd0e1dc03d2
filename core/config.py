"""Config strings: ``"flashinfer(kv_layout=HND),triton,auto"``.

A config is a preference list. Each entry is a backend name, optionally with
``(key=value, ...)`` options for it; ``auto`` stands for every registered backend by
descending priority. This module holds the grammar only (no torch import): backend
names are checked against it at registration, so every registered name can be
written in a config string.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from pagedkv.errors import ConfigError

CONFIG_ENV = "PAGEDKV_BACKEND"
AUTO = "auto"
# Words with a meaning of their own in a config string or on a command line, never
# backend names: `auto` (every backend), `split(decode=..., prefill=...)` (one backend
# per kind of step) and `all` (every backend, for `pagedkv conform --backend all`).
RESERVED_NAMES = frozenset({AUTO, "split", "all"})

NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_BARE_VALUE = re.compile(r"[^,()=\s'\"]+")


def name_problem(name: object, what: str = "backend name") -> str | None:
    """Why ``name`` cannot be a backend name in a config string (None: it can)."""
    if not isinstance(name, str):
        return f"{what} must be a str, got {type(name).__name__} {name!r}"
    if not NAME_PATTERN.fullmatch(name):
        return (
            f"{what} {name!r} cannot be written in a config string (expected a letter or '_' "
            "followed by letters, digits, '_', '.' or '-')"
        )
    if name.lower() in RESERVED_NAMES:
        return f"{what} {name!r} is reserved (reserved: {', '.join(sorted(RESERVED_NAMES))})"
    return None


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
    if not isinstance(config, str):
        raise ConfigError(f"a backend config must be a str, got {type(config).__name__}")
    scanner = _Scanner(config)
    scanner.skip_space()
    if not scanner.peek():
        raise scanner.error("expected a backend name (the config is empty)")
    choices: list[BackendChoice] = []
    while True:
        name_pos = scanner.pos
        name = scanner.match(NAME_PATTERN, "expected a backend name")
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
                    key = scanner.match(NAME_PATTERN, "expected an option name")
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
    """$PAGEDKV_BACKEND, else "auto"."""
    return os.environ.get(CONFIG_ENV) or AUTO
