"""The store interface every store implements: `BlockStore`, the `StoreResult` its calls
report, its counters and failure log.

A store maps block keys to `BlockRecord`s. It is deliberately small (`contains`, `get`, `put`,
`stats`, plus batch forms that default to them) so that a host, disk, remote or tiered store
is a few methods, and every store verifies what it serves: a record that fails a check is a
miss, never data.

Failures travel as values. Each batch method has a `*_result` form that takes the caller's
strictness as an argument and returns a `StoreResult`: the answers and the I/O failures the
call met, each already counted and logged by the store. Whoever starts a call decides its
strictness once: a user calling a plain method gets the store's own `strict`; a `KVConnector`
passes its choice. A strict call stops at its first failure; the caller then raises it.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from jaxkv._checks import bool_arg
from jaxkv.connector._records import BlockRecord
from jaxkv.errors import StoreReplyError

# Library logging: silent unless the application configures the "jaxkv" logger.
log = logging.getLogger("jaxkv")
log.addHandler(logging.NullHandler())

T = TypeVar("T")
Item = TypeVar("Item")


@dataclasses.dataclass(frozen=True)
class StoreResult(Generic[T]):
    """What one store call did: its answer and the I/O failures it met, as a value.

    Attributes:
        values: the answer the plain method gives (`contains_many`: one bool per key,
            `get_many`: one record or `None` per key, `put_many`: one bool per record,
            `discard`: one bool). A strict call that stopped at a failure answers a miss
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
        """`values`; when `strict`, the first error is raised instead (as a plain method
        does)."""
        if strict and self.errors:
            raise self.errors[0]
        return self.values


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

    def absorb(self, result: StoreResult[T]) -> T:
        """The values of a call this one made (a tier's), whose failures become this call's:
        a strict call stops at them."""
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


#: `BlockStore.on_drop` listeners: called with `(key, reason)`.
DropListener = Callable[[str, str], None]

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


_COUNTERS = (
    "hits",
    "misses",
    "blocks_stored",
    "bytes_stored",
    "blocks_loaded",
    "bytes_loaded",
    "verification_failures",
    "evictions",
    "io_errors",
    "rejected",
    "discarded",
    "undiscarded",
)


