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


def token_array(token_ids, name: str = "token_ids") -> np.ndarray:
    """Token ids as a 1-D native-order uint32 array, by value: the one conversion the radix
    cache, the connector's keys and the serving integrations share, so that a prompt is the
    same prefix to all of them whatever its container (a list, numpy or jax array), integer
    dtype or byte order. Ids outside `[0, 2**32)` are refused (`ValueError`), as are
    non-integer ones (`TypeError`).

    Native-order 4-byte ids are viewed, not copied (int32 ids in range are their uint32
    bits); any other dtype or byte order (`>i4`, int64, uint16...) is converted by value.
    """
    arr = int_vector(name, token_ids, "token ids")
    # Only the bounds a dtype can break are read: an unsigned dtype has no negatives, one of
    # 4 bytes or fewer nothing at 2**32 or above. Wide native ids take one pass: read as
    # unsigned, a negative id is at 2**63 or above.
    if not arr.size:
        pass
    elif arr.dtype.itemsize > 4 and arr.dtype.isnative:
        bad = arr.view(f"u{arr.dtype.itemsize}").max() >= 2**32
    else:
        bad = (arr.dtype.kind == "i" and arr.min() < 0) or (
            arr.dtype.itemsize > 4 and arr.max() >= 2**32
        )
    if arr.size and bad:
        raise ValueError(f"{name}: expected ids in [0, 2**32), got [{arr.min()}, {arr.max()}]")
    if arr.dtype.itemsize == 4 and arr.dtype.isnative:
        return arr.view(np.uint32)
    return arr.astype(np.uint32)
