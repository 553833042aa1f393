"""What the connector accepts from a store: results and answers of the right type and length,
and records that are the blocks their keys name. Anything else is the store failing (an
answer) or a miss (a record), never data."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxkv._checks import is_int
from jaxkv.connector import _hashing
from jaxkv.connector._records import BlockRecord
from jaxkv.connector.stores import StoreResult, batch_result
from jaxkv.errors import StoreReplyError


def block_fault(
    record: BlockRecord, key: str, block_tokens: bytes, fingerprint: str, want
) -> str | None:
    """None when `record` is the block that `key` names: that key, the layout `fingerprint`,
    the digest of `block_tokens`, and exactly the parts of `want` (part key -> (shape,
    dtype)), each a numpy array of that shape and dtype; else what it is instead. Whatever
    the store handed back, a record that is anything else (or that breaks these checks by
    raising) is not that block."""
    try:
        if record.key != key:
            return f"names key {record.key!r:.80}"
        if record.layout != fingerprint:
            return f"has layout {record.layout!r:.80}, expected {fingerprint!r}"
        if record.tokens != _hashing.block_digest(block_tokens):
            return "holds other token ids than its key names"
        parts = record.parts
        if not isinstance(parts, Mapping) or parts.keys() != want.keys():
            names = sorted(parts) if isinstance(parts, Mapping) else type(parts).__name__
            return f"has parts {names!r:.200}, expected {sorted(want)}"
        for name, (shape, dtype) in want.items():
            arr = parts[name]
            if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != dtype:
                shape_got, dtype_got = getattr(arr, "shape", ""), getattr(arr, "dtype", "")
                got = f"{type(arr).__name__} {shape_got} {dtype_got}"
                return f"has part {name!r} {got}, expected ndarray {shape} {np.dtype(dtype)}"
        return None
    except Exception as err:
        return f"cannot be checked ({type(err).__name__}: {err})"


def is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_))


def is_record_or_none(value) -> bool:
    return value is None or isinstance(value, BlockRecord)


def store_result(answer) -> StoreResult:
    """`answer` when it is a `StoreResult` whose `errors` is a tuple of `OSError`s (what the
    batches return), or a plain list or tuple of answers (`batch_result`: no failures
    reported); else `StoreReplyError` saying what came instead."""
    answer = batch_result(answer)
    if not isinstance(answer, StoreResult):
        raise StoreReplyError(f"expected a StoreResult, got {type(answer).__name__}")
    errors = answer.errors
    if not isinstance(errors, tuple) or not all(isinstance(e, OSError) for e in errors):
        raise StoreReplyError(
            f"expected StoreResult.errors to be a tuple of OSErrors, got {errors!r:.200}"
        )
    return answer


def answers(answer, n: int, ok, what: str) -> list:
    """`answer` as a list when it is a list or tuple of `n` entries that each pass `ok`; else
    `StoreReplyError` saying what came instead."""
    if not isinstance(answer, (list, tuple)):
        raise StoreReplyError(f"expected a list of {n} {what}, got {type(answer).__name__}")
    if len(answer) != n:
        raise StoreReplyError(f"expected a list of {n} {what}, got {len(answer)} entries")
    for i, value in enumerate(answer):
        if not ok(value):
            raise StoreReplyError(f"expected {what}, got {type(value).__name__} at [{i}]")
    return list(answer)


def stats_dict(answer) -> dict:
    if not isinstance(answer, Mapping):
        raise StoreReplyError(f"expected a dict of counters, got {type(answer).__name__}")
    return dict(answer)


def count_of(stats: dict, name: str) -> int:
    """A store counter as an int; one that is not an int (a store's bug) counts as 0."""
    value = stats.get(name, 0)
    return int(value) if is_int(value) else 0
