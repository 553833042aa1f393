"""`DiskStore`: one self-describing, checksummed file per block, written atomically.

Layout: `<path>/<key[:2]>/<key>.kvb`. A record is written to a temporary file in the same
folder and renamed over its final name (`os.replace`), so a reader sees either no file or a
whole one. Every read verifies the record (`_records.decode`); a record that fails is removed
and counted as a miss. A new `DiskStore` on the same path indexes the files already there,
oldest first for eviction.

Several processes may share one folder, without locks: each file appears whole or not at all,
a reader that finds a file gone treats it as a miss, and each process keeps an index of the
folder that it refreshes by rescanning it (see `DiskStore`). Every file operation goes through
one `FileOps` object, the seam where tests inject disk faults.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import socket
import threading
import time
import uuid

from jaxkv._checks import int_arg
from jaxkv.connector import _records
from jaxkv.connector._records import BlockRecord
from jaxkv.connector.stores import BlockStore

_KEY = re.compile(r"^[0-9a-f]{64}$")
_SUBFOLDER = re.compile(r"^[0-9a-f]{2}$")
_SUFFIX = ".kvb"
# `<key>.kvb.<host>-<pid>.<random>.tmp`: the owner of a temporary file, so that a process
# opening the folder removes only files whose writer is gone.
_TMP = re.compile(r"^[0-9a-f]{64}\.kvb\.([0-9a-f]{8})-([0-9]+)\.[0-9a-f]+\.tmp$")
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# A temporary file older than this is stale whoever wrote it (a writer on another machine of
# a shared file system, whose process cannot be checked from here).
STALE_TMP_SECONDS = 15 * 60
# Share of the capacity this process may write between two rescans of the folder (which pick
# up what other processes wrote and evict down to the capacity).
RESCAN_SHARE = 1 / 16


class FileOps:
    """The file operations of a `DiskStore`, one method each; tests replace it to inject
    faults (a full or read-only disk, vanished files, read errors)."""

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def write(self, path: str, data: bytes, fsync: bool) -> None:
        with open(path, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def head(self, path: str, n: int) -> tuple[bytes, int]:
        """The first `n` bytes of a file and its size, from one open."""
        with open(path, "rb") as f:
            return f.read(n), os.fstat(f.fileno()).st_size

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def stat(self, path: str) -> os.stat_result:
        return os.stat(path)

    def touch(self, path: str) -> None:
        os.utime(path)

    def unlink(self, path: str) -> None:
        os.unlink(path)


class DiskStore(BlockStore):
    """Blocks as files under `path`, evicting least-recently-used files past `capacity_bytes`
    (no limit when `None`). `fsync=True` also flushes each record to stable storage before
    it becomes visible.

    Faults: a failed file operation (full or read-only disk, a file gone, a read error) is
    counted in `stats()["io_errors"]`, logged on the `jaxkv` logger and becomes a miss or a
    dropped write; with `strict=True` it is raised (`OSError`) instead. A record found damaged
    is removed, so `contains` (and the connector's `lookup`) stop reporting it and the next
    `put` rewrites it: `contains` checks that the file is a whole record (its header and
    size), `get` verifies its checksum.

    Processes sharing `path`: writes are atomic renames, so no locks are taken. Opening the
    folder removes temporary files only when their writer is gone (a dead process on this
    machine, or older than `STALE_TMP_SECONDS`). `capacity_bytes` holds for the folder: each
    process rescans it after writing `capacity_bytes / 16` bytes, sees the other processes'
    files and evicts the oldest (file modification time; reads refresh it) down to the
    capacity, so the folder exceeds it by at most that share per writing process.

    Args:
        path: the folder (created if missing).
        capacity_bytes: bytes of files the folder may hold, or `None` for no limit.
        fsync: flush each record to stable storage before it becomes visible.
        strict: raise I/O errors instead of counting them as misses or dropped writes.

    Raises:
        ValueError: a `capacity_bytes` that is neither `None` nor a positive int, or a `path`
            that is a file.
        OSError: the folder cannot be created; with `strict`, also a failure to list it.

    The store's methods raise `ValueError` for a key that is not 64 lowercase hex digits, and
    `OSError` only when strict (see `BlockStore`).

    Example:
        >>> import tempfile
        >>> store = DiskStore(tempfile.mkdtemp(), capacity_bytes=8 << 30)
        >>> len(store), store.nbytes
        (0, 0)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int | None = None,
        *,
        fsync: bool = False,
        strict: bool = False,
        _fs: FileOps | None = None,
    ):
        super().__init__()
        if capacity_bytes is not None:
            capacity_bytes = int_arg(
                "capacity_bytes", capacity_bytes, expected="a positive int or None"
            )
        self.path = os.fspath(path)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"path: expected a folder (or a new name), got the file {self.path}")
        self.capacity_bytes = None if capacity_bytes is None else int(capacity_bytes)
        self.fsync = fsync
        self.strict = strict
        self._fs = FileOps() if _fs is None else _fs
        os.makedirs(self.path, exist_ok=True)
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._writing: dict[str, threading.Event] = {}  # keys being written, set when done
        self._unscanned = 0  # bytes this process wrote since its last rescan
        self._rescan(clean=True)

    # ---- the folder ------------------------------------------------------------------------

    def _rescan(self, clean: bool = False) -> None:
        """Rebuilds the index from the folder, oldest file first; with `clean`, also removes
        temporary files whose writer is gone. Files vanishing meanwhile (another process
        evicting them) are skipped."""
        found = []
        now = time.time()
        for sub in self._list(self.path):
            if not _SUBFOLDER.match(sub):
                continue
            folder = os.path.join(self.path, sub)
            for name in self._list(folder):
                file = os.path.join(folder, name)
                if name.endswith(".tmp"):
                    if clean and self._stale_tmp(name, file, now):
                        self._remove(file)
                    continue
                key = name[: -len(_SUFFIX)]
                if not (name.endswith(_SUFFIX) and _KEY.match(key)):
                    continue
                try:
                    st = self._fs.stat(file)
                except FileNotFoundError:
                    continue
                except OSError as err:
                    self._failed("scan", err)
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        with self._lock:
            self._index = collections.OrderedDict((key, size) for _, key, size in found)
            self._bytes = sum(size for _, _, size in found)
            self._unscanned = 0

    def _list(self, folder: str) -> list[str]:
        try:
            return self._fs.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as err:
            self._failed("scan", err)
            return []

    def _stale_tmp(self, name: str, file: str, now: float) -> bool:
        match = _TMP.match(name)
        if match is not None and match[1] == _HOST and not _alive(int(match[2])):
            return True
        try:
            return now - self._fs.stat(file).st_mtime > STALE_TMP_SECONDS
        except OSError:
            return False  # gone already, or unreadable: leave it

    def _remove(self, file: str) -> None:
        try:
            self._fs.unlink(file)
        except FileNotFoundError:
            pass
        except OSError as err:
            self._failed("remove", err)

    def _file(self, key: str) -> str:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"key: expected 64 lowercase hex digits, got {key!r}")
        return os.path.join(self.path, key[:2], key + _SUFFIX)

    def __len__(self) -> int:
        return len(self._index)

    # ---- the store interface ---------------------------------------------------------------

    def contains(self, key: str) -> bool:
        # The folder is the truth: another process sharing it may have written or evicted the
        # file since this index last saw it. The header and size say whether the file is a
        # whole record (a torn or truncated one is dropped, so `put` can write it again).
        path = self._file(key)
        try:
            head, size = self._fs.head(path, _records.HEAD_BYTES)
        except FileNotFoundError:
            self._forget(key)
            return False
        except OSError as err:
            self._failed("read", err)
            return False
        if _records.expected_size(head) != size:
            self._drop_damaged(key, path)
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

    def _drop_damaged(self, key: str, path: str) -> None:
        self._forget(key)
        self._remove(path)
        self._count("verification_failures")

    def get(self, key: str) -> BlockRecord | None:
        path = self._file(key)
        try:
            data = self._fs.read(path)
        except FileNotFoundError:
            self._forget(key)
            self._count("misses")
            return None
        except OSError as err:
            self._count("misses")
            self._failed("read", err)
            return None
        try:
            record = _records.decode(data, key)
        except _records.CorruptRecordError:
            self._drop_damaged(key, path)
            self._count("misses")
            return None
        try:
            self._fs.touch(path)  # recency for the other processes' rescans
        except OSError:
            pass  # a read-only folder: the record was still served
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
        tmp = f"{path}.{_HOST}-{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            self._fs.makedirs(os.path.dirname(path))
            self._fs.write(tmp, data, self.fsync)
            self._fs.replace(tmp, path)
        except OSError as err:
            try:
                self._fs.unlink(tmp)
            except OSError:
                pass  # never created, or the disk refuses even that: a stale file for later
            self._failed("write", err)
            return False
        with self._lock:
            if record.key not in self._index:
                self._index[record.key] = len(data)
                self._bytes += len(data)
            self._counters["blocks_stored"] += 1
            self._counters["bytes_stored"] += record.nbytes
            rescan = self.capacity_bytes is not None and (
                self._unscanned + len(data) > self.capacity_bytes * RESCAN_SHARE
            )
            self._unscanned += len(data)
        if rescan:
            self._rescan()
        self._evict()
        return True

    def _evict(self) -> None:
        if self.capacity_bytes is None:
            return
        victims = []
        with self._lock:
            while self._bytes > self.capacity_bytes and len(self._index) > 1:
                key, size = self._index.popitem(last=False)
                self._bytes -= size
                self._counters["evictions"] += 1
                victims.append(key)
        for victim in victims:
            self._remove(self._file(victim))


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (a reused pid counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True
