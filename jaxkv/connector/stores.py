"""The store interface every store implements: `BlockStore`, and `BatchStore` for stores
whose work is done a batch at a time.

A store maps block keys to `BlockRecord`s. Writing one takes four methods (`contains`, `get`,
`put`, `__len__`); the batch forms the connector calls (`contains_many`, `get_many`,
`put_many`, `discard_many`) default to them, key by key, so a host, disk, remote or tiered
store is a few methods, and every store verifies what it serves: a record that fails a check
is a miss, never data.

Failures travel as values. Each batch method takes the caller's strictness and returns a
`StoreResult`: one answer per key or record, and the I/O failures the call met, each already
counted and logged by the store. Whoever starts a call decides its strictness once: a user
calling a method without `strict` gets the store's own; a `KVConnector` passes its choice. A
strict call stops at its first failure; `StoreResult.answer(strict)` then raises it.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from jaxkv._checks import bool_arg
from jaxkv.connector._calls import (
    Call,
    DamageLog,
    FailureLog,
    Loan,
    StoreResult,
    batch_result,
    each,
    log,
    upkeep,
)
from jaxkv.connector._records import BlockRecord
from jaxkv.errors import StoreReplyError

__all__ = [
    "BatchStore",
    "BlockStore",
    "Call",
    "DamageLog",
    "DropListener",
    "FailureLog",
    "Loan",
    "StoreResult",
    "batch_result",
    "each",
    "log",
    "upkeep",
]

T = TypeVar("T")

#: `BlockStore.on_drop` listeners: called with `(key, reason)`.
DropListener = Callable[[str, str], None]


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

    The surface, one spelling per operation:

    - written by every store: `contains(key)`, `get(key)`, `put(record)`, `__len__`;
    - optional: `discard(key)` (a store that can remove a record) and `lend` (a store that
      can hand out memory that `put` then keeps without a copy);
    - batches, each `(..., *, strict=None) -> StoreResult` with one answer per key or
      record: `contains_many`, `get_many`, `put_many`, `discard_many`. They default to the
      single-key methods, key by key; a store with cheaper batches (one round trip to a
      server) overrides them, or subclasses `BatchStore` and writes only the batches;
    - `stats()`, `on_drop(listener)`, the `strict` flag and `nbytes`.

    A subclass calls `super().__init__()` first.

    Errors: a store that meets I/O failures of its own reports them in its batches'
    `StoreResult`s, counted in `io_errors` and logged; its single-key methods raise the first
    one (an `OSError`) only when the store is strict, and otherwise answer a miss or a dropped
    write. A store may raise `ValueError` for a key it cannot name (`DiskStore`: not 64
    lowercase hex digits). In the default batches, an exception a single-key `contains`, `get`
    or `discard` raises ends that call (the caller counts it); a `put` that raises is that
    record's failure (see `put_many`).

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
        """Whether the single-key methods, and batches called without `strict`, raise I/O
        errors (after counting and logging them) instead of turning them into a miss or a
        dropped write. A `KVConnector` calling the store is strict when it or the store is,
        and passes that to the batches.
        Set it to a bool; anything else raises `TypeError` (a flag is never taken from
        truthiness: `"no"` would turn it on)."""
        return self._strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self._strict = bool_arg("strict", value)

    def _strictness(self, strict: bool | None) -> bool:
        """A batch's `strict` argument: the store's own when `None`."""
        return self.strict if strict is None else bool_arg("strict", strict)

    def _failed(self, kind: str, err: OSError, call: Call) -> None:
        """Counts and logs one I/O failure of class `kind` (read, write, evict, scan...) met
        by `call`, which lists it; a strict call stops here."""
        self._count("io_errors")
        self._failures.note(kind, err)
        call.fail(err)

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

        The connector calls it (through `discard_many`) for every record that fails its
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
    # in one round trip. These defaults ask key by key.

    def contains_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """Per key, whether it is held (as `contains`).

        Args:
            keys: block keys, in order.
            stop_at_miss: ask only for the leading run of held keys (a prefix lookup): every
                entry from the first miss on is `False`.
            strict: stop at the first failure; `None`: the store's own `strict`.

        Returns:
            One bool per key, in order, and the failures met.

        Raises:
            TypeError: a `stop_at_miss` or `strict` that is not a bool.
        """
        return self._key_by_key(self.contains, keys, False, stop_at_miss, strict)

    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[BlockRecord | None]]:
        """Per key, its verified record or `None` (as `get`).

        Args:
            keys: block keys, in order.
            stop_at_miss: read only the leading run of held keys (a prefix load): every
                entry from the first miss on is `None`.
            strict: stop at the first failure; `None`: the store's own `strict`.

        Returns:
            One record or `None` per key, in order, and the failures met.

        Raises:
            TypeError: a `stop_at_miss` or `strict` that is not a bool.
        """
        return self._key_by_key(self.get, keys, None, stop_at_miss, strict)

    def put_many(
        self, records: Sequence[BlockRecord], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """`put` of each record, in order (the same rules on the records' memory): a write
        that fails part way still says which records it stored.

        This default puts record by record: a `put` that raises is that record's failure
        (counted in `io_errors` and logged; an exception other than an `OSError` is reported
        as a `StoreReplyError` naming it), never the records' before it, and a lenient call
        goes on with the next record.

        Args:
            records: the blocks to store, in order.
            strict: stop at the first failure; `None`: the store's own `strict`.

        Returns:
            One bool per record (whether it was newly stored, as `put`), and the failures met.

        Raises:
            TypeError: a `strict` that is not a bool.
        """

        def put(record: BlockRecord, call: Call) -> bool:
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

        return each(put, records, False, strict=self._strictness(strict))

    def discard_many(
        self, keys: Sequence[str], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """`discard` of each key, in order.

        Args:
            keys: the keys of records a caller found wrong.
            strict: stop at the first failure; `None`: the store's own `strict`.

        Returns:
            One bool per key (whether a record was removed), and the failures met.

        Raises:
            TypeError: a `strict` that is not a bool.
        """
        return self._key_by_key(self.discard, keys, False, False, strict)

    def _key_by_key(self, one, keys, missing, stop_at_miss, strict) -> StoreResult:
        """`one(key)` of each key as one call (see `each`); an exception `one` raises ends
        it."""
        strict = self._strictness(strict)
        return each(
            lambda key, call: one(key), keys, missing, stop_at_miss=stop_at_miss, strict=strict
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the records held now."""
        return self._bytes


class BatchStore(BlockStore):
    """A `BlockStore` whose work is its batches (`DiskStore`, `TieredStore`): a subclass
    implements `contains_many`, `get_many`, `put_many`, `discard_many` and `__len__`, each
    batch resolving its `strict` with `_strictness`; the single-key methods call them under
    the store's own `strict` and raise the first failure when it is set. `each` (in
    `jaxkv.connector.stores`) runs a per-key method as one call.
    """

    def _one(self, run: Callable[[bool], StoreResult[list[T]]]) -> T:
        strict = self.strict  # read once: the call and what it raises agree
        return run(strict).answer(strict)[0]

    def contains(self, key: str) -> bool:
        return self._one(lambda strict: self.contains_many([key], strict=strict))

    def get(self, key: str) -> BlockRecord | None:
        return self._one(lambda strict: self.get_many([key], strict=strict))

    def put(self, record: BlockRecord) -> bool:
        return self._one(lambda strict: self.put_many([record], strict=strict))

    def discard(self, key: str) -> bool:
        return self._one(lambda strict: self.discard_many([key], strict=strict))

    @abc.abstractmethod
    def contains_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[bool]]: ...

    @abc.abstractmethod
    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[BlockRecord | None]]: ...

    @abc.abstractmethod
    def put_many(
        self, records: Sequence[BlockRecord], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]: ...

    @abc.abstractmethod
    def discard_many(
        self, keys: Sequence[str], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]: ...
