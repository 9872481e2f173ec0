"""Validation of numeric task options: every one finite and in its range, or a one-line error.

NaN compares false with everything, so a plain `x <= 0` check lets it through, and a NaN or
infinite timeout silently zeroes every reward.
"""

from __future__ import annotations

import math


def check_number(task: str, name: str, value: object, low: float, high: float) -> float:
    """A finite real number in [low, high] (booleans are not numbers)."""
    if not _is_real(value) or not low <= value <= high:  # type: ignore[operator]
        raise ValueError(f"{task}: {name} must be a number in [{low:g}, {high:g}] (got {value!r})")
    return float(value)  # type: ignore[arg-type]


def check_positive_seconds(task: str, name: str, value: object, maximum: float = 3600.0) -> float:
    if not _is_real(value) or not 0.0 < value <= maximum:  # type: ignore[operator]
        raise ValueError(f"{task}: {name} must be seconds in (0, {maximum:g}] (got {value!r})")
    return float(value)  # type: ignore[arg-type]


def check_int(task: str, name: str, value: object, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{task}: {name} must be an integer in [{low}, {high}] (got {value!r})")
    return value


def _is_real(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)  # ints are exact, even 10**400
