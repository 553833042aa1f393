"""The L3 tier's two sides of one store: the writer's view, which answers "already stored?"
from the keys this process knows (so the scheduler never asks the store), and the reader's,
which answers only from blocks prefetched into host memory by background threads; and the
counters both report to (`TierCounters`), which also reach the server's log.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxkv.connector import BlockRecord, BlockStore, HostStore, StoreResult
from jaxkv.connector.stores import FailureLog, batch_result

log = logging.getLogger("jaxkv")

# Blocks one store read asks for: a prefetch lands in host memory, and can be loaded, a batch
# at a time.
_BATCH = 16
# Prefetches in flight at once: past them a match starts none (its request is recomputed)
# rather than queueing reads behind a slow store.
_MAX_PREFETCHES = 32
_PREFETCH_THREADS = 2
# A finished prefetch is not asked again for this long: a request waiting in the queue is
# matched every round, and its blocks have either arrived or are not in the store.
_RECHECK_S = 2.0
# A match waits for its prefetch while blocks keep landing: no block for this long and the
# store counts as stalled (the match stops waiting, and later ones wait for nothing until a
# block lands or a prefetch ends). A healthy disk or Redis lands a batch in a few ms; the
# window leaves room for a first read on a loaded machine (a new process's cold files).
STALL_S = 0.5
# Host memory for prefetched blocks mapped when the tier is built (at most its capacity).
_PREALLOCATE = 64 << 20
# Finished prefetches remembered (for _RECHECK_S), beyond those in flight.
_KEPT_PREFETCHES = 4096
# Block keys the write side remembers as stored (see KnownKeys).
_KNOWN_KEYS = 1 << 17
# `store_async` calls in flight; a backup past them is not written to the store (counted).
MAX_WRITES = 8
# The counters' INFO line comes at most this often (and only when one changed): a server's
# log shows the tier at work without a line per request.
LOG_EVERY_S = 60.0

# ---- the store's two sides ----------------------------------------------------------------


class KnownKeys(BlockStore):
    """The write side of a store.

    `contains` answers from the keys this process wrote, found stored or loaded, without I/O,
    so the snapshot `store_async` takes on the scheduler's thread never waits on the store.
    `put_many`, which runs on the connector's background worker, asks the store first and
    writes only the blocks it does not hold. A key forgotten (past `_KNOWN_KEYS`) or stored by
    another process is copied again and then found held: a copy, never a wrong answer.

    A key the store no longer holds is forgotten, so that the next backup of its block writes
    it again: the store reports its own drops (`BlockStore.on_drop`: evicted, damaged,
    discarded), and the read side reports what it found missing or refused (`forget`), which
    covers drops no listener sees (another process's, a Redis server's own eviction). A drop
    reported while `put_many` runs wins over that call's "held" or "written" answer.
    """

    def __init__(self, store: BlockStore):
        super().__init__()
        self.store = store
        self._keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Per `put_many` in flight, the keys dropped since it began.
        self._watch: dict[int, set[str]] = {}
        self._calls = 0
        self._unlisten = store.on_drop(lambda key, reason: self.forget([key]))

    def remember(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._remember(keys)

    def _remember(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > _KNOWN_KEYS:
            self._keys.popitem(last=False)

    def forget(self, keys: Sequence[str]) -> None:
        """Keys the store no longer holds (or may not): their next write goes to the store.
        Called by the store's drop listener, possibly under the store's lock: it only takes
        this object's."""
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)
                for dropped in self._watch.values():
                    dropped.add(key)

    def close(self) -> None:
        """Stops listening to the store's drops."""
        self._unlisten()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._keys

    def get(self, key: str):
        return self.store.get(key)

    def put(self, record) -> bool:
        strict = self.strict
        return self.put_many([record], strict=strict).answer(strict)[0]

    def put_many(self, records, *, strict: bool | None = None) -> StoreResult[list[bool]]:
        strict = self._strictness(strict)
        keys = [r.key for r in records]
        with self._lock:
            call = self._calls = self._calls + 1
            dropped = self._watch[call] = set()
        answers: list[bool] = []
        held: list[bool] = []
        try:
            asked = batch_result(self.store.contains_many(keys, strict=strict))
            if strict and asked.errors:
                return StoreResult([False] * len(keys), asked.errors)
            held = asked.values
            new = [r for r, h in zip(records, held) if not h]
            wrote = batch_result(self.store.put_many(new, strict=strict) if new else [])
            written = iter(wrote.values)
            answers = [False if h else bool(next(written)) for h in held]
        finally:
            with self._lock:
                del self._watch[call]
                # Under the lock that ends the watch: a drop reported later finds the keys.
                stored = zip(keys, held, answers) if answers else ()
                self._remember([k for k, h, w in stored if (h or w) and k not in dropped])
        return StoreResult(answers, asked.errors + wrote.errors)

    def __len__(self) -> int:
        return len(self.store)

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def stats(self) -> dict[str, Any]:
        return self.store.stats()


