"""`DiskStore`: one self-describing, checksummed file per block, written atomically.

Layout: `<path>/<key[:2]>/<key>.kvb`. A record is written to a temporary file in the same
folder and renamed over its final name (`os.replace`), so a reader sees either no file or a
whole one. Every read verifies the record (`_records.decode`); a record that fails is removed
and counted as a miss. A new `DiskStore` on the same path indexes the files already there,
oldest first for eviction.

Several processes may share one folder, without locks: each file appears whole or not at all,
a reader that finds a file gone treats it as a miss, and each process keeps an index of the
folder that it refreshes by rescanning it (see `DiskStore`). Every file operation goes through
one `FileOps` object, the seam where tests inject disk faults; it opens only plain files and
follows no link inside the folder, since anyone who may write there could otherwise make
readers block on a FIFO or reach files elsewhere through a link.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import socket
import stat
import threading
import time
import uuid
from collections.abc import Sequence

from jaxkv._checks import bool_arg, int_arg
from jaxkv.connector import _records
from jaxkv.connector._files import FileOps, IrregularFileError
from jaxkv.connector._records import BlockRecord
from jaxkv.connector.stores import BatchStore, Call, StoreResult, each, upkeep

__all__ = ["DiskStore", "FileOps", "IrregularFileError"]

# Matched whole (`fullmatch`): `$` would also match before a final newline.
_KEY = re.compile(r"[0-9a-f]{64}")
_SUBFOLDER = re.compile(r"[0-9a-f]{2}")
_SUFFIX = ".kvb"
# `<key>.kvb.<host>-<pid>.<random>.tmp`: the owner of a temporary file, so that a process
# opening the folder removes only files whose writer is gone.
_TMP = re.compile(r"[0-9a-f]{64}\.kvb\.([0-9a-f]{8})-([0-9]+)\.[0-9a-f]+\.tmp")
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# A temporary file older than this is stale whoever wrote it (a writer on another machine of
# a shared file system, whose process cannot be checked from here).
STALE_TMP_SECONDS = 15 * 60
# Share of the capacity this process may write between two rescans of the folder (which pick
# up what other processes wrote and evict down to the capacity).
RESCAN_SHARE = 1 / 16


class DiskStore(BatchStore):
    """Blocks as files under `path`, evicting least-recently-used files past `capacity_bytes`
    (no limit when `None`). `fsync=True` also flushes each record to stable storage before
    it becomes visible.

    Faults: a failed file operation (full or read-only disk, a file gone, a read error) is
    counted in `stats()["io_errors"]`, logged on the `jaxkv` logger and becomes a miss or a
    dropped write; with `strict=True` it is raised (`OSError`) instead, and the call stops
    there. The batches report each failure in their `StoreResult` and raise none
    (a `KVConnector` decides). A failure while tidying up after a successful write (its
    rescan, its evictions) is counted and logged but never reported nor raised: the write did
    land.

    Damage: a record file that fails a check, and anything found under a block's name that
    the store never writes there (a FIFO, device, socket, folder or link; or a link or
    special file under a subfolder's name), is removed and counted in
    `stats()["verification_failures"]`; it is a miss. Such names are never opened (a FIFO
    would block the reader) nor followed (a link could serve another tenant's file). `contains`
    (and the connector's `lookup`) checks that the file is a plain file holding a whole record
    (its header and size); `get` reads it only when its size is right and verifies its
    checksum, removing it when that fails, so the next `put` rewrites it. A damaged or
    discarded file that cannot be removed (a read-only folder) is never promised or served
    again by this store, until a `put` of its block replaces it.

    Processes sharing `path`: writes are atomic renames, so no locks are taken. Opening the
    folder removes temporary files only when their writer is gone (a dead process on this
    machine, or older than `STALE_TMP_SECONDS`). `capacity_bytes` holds for the folder: each
    process rescans it after writing `capacity_bytes / 16` bytes, sees the other processes'
    files and evicts the oldest (file modification time; reads refresh it) down to the
    capacity, so the folder exceeds it by at most that share per writing process.

    Args:
        path: the folder (created if missing), a `str` or `os.PathLike`. Links on the way to
            it are followed once, at construction; links inside it never are.
        capacity_bytes: bytes of files the folder may hold, or `None` for no limit.
        fsync: flush each record to stable storage before it becomes visible (a bool).
        strict: raise I/O errors instead of counting them as misses or dropped writes (a
            bool).

    Raises:
        TypeError: a `path` that is not a str or `os.PathLike` of one, or a `fsync` or
            `strict` that is not a bool (also when assigned later).
        ValueError: a `capacity_bytes` that is neither `None` nor a positive int, an empty
            `path`, or a `path` that is a file.
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
        self._path = _folder_arg(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.strict = strict
        self._fs = FileOps() if _fs is None else _fs
        try:
            # Every name is used under the real path: a link inside the folder is never
            # followed, and the folder itself then is none.
            self._root = self._fs.makedirs(self.path)
        except (FileExistsError, NotADirectoryError):
            raise ValueError(
                f"path: expected a folder (or a new name), got the file {self.path} "
                "(or a path under one)"
            ) from None
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._writing: dict[str, threading.Event] = {}  # keys being written, set when done
        # Keys whose damaged or discarded file could not be removed: never promised or served
        # again until a `put` of the block replaces the file.
        self._unremoved: set[str] = set()
        self._unscanned = 0  # bytes this process wrote since its last rescan
        with Call(self.strict) as call:
            self._rescan(call, clean=True)
        call.result(None).answer(call.strict)

    @property
    def path(self) -> str:
        """The folder, as given (read-only: the store's files and index are those of this
        folder)."""
        return self._path

    @property
    def fsync(self) -> bool:
        """Flush each record to stable storage before it becomes visible (a bool)."""
        return self._fsync

    @fsync.setter
    def fsync(self, value: bool) -> None:
        self._fsync = bool_arg("fsync", value)

    # ---- the folder ------------------------------------------------------------------------

    def _rescan(self, call: Call, clean: bool = False) -> None:
        """Rebuilds the index from the folder, oldest file first; with `clean`, also removes
        temporary files whose writer is gone. Files vanishing meanwhile (another process
        evicting them) are skipped; what is not a plain file under a block's name, or not a
        folder under a subfolder's name, is removed as damaged."""
        found = []
        now = time.time()
        for sub in self._list(self._root, call):
            if not _SUBFOLDER.fullmatch(sub):
                continue
            folder = os.path.join(self._root, sub)
            for name in self._list(folder, call):
                file = os.path.join(folder, name)
                if name.endswith(".tmp"):
                    if clean and self._stale_tmp(name, file, now):
                        self._remove(file, call)
                    continue
                key = name[: -len(_SUFFIX)]
                if not (name.endswith(_SUFFIX) and _KEY.fullmatch(key)):
                    continue
                try:
                    st = self._fs.stat(file)
                except FileNotFoundError:
                    continue
                except IrregularFileError as err:  # the subfolder was swapped for a link
                    self._drop_damaged(None, err.filename, call)
                    break
                except OSError as err:
                    self._failed("scan", err, call)
                    continue
                if not stat.S_ISREG(st.st_mode):
                    self._drop_damaged(None, file, call)
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        with self._lock:
            self._index = collections.OrderedDict((key, size) for _, key, size in found)
            self._bytes = sum(size for _, _, size in found)
            self._unscanned = 0

    def _list(self, folder: str, call: Call) -> list[str]:
        try:
            return self._fs.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except IrregularFileError as err:
            self._drop_damaged(None, err.filename, call)
            return []
        except OSError as err:
            self._failed("scan", err, call)
            return []

    def _stale_tmp(self, name: str, file: str, now: float) -> bool:
        match = _TMP.fullmatch(name)
        if match is not None and match[1] == _HOST and not _alive(int(match[2])):
            return True
        try:
            st = self._fs.stat(file)
        except OSError:
            return False  # gone already, or unreadable: leave it
        # Not a plain file: no writer of this store made it.
        return not stat.S_ISREG(st.st_mode) or now - st.st_mtime > STALE_TMP_SECONDS

    def _remove(self, file: str, call: Call) -> bool | None:
        """Removes the name `file`: True when removed, None when gone already (or its folder
        is not one of the store's: then that name goes), False when it stays (a failure of
        `call`, counted and logged; a strict call stops there)."""
        try:
            self._fs.unlink(file)
            return True
        except FileNotFoundError:
            return None
        except IrregularFileError as err:  # its subfolder is a link or a special file
            self._drop_damaged(None, err.filename, call)
            return None
        except OSError as err:
            self._failed("remove", err, call)
            return False

    def _file(self, key: str) -> str:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"key: expected 64 lowercase hex digits, got {key!r}")
        return os.path.join(self._root, key[:2], key + _SUFFIX)

    def __len__(self) -> int:
        return len(self._index)

    # ---- the store interface ---------------------------------------------------------------
    # Each key is one `_contains`/`_get`/`_put`/`_discard` of the call it belongs to; the
    # batches run them key by key (`each`), and the single-key methods call those.

    def contains_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        strict = self._strictness(strict)
        return each(self._contains, keys, False, stop_at_miss=stop_at_miss, strict=strict)

    def get_many(
        self, keys: Sequence[str], *, stop_at_miss: bool = False, strict: bool | None = None
    ) -> StoreResult[list[BlockRecord | None]]:
        strict = self._strictness(strict)
        return each(self._get, keys, None, stop_at_miss=stop_at_miss, strict=strict)

    def put_many(
        self, records: Sequence[BlockRecord], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        return each(self._put, records, False, strict=self._strictness(strict))

    def discard_many(
        self, keys: Sequence[str], *, strict: bool | None = None
    ) -> StoreResult[list[bool]]:
        """Removes the file of each key, if any (see `BlockStore.discard`). A file that cannot
        be removed (counted in `io_errors`; raised by a strict call) is never promised or
        served again by this store, until a `put` of the block replaces it."""
        return each(self._discard, keys, False, strict=self._strictness(strict))

    def _contains(self, key: str, call: Call) -> bool:
        # The folder is the truth: another process sharing it may have written or evicted the
        # file since this index last saw it. The header and size say whether the plain file
        # is a whole record (a torn or truncated one is dropped, so `put` can write it again);
        # its checksum is verified by `get`, which drops it when that fails.
        path = self._file(key)
        if key in self._unremoved:
            return False
        try:
            head, size = self._fs.head(path, _records.HEAD_BYTES)
        except FileNotFoundError:
            self._forget(key)
            return False
        except IrregularFileError as err:
            self._drop_damaged(key, err.filename, call)
            return False
        except OSError as err:
            self._failed("read", err, call)
            return False
        expected = _records.expected_size(head)
        if expected != size:
            why = f"is torn or truncated ({size} bytes, its header says {expected})"
            self._drop_damaged(key, path, call, why)
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:
                self._index[key] = size
                self._bytes += size
        return True

    def _forget(self, key: str) -> bool:
        """Drops `key` from the index; whether it was there."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        return size is not None

    def _drop_damaged(self, key: str | None, path: str, call: Call, why: str = "") -> None:
        """Removes the damaged name `path` (the file of `key`, or a name of the folder that
        holds what the store never writes there) and counts it; a record's drop is logged and
        reported (`on_drop`). A file of `key` that stays is never promised or served again
        (until a `put` replaces it)."""
        self._count("verification_failures")
        if path == self._root:  # the folder itself is never removed
            return
        if key is None:
            self._remove(path, call)
            return
        self._forget(key)
        self._remove_file(key, path, call)
        self._dropped([key], "damaged", f"in {path} {why or 'is not a plain file'}")

    def _remove_file(self, key: str, path: str, call: Call) -> bool | None:
        """`_remove(path)` for the file of `key`. Should the file stay, the key is no longer
        promised or served (also when the failure stops a strict call)."""
        with self._lock:
            self._unremoved.add(key)
        removed = self._remove(path, call)
        if removed is not False:
            with self._lock:
                self._unremoved.discard(key)
        return removed

    def _get(self, key: str, call: Call) -> BlockRecord | None:
        path = self._file(key)
        if key in self._unremoved:
            self._count("misses")
            return None
        try:
            data = self._fs.read(path)
            record = _records.decode(data, key)
        except FileNotFoundError:
            if self._forget(key):  # gone since this store saw it (another process evicted it)
                self._dropped([key], "evicted")
            self._count("misses")
            return None
        except IrregularFileError as err:
            self._count("misses")
            self._drop_damaged(key, err.filename, call)
            return None
        except _records.CorruptRecordError as err:
            self._count("misses")
            self._drop_damaged(key, path, call, f"failed verification ({err})")
            return None
        except OSError as err:
            self._count("misses")
            self._failed("read", err, call)
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

    def _discard(self, key: str, call: Call) -> bool:
        path = self._file(key)
        self._forget(key)
        if self._remove_file(key, path, call):
            self._count("discarded")
            self._dropped([key], "discarded")
            return True
        return False

    def _put(self, record: BlockRecord, call: Call) -> bool:
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
            return self._write(record, path, call)
        finally:
            with self._lock:
                del self._writing[record.key]
            done.set()

    def _write(self, record: BlockRecord, path: str, call: Call) -> bool:
        if self._contains(record.key, call):
            return False
        data = _records.encode(record)
        if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
            self._count("rejected")
            return False
        tmp = f"{path}.{_HOST}-{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            self._fs.mkdir(os.path.dirname(path))
            self._fs.write(tmp, data, self.fsync)
            self._fs.replace(tmp, path)
        except OSError as err:
            try:
                self._fs.unlink(tmp)
            except OSError:
                pass  # never created, or the disk refuses even that: a stale file for later
            if isinstance(err, IrregularFileError):  # swapped in since `contains` looked
                self._drop_damaged(None, err.filename, call)
                return False
            self._failed("write", err, call)
            return False
        with self._lock:
            self._unremoved.discard(record.key)
            if record.key not in self._index:
                self._index[record.key] = len(data)
                self._bytes += len(data)
            self._counters["blocks_stored"] += 1
            self._counters["bytes_stored"] += record.nbytes
            rescan = self.capacity_bytes is not None and (
                self._unscanned + len(data) > self.capacity_bytes * RESCAN_SHARE
            )
            self._unscanned += len(data)
        # The record landed: what fails now is upkeep, counted and logged, not the write's.
        tidy = upkeep()
        if rescan:
            self._rescan(tidy)
        self._evict(tidy)
        return True

    def _evict(self, call: Call) -> None:
        if self.capacity_bytes is None:
            return
        victims = []
        with self._lock:
            while self._bytes > self.capacity_bytes and len(self._index) > 1:
                key, size = self._index.popitem(last=False)
                self._bytes -= size
                victims.append(key)
        for victim in victims:
            # Counted only when this store removed the file: another process may have evicted
            # it first, and a file that stays (a failed removal) is found again by a rescan.
            removed = self._remove(self._file(victim), call)
            if removed:
                self._count("evictions")
            if removed is not False:  # gone (here or by another process); a file that stays
                self._dropped([victim], "evicted")  # is still held, and a rescan finds it


def _folder_arg(path) -> str:
    """`path` as a str, checked: the store names its files under it."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(
            f"path: expected a folder path (a str or os.PathLike), got {type(path).__name__}"
        )
    if not path:
        raise ValueError("path: expected a folder path, got ''")
    return path


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (a reused pid counts as alive). A name
    in the folder says `pid`, so it may be any number: 0 and numbers no pid can be are no
    process (`os.kill` would signal a process group, or fail with OverflowError)."""
    if pid == os.getpid():
        return True
    if not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True
