"""Integer helpers for sizes and grids, in plain Python: Triton's ``triton.cdiv`` and
``triton.next_power_of_2`` are constexpr functions whose host calls cost microseconds,
on the per-step launch path."""

from __future__ import annotations

import numbers


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_power_of_2(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(0, n.bit_length() - 1)


def is_int(value: object) -> bool:
    """An integer (numpy's too), not a bool: ``True`` is an int to Python, never a count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