class BlockStore(abc.ABC):
    """Key -> `BlockRecord`. Implementations are thread-safe.

    A subclass calls `super().__init__()` first and implements `contains`, `get`, `put` and
    `__len__`; optionally `discard` (when it can remove a record) and `lend` (when it can
    hand out memory that `put` then keeps without a copy). The batch methods default to the
    single-key ones, key by key, and each `*_result` method defaults to its batch method.

    Errors: a store that meets I/O failures of its own reports them from its `*_result`
    methods, counted in `io_errors` and logged; its plain methods raise the first one (an
    `OSError`) only when the store is strict, and otherwise answer a miss or a dropped write.
    A store may raise `ValueError` for a key it cannot name (`DiskStore`: not 64 lowercase
    hex digits). An exception a store's method raises instead of reporting it (a store that
    does not override the `*_result` methods) ends that call; the caller counts it.

    Whatever `contains` reports held, a `get` of it either returns the verified record or
    finds it damaged and removes it then (so that `contains` stops reporting it and the next
    `put` rewrites it): `contains` may check less than `get` (a checksum is verified only on
    reads), never promise what `get` would keep refusing.
    """

    _strict = False

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._bytes = 0
        self._failures = FailureLog(type(self).__name__)
        self._drop_listeners: tuple[DropListener, ...] = ()
        self._damage_log = DamageLog(type(self).__name__)

    # ---- drops ---------------------------------------------------------------------------

    def on_drop(self, listener: DropListener) -> Callable[[], None]:
        """Calls `listener(key, reason)` whenever this store stops holding a record it held:
        `reason` is `"evicted"` (removed to stay within the capacity), `"damaged"` (found
        failing its checks on a read, and removed) or `"discarded"` (removed by `discard`).

        A cache of "what the store holds" (the sglang-jax tier's memory of the keys it wrote)
        forgets a key here, so that the next write of the block stores it again. Listeners
        run on the thread that dropped the record, possibly under the store's lock: they must
        be quick and must not call the store. A listener that raises is logged and ignored.
        Only drops this store makes are reported: a record another process removed, or a
        Redis server evicted on its own, is seen by whoever next reads it (a miss).

        Args:
            listener: a callable taking `(key, reason)`.

        Returns:
            A callable that removes the listener (calling it twice is harmless).

        Raises:
            TypeError: a `listener` that is not callable.
        """
        if not callable(listener):
            raise TypeError(f"listener: expected a callable, got {type(listener).__name__}")
        with self._lock:
            self._drop_listeners += (listener,)

        def remove() -> None:
            with self._lock:
                self._drop_listeners = tuple(f for f in self._drop_listeners if f is not listener)

        return remove

    def _dropped(self, keys: Sequence[str], reason: str, detail: str = "") -> None:
        """Reports records this store no longer holds to its `on_drop` listeners; a damaged
        record is also logged (once per key) at WARNING with `detail` saying what failed."""
        if reason == "damaged":
            for key in keys:
                self._damage_log.note(key, detail or "failed its checks", "removed")
        self._tell_drop_listeners(keys, reason)

    def _tell_drop_listeners(self, keys: Sequence[str], reason: str) -> None:
        listeners = self._drop_listeners  # one read: a listener added meanwhile waits
        for listener in listeners:
            for key in keys:
                try:
                    listener(key, reason)
                except Exception as err:
                    self._failures.note("drop listener", err)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    @property
    def strict(self) -> bool:
        """Whether the plain methods raise I/O errors (after counting and logging them)
        instead of turning them into a miss or a dropped write. A `KVConnector` calling the
        store is strict when it or the store is, and passes that to the `*_result` methods.
        Set it to a bool; anything else raises `TypeError` (a flag is never taken from
        truthiness: `"no"` would turn it on)."""
        return self._strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self._strict = bool_arg("strict", value)

    def _failed(self, kind: str, err: OSError, call: Call) -> None:
        """Counts and logs one I/O failure of class `kind` (read, write, evict, scan...) met
        by `call`, which lists it; a strict call stops here."""
        self._count("io_errors")
        self._failures.note(kind, err)
        call.errors.append(err)
        if call.strict:
            raise _Stop

    def stats(self) -> dict[str, int]:
        """Counters, each with one meaning:

        - `hits`, `misses`: `get` calls that returned a record, or `None` (for any reason).
        - `blocks_stored`, `bytes_stored`: records newly written by `put` (bytes of their
          arrays); `blocks_loaded`, `bytes_loaded`: records returned by `get`.
        - `verification_failures`: records found damaged (each is dropped and is a miss).
        - `evictions`: records removed to stay within the capacity.
        - `io_errors`: failed file or network operations (each also a miss or a dropped
          write, unless the call was strict).
        - `rejected`: records refused because they cannot fit.
        - `discarded`: records removed by `discard` (a caller found them wrong);
          `undiscarded`: `discard` calls for records this store cannot remove.
        - `blocks`, `bytes`: what the store holds now.

        Returns:
            A new dict of the counters (ints); stores add their own (see each store).
        """
        with self._lock:
            return {**self._counters, "blocks": len(self), "bytes": self.nbytes}

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether `key` is held (may refresh its recency; changes no data).

        Args:
            key: a block key (64 hex digits, from `KVConnector.block_hashes`).

        Returns:
            `True` when the store holds a record under `key`.

        Raises:
            OSError: the store failed to answer, only when strict.
        """

    @abc.abstractmethod
    def get(self, key: str) -> BlockRecord | None:
        """The verified record of `key`, or `None` (a record failing verification is a miss).

        Args:
            key: a block key.

        Returns:
            The record, read-only, or `None` when absent, damaged or unreadable.

        Raises:
            OSError: the read failed, only when strict.
        """

    @abc.abstractmethod
    def put(self, record: BlockRecord) -> bool:
        """Stores `record`; `False` when it was already held or cannot fit.

        The record's arrays may be views into the connector's staging memory, valid only
        during the call: a store keeps copies (or bytes) of them. The exception is a record
        whose `source` is set: its arrays are a block of a `Segment`, memory the transfer
        produced and nobody writes again, which a store may keep as it is.

        Args:
            record: the block to store, under `record.key`.

        Returns:
            `True` when the record was newly stored; `False` when it was held already, could
            not fit (counted as `rejected`) or failed to write (counted in `io_errors`).

        Raises:
            OSError: the write failed, only when strict.
        """

    @abc.abstractmethod
    def __len__(self) -> int: ...

    # ---- optional ------------------------------------------------------------------------

    def lend(
        self, parts: Mapping[str, tuple[tuple[int, ...], np.dtype]], count: int
    ) -> tuple[list[dict[str, np.ndarray]], Loan] | None:
        """Memory for `count` records the caller fills itself and then `put`s, so that the
        store keeps them without copying. Optional: this default lends nothing (`None`), and
        a store that cannot lend as much right now answers `None` too.

        The connector asks before it copies a CPU pool's blocks to host memory: with a loan,
        the rows go straight into the store's memory and `put` adopts them; without one, it
        copies them into its own staging and `put` copies them again.

        Args:
            parts: the records' parts, name -> (shape, dtype).
            count: how many records.

        Returns:
            None, or `(arrays, loan)`: per record, writable arrays laid out as the store
            keeps them, which `put` keeps without a copy when a record's parts are exactly
            those arrays; `loan.release()` gives back whatever no `put` kept (call it once
            the records were put, or when they never will be).
        """
        return None

    def discard(self, key: str) -> bool:
        """Removes the record held under `key`, if any, because a caller found it wrong: the
        record of another block, another layout or other tokens than its key names (a store
        answered the wrong record), or damaged in a way only the caller can see. Optional:
        this default cannot remove anything; it counts the call in `stats()["undiscarded"]`
        and returns `False`.

        The connector calls it (through `discard_result`) for every record that fails its
        checks, so that `contains` stops promising that record and the next `put` of the
        block writes a good one.

        Args:
            key: the block key the record was fetched for.

        Returns:
            `True` when a record was removed (counted in `stats()["discarded"]`).

        Raises:
            OSError: the removal failed, only when strict.
        """
        self._count("undiscarded")
        return False

    # ---- batches ---------------------------------------------------------------------------
    # The connector asks for all the blocks of a call at once, so that a remote store answers
    # in one round trip. These defaults ask key by key; a store with cheaper batches
    # overrides them and keeps their results.

    def contains_many(self, keys: Sequence[str], *, stop_at_miss: bool = False) -> list[bool]:
        """Per key, whether it is held. With `stop_at_miss`, only the leading run of held keys
        is asked for: every entry from the first miss on is `False`.

        Args:
            keys: block keys, in order.
            stop_at_miss: stop asking at the first key not held (a prefix lookup).

        Returns:
            One bool per key, in order.

        Raises:
            TypeError: a `stop_at_miss` that is not a bool.
            OSError: as `contains`, only when strict.
        """
        stop_at_miss = bool_arg("stop_at_miss", stop_at_miss)
        held = []
        for key in keys:
            held.append(self.contains(key))
            if stop_at_miss and not held[-1]:
                return held + [False] * (len(keys) - len(held))
        return held

    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False
    ) -> list[BlockRecord | None]:
        """Per key, its verified record or `None`. With `stop_at_miss`, only the leading run of
        held keys is read: every entry from the first miss on is `None`.

        Args:
            keys: block keys, in order.
            stop_at_miss: stop reading at the first miss (a prefix load).

        Returns:
            One record or `None` per key, in order.

        Raises:
            TypeError: a `stop_at_miss` that is not a bool.
            OSError: as `get`, only when strict.
        """
        stop_at_miss = bool_arg("stop_at_miss", stop_at_miss)
        records: list[BlockRecord | None] = []
        for key in keys:
            records.append(self.get(key))
            if stop_at_miss and records[-1] is None:
                return records + [None] * (len(keys) - len(records))
        return records

    def put_many(self, records: Sequence[BlockRecord]) -> list[bool]:
        """`put` of each record, in order (the same rules on the records' memory).

        Args:
            records: the blocks to store, in order.

        Returns:
            One bool per record: whether it was newly stored (as `put`).

        Raises:
            OSError: as `put`, only when strict. What an error raised part way leaves
                stored, only `put_many_result` can report (it puts record by record).
        """
        return [self.put(record) for record in records]

    # ---- results ---------------------------------------------------------------------------
    # The connector calls these, passing the strictness it decided; each reports its answer
    # and the failures it met as a `StoreResult` and raises none of them. The defaults call
    # the batch methods above and report no failure: a store whose methods raise leaves
    # them, and its exception reaches the caller, which counts it. A store that meets
    # failures of its own overrides these four (see `ReportingStore`).

    def contains_many_result(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool
    ) -> StoreResult[list[bool]]:
        """`contains_many`, with its failures reported (see `StoreResult`).

        Args:
            keys, stop_at_miss: as `contains_many`.
            strict: stop at the first failure.

        Returns:
            The answers of `contains_many`, and the failures met.
        """
        return StoreResult(self.contains_many(keys, stop_at_miss=stop_at_miss))

    def get_many_result(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool
    ) -> StoreResult[list[BlockRecord | None]]:
        """`get_many`, with its failures reported (see `StoreResult`).

        Args:
            keys, stop_at_miss: as `get_many`.
            strict: stop at the first failure.

        Returns:
            The answers of `get_many`, and the failures met.
        """
        return StoreResult(self.get_many(keys, stop_at_miss=stop_at_miss))

    def put_many_result(
        self, records: Sequence[BlockRecord], *, strict: bool
    ) -> StoreResult[list[bool]]:
        """`put_many`, with its failures reported (see `StoreResult`): a write that fails part
        way still says which records it stored.

        This default puts record by record: a `put` that raises is that record's failure
        (counted in `io_errors` and logged; an exception other than an `OSError` is reported
        as a `StoreReplyError` naming it), never the records' before it, and a lenient call
        goes on with the next record. A store that overrides `put_many` (one batch of its
        own) is called through it instead: an exception it raises ends the call.

        Args:
            records: as `put_many`.
            strict: stop at the first failure.

        Returns:
            The answers of `put_many`, and the failures met.
        """
        if type(self).put_many is not BlockStore.put_many:
            return StoreResult(self.put_many(records))

        def put(record: BlockRecord, call: Call):
            try:
                return self.put(record)
            except OSError as err:
                failure = err
            except Exception as err:
                failure = StoreReplyError(
                    f"{type(self).__name__}.put raised {type(err).__name__}: {err}"
                )
                failure.__cause__ = err
            self._failed("write", failure, call)
            return False

        return each(put, records, False, strict=strict)

    def discard_result(self, key: str, *, strict: bool) -> StoreResult[bool]:
        """`discard`, with its failures reported (see `StoreResult`).

        Args:
            key: as `discard`.
            strict: stop at the first failure.

        Returns:
            The answer of `discard`, and the failures met.
        """
        return StoreResult(self.discard(key))

    @property
    def nbytes(self) -> int:
        """Bytes of the records held now."""
        return self._bytes


class ReportingStore(BlockStore):
    """A `BlockStore` whose work is its `*_result` methods, which report failures as values
    (`DiskStore`, `TieredStore`). Its plain methods call them under the store's own `strict`
    and raise the first failure when it is set.

    A subclass implements `contains_many_result`, `get_many_result`, `put_many_result`,
    `discard_result` and `__len__`; `each` (below) runs a per-key method as one call.
    """

    def _plain(self, run: Callable[[bool], StoreResult[T]]) -> T:
        strict = self.strict  # read once: the call and what it raises agree
        return run(strict).answer(strict)

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def get(self, key: str) -> BlockRecord | None:
        return self.get_many([key])[0]

    def put(self, record: BlockRecord) -> bool:
        return self.put_many([record])[0]

    def discard(self, key: str) -> bool:
        return self._plain(lambda strict: self.discard_result(key, strict=strict))

    def contains_many(self, keys: Sequence[str], *, stop_at_miss: bool = False) -> list[bool]:
        return self._plain(
            lambda strict: self.contains_many_result(keys, stop_at_miss=stop_at_miss, strict=strict)
        )

    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False
    ) -> list[BlockRecord | None]:
        return self._plain(
            lambda strict: self.get_many_result(keys, stop_at_miss=stop_at_miss, strict=strict)
        )

    def put_many(self, records: Sequence[BlockRecord]) -> list[bool]:
        return self._plain(lambda strict: self.put_many_result(records, strict=strict))

    @abc.abstractmethod
    def contains_many_result(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool
    ) -> StoreResult[list[bool]]: ...

    @abc.abstractmethod
    def get_many_result(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool
    ) -> StoreResult[list[BlockRecord | None]]: ...

    @abc.abstractmethod
    def put_many_result(
        self, records: Sequence[BlockRecord], *, strict: bool
    ) -> StoreResult[list[bool]]: ...

    @abc.abstractmethod
    def discard_result(self, key: str, *, strict: bool) -> StoreResult[bool]: ...


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
