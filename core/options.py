"""Backend options: the ``key=value`` pairs of a config string such as ``triton(num_splits=4)``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.errors import ConfigError

OptionValue = str | int | float | bool


@dataclass(frozen=True)
class BackendOption:
    """One ``key=value`` a backend accepts in a config string.

    ``kind`` is str, int, float or bool; a config string's text is converted to it.
    ``minimum``/``maximum`` (inclusive, int and float options) bound the value;
    ``choices`` lists every accepted value. ``None`` is accepted where it is the
    default (the option is unset).
    """

    default: OptionValue | None
    help: str
    choices: tuple[OptionValue, ...] | None = None
    kind: type = str
    minimum: int | float | None = None
    maximum: int | float | None = None

    def parse(self, key: str, raw: OptionValue | None) -> OptionValue | None:
        """``raw`` (config-string text, or a value of ``kind``) as a checked value of ``kind``.

        Raises ConfigError naming the option, the value and what was expected.
        """
        if raw is None and self.default is None:
            return None  # explicitly unset
        value = self._convert(key, raw)
        if self.choices is not None and value not in self.choices:
            raise ConfigError(
                f"option {key}={value!r}: expected one of {', '.join(map(str, self.choices))}"
            )
        low, high = self.minimum, self.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            raise ConfigError(f"option {key}={value!r}: expected {self.describe_range()}")
        return value

    def describe_range(self) -> str:
        """``"0 to 64"``, ``">= 1"``, ``"<= 8"`` ("" when unbounded)."""
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            return f"{low} to {high}"
        if low is not None:
            return f">= {low}"
        return "" if high is None else f"<= {high}"

    def _convert(self, key: str, raw: OptionValue) -> OptionValue:
        kind = self.kind
        if isinstance(raw, str) and kind is not str:
            try:
                value = _BOOLS[raw.lower()] if kind is bool else kind(raw)
            except (ValueError, KeyError):
                raise ConfigError(f"option {key}={raw!r}: expected {_a(kind)}") from None
        elif _is_kind(raw, kind):
            value = raw
        else:
            raise ConfigError(
                f"option {key}={raw!r}: expected {_a(kind)}, got {type(raw).__name__}"
            )
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"option {key}={raw!r}: expected a finite float")
        return value


def parse_options(
    backend: str, specs: Mapping[str, BackendOption], given: Mapping[str, OptionValue]
) -> dict[str, OptionValue | None]:
    """Every option of a backend: the defaults of ``specs`` overridden by ``given``,
    each converted and checked.

    Raises ConfigError for a key the backend does not declare (naming the accepted
    ones) or a bad value.
    """
    unknown = sorted(set(given) - set(specs))
    if unknown:
        accepted = ", ".join(sorted(specs)) or "none"
        raise ConfigError(
            f"{backend}: unknown option(s) {', '.join(unknown)} (accepted: {accepted})"
        )
    resolved = {key: spec.default for key, spec in specs.items()}
    resolved.update({key: specs[key].parse(key, value) for key, value in given.items()})
    return resolved


def _is_kind(value: object, kind: type) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _a(kind: type) -> str:
    return f"{'an' if kind is int else 'a'} {kind.__name__}"


_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}
