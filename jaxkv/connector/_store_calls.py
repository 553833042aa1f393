"""The connector's side of its store: every call a `KVConnector` makes to its `BlockStore`,
with the strictness decided once per call, the answers checked, the failures counted, and the
connector's counters.

A store is another party: whatever it answers or raises, the connector counts it and goes on
(a miss, a dropped write), unless it or the store is strict. A record it serves is loaded only
when it is the block its key names (`_replies.block_fault`); one that is not is discarded, so
the next `store` writes the block again.
"""

from __future__ import annotations

import threading
from typing import Any

from jaxkv.connector._records import BlockRecord
from jaxkv.connector._replies import (
    answers,
    block_fault,
    count_of,
    is_bool,
    is_record_or_none,
    stats_dict,
    store_result,
)
from jaxkv.connector._writes import BackgroundWrites
from jaxkv.connector.stores import BlockStore, DamageLog, FailureLog, StoreResult
from jaxkv.errors import StoreReplyError

# The connector's counters (see `KVConnector.stats`), each with one meaning.
COUNTERS = (
    "lookups",
    "lookup_hits",
    "lookup_misses",
    "loads",
    "hits",
    "misses",
    "blocks_stored",
    "blocks_loaded",
    "records_stored",
    "records_loaded",
    "bytes_stored",
    "bytes_loaded",
    "verification_failures",
    "discarded",
    "io_errors",
    "async_failures",
)


def checked_store(store) -> BlockStore:
    """`store` when it is a `BlockStore`; else `TypeError` naming what it is."""
    if not isinstance(store, BlockStore):
        raise TypeError(
            "store: expected a BlockStore (HostStore, DiskStore, RedisStore, TieredStore, "
            f"MooncakeStore or a subclass of jaxkv.connector.BlockStore), got "
            f"{type(store).__name__}"
        )
    return store