@dataclasses.dataclass
class _Prefetch:
    """One prefetch: `done` is set when it ended (whatever it found is in host memory)."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    finished_at: float | None = None


class ReadAhead(BlockStore):
    """The read side of a store: answers from host memory alone (`cache`), so the lookups and
    loads the scheduler's thread runs never wait on the store; `fetch` fills it from the store
    on background threads, a `_BATCH` of blocks at a time.

    Records a load checked are held (`pin`) until the load writes them, and answered first.

    Args:
        store: the store.
        capacity: bytes of host memory for the blocks read ahead.
        max_blocks: the most blocks one prefetch reads, per shard.
        counters: where prefetches started or refused, and failed store calls, are counted.
        missing: called with keys the store did not answer with a record (a prefetch's
            miss) or answered with a wrong one (`discard`): the write side forgets them.
    """

    def __init__(
        self,
        store: BlockStore,
        capacity: int,
        max_blocks: int,
        counters: TierCounters,
        missing: Callable[[Sequence[str]], None],
    ):
        super().__init__()
        self.store = store
        # Some memory mapped and touched now, not on a restarted server's first store hit.
        self.cache = HostStore(capacity, preallocate_bytes=min(capacity, _PREALLOCATE))
        self._max_blocks = max_blocks
        self._count_as = counters.count
        self._on_error = counters.failed
        self._missing = missing
        # Records a load checked and holds until it writes them (see `pin`), per key.
        self._pinned: dict[str, list[BlockRecord]] = {}
        self._jobs: collections.OrderedDict[str, _Prefetch] = collections.OrderedDict()
        self._running = 0
        # Progress of every prefetch: blocks landed so far, and whether the store stalled.
        self._progress = threading.Condition(self._lock)
        self._landed = 0
        self._stalled = False
        self._threads = ThreadPoolExecutor(_PREFETCH_THREADS, thread_name_prefix="jaxkv-prefetch")

    def pin(self, records: Sequence[BlockRecord]) -> list[str]:
        """Holds `records` (read from this side) until `unpin`: a load checked now and written
        later reads them, whatever the prefetches evict meanwhile. No copy: they are views of
        the read-ahead `HostStore`'s memory, which it never reuses while a view of a record is
        alive, evicted or not. Returns their keys."""
        with self._lock:
            for record in records:
                self._pinned.setdefault(record.key, []).append(record)
        return [r.key for r in records]

    def unpin(self, keys: Sequence[str]) -> None:
        """Lets go of records `pin` held (once per `pin` of each)."""
        with self._lock:
            for key in keys:
                copies = self._pinned.get(key)
                if copies:
                    copies.pop()
                    if not copies:
                        del self._pinned[key]

    def missing(self, blocks: Sequence[Sequence[str]]) -> list[list[str]]:
        """Per shard, its keys among `blocks` (per block, one key per shard) from the first
        one not in host memory on; shards holding them all are left out."""
        out = []
        for keys in zip(*blocks):
            held = self.contains_many(list(keys), stop_at_miss=True).values
            if False in held:
                out.append(list(keys[held.index(False) :]))
        return out

    def contains(self, key: str) -> bool:
        return self.contains_many([key]).values[0]

    def contains_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        with self._lock:
            pinned = [k in self._pinned for k in keys]
        if not any(pinned):
            return self.cache.contains_many(keys, stop_at_miss=stop_at_miss, strict=strict)
        got = self.cache.contains_many(keys, strict=strict)
        held = [p or g for p, g in zip(pinned, got.values)]
        if stop_at_miss and False in held:
            held[held.index(False) :] = [False] * (len(held) - held.index(False))
        return StoreResult(held, got.errors)

    def get(self, key: str):
        return self.get_many([key]).values[0]

    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[BlockRecord | None]]:
        with self._lock:
            pinned = [self._pinned[k][-1] if k in self._pinned else None for k in keys]
        if not any(r is not None for r in pinned):
            return self.cache.get_many(keys, stop_at_miss=stop_at_miss, strict=strict)
        got = self.cache.get_many(keys, strict=strict)
        records = [p if p is not None else g for p, g in zip(pinned, got.values)]
        if stop_at_miss and None in records:
            records[records.index(None) :] = [None] * (len(records) - records.index(None))
        return StoreResult(records, got.errors)

    def put(self, record) -> bool:
        return self.cache.put(record)

    def discard(self, key: str) -> bool:
        # A record the connector found wrong: gone from host memory now, and from the store
        # in the background (so that the next write of the block repairs it). The write side
        # forgets it at once: a store that cannot discard still gets the block again.
        self._missing([key])
        self._threads.submit(self._discard_stored, key)
        return self.cache.discard(key)

    def _discard_stored(self, key: str) -> None:
        try:
            self.store.discard(key)
        except Exception as err:
            self._on_error("discard", err)

    def __len__(self) -> int:
        return len(self.cache)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def stats(self) -> dict[str, Any]:
        return self.cache.stats()

    def fetch(self, groups: list[list[str]], name: str) -> _Prefetch | None:
        """The prefetch named `name` of the blocks `groups` (per shard, in prefix order): the
        one in flight, or a new one. None when one of that name finished less than
        `_RECHECK_S` ago (what it found is in host memory), or `_MAX_PREFETCHES` are in
        flight."""
        now = time.monotonic()
        with self._lock:
            last = self._jobs.get(name)
            if last is not None:
                if last.finished_at is None:
                    return last
                if now - last.finished_at < _RECHECK_S:
                    return None
            refused = self._running >= _MAX_PREFETCHES
            if not refused:
                self._running += 1
                job = self._jobs[name] = _Prefetch()
                self._jobs.move_to_end(name)
                while len(self._jobs) > _KEPT_PREFETCHES + self._running:
                    oldest = next(k for k, j in self._jobs.items() if j.finished_at is not None)
                    del self._jobs[oldest]
        if refused:
            self._count_as("prefetches_refused")
            return None
        self._count_as("prefetches")
        self._threads.submit(self._run, job, [keys[: self._max_blocks] for keys in groups])
        return job

    def _run(self, job: _Prefetch, groups: list[list[str]]) -> None:
        try:
            for keys in groups:
                for i in range(0, len(keys), _BATCH):
                    batch = keys[i : i + _BATCH]
                    found = []
                    for record in batch_result(
                        self.store.get_many(batch, stop_at_miss=True)
                    ).values:
                        if record is None:
                            break
                        found.append(record)
                    if found:
                        self.cache.put_many(found)
                        with self._progress:
                            self._landed += len(found)
                            self._stalled = False
                            self._progress.notify_all()
                    if len(found) < len(batch):
                        # Gone from the store, or never written (then forgetting it changes
                        # nothing); the blocks after it were not asked (stop_at_miss) and
                        # cannot load without it: forgotten too, each write then asks the
                        # store whether it holds them.
                        self._missing(keys[i + len(found) :])
                        break
        except Exception as err:  # a failing store: the blocks are recomputed
            self._on_error("prefetch", err)
        finally:
            with self._progress:
                job.finished_at = time.monotonic()
                self._running -= 1
                self._stalled = False  # the store answered (or failed fast)
                job.done.set()
                self._progress.notify_all()

    def wait(self, job: _Prefetch, limit_s: float) -> float:
        """Waits for `job` while the store makes progress: until it ended, `limit_s` passed,
        or no block of any prefetch landed for `STALL_S` (the store then counts as stalled,
        and later waits return at once until a block lands or a prefetch ends). A long
        prefix from a healthy store is waited for whole; a hung store costs one `STALL_S`.

        Returns:
            The seconds waited.
        """
        began = time.monotonic()
        deadline = began + limit_s
        with self._progress:
            landed, since = self._landed, began
            while not self._stalled and not job.done.is_set():
                now = time.monotonic()
                if self._landed != landed:
                    landed, since = self._landed, now
                if now >= deadline:
                    break
                if now - since >= STALL_S:
                    self._stalled = True
                    break
                self._progress.wait(min(deadline, since + STALL_S) - now)
        return time.monotonic() - began

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)


# ---- counters -----------------------------------------------------------------------------

_COUNTERS = (
    "lookups",
    "hits",
    "hit_tokens",
    "loads",
    "loaded_tokens",
    "prefetches",
    "prefetches_refused",
    "writes",
    "writes_refused",
    "errors",
    "waited_s",
)


class TierCounters:
    """The tier's counters (their meanings: `StoreTier.stats`), its failures logged (each
    class at its 1st, 2nd, 4th... occurrence) and an INFO line of the counters on the `jaxkv`
    logger, which sglang-jax's server routes to its log.

    `log_changes` writes that line when a counter changed since the last one and `every_s`
    passed (on `clock`); it is cheap enough for every scheduling round: one clock read and a
    compare, the counters read only once the interval passed.

    Args:
        owner: the name lines start with.
        every_s: the least time between two lines, in seconds.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        owner: str,
        *,
        every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.owner = owner
        self.every_s = every_s
        self.clock = clock
        self._lock = threading.Lock()
        self._values: dict[str, float] = {**dict.fromkeys(_COUNTERS, 0), "waited_s": 0.0}
        self._writes = 0  # `store_async` calls in flight
        self._failures = FailureLog(owner)
        self._logged = dict(self._values)
        self._logged_at = clock()

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._values[name] += n

    def failed(self, kind: str, err: BaseException) -> None:
        self.count("errors")
        self._failures.note(kind, err)

    def start_write(self) -> bool:
        """A backup handed to the store: False, counted in `writes_refused`, when `MAX_WRITES`
        calls are in flight."""
        with self._lock:
            if self._writes >= MAX_WRITES:
                self._values["writes_refused"] += 1
                return False
            self._writes += 1
            return True

    def end_write(self) -> None:
        with self._lock:
            self._writes -= 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {**self._values, "writes_in_flight": self._writes}

    def log_changes(self) -> None:
        now = self.clock()
        if now - self._logged_at < self.every_s:
            return
        self._logged_at = now
        values = self.snapshot()
        if all(values[name] == self._logged[name] for name in _COUNTERS):
            return
        self._logged = values
        line = " ".join(
            f"{name}={value:.3f}" if isinstance(value, float) else f"{name}={value}"
            for name, value in values.items()
        )
        try:
            log.info("%s: %s", self.owner, line)
        except Exception as err:  # a broken log handler: never into the scheduler
            self.failed("log", err)
