"""One store call as a value: `StoreResult` (its answers and the failures it met), `Call`
(its strictness, handed down to the helpers that do its work), `each` (a per-key method run
as one call), and the logs that keep a failing store from flooding a server's log."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from jaxkv._checks import bool_arg

# Library logging: silent unless the application configures the "jaxkv" logger.
log = logging.getLogger("jaxkv")
log.addHandler(logging.NullHandler())

T = TypeVar("T")
Item = TypeVar("Item")


@dataclasses.dataclass(frozen=True)
class StoreResult(Generic[T]):
    """What one store call did: its answer and the I/O failures it met, as a value.

    Attributes:
        values: one answer per key or record (`contains_many`: a bool per key, `get_many`:
            a record or `None` per key, `put_many`: a bool per record, `discard_many`: a bool
            per key). A strict call that stopped at a failure answers a miss
            (`False`, `None`) for every key or record it did not reach.
        errors: the failures of the call's own work, in order, each an `OSError` the store
            already counted in `io_errors` and logged. A lenient call went on past each (a
            miss, a dropped write); a strict one stopped at its first, so it has at most one.
            Upkeep after the call's work succeeded (a disk store's evictions) is not the
            call's work: its failures are counted and logged, never listed.
    """

    values: T
    errors: tuple[OSError, ...] = ()

    def answer(self, strict: bool) -> T:
        """`values`; when `strict`, the first error is raised instead (as a single-key method
        of a strict store does)."""
        if strict and self.errors:
            raise self.errors[0]
        return self.values


def batch_result(answer):
    """A batch's answer as a `StoreResult`: a store whose batch returns a plain list or tuple
    (one answer per key or record, as batches returned before they reported failures) answered
    those values and reported no failure. Anything else is returned as it is, for the caller
    to check."""
    if isinstance(answer, (list, tuple)):
        return StoreResult(list(answer))
    return answer


class _Stop(Exception):
    """Ends a strict call at its first failure. Raised by `BlockStore._failed` and caught by
    the `Call` the failure belongs to (the failure itself is in `Call.errors`): it never
    leaves the store."""


class Call:
    """One store call's strictness and the failures it met, handed down to the helpers that
    do its work (`BlockStore._failed` notes each failure here).

    Used as `with Call(strict) as call: ...`, which ends the block quietly when a strict call
    stops; `call.result(values)` then reports what was done.
    """

    def __init__(self, strict: bool):
        self.strict = bool_arg("strict", strict)
        self.errors: list[OSError] = []

    def __enter__(self) -> Call:
        return self

    def __exit__(self, kind, err, tb) -> bool:
        return kind is not None and issubclass(kind, _Stop)

    def fail(self, err: OSError) -> None:
        """Lists one failure of this call (already counted and logged); a strict call stops
        here."""
        self.errors.append(err)
        if self.strict:
            raise _Stop

    def absorb(self, result: StoreResult[T]) -> T:
        """The values of a call this one made (a tier's), whose failures become this call's:
        a strict call stops at them."""
        result = batch_result(result)
        self.errors += result.errors
        if self.strict and result.errors:
            raise _Stop
        return result.values

    def result(self, values: T) -> StoreResult[T]:
        return StoreResult(values, tuple(self.errors))


def upkeep() -> Call:
    """A call for upkeep after a call's own work succeeded (a rescan, evictions): its
    failures are counted and logged, never raised, and belong to no caller."""
    return Call(False)


class Loan(Protocol):
    """Memory a store lent (`BlockStore.lend`)."""

    def release(self) -> None:
        """Gives back whatever of the loan no `put` kept."""


class FailureLog:
    """Counts failures per class and logs one warning line per class at its 1st, 2nd, 4th,
    8th... occurrence, with the count so far: a failing disk cannot flood the log."""

    def __init__(self, owner: str):
        self.owner = owner
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def note(self, kind: str, err: BaseException) -> None:
        with self._lock:
            self.counts[kind] += 1
            n = self.counts[kind]
        if n & (n - 1) == 0:
            log.warning("%s: %s failed (%d so far): %s", self.owner, kind, n, err)


# Keys a DamageLog remembers having logged (beyond them the oldest is logged again).
_LOGGED_KEYS = 4096


class DamageLog:
    """Logs each damaged or refused record at WARNING, once per key (a bounded memory of the
    keys logged): the key, who found it (`owner`), what failed and what was done, so that a
    server's log says why a block was recomputed."""

    def __init__(self, owner: str):
        self.owner = owner
        self._logged: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def note(self, key: str, why: str, done: str) -> None:
        with self._lock:
            if key in self._logged:
                return
            self._logged[key] = None
            if len(self._logged) > _LOGGED_KEYS:
                self._logged.popitem(last=False)
        log.warning("%s: the record of key %s %s; %s", self.owner, key, why, done)


def each(
    one: Callable[[Item, Call], T],
    items: Sequence[Item],
    missing: T,
    *,
    stop_at_miss: bool = False,
    strict: bool,
) -> StoreResult[list[T]]:
    """`one(item, call)` for every item, in order, as one call: it stops at the first failure
    when `strict`, and at the first falsy answer with `stop_at_miss`; every item it did not
    reach answers `missing`.

    Raises:
        TypeError: a `stop_at_miss` or `strict` that is not a bool.
    """
    stop_at_miss = bool_arg("stop_at_miss", stop_at_miss)
    answers = [missing] * len(items)
    with Call(strict) as call:
        for i, item in enumerate(items):
            answers[i] = one(item, call)
            if stop_at_miss and not answers[i]:
                break
    return call.result(answers)