class StoreCalls:
    """A connector's calls into `backend`, its counters and its failure logs.

    Args:
        backend: the store.
        strict: whether the connector raises the store's failures (see `KVConnector`).
        writes: the connector's background writes (keys being written count as held).
    """

    def __init__(self, backend: BlockStore, strict: bool, writes: BackgroundWrites):
        self.backend = backend
        self.strict = strict
        self.writes = writes
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._failures = FailureLog("KVConnector")
        self._refused = DamageLog("KVConnector")

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def held(self, keys: list[str], *, stop_at_miss: bool = False) -> list[bool]:
        """Per key, "stored, or being written by `store_async`" (pending keys as of now); the
        store is asked about the other keys in one batch (`stop_at_miss`: see `BlockStore`)."""
        pending = self.writes.pending()
        ask = [k for k in keys if k not in pending]
        asked = iter(
            self.call(
                "read",
                lambda ks, strict: self.backend.contains_many(
                    ks, stop_at_miss=stop_at_miss, strict=strict
                ),
                ask,
                None,
                check=lambda answer: answers(answer, len(ask), is_bool, "bools"),
            )
            or ()
        )
        held = []
        for key in keys:
            held.append(key in pending or next(asked, False))
            if stop_at_miss and not held[-1]:
                return held + [False] * (len(keys) - len(held))
        return held

    def call(self, kind: str, method, arg, failed, check=None):
        """`method(arg, strict)` on the store, a `StoreResult` whose values pass through
        `check` (which returns them or raises `StoreReplyError`).

        Strictness is decided here, once per call (this connector's or the store's `strict`),
        and handed to the store, which stops at its first failure when strict. The failures a
        result lists were counted and logged by the store; a failure it raises instead (an
        `OSError`, any other exception, a malformed result) is counted and logged here. A
        strict call raises its failure (a non-`OSError` as `StoreReplyError`); a lenient one
        answers `failed` (a miss, a dropped write) when the call failed as a whole, and the
        values otherwise, in which each reported failure already is a miss or a drop.
        """
        store = type(self.backend).__name__
        strict = self.strict_store()
        try:
            result = method(arg, strict)
        except OSError as err:
            self.count("io_errors")
            self._failures.note(kind, err)
            if strict:
                raise
            return failed
        except Exception as err:
            why = f"{store} {kind} raised {type(err).__name__}: {err}"
            return self._failed(kind, StoreReplyError(why), err, failed, strict)
        try:
            result = store_result(result)
            values = result.values if check is None else check(result.values)
        except StoreReplyError as err:
            why = f"{store} {kind} answered wrongly: {err}"
            return self._failed(kind, StoreReplyError(why), None, failed, strict)
        return StoreResult(values, result.errors).answer(strict)

    def _failed(self, kind: str, failure: StoreReplyError, cause, failed, strict: bool):
        self.count("io_errors")
        self._failures.note(kind, failure)
        if strict:
            raise failure from cause
        return failed

    def strict_store(self) -> bool:
        """Whether store failures are raised: this connector or its store is strict."""
        if self.strict:
            return True
        try:
            return self.backend.strict is True
        except Exception:  # a store whose `strict` itself fails is not asking to raise
            return False

    def write(self, records: list[BlockRecord], blocks: list[int]) -> int:
        """Puts `records` (record j holds a shard of block `blocks[j]`, or the whole block);
        returns the number of blocks of which a record was newly written."""
        results: list[bool] = []

        def record_landed(values) -> list[bool]:
            # Kept before a strict failure is raised: what landed is counted all the same.
            results.extend(answers(values, len(records), is_bool, "bools"))
            return results

        try:
            self.call(
                "write",
                lambda batch, strict: self.backend.put_many(batch, strict=strict),
                records,
                None,
                check=record_landed,
            )
        finally:
            new = [j for j, landed in enumerate(results) if landed]
            with self._lock:
                self._counters["records_stored"] += len(new)
                self._counters["blocks_stored"] += len({blocks[j] for j in new})
                self._counters["bytes_stored"] += sum(records[j].nbytes for j in new)
        return len({blocks[j] for j in new})

    def fetch(
        self, layout, fingerprint: str, keys: list[str], data: bytes, first: int, bs: int
    ) -> list[BlockRecord]:
        """The verified records of the longest stored run of `keys` (the keys of blocks
        `first`, `first + 1`... of token bytes `data`, `bs` tokens each, under
        `fingerprint`)."""
        self.writes.wait_for(keys)
        records: list[BlockRecord] = []
        got = self.call(
            "read",
            lambda ks, strict: self.backend.get_many(ks, stop_at_miss=True, strict=strict),
            keys,
            None,
            check=lambda answer: answers(answer, len(keys), is_record_or_none, "records"),
        )
        want = {
            p.key: ((layout.part_layers(p), bs, *p.row_shape), p.bits_dtype) for p in layout.parts
        }
        for i, record in enumerate(got or ()):
            if record is None:
                break
            block = data[4 * (first + i) * bs : 4 * (first + i + 1) * bs]
            fault = block_fault(record, keys[i], block, fingerprint, want)
            if fault is not None:
                self.count("verification_failures")
                removed = self.discard(keys[i])
                store = type(self.backend).__name__
                done = f"{store} discarded it" if removed else f"{store} could not remove it"
                self._refused.note(keys[i], f"served by {store} {fault}", done)
                break
            records.append(record)
        return records

    def discard(self, key: str) -> bool:
        """Removes the record the store served for `key`, which failed the checks, so that
        `lookup` stops promising it and the next `store` writes the block again."""
        removed = self.call(
            "discard",
            lambda ks, strict: self.backend.discard_many(ks, strict=strict),
            [key],
            [False],
            check=lambda answer: answers(answer, 1, is_bool, "bools"),
        )[0]
        if removed:
            self.count("discarded")
        return bool(removed)

    def stats(self) -> dict[str, Any]:
        """The connector's counters (see `KVConnector.stats`), the store's folded in."""
        store = self.call(
            "stats", lambda _, strict: StoreResult(self.backend.stats()), None, {}, check=stats_dict
        )
        with self._lock:
            counters = dict(self._counters)
            pending = len(self.writes)
        counters["verification_failures"] += count_of(store, "verification_failures")
        counters["evictions"] = count_of(store, "evictions")
        counters["io_errors"] += count_of(store, "io_errors")
        return {**counters, "pending_blocks": pending, "store": store}
