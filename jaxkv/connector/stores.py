"""The store interface every store implements: `BlockStore`, its counters and failure log.

A store maps block keys to `BlockRecord`s. It is deliberately small (`contains`, `get`, `put`,
`stats`, plus batch forms that default to them) so that a host, disk, remote or tiered store
is a few methods, and every store verifies what it serves: a record that fails a check is a
miss, never data.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from jaxkv._checks import bool_arg
from jaxkv.connector._records import BlockRecord

# Library logging: silent unless the application configures the "jaxkv" logger.
log = logging.getLogger("jaxkv")
log.addHandler(logging.NullHandler())

# Set while a strict connector's call runs (per thread): stores then raise their I/O errors.
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxkv_strict", default=False)
# Set while a store tidies up after a call's own work succeeded (a disk store's rescan and
# eviction after a write): a failure there is counted and logged, never raised, since raising
# would report the finished work as failed.
_TIDYING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxkv_tidying", default=False)


@contextlib.contextmanager
def strict_scope(strict: bool) -> Iterator[None]:
    """Makes the stores used inside the block raise their I/O errors when `strict`."""
    token = _STRICT.set(bool_arg("strict", strict) or _STRICT.get())
    try:
        yield
    finally:
        _STRICT.reset(token)


@contextlib.contextmanager
def tidying_scope() -> Iterator[None]:
    """Inside the block, stores count and log their I/O errors but never raise them, strict
    or not: for the upkeep that follows a call whose own work already succeeded."""
    token = _TIDYING.set(True)
    try:
        yield
    finally:
        _TIDYING.reset(token)


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
    `__len__`, and `discard` when it can remove a record; the batch methods default to those,
    key by key. Errors of the methods: an `OSError` of the store's I/O is raised only when the
    store is strict (or a strict `KVConnector` is calling it), else it is counted in
    `io_errors` and the call answers a miss or a dropped write; a store may raise `ValueError`
    for a key it cannot name (`DiskStore`: not 64 lowercase hex digits).

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

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    @property
    def strict(self) -> bool:
        """Raise I/O errors (after counting and logging them) instead of turning them into a
        miss or a dropped write. A strict `KVConnector` makes every store strict for its
        calls. Set it to a bool; anything else raises `TypeError` (a flag is never taken from
        truthiness: `"no"` would turn it on)."""
        return self._strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self._strict = bool_arg("strict", value)

    def _failed(self, kind: str, err: OSError) -> None:
        """Counts and logs one I/O failure of class `kind` (read, write, evict, scan...);
        raises it when the store, or the connector calling it, is strict (except inside a
        `tidying_scope`)."""
        self._count("io_errors")
        self._failures.note(kind, err)
        if (self.strict or _STRICT.get()) and not _TIDYING.get():
            # The connector reads it back (getattr) so that it does not count this again.
            err.jaxkv_counted = True  # type: ignore[attr-defined]
            raise err

    def stats(self) -> dict[str, int]:
        """Counters, each with one meaning:

        - `hits`, `misses`: `get` calls that returned a record, or `None` (for any reason).
        - `blocks_stored`, `bytes_stored`: records newly written by `put` (bytes of their
          arrays); `blocks_loaded`, `bytes_loaded`: records returned by `get`.
        - `verification_failures`: records found damaged (each is dropped and is a miss).
        - `evictions`: records removed to stay within the capacity.
        - `io_errors`: failed file or network operations (each also a miss or a dropped
          write, unless the store is strict).
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

    def lend(self, parts: Mapping[str, tuple[tuple[int, ...], np.dtype]], count: int):
        """Memory for `count` records the caller fills itself and then `put`s, so that the
        store keeps them without copying (optional: a store that cannot lend returns None,
        this default).

        The connector asks before it copies a CPU pool's blocks to host memory: with a loan,
        the rows go straight into the store's memory and `put` adopts them.

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
        answered the wrong record), or damaged in a way only the caller can see.

        The connector calls it for every record that fails its checks, so that `contains`
        stops promising that record and the next `put` of the block writes a good one.
        Stores override it; this default cannot remove anything: it counts the call in
        `stats()["undiscarded"]` and returns `False`.

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

        An error raised part way carries the answers so far as `err.jaxkv_written`, so a
        caller can count the records that did land.

        Args:
            records: the blocks to store, in order.

        Returns:
            One bool per record: whether it was newly stored (as `put`).

        Raises:
            OSError: as `put`, only when strict.
        """
        written: list[bool] = []
        try:
            for record in records:
                written.append(self.put(record))
        except Exception as err:
            err.jaxkv_written = written  # type: ignore[attr-defined]  # read back with getattr
            raise
        return written

    @property
    def nbytes(self) -> int:
        """Bytes of the records held now."""
        return self._bytes
