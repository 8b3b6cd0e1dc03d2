"""Backend options: the ``key=value`` pairs of a config string such as ``triton(num_splits=4)``."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import ConfigError

OptionValue = str | int | float | bool


@dataclass(frozen=True)
class BackendOption:
    """One ``key=value`` a backend accepts in a config string."""

    default: OptionValue | None
    help: str
    choices: tuple[OptionValue, ...] | None = None
    kind: type = str

    def parse(self, key: str, raw: OptionValue) -> OptionValue:
        value: OptionValue
        if isinstance(raw, str) and self.kind is not str:
            try:
                value = _BOOLS[raw.lower()] if self.kind is bool else self.kind(raw)
            except (ValueError, KeyError):
                raise ConfigError(
                    f"option {key}={raw!r}: expected a {self.kind.__name__}"
                ) from None
        else:
            value = raw
        if self.choices is not None and value not in self.choices:
            raise ConfigError(
                f"option {key}={value!r}: expected one of {', '.join(map(str, self.choices))}"
            )
        return value


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
