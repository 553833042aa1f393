"""`DiskStore`: one self-describing, checksummed file per block, written atomically.

Layout: `<path>/<key[:2]>/<key>.kvb`. A record is written to a temporary file in the same
folder and renamed over its final name (`os.replace`), so a reader sees either no file or a
whole one. Every read verifies the record (`_records.decode`); a record that fails is removed
and counted as a miss. A new `DiskStore` on the same path indexes the files already there,
oldest first for eviction.
"""

from __future__ import annotations

import collections
import os
import re
import threading
import uuid

from jaxkv._checks import int_arg
from jaxkv.connector import _records
from jaxkv.connector._records import BlockRecord
from jaxkv.connector.stores import BlockStore

_KEY = re.compile(r"^[0-9a-f]{64}$")
_SUFFIX = ".kvb"


class DiskStore(BlockStore):
    """Blocks as files under `path`, evicting least-recently-used files past `capacity_bytes`
    (no limit when `None`). `fsync=True` also flushes each record to stable storage before
    it becomes visible.

    Example:
        >>> import tempfile
        >>> store = DiskStore(tempfile.mkdtemp(), capacity_bytes=8 << 30)
        >>> len(store), store.nbytes
        (0, 0)
    """

    def __init__(
        self, path: str | os.PathLike, capacity_bytes: int | None = None, *, fsync: bool = False
    ):
        super().__init__()
        if capacity_bytes is not None:
            capacity_bytes = int_arg(
                "capacity_bytes", capacity_bytes, expected="a positive int or None"
            )
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        os.makedirs(self.path, exist_ok=True)
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._writing: dict[str, threading.Event] = {}  # keys being written, set when done
        self._scan()

    def _scan(self) -> None:
        found = []
        for sub in os.scandir(self.path):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                if name.endswith(".tmp"):  # a writer died before its rename
                    _unlink(entry.path)
                elif name.endswith(_SUFFIX) and _KEY.match(name[: -len(_SUFFIX)]):
                    st = entry.stat()
                    found.append((st.st_mtime_ns, name[: -len(_SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size

    def _file(self, key: str) -> str:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"key: expected 64 lowercase hex digits, got {key!r}")
        return os.path.join(self.path, key[:2], key + _SUFFIX)

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, key: str) -> bool:
        # The folder is the truth: another process sharing it may have written or evicted the
        # file since this index last saw it.
        path = self._file(key)
        try:
            size = os.stat(path).st_size
        except OSError:
            self._forget(key)
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:
                self._index[key] = size
                self._bytes += size
        return True

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def get(self, key: str) -> BlockRecord | None:
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            self._count("misses")
            return None
        except OSError:
            self._count("io_errors")
            self._count("misses")
            return None
        try:
            record = _records.decode(data, key)
        except _records.CorruptRecordError:
            self._forget(key)
            _unlink(path)
            self._count("verification_failures")
            self._count("misses")
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self._counters["hits"] += 1
            self._counters["blocks_loaded"] += 1
            self._counters["bytes_loaded"] += record.nbytes
        return record

    def put(self, record: BlockRecord) -> bool:
        path = self._file(record.key)
        # One writer per key: a second thread storing the same block waits for the first (so
        # the block is readable when its `put` returns) and does not count it again.
        with self._lock:
            busy = self._writing.get(record.key)
            if busy is None:
                done = self._writing[record.key] = threading.Event()
        if busy is not None:
            busy.wait()
            return False
        try:
            return self._put(record, path)
        finally:
            with self._lock:
                del self._writing[record.key]
            done.set()

    def _put(self, record: BlockRecord, path: str) -> bool:
        if self.contains(record.key):
            return False
        data = _records.encode(record)
        if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
            self._count("rejected")
            return False
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            _unlink(tmp)
            self._count("io_errors")
            return False
        with self._lock:
            if record.key not in self._index:
                self._index[record.key] = len(data)
                self._bytes += len(data)
            self._counters["blocks_stored"] += 1
            self._counters["bytes_stored"] += record.nbytes
            victims = self._evict_locked()
        for victim in victims:
            _unlink(self._file(victim))
        return True

    def _evict_locked(self) -> list[str]:
        victims = []
        if self.capacity_bytes is None:
            return victims
        while self._bytes > self.capacity_bytes and len(self._index) > 1:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._counters["evictions"] += 1
            victims.append(key)
        return victims


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
