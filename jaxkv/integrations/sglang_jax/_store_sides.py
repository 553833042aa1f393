"""The L3 tier's two sides of one store: the writer's view, which answers "already stored?"
from the keys this process knows (so the scheduler never asks the store), and the reader's,
which answers only from blocks prefetched into host memory by background threads.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxkv.connector import BlockStore, HostStore

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
# Finished prefetches remembered (for _RECHECK_S), beyond those in flight.
_KEPT_PREFETCHES = 4096
# Block keys the write side remembers as stored (see KnownKeys).
_KNOWN_KEYS = 1 << 17

# ---- the store's two sides ----------------------------------------------------------------


class KnownKeys(BlockStore):
    """The write side of a store.

    `contains` answers from the keys this process wrote, found stored or loaded, without I/O,
    so the snapshot `store_async` takes on the scheduler's thread never waits on the store.
    `put_many`, which runs on the connector's background worker, asks the store first and
    writes only the blocks it does not hold. A key forgotten (past `_KNOWN_KEYS`) or stored by
    another process is copied again and then found held: a copy, never a wrong answer.
    """

    def __init__(self, store: BlockStore):
        super().__init__()
        self.store = store
        self._keys: collections.OrderedDict[str, None] = collections.OrderedDict()

    def remember(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > _KNOWN_KEYS:
                self._keys.popitem(last=False)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._keys

    def get(self, key: str):
        return self.store.get(key)

    def put(self, record) -> bool:
        return self.put_many([record])[0]

    def put_many(self, records) -> list[bool]:
        keys = [r.key for r in records]
        held = self.store.contains_many(keys)
        new = [r for r, h in zip(records, held) if not h]
        written = iter(self.store.put_many(new) if new else ())
        answers = [False if h else bool(next(written)) for h in held]
        self.remember([k for k, h, w in zip(keys, held, answers) if h or w])
        return answers

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

    While `seen()` is open, every key asked for (`contains_many`) or served (`get_many`) is
    recorded with its answer: that is how the tier learns the keys the connector uses for a
    prompt, per shard of a sharded pool, without computing them itself.

    Args:
        store: the store.
        capacity: bytes of host memory for the blocks read ahead.
        max_blocks: the most blocks one prefetch reads, per shard.
        count: called with a counter's name: "prefetches" (one started), "prefetches_refused".
        failed: called with (what, error) for a store call that raised.
    """

    def __init__(
        self,
        store: BlockStore,
        capacity: int,
        max_blocks: int,
        count: Callable[[str], None],
        failed: Callable[[str, BaseException], None],
    ):
        super().__init__()
        self.store = store
        self.cache = HostStore(capacity, preallocate_bytes=0)
        self._max_blocks = max_blocks
        self._count_as = count
        self._on_error = failed
        self._seen: list[tuple[list[str], list[bool]]] | None = None
        self._jobs: collections.OrderedDict[str, _Prefetch] = collections.OrderedDict()
        self._running = 0
        self._threads = ThreadPoolExecutor(_PREFETCH_THREADS, thread_name_prefix="jaxkv-prefetch")

    @contextlib.contextmanager
    def seen(self) -> Iterator[list[tuple[list[str], list[bool]]]]:
        """Records, while open, the keys asked for or served, each call's with its answers
        (the scheduler's thread alone calls this)."""
        seen: list[tuple[list[str], list[bool]]] = []
        self._seen = seen
        try:
            yield seen
        finally:
            self._seen = None

    def contains(self, key: str) -> bool:
        return self.cache.contains(key)

    def contains_many(self, keys: Sequence[str], *, stop_at_miss: bool = False) -> list[bool]:
        held = self.cache.contains_many(keys, stop_at_miss=stop_at_miss)
        if self._seen is not None:
            self._seen.append((list(keys), list(held)))
        return held

    def get(self, key: str):
        return self.cache.get(key)

    def get_many(self, keys: Sequence[str], *, stop_at_miss: bool = False):
        got = self.cache.get_many(keys, stop_at_miss=stop_at_miss)
        if self._seen is not None:
            self._seen.append((list(keys), [r is not None for r in got]))
        return got

    def put(self, record) -> bool:
        return self.cache.put(record)

    def discard(self, key: str) -> bool:
        # A record the connector found wrong: gone from host memory now, and from the store
        # in the background (so that the next write of the block repairs it).
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
                    for record in self.store.get_many(batch, stop_at_miss=True):
                        if record is None:
                            break
                        found.append(record)
                    if found:
                        self.cache.put_many(found)
                    if len(found) < len(batch):
                        break
        except Exception as err:  # a failing store: the blocks are recomputed
            self._on_error("prefetch", err)
        finally:
            with self._lock:
                job.finished_at = time.monotonic()
                self._running -= 1
            job.done.set()

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
