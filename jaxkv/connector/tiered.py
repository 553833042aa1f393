"""`TieredStore`: stores stacked fastest first, read in order and written through.

A read asks the tiers in order for the keys still missing, and copies what a slower tier
answered into every faster one (promotion), so the next read of those blocks stops earlier.
A write goes to every tier. Each tier keeps its own capacity, eviction and verification.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from jaxkv._checks import bool_arg
from jaxkv.connector._records import BlockRecord
from jaxkv.connector.stores import BlockStore, strict_scope

# Counters summed from the tiers (added to the stack's own): failures of any tier are
# failures of the stack.
_FROM_TIERS = ("verification_failures", "evictions", "io_errors", "rejected", "undiscarded")


def _in_strict_scope(method):
    """Runs `method` with every tier strict when the stack itself is set strict."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with strict_scope(self._strict):
            return method(self, *args, **kwargs)

    return run


class TieredStore(BlockStore):
    """Several stores as one, fastest first: reads try tiers in order and promote hits into
    the faster tiers; writes go to every tier (write-through).

    A `put` is `True` when any tier newly stored the record; `discard` removes the record
    from every tier. `stats()` has the stack's own counters (hits and misses of the stack as
    a whole; `promotions`: copies a faster tier newly stored of records a slower tier
    answered, so a record promoted into two tiers counts twice and one a full tier refused
    counts nothing; `discarded`: `discard` calls that removed the record from some tier), the
    failures of all tiers summed (`undiscarded` too), and under `"tiers"` each tier's
    `stats()`, in order. `blocks` is the most any tier holds, `bytes` the sum over tiers.

    Strictness: the stack is strict when set so (`strict = True`: its calls then run with
    every tier strict) or when any tier is. Its methods raise what a tier raises (an
    `OSError` of a strict tier, or of any tier under a strict stack or `KVConnector`), at the
    first tier that does, with one exception: a promotion that fails is that faster tier's
    failed write, counted (`io_errors`) and logged, and never raised, strict or not. The read
    it follows has its records in hand; raising would turn them into a failure.

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

    def __len__(self) -> int:
        return max(len(tier) for tier in self.tiers)

    @property
    def strict(self) -> bool:
        """Whether the stack raises I/O errors: set on it, or on any tier (a connector then
        passes a tier's error on too)."""
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

    # ---- reads -----------------------------------------------------------------------------

    def _find(self, keys: Sequence[str], ask: Callable, stop_at_miss: bool) -> list:
        """Per key, `(tier index, answer)` from the first tier that has it, or `None`.

        `ask(tier, keys, stop_at_miss)` is the tier's batch call. Without `stop_at_miss`, each
        tier is asked once, for the keys the faster tiers lacked. With it, the leading run is
        followed from tier to tier: the fastest tier holding the next key answers the run it
        holds from there; a tier is not asked again at the key it has just missed.
        """
        found: list = [None] * len(keys)
        if not stop_at_miss:
            left = list(range(len(keys)))
            for t, tier in enumerate(self.tiers):
                if not left:
                    break
                answers = ask(tier, [keys[i] for i in left], False)
                for i, answer in zip(left, answers):
                    if answer:
                        found[i] = (t, answer)
                left = [i for i in left if found[i] is None]
            return found
        pos, missed_at = 0, [-1] * len(self.tiers)
        while pos < len(keys):
            for t, tier in enumerate(self.tiers):
                if missed_at[t] == pos:
                    continue
                answers = ask(tier, keys[pos:], True)
                run = next((j for j, a in enumerate(answers) if not a), len(answers))
                missed_at[t] = pos + run
                if run:
                    found[pos : pos + run] = [(t, a) for a in answers[:run]]
                    pos += run
                    break
            else:
                break
        return found

    @_in_strict_scope
    def contains_many(self, keys: Sequence[str], *, stop_at_miss: bool = False) -> list[bool]:
        stop_at_miss = bool_arg("stop_at_miss", stop_at_miss)
        found = self._find(
            keys, lambda tier, ks, stop: tier.contains_many(ks, stop_at_miss=stop), stop_at_miss
        )
        return [f is not None for f in found]

    @_in_strict_scope
    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False
    ) -> list[BlockRecord | None]:
        stop_at_miss = bool_arg("stop_at_miss", stop_at_miss)
        found = self._find(
            keys, lambda tier, ks, stop: tier.get_many(ks, stop_at_miss=stop), stop_at_miss
        )
        # Promotion: what tier t answered goes into tiers 0..t-1, one batch per tier.
        promoted = 0
        for t in range(len(self.tiers) - 1):
            slower = [f[1] for f in found if f is not None and f[0] > t]
            if slower:
                promoted += self._promote(self.tiers[t], slower)
        records = [None if f is None else f[1] for f in found]
        hits = [r for r in records if r is not None]
        with self._lock:
            c = self._counters
            c["promotions"] += promoted
            c["hits"] += len(hits)
            c["blocks_loaded"] += len(hits)
            c["bytes_loaded"] += sum(r.nbytes for r in hits)
            c["misses"] += (1 if None in records else 0) if stop_at_miss else len(keys) - len(hits)
        return records

    def _promote(self, tier: BlockStore, records: list[BlockRecord]) -> int:
        """Copies `records` into the faster `tier`; returns how many it newly stored.

        A failure is the tier's failed write: the tier counted and logged it (else the stack
        does), and it is not raised, strict or not: the read already has its records.
        """
        try:
            return sum(tier.put_many(records))
        except OSError as err:
            if not getattr(err, "jaxkv_counted", False):
                self._count("io_errors")
                self._failures.note("promotion", err)
            return sum(getattr(err, "jaxkv_written", ()))

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def get(self, key: str) -> BlockRecord | None:
        return self.get_many([key])[0]

    @_in_strict_scope
    def discard(self, key: str) -> bool:
        """Removes the record of `key` from every tier (the wrong record was promoted into the
        faster ones too); `True` when some tier removed one. A tier that raises does not stop
        the others: the first error is raised once every tier was asked."""
        removed, error = False, None
        for tier in self.tiers:
            try:
                removed = tier.discard(key) or removed
            except OSError as err:
                error = err if error is None else error
        if removed:
            self._count("discarded")
        if error is not None:
            raise error
        return removed

    # ---- writes ----------------------------------------------------------------------------

    @_in_strict_scope
    def put_many(self, records: Sequence[BlockRecord]) -> list[bool]:
        """Writes every record to every tier. A tier that raises stops the write there; the
        error carries, as `err.jaxkv_written`, which records a tier newly stored so far."""
        stored = [False] * len(records)
        try:
            for tier in self.tiers:
                answers: Sequence[bool] = ()
                try:
                    answers = tier.put_many(records)
                except Exception as err:
                    answers = getattr(err, "jaxkv_written", ())  # a prefix of the records'
                    raise
                finally:
                    stored[: len(answers)] = [a or b for a, b in zip(stored, answers)]
        except Exception as err:
            err.jaxkv_written = stored  # type: ignore[attr-defined]  # read back with getattr
            raise
        finally:
            with self._lock:
                self._counters["blocks_stored"] += sum(stored)
                self._counters["bytes_stored"] += sum(
                    r.nbytes for r, new in zip(records, stored) if new
                )
        return stored

    def put(self, record: BlockRecord) -> bool:
        return self.put_many([record])[0]
