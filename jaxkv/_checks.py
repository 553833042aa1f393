"""The integer argument check every public constructor and setter shares."""

from __future__ import annotations

import numpy as np


def int_arg(name: str, value, *, low: int = 1, high: int | None = None, expected: str = "") -> int:
    """`value` as an int when it is an integer (Python or numpy, never a bool) in
    `[low, high]`; else `ValueError` naming `name`, what was expected and what came.

    `expected` overrides the default wording ("a positive int", "an int >= 0", ...).
    """
    if not expected:
        expected = "a positive int" if low == 1 and high is None else f"an int >= {low}"
        if high is not None:
            expected = f"an int in [{low}, {high}]"
    if not is_int(value) or value < low or (high is not None and value > high):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return int(value)


def is_int(value) -> bool:
    """Whether `value` is an integer (Python or numpy), a bool excluded."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
