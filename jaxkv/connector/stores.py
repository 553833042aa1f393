"""The store interface and the in-memory `HostStore`.

A store maps block keys to `BlockRecord`s. It is deliberately small (`contains`, `get`, `put`,
`stats`) so that a disk, remote or tiered store is a few methods, and every store verifies what
it serves: a record that fails a check is a miss, never data.
"""

from __future__ import annotations

import abc
import collections
import threading

from jaxkv.connector._records import BlockRecord

_COUNTERS = (
    "hits", "misses", "blocks_stored", "bytes_stored", "blocks_loaded", "bytes_loaded",
    "verification_failures", "evictions", "io_errors", "rejected",
)


class BlockStore(abc.ABC):
    """Key -> `BlockRecord`. Implementations are thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._counters = dict.fromkeys(_COUNTERS, 0)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, blocks/bytes stored and loaded, verification failures,
        evictions, I/O errors, rejected (records larger than the capacity), plus `blocks` and
        `bytes` held now."""
        with self._lock:
            return {**self._counters, "blocks": len(self), "bytes": self.nbytes}

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether `key` is held (may refresh its recency; changes no data)."""

    @abc.abstractmethod
    def get(self, key: str) -> BlockRecord | None:
        """The verified record of `key`, or `None` (a record failing verification is a miss)."""

    @abc.abstractmethod
    def put(self, record: BlockRecord) -> bool:
        """Stores `record`; `False` when it was already held or cannot fit."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @property
    @abc.abstractmethod
    def nbytes(self) -> int: ...


class HostStore(BlockStore):
    """Blocks in host memory, evicting least-recently-used blocks past `capacity_bytes`.

    Records are copied on `put` and handed out read-only, so nothing outside can change them.

    Example:
        >>> store = HostStore(capacity_bytes=1 << 30)
    """

    def __init__(self, capacity_bytes: int):
        super().__init__()
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or (
            capacity_bytes <= 0
        ):
            raise ValueError(f"capacity_bytes: expected a positive int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._records: collections.OrderedDict[str, BlockRecord] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._records:
                self._records.move_to_end(key)
                return True
            return False

    def get(self, key: str) -> BlockRecord | None:
        with self._lock:
            record = self._records.get(key)
            if record is None:
                self._counters["misses"] += 1
                return None
            self._records.move_to_end(key)
            self._counters["hits"] += 1
            self._counters["blocks_loaded"] += 1
            self._counters["bytes_loaded"] += record.nbytes
            return record

    def put(self, record: BlockRecord) -> bool:
        size = record.nbytes
        if size > self.capacity_bytes:
            self._count("rejected")
            return False
        with self._lock:
            if record.key in self._records:
                self._records.move_to_end(record.key)
                return False
        own = record.frozen_copy()  # the copy runs outside the lock
        with self._lock:
            if record.key in self._records:
                return False
            while self._bytes + size > self.capacity_bytes:
                _, old = self._records.popitem(last=False)
                self._bytes -= old.nbytes
                self._counters["evictions"] += 1
            self._records[record.key] = own
            self._bytes += size
            self._counters["blocks_stored"] += 1
            self._counters["bytes_stored"] += size
            return True
