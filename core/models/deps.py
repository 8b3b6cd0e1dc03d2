"""The transformers dependency: present, and within the tested range."""

from __future__ import annotations

import warnings
from types import ModuleType

from pagedkv.models.errors import ModelSupportError

# the range pyproject's `models` extra pins and the tests ran on (both ends)
TESTED_RANGE = ((5, 17), (5, 24))


def require_transformers() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ModelSupportError(
            "transformers is not installed: pip install 'pagedkv[models]'"
        ) from None
    version = _major_minor(transformers.__version__)
    low, high = TESTED_RANGE
    if version[0] != low[0] or version < low:
        raise ModelSupportError(
            f"transformers {transformers.__version__} is not supported: pagedkv.models needs "
            f"{low[0]}.x >= {low[0]}.{low[1]} (pip install 'pagedkv[models]')"
        )
    if version > high:
        warnings.warn(
            f"transformers {transformers.__version__} is newer than the range pagedkv.models "
            f"was tested on ({low[0]}.{low[1]} to {high[0]}.{high[1]})",
            stacklevel=2,
        )
    return transformers


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)
