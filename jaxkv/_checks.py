"""The argument checks every public constructor and setter shares."""

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


def bool_arg(name: str, value) -> bool:
    """`value` when it is a bool (Python or numpy); else `TypeError` naming `name`.

    Flags are never taken from truthiness: `strict="no"` would otherwise turn strictness on.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool (True or False), got {value!r}")
    return bool(value)


def text_arg(name: str, value) -> str:
    """`value` when it is a str that UTF-8 can encode (keys, salts, namespaces are hashed or
    sent as its UTF-8 bytes); else `TypeError` (not a str) or `ValueError` (a lone surrogate
    such as `"\\ud800"`) naming `name`."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{name}: expected a str UTF-8 can encode, got {value!r} "
            f"({err.reason} at index {err.start})"
        ) from None
    return value


def int_vector(name: str, values, what: str = "ints") -> np.ndarray:
    """`values` as a 1-D numpy array of integers, as given (its own integer dtype; an empty
    sequence included): the one check of slot and token vectors at the public boundary. Else
    `TypeError` (ragged input, non-integer entries) or `ValueError` (not 1-D) naming `name`
    and `what` it holds (e.g. "token ids", "slots")."""
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError) as err:  # ragged nesting and the like
        raise TypeError(f"{name}: expected a 1-D sequence of {what}, got {err}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected shape (n,), got {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer {what}, got dtype {arr.dtype}")
    return arr
