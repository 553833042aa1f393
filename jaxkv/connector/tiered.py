"""`TieredStore`: stores stacked fastest first, read in order and written through.

A read asks the tiers in order for the keys still missing, and copies what a slower tier
answered into every faster one (promotion), so the next read of those blocks stops earlier.
A write goes to every tier. Each tier keeps its own capacity, eviction and verification.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from jaxkv._checks import bool_arg
from jaxkv.connector._records import BlockRecord
from jaxkv.connector.stores import (
    BatchStore,
    BlockStore,
    Call,
    StoreResult,
    batch_result,
    upkeep,
)

T = TypeVar("T")

# Counters summed from the tiers (added to the stack's own): failures of any tier are
# failures of the stack.
_FROM_TIERS = ("verification_failures", "evictions", "io_errors", "rejected", "undiscarded")


class TieredStore(BatchStore):
    """Several stores as one, fastest first: reads try tiers in order and promote hits into
    the faster tiers; writes go to every tier (write-through).

    A `put` is `True` when any tier newly stored the record; `discard` removes the record from
    every tier; `on_drop` listeners hear of every record any tier drops. `stats()` has the
    stack's own counters (hits and misses of the stack as a whole; `promotions`: copies a faster
    tier newly stored of records a slower tier answered, so a record promoted into two tiers
    counts twice and one a full tier refused counts nothing; `discarded`: `discard` calls that
    removed the record from some tier), the failures of all tiers summed (`undiscarded` too),
    and under `"tiers"` each tier's `stats()`, in order. `blocks` is the most any tier holds,
    `bytes` the sum over tiers.

    Results: the stack combines its tiers' `StoreResult`s. Each tier is called with the
    stack call's strictness, and the failures they report are the stack's; an `OSError` a
    tier raises instead (a store that does not report failures) is the stack's failure too,
    counted in its `io_errors` and logged. A strict call stops at the first failure of any
    tier, and the stack then counts nothing of a read (no hit, no miss, no promotion); a
    write reports what the tiers stored before it stopped. A promotion that fails is that
    faster tier's failed write, counted and logged, and never the read's failure, strict or
    not: the read has its records in hand.

    Strictness: `strict` is true when set on the stack or on any tier; the plain methods
    then run every tier strict (a `KVConnector` passes its own choice, which takes the
    stack's `strict` into account).

    Args:
        *stores: the tiers, fastest first (e.g. host memory, local disk, Redis).

    Raises:
        TypeError: no store, or one that is not a `BlockStore`.

    Example:
        >>> import tempfile
        >>> from jaxkv.connector import DiskStore, HostStore
        >>> store = TieredStore(HostStore(1 << 24), DiskStore(tempfile.mkdtemp()))
        >>> [type(t).__name__ for t in store.tiers]
        ['HostStore', 'DiskStore']
    """

    def __init__(self, *stores: BlockStore):
        super().__init__()
        if not stores:
            raise TypeError("stores: expected at least one BlockStore, got none")
        for i, store in enumerate(stores):
            if not isinstance(store, BlockStore):
                raise TypeError(f"stores[{i}]: expected a BlockStore, got {type(store).__name__}")
        self.tiers = tuple(stores)
        self._counters["promotions"] = 0
        for tier in self.tiers:
            tier.on_drop(self._tier_dropped)

    def _tier_dropped(self, key: str, reason: str) -> None:
        # A tier's drop is the stack's (another tier may still hold the record: a listener
        # that forgets the key only asks the stack again). The tier logged a damaged one.
        self._tell_drop_listeners([key], reason)

    def __len__(self) -> int:
        return max(len(tier) for tier in self.tiers)

    @property
    def strict(self) -> bool:
        """Whether the stack's plain methods raise I/O errors: set on it, or on any tier (a
        strict call runs every tier strict)."""
        return self._strict or any(tier.strict for tier in self.tiers)

    @strict.setter
    def strict(self, value: bool) -> None:
        self._strict = bool_arg("strict", value)

    @property
    def nbytes(self) -> int:
        return sum(tier.nbytes for tier in self.tiers)

    def stats(self) -> dict[str, Any]:
        tiers = [tier.stats() for tier in self.tiers]
        with self._lock:
            counters = dict(self._counters)
        for name in _FROM_TIERS:
            counters[name] += sum(t.get(name, 0) for t in tiers)
        blocks = max(t.get("blocks", 0) for t in tiers)
        return {
            **counters,
            "blocks": blocks,
            "bytes": sum(t.get("bytes", 0) for t in tiers),
            "tiers": tiers,
        }

    def _ask(
        self,
        kind: str,
        call: Call,
        failed: T,
        method: Callable[..., StoreResult[T]],
        *args,
        **kwargs,
    ) -> T:
        """A tier's answer to `method(*args, **kwargs, strict=call.strict)` (one of its
        batches), whose failures become `call`'s (a strict call stops at them). An `OSError`
        the tier raises instead is the stack's failure of `kind`, counted and logged here;
        the tier then answers `failed`."""
        try:
            result = method(*args, **kwargs, strict=call.strict)
        except OSError as err:
            self._failed(kind, err, call)
            return failed
        return call.absorb(result)

    # ---- reads -----------------------------------------------------------------------------

    def _find(
        self,
        keys: Sequence[str],
        method: Callable[[BlockStore], Callable[..., StoreResult]],
        stop_at_miss: bool,
        call: Call,
    ) -> list:
        """Per key, `(tier index, answer)` from the first tier that has it, or `None`.

        `method(tier)` is the tier's batch to ask. Without
        `stop_at_miss`, each tier is asked once, for the keys the faster tiers lacked. With
        it, the leading run is followed from tier to tier: the fastest tier holding the next
        key answers the run it holds from there; a tier is not asked again at the key it has
        just missed. A strict `call` ends at the first failure.
        """
        found: list = [None] * len(keys)

        def answers(tier: BlockStore, ks: Sequence[str], stop: bool) -> list:
            return self._ask("read", call, [None] * len(ks), method(tier), ks, stop_at_miss=stop)

        if not stop_at_miss:
            left = list(range(len(keys)))
            for t, tier in enumerate(self.tiers):
                if not left:
                    break
                for i, answer in zip(left, answers(tier, [keys[i] for i in left], False)):
                    if answer:
                        found[i] = (t, answer)
                left = [i for i in left if found[i] is None]
            return found
        pos, missed_at = 0, [-1] * len(self.tiers)
        while pos < len(keys):
            for t, tier in enumerate(self.tiers):
                if missed_at[t] == pos:
                    continue
                got = answers(tier, keys[pos:], True)
                run = next((j for j, a in enumerate(got) if not a), len(got))
                missed_at[t] = pos + run
                if run:
                    found[pos : pos + run] = [(t, a) for a in got[:run]]
                    pos += run
                    break
            else:
                break
        return found

    def contains_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        stop_at_miss = bool_arg("stop_at_miss", stop_at_miss)
        found: list = [None] * len(keys)
        with Call(self._strictness(strict)) as call:
            found = self._find(keys, lambda tier: tier.contains_many, stop_at_miss, call)
        return call.result([f is not None for f in found])

    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[BlockRecord | None]]:
        stop_at_miss = bool_arg("stop_at_miss", stop_at_miss)
        with Call(self._strictness(strict)) as call:
            found = self._find(keys, lambda tier: tier.get_many, stop_at_miss, call)
            # Promotion: what tier t answered goes into tiers 0..t-1, one batch per tier.
            promoted = 0
            for t in range(len(self.tiers) - 1):
                slower = [f[1] for f in found if f is not None and f[0] > t]
                if slower:
                    promoted += self._promote(self.tiers[t], slower, call.strict)
            records = [None if f is None else f[1] for f in found]
            hits = [r for r in records if r is not None]
            with self._lock:
                c = self._counters
                c["promotions"] += promoted
                c["hits"] += len(hits)
                c["blocks_loaded"] += len(hits)
                c["bytes_loaded"] += sum(r.nbytes for r in hits)
                c["misses"] += (
                    (1 if None in records else 0) if stop_at_miss else len(keys) - len(hits)
                )
            return call.result(records)
        return call.result([None] * len(keys))  # a strict read stopped at a failure

    def _promote(self, tier: BlockStore, records: list[BlockRecord], strict: bool) -> int:
        """Copies `records` into the faster `tier`; returns how many it newly stored.

        A failure is the tier's failed write, counted and logged by the tier (or here, when
        the tier raised it), and never the read's: the read already has its records.
        """
        try:
            result = tier.put_many(records, strict=strict)
        except OSError as err:
            self._failed("promotion", err, upkeep())
            return 0
        return sum(batch_result(result).values)  # what landed, also before a strict stop

    # ---- writes ----------------------------------------------------------------------------

    def put_many(
        self, records: Sequence[BlockRecord], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """Writes every record to every tier; a record is stored when some tier newly stored
        it. A strict call stops at the first tier that fails, and reports what the tiers
        stored until then."""
        stored = [False] * len(records)
        try:
            with Call(self._strictness(strict)) as call:
                for tier in self.tiers:
                    answers = self._ask(
                        "write", call, [False] * len(records), tier.put_many, records
                    )
                    stored[: len(answers)] = [a or b for a, b in zip(stored, answers)]
        finally:
            with self._lock:
                self._counters["blocks_stored"] += sum(stored)
                self._counters["bytes_stored"] += sum(
                    r.nbytes for r, new in zip(records, stored) if new
                )
        return call.result(stored)

    def discard_many(
        self, keys: Sequence[str], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """Removes the record of each key from every tier (the wrong record was promoted into
        the faster ones too); a key's answer is `True` when some tier removed one. Every tier
        is asked, strict or not: a tier's failure does not stop the others, and the result
        lists them all."""
        strict = self._strictness(strict)
        removed, errors = [False] * len(keys), []
        for tier in self.tiers:
            with Call(strict) as call:  # a strict failure stops this tier, never the others
                answers = self._ask("discard", call, [False] * len(keys), tier.discard_many, keys)
                removed = [a or bool(b) for a, b in zip(removed, answers)]
            errors += call.errors
        self._count("discarded", sum(removed))
        return StoreResult(removed, tuple(errors))
